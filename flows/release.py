"""The release flow: every stage of the pipeline, in order, each a retry-safe cached task.

Run it with ``drafter release -c configs/demo.yaml``, ``prefect deployment run release/…`` or from
the Prefect UI (the config renders as a form). A stage whose output is already in the store is
not recomputed; the run summary says which stages were reused.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from drafter.core.config import ReleaseConfig, set_dotted, config_from_dict, load_config, parse_override
from drafter.data.preflight import preflight
from drafter.evaluation.report import release_report
from drafter.core.pipeline import PlannedStage, StageResult, format_table, new_run_id, open_store, plan, summarize
from drafter.core.store import Store
from flows.api_server import reinstall_signal_handlers
from flows.events import failure_event
from tasks import for_stage


class ReleaseFailed(RuntimeError):
    """A stage of the release failed. Its ``__cause__`` is the stage's own error (``raise … from``): its
    class decides whether a retry could help and the command line's exit code (2 for bad input)."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def resolve_config(config: ReleaseConfig | dict | None, config_path: str | None, profile: str | None,
                   overrides: list[str] | None) -> ReleaseConfig:
    """The run's config: the `config` parameter (the form) when given — it wins over a deployment's
    default `config_path` —, else the file at `config_path` with `profile`, else the defaults;
    `overrides` (`section.field=value`) apply to either."""
    if config is None and config_path:
        return load_config(config_path, profile=profile, overrides=overrides)
    if config is None:
        config = ReleaseConfig()
    if not overrides and isinstance(config, ReleaseConfig):
        return config
    data = config.model_dump() if isinstance(config, ReleaseConfig) else dict(config)  # python mode keeps secrets
    for item in overrides or []:
        set_dotted(data, *parse_override(item))
    return config_from_dict(data, source="(flow parameter `config`)")


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# Release run `{summary['run_id']}` — {summary['status']}", "",
             "| stage | key | status | time (s) | metrics |", "|---|---|---|---|---|"]
    for s in summary["stages"]:
        t = s["compute_seconds"] if s["status"] == "reused" else s["seconds"]
        m = "<br>".join(f"{k}: {v}" for k, v in s["metrics"].items())
        lines.append(f"| {s['stage']} | `{s['key']}` | {s['status']} | {t:.1f} | {m} |")
    if summary.get("error"):
        lines += ["", f"**Error:** {summary['error']}"]
    return "\n".join(lines)


def _in_process(cfg: ReleaseConfig, planned: list[PlannedStage], store: Store) -> tuple[list[StageResult], tuple | None]:
    """runner: local — each stage a task of this flow run, in this process; (results, (stage, error) or None)."""
    present = {p.stage.name: store.find(p.stage.name, p.key) is not None for p in planned}
    futures: dict[str, Any] = {}
    for p in planned:
        name = p.stage.name
        task = for_stage(name, cfg).with_options(refresh_cache=not present[name])
        # one stage at a time, in pipeline order: stages share the machine's cores, and eval_offline /
        # ab_live measure speed, which a concurrently running stage would distort
        futures[name] = task.submit(cfg, name, wait_for=list(futures.values()))
    results: list[StageResult] = []
    for p in planned:
        try:
            r = StageResult(**futures[p.stage.name].result())
        except Exception as e:  # noqa: BLE001 — recorded in the summary, then re-raised
            results.append(StageResult(p.stage.name, p.key, "failed", store.location(p.stage.name, p.key), reason=str(e)))
            return results, (p.stage.name, e)
        if present[p.stage.name]:
            r.status = "reused"  # served from the Prefect cache / store: nothing was recomputed now
        results.append(r)
    return results, None


def _in_containers(cfg: ReleaseConfig, planned: list[PlannedStage], store: Store) -> tuple[list[StageResult], tuple | None]:
    """runner: containers — each stage to compute a flow run of its deployment (flows/containers.py), in order."""
    from flows.containers import run_stage_in_container

    results: list[StageResult] = []
    for p in planned:
        try:
            r = run_stage_in_container(cfg, p, store)
        except Exception as e:  # noqa: BLE001 — recorded in the summary, then re-raised
            results.append(StageResult(p.stage.name, p.key, "failed", store.location(p.stage.name, p.key), reason=str(e)))
            return results, (p.stage.name, e)
        print(r.line())
        results.append(r)
    return results, None


@flow(name="release", log_prints=True, validate_parameters=True)
def release(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
            overrides: list[str] | None = None, stages: list[str] | None = None) -> dict[str, Any]:
    """Run the release pipeline end to end (or `stages` and what they need).

    Give either a `config` (the form) or a `config_path` to a YAML file (with optional `profile`
    and `overrides` like `generate.num_prompts=64`).
    """
    reinstall_signal_handlers()  # `drafter release`: a signal ends the run at once (see flows/api_server.py)
    cfg = None
    try:
        cfg = resolve_config(config, config_path, profile, overrides)
        # everything that can be checked before the first stage starts (config across sections, prompt
        # files, the store root, serving): a bad input fails here in seconds, not after data generation
        preflight(cfg, stages)
        if cfg.runner.kind == "containers":  # every stage's deployment exists on the server
            from flows.containers import check_deployments

            check_deployments(cfg, [p.stage.name for p in plan(cfg, stages)])
    except Exception as e:
        name = cfg.name if cfg is not None else getattr(config, "name", None) or "unknown"
        failure_event(name, None, "preflight" if cfg is not None else "config", e)
        raise
    store = open_store(cfg)
    planned = plan(cfg, stages)
    run_id, started = new_run_id(), datetime.now(timezone.utc).isoformat()
    run = _in_containers if cfg.runner.kind == "containers" else _in_process
    results, failed = run(cfg, planned, store)
    error = f"{failed[0]}: {type(failed[1]).__name__}: {failed[1]}" if failed else None
    summary = summarize(cfg, run_id, started, results, "failed" if error else "completed", error)
    summary["summary_path"] = store.write_run(run_id, summary)
    create_markdown_artifact(markdown=summary_markdown(summary) + "\n\n" + release_report(summary), key="release-summary",
                             description=f"release {cfg.name}")
    print(format_table(summary))
    if error:
        failure_event(cfg.name, run_id, *failed)  # a notification through deployments/automations.yaml
        raise ReleaseFailed(f"release {cfg.name} failed at {error}", failed[0]) from failed[1]
    return summary
