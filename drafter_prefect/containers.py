"""`runner: containers`: each stage of a release as its own flow run, in its own image, on its work pool.

The release flow hands every stage it has to compute to the per-stage deployment the config names
(``runner.deployment``, default ``stage-{stage}/docker``: deployments/prefect.yaml has one for every stage on
the ``docker`` pool, each with its image) and waits for it. The child is a flow run of
``flows/stages.py``; it runs the stage task (same cache key, retries and artifacts as in-process) in the
container the worker starts, against the same store. Stages talk only through the store, so the parent
then reads the child's output from there, exactly as a local run would find it: same key, same place.

* A stage whose output is already in the store is reused without starting anything.
* The child gets the config as its ``config`` parameter with ``runner: local`` (it runs its stage
  itself). Parameters are stored by the Prefect server, so secrets never go there: ``serving.env`` may
  only hold ``${VAR}`` references (resolved in the container's environment; give the variables through
  the pool's or ``runner.job_variables``' ``env``, values by block reference), which preflight checks.
* The parent fails when a child does not complete (failed, crashed — e.g. its container was killed —,
  cancelled), naming the child's flow run id, name, deployment and state; a child still running after
  ``runner.timeout_s`` is cancelled (the worker stops its container) and the release fails saying so;
  a parent that is itself stopped (cancelled, a signal) cancels the child it was waiting for.
* A child that completed but whose output is not in the store means the containers do not share the
  store with the parent: the error says what to mount or to use an ``s3://`` store.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Cancelling

from drafter.core.config import ReleaseConfig
from drafter.core.errors import ConfigError, DrafterError, StoreError
from drafter.core.pipeline import PlannedStage, StageResult
from drafter.core.store import Store
from drafter_prefect.api_server import at_stop, is_temporary_server


class ContainerStageError(DrafterError):
    """A stage's flow run (its container) did not complete; the message names the flow run and its state."""

    def __init__(self, message: str, flow_run_id: UUID | None = None, state: str | None = None):
        super().__init__(message)
        self.flow_run_id, self.state = flow_run_id, state


def stage_flow_name(stage: str) -> str:
    """``quantize_fp8`` → ``quantize-fp8`` (the flow of flows/stages.py is ``stage-quantize-fp8``)."""
    return stage.replace("_", "-")


def deployment_for(cfg: ReleaseConfig, stage: str) -> str:
    """The ``FLOW/DEPLOYMENT`` that runs ``stage``: ``runner.deployments[stage]``, else ``runner.deployment``."""
    r = cfg.runner
    return r.deployments.get(stage) or r.deployment.format(stage=stage_flow_name(stage))


def child_config(cfg: ReleaseConfig) -> dict[str, Any]:
    """The config a stage's flow run gets as its parameter: JSON, ``runner: local``, and ``serving.env`` as
    the ``${VAR}`` references it holds (preflight refuses literal values there in containers mode)."""
    data = cfg.model_dump(mode="json")
    data["runner"] = {"kind": "local"}
    data["serving"]["env"] = cfg.serving.env_values()
    return data


def check_deployments(cfg: ReleaseConfig, stages: list[str]) -> None:
    """Every deployment these stages would run as exists on the server (fails in seconds, naming them)."""
    missing = []
    with get_client(sync_client=True) as client:
        for stage in stages:
            name = deployment_for(cfg, stage)
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                missing.append(f"{name} (stage {stage})")
    if missing:
        raise ConfigError(missing_deployments_message(missing))


DEPLOY_COMMAND = "DRAFTER_HOME=$PWD prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml"


def missing_deployments_message(missing: list[str]) -> str:
    """The error for deployments the Prefect server does not have: which server (PREFECT_API_URL, or the
    temporary one `drafter release` starts without it, which has none) and what to do."""
    from urllib.parse import urlsplit

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    head = f"runner: containers needs these deployments, which the Prefect server "
    if not url or is_temporary_server(url):
        return (head + f"of this run does not have: {', '.join(missing)}; PREFECT_API_URL is not set, so this run "
                "started a temporary local server, which has no deployments: set PREFECT_API_URL to the server they "
                f"are deployed on, deploy them to a server first ({DEPLOY_COMMAND} with PREFECT_API_URL set), "
                "or point runner.deployment(s) at yours")
    parts = urlsplit(url)  # never a password of the URL
    shown = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path}"
    return (head + f"at PREFECT_API_URL={shown} does not have: {', '.join(missing)}; deploy them there "
            f"({DEPLOY_COMMAND}), set PREFECT_API_URL to the server that has them, or point runner.deployment(s) "
            "at yours")


