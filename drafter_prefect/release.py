"""The release flow: every stage of the pipeline, in order, each a retry-safe cached task.

Run it with ``drafter release -c configs/demo.yaml``, ``prefect deployment run release/…`` or from
the Prefect UI (the config renders as a form). A stage whose output is already in the store is
not recomputed; the run summary says which stages were reused.
"""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from drafter.core.config import ReleaseConfig, set_dotted, config_from_dict, load_config, parse_override
from drafter.data.preflight import PreflightReport
from drafter.data.preflight import preflight as run_preflight
from drafter.evaluation.report import release_report
from drafter.core.pipeline import PlannedStage, Runner, StageResult, format_table, open_store, plan, run_plan
from drafter.core.store import Store
from drafter_prefect.api_server import reinstall_signal_handlers
from drafter_prefect.events import failure_event
from drafter_prefect.task import for_stage


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


def _task_runner(cfg: ReleaseConfig, store: Store) -> Runner:
    """runner: local — each stage a task of this flow run, in this process, one at a time in pipeline order
    (stages share the machine's cores, and eval_offline / ab_live measure speed, which a concurrently running
    stage would distort)."""

    def run(p: PlannedStage) -> StageResult:
        name = p.stage.name
        present = store.find(name, p.key) is not None  # verified once: the task's own reuse check does not hash again
        task = for_stage(name, cfg).with_options(refresh_cache=not present)
        r = StageResult(**task.submit(cfg, name).result())
        if present:
            r.status = "reused"  # served from the Prefect cache / store: nothing was recomputed now
        return r

    return run


def _container_runner(cfg: ReleaseConfig, store: Store) -> Runner:
    """runner: containers — each stage to compute a flow run of its deployment (drafter_prefect/containers.py)."""
    from drafter_prefect.containers import run_stage_in_container

    return lambda p: run_stage_in_container(cfg, p, store)


@flow(name="release", log_prints=True, validate_parameters=True)
def release(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
            overrides: list[str] | None = None, stages: list[str] | None = None,
            preflight: PreflightReport | None = None) -> dict[str, Any]:
    """Run the release pipeline end to end (or `stages` and what they need).

    Give either a `config` (the form) or a `config_path` to a YAML file (with optional `profile`
    and `overrides` like `generate.num_prompts=64`). `preflight`: the report of a preflight of this same
    config and stages (``drafter release`` passes its own); otherwise the flow runs the checks itself.
    """
    reinstall_signal_handlers()  # `drafter release`: a signal ends the run at once (see drafter_prefect/api_server.py)
    cfg = _checked_config(config, config_path, profile, overrides, stages, preflight)
    store = open_store(cfg)
    containers = cfg.runner.kind == "containers"
    runner = _container_runner(cfg, store) if containers else _task_runner(cfg, store)
    outcome = run_plan(cfg, plan(cfg, stages), store, runner, echo=print if containers else lambda _line: None)
    summary, failed = outcome.summary, outcome.failed
    create_markdown_artifact(markdown=summary_markdown(summary) + "\n\n" + release_report(summary), key="release-summary",
                             description=f"release {cfg.name}")
    print(format_table(summary))
    if failed:
        failure_event(cfg.name, summary["run_id"], *failed)  # a notification through deployments/automations.yaml
        raise ReleaseFailed(f"release {cfg.name} failed at {summary['error']}", failed[0]) from failed[1]
    return summary


def _checked_config(config: ReleaseConfig | dict | None, config_path: str | None, profile: str | None,
                    overrides: list[str] | None, stages: list[str] | None,
                    report: PreflightReport | None) -> ReleaseConfig:
    """The run's config, checked before the first stage starts: everything that can be checked (config across
    sections, prompt files, the store, serving) fails here in seconds, not after data generation. A preflight
    report of this very config and stages (``drafter release`` passes its own) is accepted instead of checking
    again; with containers, every stage's deployment must exist on the server."""
    cfg = None
    try:
        cfg = resolve_config(config, config_path, profile, overrides)
        if report is None or not report.covers(cfg, stages):
            run_preflight(cfg, stages)
        if cfg.runner.kind == "containers":
            from drafter_prefect.containers import check_deployments

            check_deployments(cfg, [p.stage.name for p in plan(cfg, stages)])
    except Exception as e:
        name = cfg.name if cfg is not None else getattr(config, "name", None) or "unknown"
        failure_event(name, None, "preflight" if cfg is not None else "config", e)
        raise
    return cfg
