"""The scheduled retraining flow: the release flow over fresh traffic.

A cron deployment (`retrain/nightly` in deployments/prefect.yaml) calls it with glob patterns of
traffic files (JSONL/Parquet chat conversations; the flow's `traffic` parameter, else
`retrain.traffic`). Conversations are deduplicated by content, within the run and against every
earlier retrain (a ledger in the store, `records/traffic-seen.txt`). With fewer than
`retrain.min_new_rows` new ones the run ends at once — "not enough new traffic", no server started.
Otherwise the new conversations are written to one content-named file that becomes
`generate.user_files`, the release runs, and only when it completed are they added to the ledger.
Each run ends with a `retrain-decision` markdown artifact saying what happened, with the counts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from drafter.core.config import ReleaseConfig
from drafter.core.pipeline import open_store
from drafter.data.traffic import load_seen, new_traffic, record_seen, write_snapshot
from flows.release import release, resolve_config

NOT_ENOUGH = "not enough new traffic"


def _traffic_dir(cfg: ReleaseConfig, store) -> Path:
    """Where the new-traffic file goes: inside a local store, else in the local cache (generate reads local files)."""
    return (store.root / "records" / "traffic") if store.local else Path(cfg.store.cache_dir).expanduser() / "traffic"


@flow(name="retrain", log_prints=True)
def retrain(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
            overrides: list[str] | None = None, traffic: list[str] | None = None) -> dict[str, Any]:
    """Re-run the release on fresh traffic (`traffic`: glob patterns of JSONL/Parquet conversations)."""
    cfg = resolve_config(config, config_path, profile, overrides).model_copy(deep=True)
    patterns = traffic if traffic is not None else cfg.retrain.traffic
    store = open_store(cfg)
    seen = load_seen(store)
    t = new_traffic(patterns, seen, heldout_fraction=cfg.generate.heldout_fraction)
    counts = (f"{len(t.new)} new conversation(s) in {t.rows} read from {len(t.files)} file(s); "
              f"{t.seen_before} used by earlier retrains, {t.duplicates} repeated in this traffic")
    info = {"files": len(t.files), "rows": t.rows, "new_rows": len(t.new), "seen_before": t.seen_before,
            "duplicates": t.duplicates, "min_new_rows": cfg.retrain.min_new_rows}
    if len(t.new) < cfg.retrain.min_new_rows:
        msg = f"{NOT_ENOUGH}: {counts} (retrain.min_new_rows = {cfg.retrain.min_new_rows}); nothing was started"
        print(msg)
        create_markdown_artifact(markdown=f"# Retrain {cfg.name}: {NOT_ENOUGH}\n\n{msg}\n", key="retrain-decision",
                                 description=f"retrain {cfg.name}")
        return {"status": NOT_ENOUGH, **info}
    snapshot = write_snapshot(t.new, _traffic_dir(cfg, store))
    print(f"retrain: {counts} → {snapshot.name}")
    cfg.generate.user_files = [str(snapshot)]
    summary = release(config=cfg)
    record_seen(store, seen | set(t.hashes))  # only a completed release uses up its traffic
    create_markdown_artifact(
        markdown=f"# Retrain {cfg.name}: release {summary['status']}\n\n{counts}; trained on `{snapshot.name}`; "
                 f"run `{summary['run_id']}`, computed: {', '.join(summary['computed']) or 'nothing'}\n",
        key="retrain-decision", description=f"retrain {cfg.name}")
    return {"status": "release completed", **info, "traffic_file": snapshot.name, "release": summary}
