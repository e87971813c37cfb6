"""One Prefect flow per stage, for per-stage deployments (e.g. `capture` on a GPU work pool).

Each flow runs its stage only; its inputs must already be in the store (the release flow or an
earlier deployment put them there).
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from drafter.core.config import ReleaseConfig
from drafter.stages import ORDER
from flows.release import resolve_config
from tasks import for_stage


def make_stage_flow(name: str):
    @flow(name=f"stage-{name.replace('_', '-')}", log_prints=True)
    def stage_flow(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
                   overrides: list[str] | None = None) -> dict[str, Any]:
        cfg = resolve_config(config, config_path, profile, overrides)
        return for_stage(name, cfg)(cfg, name)

    stage_flow.__doc__ = f"Run the `{name}` stage alone (inputs must be in the store)."
    return stage_flow


STAGE_FLOWS = {name: make_stage_flow(name) for name in ORDER}
# module-level names, for deployment entrypoints such as flows/stages.py:capture_flow
globals().update({f"{name}_flow": fl for name, fl in STAGE_FLOWS.items()})
