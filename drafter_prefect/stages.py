"""One Prefect flow per stage, for per-stage deployments (e.g. `capture` on a GPU work pool).

Each flow runs its stage only; its inputs must already be in the store (the release flow or an
earlier deployment put them there). A flow is made when first asked for (:func:`stage_flow`): Prefect
computes a flow's parameter schema (the JSON schema of ``ReleaseConfig``) when it is made, ~0.3 s of CPU
each, and a stage's container or worker process needs only its own.
"""
from __future__ import annotations

import functools
from typing import Any

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.runtime import flow_run as this_run
from prefect.states import Cancelled

from drafter.core.config import ReleaseConfig
from drafter.stages import ORDER
from drafter_prefect.release import resolve_config
from drafter_prefect.task import for_stage


def cancelled_before_start() -> str | None:
    """Why this flow run must not go on: it was cancelled while it was still pending, and then
    started anyway — or None.

    A run is cancelled before it starts when the release waiting for it stops or times out while the
    worker is still creating its container; the server lets a CANCELLED run be proposed RUNNING
    again (that is how a cancelled run is retried), so without this check the container starting
    seconds later would compute and publish the stage after its release had given up on it. A run
    retried on purpose goes through SCHEDULED/PENDING again and is not refused."""
    run_id = this_run.id
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        history = sorted(client.read_flow_run_states(run_id), key=lambda st: st.timestamp)
    # the state the latest RUNNING came from
    prev = next((a for a, b in zip(reversed(history[:-1]), reversed(history[1:])) if b.type is StateType.RUNNING),
                None)
    if prev is not None and prev.type is StateType.CANCELLED:
        return (f"flow run {this_run.name!r} ({run_id}) was CANCELLED before it started "
                f"({(prev.message or 'no message').strip()}); it is not run")
    return None


@functools.cache
def stage_flow(name: str):
    """The flow ``stage-{name}`` that runs the stage ``name`` alone (one object per stage and process)."""
    if name not in ORDER:
        raise KeyError(f"no stage {name!r} (stages: {', '.join(ORDER)})")

    @flow(name=f"stage-{name.replace('_', '-')}", log_prints=True)
    def run_one_stage(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
                      overrides: list[str] | None = None) -> dict[str, Any]:
        refused = cancelled_before_start()
        if refused:
            print(refused)
            return Cancelled(message=refused)
        cfg = resolve_config(config, config_path, profile, overrides)
        return for_stage(name, cfg)(cfg, name)

    run_one_stage.__doc__ = f"Run the `{name}` stage alone (inputs must be in the store)."
    return run_one_stage
