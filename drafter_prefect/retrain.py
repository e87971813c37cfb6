"""The scheduled retraining flow: the release flow over fresh traffic, champion / challenger.

A cron deployment (`retrain/nightly` in deployments/prefect.yaml) calls it with glob patterns of
traffic files (JSONL/Parquet chat conversations; the flow's `traffic` parameter, else
`retrain.traffic`). Conversations are deduplicated by content, within the run and against every
earlier retrain (a ledger in the store, `records/traffic-seen.txt`). Every conversation is scrubbed with
the release's rules (`cfg.scrub`) as it is read, before it is hashed, written or logged
(:mod:`drafter.data.traffic`): the snapshot, the ledger, the logs and the artifacts hold only scrubbed
text; a malformed row stops the run before anything is written, naming its file:line and what to do.
With fewer than
`retrain.min_new_rows` new ones the run ends at once — "not enough new traffic", no server started.
Otherwise the new conversations are written to one content-named file that becomes
`generate.user_files`, and:

* no champion yet (no earlier release of this name; `retrain.champion: false`): the release runs as usual;
* a champion (:mod:`drafter.release.champion`): the stages up to `eval_offline` and `ab_live` run with
  the champion as the baseline (same held-out set, same replayed traffic); only a candidate that
  beats it goes on to the gate and `publish`. Otherwise "champion kept": nothing is published, the
  decision with both sets of numbers goes to `records/retrain-decisions.jsonl`, a
  `drafter.release.champion-kept` event and the `retrain-decision` artifact.

The traffic is added to the ledger once the run reached its decision.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from drafter.core.config import ReleaseConfig
from drafter.core.pipeline import open_store, plan
from drafter.data.scrub import scrubber_for
from drafter.evaluation.ab_live import AbLiveResult, load_ab_live
from drafter.evaluation.offline_result import OfflineResult, load_eval_offline
from drafter.data.traffic import load_seen, new_traffic, record_seen, write_snapshot
from drafter.release.champion import FIRST, KEPT, baseline_for, challenge, decision_markdown, find_champion
from drafter_prefect.events import emit_release_event
from drafter_prefect.release import release, resolve_config
from drafter_prefect.task import hub_token

NOT_ENOUGH = "not enough new traffic"
DECISIONS = "retrain-decisions.jsonl"
CHALLENGE_STAGES = ["eval_offline", "ab_live"]


def _traffic_dir(cfg: ReleaseConfig, store) -> Path:
    """Where the new-traffic file goes: inside a local store, else in the local cache (generate reads local files)."""
    return (store.root / "records" / "traffic") if store.local else Path(cfg.store.cache_dir).expanduser() / "traffic"


def _record_decision(store, entry: dict) -> None:
    old = store.read_record(DECISIONS) or ""
    store.write_record(DECISIONS, old + json.dumps(entry, sort_keys=True, default=str) + "\n")


def _challenge_inputs(cfg: ReleaseConfig, store) -> tuple[AbLiveResult | None, OfflineResult, str | None]:
    """(the A/B's result or None, the offline evaluation's, why the A/B has no numbers) of the challenge run."""
    arts = {p.stage.name: store.find(p.stage.name, p.key) for p in plan(cfg, CHALLENGE_STAGES)}
    ev = load_eval_offline(arts["eval_offline"].path)
    ab_art = arts["ab_live"]
    if ab_art.status == "skipped":
        return None, ev, ab_art.manifest.get("reason") or "skipped"
    return load_ab_live(ab_art.path), ev, None


@flow(name="retrain", log_prints=True)
def retrain(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
            overrides: list[str] | None = None, traffic: list[str] | None = None) -> dict[str, Any]:
    """Re-run the release on fresh traffic (`traffic`: glob patterns of JSONL/Parquet conversations);
    publish only a candidate that beats the last release."""
    cfg = resolve_config(config, config_path, profile, overrides).model_copy(deep=True)
    patterns = traffic if traffic is not None else cfg.retrain.traffic
    store = open_store(cfg)
    seen = load_seen(store)
    t = new_traffic(patterns, seen, scrubber_for(cfg.scrub), heldout_fraction=cfg.generate.heldout_fraction)
    counts = (f"{len(t.new)} new conversation(s) in {t.rows} read from {len(t.files)} file(s); "
              f"{t.seen_before} used by earlier retrains, {t.duplicates} repeated in this traffic; "
              f"{t.secrets_text()}")
    info = {"files": len(t.files), "rows": t.rows, "new_rows": len(t.new), "seen_before": t.seen_before,
            "duplicates": t.duplicates, "min_new_rows": cfg.retrain.min_new_rows,
            "secrets_removed": dict(sorted(t.secrets.items())), "conversations_scrubbed": t.scrubbed}
    if len(t.new) < cfg.retrain.min_new_rows:
        msg = f"{NOT_ENOUGH}: {counts} (retrain.min_new_rows = {cfg.retrain.min_new_rows}); nothing was started"
        print(msg)
        create_markdown_artifact(markdown=f"# Retrain {cfg.name}: {NOT_ENOUGH}\n\n{msg}\n", key="retrain-decision",
                                 description=f"retrain {cfg.name}")
        return {"status": NOT_ENOUGH, **info}
    snapshot = write_snapshot(t.new, _traffic_dir(cfg, store))
    print(f"retrain: {counts} → {snapshot.name}")
    cfg.generate.user_files = [str(snapshot)]

    champ = None
    if cfg.retrain.champion:
        with hub_token(cfg, "publish"):
            champ = find_champion(cfg, store, warn=print)
    if champ is None:
        print("retrain: no champion (no earlier release of "
              f"{cfg.name!r}{'' if cfg.retrain.champion else '; retrain.champion is off'}): a plain release")
        summary = release(config=cfg)
        record_seen(store, t.ledger(seen))  # only a completed release uses up its traffic
        create_markdown_artifact(
            markdown=f"# Retrain {cfg.name}: release {summary['status']} ({FIRST if cfg.retrain.champion else 'no challenge'})"
                     f"\n\n{counts}; trained on `{snapshot.name}`; run `{summary['run_id']}`, computed: "
                     f"{', '.join(summary['computed']) or 'nothing'}\n",
            key="retrain-decision", description=f"retrain {cfg.name}")
        return {"status": "release completed", "decision": FIRST, **info, "traffic_file": snapshot.name,
                "release": summary}

    print(f"retrain: champion {champ.release_id} ({champ.source}); the candidate starts from the "
          f"{cfg.retrain.start_from} drafter")
    cfg.baseline = baseline_for(champ, cfg.retrain)
    trial = release(config=cfg, stages=CHALLENGE_STAGES)
    ab, ev, no_live = _challenge_inputs(cfg, store)
    d = challenge(ab, ev, cfg, champ.release_id, no_live, champion_release=champ.release)
    d["champion"]["source"] = champ.source
    print(f"retrain: {d['decision']}: " + "; ".join(d["reasons"]))
    entry = {"at": datetime.now(timezone.utc).isoformat(), "release": cfg.name, "traffic_file": snapshot.name,
             "challenge_run": trial["run_id"], **{k: d[k] for k in ("decision", "winner", "reasons", "champion",
                                                                    "candidate", "k", "min_tau_gain", "speed")},
             "gate": {k: d["gate"][k] for k in ("verdict", "failed")}}
    result: dict[str, Any] = {**info, "traffic_file": snapshot.name, "decision": d["decision"], "challenge": d}
    if d["winner"] == "candidate":
        summary = release(config=cfg)  # the gate and publish; every measured stage is reused
        entry["release_run"] = summary["run_id"]
        result |= {"status": "release completed", "release": summary}
    else:
        emit_release_event("champion-kept", cfg.name, {
            "champion": d["champion"], "candidate": d["candidate"], "reasons": d["reasons"], "k": d["k"],
            "gate": entry["gate"], "challenge_run": trial["run_id"]})
        result["status"] = KEPT
    _record_decision(store, entry)
    record_seen(store, t.ledger(seen))
    create_markdown_artifact(markdown=decision_markdown(cfg.name, d, f"{counts}; trained on `{snapshot.name}`."),
                             key="retrain-decision", description=f"retrain {cfg.name}: {d['decision']}")
    return result