def _describe(run: FlowRun, deployment: str) -> str:
    return f"flow run {run.name!r} ({run.id}) of deployment {deployment}"


def _cancel(run_id: UUID, why: str) -> None:
    """Cancel a child flow run. One not started yet (SCHEDULED, or PENDING while its worker creates the
    container) is set Cancelled at once — a container that still starts afterwards refuses to run
    (drafter_prefect.stages.cancelled_before_start). A running one goes through its worker and engine, which
    stop the container: Cancelling → Cancelled. If the run started between reading its state and
    setting Cancelled, its engine would run on under a Cancelled state: it is then sent Cancelling."""
    with get_client(sync_client=True, httpx_settings={"timeout": 10.0}) as client:
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            return
        started = state is not None and state.type not in (StateType.SCHEDULED, StateType.PENDING)
        if started:
            client.set_flow_run_state(run_id, Cancelling(message=why), force=True)
            return
        done = client.set_flow_run_state(run_id, Cancelled(message=why), force=True).state
        if state is None or done is None:
            return
        began = [st for st in client.read_flow_run_states(run_id)
                 if st.type is StateType.RUNNING and state.timestamp < st.timestamp < done.timestamp]
        if began:
            client.set_flow_run_state(run_id, Cancelling(message=why), force=True)


def _wait(run: FlowRun, what: str, name: str, deadline: float, cfg: ReleaseConfig, stopped: str) -> FlowRun:
    """Poll the child until it is final; past ``deadline`` cancel it and raise; an exception in the parent
    (its cancellation by a worker, an interrupt) cancels it too."""
    try:
        while True:
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(run.id)
            if run.state is not None and run.state.is_final():
                break
            if time.monotonic() > deadline:
                _cancel(run.id, f"runner.timeout_s={cfg.runner.timeout_s:g} s passed")
                raise ContainerStageError(
                    f"stage {name}: {what} did not finish within runner.timeout_s={cfg.runner.timeout_s:g} s "
                    f"(state {run.state.type.value if run.state else 'none'}); it was cancelled", run.id, "TIMEOUT")
            time.sleep(cfg.runner.poll_s)
    except ContainerStageError:
        raise
    except BaseException:  # the parent is stopped (cancelled, a signal): its child must not run on alone
        with contextlib.suppress(Exception):
            _cancel(run.id, stopped)
        raise
    return run


def run_stage_in_container(cfg: ReleaseConfig, p: PlannedStage, store: Store, echo=print) -> StageResult:
    """Reuse stage ``p``'s output from the store, or compute it as a flow run of its deployment and wait."""
    name, key = p.stage.name, p.key
    t0 = time.monotonic()
    found = store.find(name, key)
    if found is not None:
        return StageResult(name, key, "reused", str(found.path), found.metrics, time.monotonic() - t0,
                           found.manifest.get("seconds", 0.0), found.manifest.get("reason"))
    deployment = deployment_for(cfg, name)
    run: FlowRun = run_deployment(deployment, parameters={"config": child_config(cfg)}, timeout=0, as_subflow=True,
                                  job_variables=cfg.runner.job_variables or None,
                                  tags=["drafter", f"stage:{name}", f"key:{key}"])
    what = _describe(run, deployment)
    echo(f"{name:<15} {key}  running as {what}")
    deadline = time.monotonic() + cfg.runner.timeout_s
    stopped, run_id = "the release run waiting for it was stopped", run.id
    # a signal that ends `drafter release` (os._exit: no exception reaches this frame) still cancels the child
    with at_stop(lambda: _cancel(run_id, stopped)):
        run = _wait(run, what, name, deadline, cfg, stopped)
    state = run.state
    if not state.is_completed():
        message = " ".join(ln.strip() for ln in (state.message or "").splitlines() if ln.strip())[:1500]
        raise ContainerStageError(f"stage {name}: {what} ended {state.type.value}"
                                  + (f": {message}" if message else ""), run.id, state.type.value)
    art = store.find(name, key)
    if art is None:
        raise StoreError(f"stage {name}: {what} completed, but its output {name}/{key} is not in the store "
                         f"{store.root_url}: the containers do not share the store with this run — mount it into "
                         f"them at the same path (runner.job_variables volumes) or use an s3:// store.root")
    status = "skipped" if art.status == "skipped" else "computed"
    return StageResult(name, key, status, str(art.path), art.metrics, time.monotonic() - t0,
                       art.manifest.get("seconds", 0.0), art.manifest.get("reason"))
