"""Servers the tests start themselves (moto's S3, a Prefect server, vLLM from a card's command): on a port picked
free, started again on a new port when another process took it first, and ready only once the started process
group holds the port (drafter/core/ports.py; the pipeline's own launchers do the same)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from drafter.core import procs
from drafter.core.ports import BIND_ATTEMPTS, free_port, group_listens_on, port_in_use


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
        return True
    except httpx.HTTPError:
        return False


def start_server(command: Callable[[int], tuple[list[str], dict | None]], log_path: Path, *, what: str,
                 timeout_s: float, health: str = "", cwd: Path | None = None) -> tuple[subprocess.Popen, int]:
    """``command(port) -> (argv, env)`` started on a free port (its output appended to ``log_path``) until
    ``http://127.0.0.1:PORT{health}`` answers from it; returns ``(process, port)``. Fails the test with the log's
    tail when the server exits or does not answer within ``timeout_s``."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = free_port()
        argv, env = command(port)
        with open(log_path, "ab") as log:
            offset = log.tell()
            proc = procs.spawn(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if _answers(f"http://127.0.0.1:{port}{health}") and group_listens_on(port, proc.pid):
                return proc, port
            if proc.poll() is not None:
                with open(log_path, "rb") as f:
                    f.seek(offset)
                    text = f.read().decode(errors="replace")
                if port_in_use(text) and attempt < BIND_ATTEMPTS:
                    procs.stop(proc)
                    break  # another process took the port first: a new one
                pytest.fail(f"{what} exited with {proc.returncode} before answering:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                procs.stop(proc)
                pytest.fail(f"{what} did not answer within {timeout_s:.0f} s:\n" + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.5)
    raise AssertionError("unreachable")
