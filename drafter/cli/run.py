"""``drafter release`` and ``drafter publish``: the release flow (Prefect), with a local API server unless
``PREFECT_API_URL`` is set. A failure inside the flow is one ``error: …`` line naming the log file that keeps
its traceback (``$PREFECT_HOME/drafter-logs``); the stage's own error decides the exit code."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer

from drafter.cli.common import (ConfigOpt, ProfileOpt, SetOpt, StoreOpt, app, cli_errors, exit_code, fail, load_checked,
                                one_line)
from drafter.cli.render import print_outputs
from drafter.core.config import ReleaseConfig
from drafter.core.errors import DrafterError
from drafter_prefect.api_server import DEFAULT_STARTUP_TIMEOUT_S, TIMEOUT_ENV


def _run_release(cfg: ReleaseConfig, stage: Optional[list[str]], prefect_startup_timeout: Optional[float],
                 checked=None) -> dict:
    """Run the release flow; a failure inside it is one `error: …` line (the original error's message and exit
    code: 2 for bad input, also when a stage raised it) naming the log file that holds the traceback."""
    from drafter_prefect.api_server import exit_on_signals, prefect_api
    from drafter_prefect.logs import flow_log
    from drafter_prefect.release import ReleaseFailed
    from drafter_prefect.release import release as release_flow

    exit_on_signals()
    with flow_log() as log_path:
        try:
            with prefect_api(prefect_startup_timeout):
                return release_flow(config=cfg, stages=stage, preflight=checked)
        except typer.Exit:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of the flow: one line, the traceback in the log
            message = one_line(e) if isinstance(e, (DrafterError, ReleaseFailed)) else f"{type(e).__name__}: {one_line(e)}"
            if log_path is not None and log_path.is_file() and log_path.stat().st_size:
                message += f" (the traceback: {log_path})"
            fail(message, exit_code(e))


StartupOpt = typer.Option(
    None, "--prefect-startup-timeout", metavar="SECONDS",
    help=f"Start-up limit of the local Prefect API server started when PREFECT_API_URL is not set "
         f"(default ${TIMEOUT_ENV}, else {DEFAULT_STARTUP_TIMEOUT_S:.0f}).")


@app.command()
@cli_errors
def release(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
            store: Optional[str] = StoreOpt,
            stage: Optional[list[str]] = typer.Option(None, "--stage", help="Run only these stages (and what they need)."),
            prefect_startup_timeout: Optional[float] = StartupOpt,
            ) -> None:
    """Run the release flow (Prefect: a local API server unless PREFECT_API_URL is set)."""
    stage = stage or None
    cfg, checked = load_checked(config, profile, set_, store, stages=stage)
    # the same config, profile, overrides and store, so that only `publish` is computed again
    send = shlex.join(["drafter", "publish", "-c", str(config), *(["--profile", profile] if profile else []),
                       *[a for s in set_ or [] for a in ("--set", s)], *(["--store", store] if store else []),
                       "--repo-id", cfg.publish.repo_id or "ORG/NAME"])
    print_outputs(_run_release(cfg, stage, prefect_startup_timeout, checked), send)


@app.command()
@cli_errors
def publish(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
            store: Optional[str] = StoreOpt,
            repo_id: Optional[str] = typer.Option(None, "--repo-id", metavar="ORG/NAME", help="Hub repo (default: publish.repo_id)."),
            mode: Optional[str] = typer.Option(None, "--mode", help="commit | pr (default: publish.mode)."),
            dry_run: bool = typer.Option(False, "--dry-run", help="Only build the release folder and the plan."),
            prefect_startup_timeout: Optional[float] = StartupOpt,
            ) -> None:
    """Publish the release to the Hub: the release flow up to `publish` (finished stages are reused), sending
    the release folder unless --dry-run. The token is read from $HF_TOKEN (publish.token_env)."""
    sets = list(set_ or []) + [f"publish.dry_run={'true' if dry_run else 'false'}"]
    if repo_id:
        sets.append(f"publish.repo_id={repo_id}")
    if mode:
        sets.append(f"publish.mode={mode}")
    cfg, checked = load_checked(config, profile, sets, store, stages=["publish"])
    print_outputs(_run_release(cfg, ["publish"], prefect_startup_timeout, checked))
