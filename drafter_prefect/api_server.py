"""The Prefect API that `drafter release` talks to, and what happens when the run is signalled.

Without ``PREFECT_API_URL``, Prefect would start its own temporary API server (a uvicorn
subprocess) with a 20 s start-up limit. On a machine where Prefect never ran, that server first
creates its database, which on two busy cores takes longer, and the run died before doing anything;
that server also outlived a killed run. :func:`prefect_api` starts the same server itself instead:

* under :func:`drafter.core.procs.spawn`, so it dies with the run on any signal, SIGKILL included;
* with a start-up limit that the user sets (``--prefect-startup-timeout`` or
  ``DRAFTER_PREFECT_STARTUP_TIMEOUT``; default :data:`DEFAULT_STARTUP_TIMEOUT_S`), and an error
  that says what to set when it is exceeded;
* its output in ``$PREFECT_HOME/drafter-api-server.log``.

With ``PREFECT_API_URL`` set, nothing is started: the run uses that server.

:func:`exit_on_signals` makes SIGTERM, SIGINT and SIGHUP end the run at once: the flow run is
marked crashed (best effort), the process exits, and every child process (servers, torchrun
ranks) goes with it. Finished stage outputs stay in the store; a stage's ``.partial`` directory
stays too, so a rerun resumes it.

Example::

    with prefect_api(timeout_s=300):
        release_flow(config=cfg)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from drafter.core import procs
from drafter.core.ports import free_port, group_listens_on
from drafter.core.errors import DrafterError

DEFAULT_STARTUP_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DRAFTER_PREFECT_STARTUP_TIMEOUT"


class PrefectStartupError(DrafterError):
    """The local Prefect API server did not start."""


def startup_timeout(option: float | None = None) -> float:
    """The start-up limit: the CLI option, else $DRAFTER_PREFECT_STARTUP_TIMEOUT, else the default."""
    if option is not None:
        value, source = option, "--prefect-startup-timeout"
    elif os.environ.get(TIMEOUT_ENV):
        value, source = os.environ[TIMEOUT_ENV], TIMEOUT_ENV
    else:
        return DEFAULT_STARTUP_TIMEOUT_S
    try:
        value = float(value)
    except ValueError:
        raise PrefectStartupError(f"{source}={value!r} is not a number of seconds") from None
    if not value > 0:
        raise PrefectStartupError(f"{source}={value} must be a positive number of seconds")
    return value


def _healthy(api_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{api_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _server_command(port: int) -> list[str]:
    import prefect

    return [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


@contextmanager
def prefect_api(timeout_s: float | None = None) -> Iterator[str]:
    """Yield the Prefect API URL to run against; start a local server for the block if none is set."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, get_current_settings, temporary_settings

    url = PREFECT_API_URL.value()
    if url:
        yield url
        return
    limit = startup_timeout(timeout_s)
    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "drafter-api-server.log"
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        while True:
            port = free_port()
            api = f"http://127.0.0.1:{port}/api"
            proc = procs.spawn(_server_command(port), stdout=log, stderr=subprocess.STDOUT, env=env)
            while not (_healthy(api) and group_listens_on(port, proc.pid)):  # our server, not one that took the port
                if proc.poll() is not None:
                    break
                if time.monotonic() - t0 > limit:
                    procs.stop(proc, term_timeout_s=5)
                    raise PrefectStartupError(
                        f"the local Prefect API server did not answer within {limit:.0f} s (its log: {log_path}); "
                        f"a first run creates Prefect's database, which takes longer on a busy machine: "
                        f"pass --prefect-startup-timeout SECONDS or set {TIMEOUT_ENV}=SECONDS, "
                        "or set PREFECT_API_URL to a running server (`prefect server start`)")
                time.sleep(0.2)
            else:
                break
            if proc.returncode != 3 or time.monotonic() - t0 > limit:  # 3: the port was taken meanwhile
                raise PrefectStartupError(f"the local Prefect API server exited with code {proc.returncode} "
                                          f"before answering; its log: {log_path}")
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            _LOCAL_API.append(api)
            try:
                yield api
            finally:
                _LOCAL_API.remove(api)
                _drain_clients()  # logs and events still queued go out while the server is up
    finally:
        procs.stop(proc, term_timeout_s=10)


_LOCAL_API: list[str] = []  # the URL of the server prefect_api started, while it runs


def is_temporary_server(api_url: str | None) -> bool:
    """Whether ``api_url`` is the temporary local server :func:`prefect_api` started (PREFECT_API_URL not set):
    it knows no deployments, work pools or blocks."""
    return bool(api_url) and api_url in _LOCAL_API


def _drain_clients(timeout_s: float = 15.0) -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # noqa: BLE001 — a worker that never started has nothing to send
            pass


def _mark_crashed(signum: int) -> None:
    """Best effort, a few seconds at most: the current flow run is recorded as crashed."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.context import FlowRunContext
        from prefect.states import Crashed

        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None:
            return
        with get_client(sync_client=True, httpx_settings={"timeout": 5.0}) as client:
            client.set_flow_run_state(ctx.flow_run.id, Crashed(message=f"stopped by {signal.Signals(signum).name}"),
                                      force=True)
    except Exception:  # noqa: BLE001 — the process is ending anyway
        pass


_HANDLER: list = []  # the handler exit_on_signals installed in this process, if any
_AT_STOP: list = []  # what a signal that ends this process must still do (best effort), newest last


@contextmanager
def at_stop(fn) -> Iterator[None]:
    """While the block runs, a signal that ends the process (:func:`exit_on_signals`) first calls ``fn()``
    — e.g. to cancel the child flow run the release is waiting for (drafter_prefect/containers.py)."""
    _AT_STOP.append(fn)
    try:
        yield
    finally:
        _AT_STOP.remove(fn)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _to_stderr(msg: str) -> None:
    # straight to the file descriptor: during a flow run `print` is Prefect's logger (log_prints)
    os.write(2, (msg + "\n").encode())


def exit_on_signals(echo=_to_stderr) -> None:
    """SIGTERM / SIGINT / SIGHUP end this process at once (children die with it, see drafter.core.procs).

    For the command line only: a flow run started by a Prefect worker keeps Prefect's own handling
    (cancellation from the UI arrives as SIGTERM there). During a flow run Prefect swaps in its own
    SIGTERM handler, which waits for the running task; the release flow therefore calls
    :func:`reinstall_signal_handlers` when it starts."""

    def handler(signum, _frame) -> None:
        procs.request_stop()  # a stage that finishes now is not published
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        echo(f"\nstopped by {signal.Signals(signum).name}: finished stage outputs are kept in the store; "
             "rerun the same command to resume")
        for fn in reversed(_AT_STOP):
            try:
                fn()
            except Exception:  # noqa: BLE001 — the process is ending anyway
                pass
        _mark_crashed(signum)
        os._exit(128 + signum)

    _HANDLER[:] = [handler]
    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def reinstall_signal_handlers() -> None:
    """Put back the command line's handlers (no-op unless :func:`exit_on_signals` ran in this
    process, or outside the main thread). Prefect restores its saved handler when the flow ends."""
    if not _HANDLER or threading.current_thread() is not threading.main_thread():
        return
    for s in STOP_SIGNALS:
        signal.signal(s, _HANDLER[0])
