"""The Prefect task around a stage: one generic task, a thin wrapper of ``drafter.core.pipeline.run_stage``.

A task run: computes the stage key from the config (also the Prefect cache key, results
persisted), reuses or computes the output in the store, publishes a metrics table artifact.
Retries use exponential backoff with jitter; errors that cannot change on a retry (configuration,
bad input, permission and decode errors, store integrity, a refusal of the release gate:
:func:`drafter.core.errors.is_permanent`) are not retried (they would fail the same way again).

A stage also runs without Prefect, as a container does: ``python -m drafter stage <stage> --config C --store S``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from drafter.core.config import ReleaseConfig
from drafter.core.errors import is_permanent
from drafter.core.pipeline import planned_stage, run_stage


def _key_for(cfg: ReleaseConfig, name: str) -> str:
    return planned_stage(cfg, name).key  # a stage the config does not enable: ConfigError naming it


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg = parameters["cfg"]
    if isinstance(cfg, dict):
        cfg = ReleaseConfig.model_validate(cfg)
    return f"drafter-{parameters['name']}-{_key_for(cfg, parameters['name'])}"


def _retry_condition(task, task_run, state) -> bool:
    """Retry only what a retry can fix: errors that cannot change (bad config or input, permission and
    decode errors, an inconsistent store, the gate's refusal; :func:`drafter.core.errors.is_permanent`)
    fail at once. Transient ones (connection errors, timeouts, a server that died) are retried."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - classified, not handled
        return not is_permanent(e)
    return True


def _artifact_key(name: str) -> str:
    return f"{name.replace('_', '-')}-metrics"


@task(
    name="stage",
    task_run_name="{name}",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=10),
    retry_jitter_factor=0.5,
    retry_condition_fn=_retry_condition,
    log_prints=True,
)
def stage_task(cfg: ReleaseConfig, name: str) -> dict[str, Any]:
    """Reuse or compute one stage's output; returns its StageResult as a dict."""
    with hub_token(cfg, name):
        result = run_stage(cfg, name)
    print(result.line())
    card = Path(result.path) / "release" / "README.md"
    if name == "publish" and card.is_file():
        create_markdown_artifact(markdown=card.read_text(), key="model-card", description=f"model card of {cfg.name}")
    rows = [{"metric": k, "value": v if isinstance(v, (int, float, str)) else str(v)} for k, v in result.metrics.items()]
    rows = [{"metric": "status", "value": result.status}, {"metric": "key", "value": result.key},
            {"metric": "output", "value": result.path}, *rows]
    create_table_artifact(table=rows, key=_artifact_key(name), description=f"{name}: {result.status} ({result.key})")
    return result.to_dict()


@contextmanager
def hub_token(cfg: ReleaseConfig, name: str) -> Iterator[None]:
    """For a `publish` that sends: when ``publish.token_env`` is not set in this worker's environment and
    ``publish.token_block`` names a Prefect Secret block, the token is read from the block and put into
    the environment for the stage only (never into parameters, results or logs)."""
    pc = cfg.publish
    if name != "publish" or pc.dry_run or os.environ.get(pc.token_env) or not pc.token_block:
        yield
        return
    from prefect.blocks.system import Secret

    os.environ[pc.token_env] = str(Secret.load(pc.token_block).get())
    try:
        yield
    finally:
        os.environ.pop(pc.token_env, None)


def for_stage(name: str, cfg: ReleaseConfig | None = None):
    """The stage task with this config's retry settings."""
    opts: dict[str, Any] = {"name": name}
    if cfg is not None:
        opts.update(retries=cfg.retries, retry_delay_seconds=exponential_backoff(backoff_factor=max(cfg.retry_delay_s, 0.0)))
    return stage_task.with_options(**opts)
