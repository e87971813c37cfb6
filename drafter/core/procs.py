"""Child processes that die with their parent, whatever signal ends it.

Servers (vLLM, the local Prefect API), torchrun ranks and converters are started through
:func:`spawn`: the command runs under a small *guard* process (this file run as a script) that

* leads its own process group, so the command's own children (vLLM's engine core, torchrun's
  ranks) are in it too and :func:`stop` ends all of them with one ``killpg``;
* is told by the kernel when the process that started it dies (``PR_SET_PDEATHSIG``) — also on
  ``SIGKILL``, when no ``finally`` block of the parent runs — and then ends its whole group;
* also ends its group on ``SIGTERM``/``SIGINT``/``SIGHUP``, and watches its parent's pid as a
  backstop (the death signal is tied to the thread that started the guard).

No process of a run outlives it: an orphaned server that kept writing into a published stage
output (its log) is what corrupted the store before.

Example::

    proc = spawn(["python", "-m", "http.server"], stdout=log, stderr=subprocess.STDOUT)
    try:
        ...
    finally:
        stop(proc)
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

PR_SET_PDEATHSIG = 1
GUARD = str(Path(__file__).resolve())
POLL_S = 0.25


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the parent-pid watch below still works
        return False


_STOPPING = threading.Event()


def request_stop() -> None:
    """Mark this process as stopping (a signal arrived): from now on no stage output is published
    (:meth:`drafter.core.store.Store.produce` checks :func:`stopping` before it publishes)."""
    _STOPPING.set()


def stopping() -> bool:
    return _STOPPING.is_set()


def spawn(cmd: Sequence[str], *, grace_s: float = 10.0, **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``cmd`` under a guard in a new process group; returns the guard's Popen.

    The guard's pid is the process group id: :func:`stop` (or ``os.killpg(proc.pid, …)``) ends the
    command and everything it started. ``grace_s``: seconds between SIGTERM and SIGKILL when the
    group is ended because the parent died or the guard was signalled. Other keyword arguments go
    to :class:`subprocess.Popen` (``stdout``, ``stderr``, ``env``, ``cwd`` …).
    """
    if popen_kwargs.pop("start_new_session", None) is not None or "preexec_fn" in popen_kwargs:
        raise TypeError("spawn() always starts a new session; do not pass start_new_session/preexec_fn")
    guard = [sys.executable, "-S", GUARD, str(os.getpid()), str(grace_s), "--", *map(str, cmd)]
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(guard, start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen, term_timeout_s: float = 20.0) -> None:
    """SIGTERM the guard's process group, wait up to ``term_timeout_s``, then SIGKILL what is left."""
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _killpg(proc.pid, signal.SIGKILL)  # stray members of the group, if any
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def group_members(pgid: int) -> list[int]:
    """Live pids of process group ``pgid`` (from /proc; zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return sorted(out)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- the guard itself


def _guard_main(argv: list[str]) -> int:
    parent, grace_s = int(argv[0]), float(argv[1])
    cmd = argv[3:]
    _set_parent_death_signal(signal.SIGTERM)
    me = os.getpid()
    ending: list[int] = []

    def end_group(reason_sig: int) -> None:
        if ending:
            return
        ending.append(reason_sig)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the killpg below reaches this process too
        _killpg(me, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and [p for p in group_members(me) if p != me]:
            time.sleep(0.1)
        for p in group_members(me):
            if p != me:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def on_signal(signum, _frame) -> None:
        end_group(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 1
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        print(f"cannot start {cmd[0]}: {e}", file=sys.stderr, flush=True)
        return 127
    while True:
        if ending:
            _reap(child)
            return 128 + ending[0]
        code = child.poll()
        if code is not None:
            if group_members(me) != [me]:  # the command is gone; what it started goes with it
                end_group(signal.SIGTERM)
            return code
        if os.getppid() != parent:  # backstop for the death signal
            end_group(signal.SIGTERM)
            continue
        time.sleep(POLL_S)


def _reap(child: subprocess.Popen) -> None:
    try:
        child.wait(timeout=1)
    except subprocess.TimeoutExpired:
        pass


if __name__ == "__main__":  # python -S procs.py PARENT_PID GRACE_S -- CMD...
    sys.exit(_guard_main(sys.argv[1:]))
