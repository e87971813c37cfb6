"""TCP ports for the servers a run starts (vLLM, the local Prefect API server, the tests' servers).

A port is picked free here and bound later by another process (vLLM binds its port seconds after it
starts), so another process can take it in between. Two things keep that rare and harmless:

- :func:`free_port` picks at random *outside* the kernel's ephemeral range
  (``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel hands out ports to every ``bind(0)`` and
  every outgoing connection — vLLM's own internal sockets, HTTP clients, other servers' ``bind(0)``.
  Asking the kernel for a port (``bind(port 0)``) would return one from that busy range.
- the launchers retry with a new port when the bind fails (:func:`port_in_use`), at most
  :data:`BIND_ATTEMPTS` times, only for a port they picked themselves (never for one the user set).

And a server is taken as up only once the started process holds the port (:func:`group_listens_on`): the
process that took the port may itself be a server that answers ``/health`` — another run's vLLM.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

BIND_ATTEMPTS = 4
# what a server prints when its port is taken (lower case): Python's OSError (uvicorn, vLLM), podman, docker
_IN_USE = ("address already in use", "[errno 98]", "port is already allocated")
_LOWEST = 10000  # below: the ports of well-known services
_EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where the file cannot be read)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port of ``host`` that nothing holds now, at random outside the ephemeral range (see the module)."""
    lo, hi = ephemeral_range()
    pool = [r for r in (range(_LOWEST, max(lo, _LOWEST)), range(hi + 1, 65536)) if len(r)]
    rng = rng or random.SystemRandom()
    if pool:
        for _ in range(200):
            r = rng.choices(pool, weights=[len(x) for x in pool])[0]
            port = rng.choice(r)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a machine with no port outside the range
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(log_text: str) -> bool:
    """Whether a server's output says its port was taken (the bind failed)."""
    text = log_text.lower()
    return any(m in text for m in _IN_USE)


def _listening_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on TCP ``port`` (any address), from ``/proc/net/tcp{,6}``; None off Linux."""
    found: set[str] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(t.is_file() for t in tables):
        return None
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(f[9])
    return found


def group_listens_on(port: int, pgid: int) -> bool:
    """Whether a process of process group ``pgid`` holds the listening socket of ``port`` — that the server
    answering there is the one started, not another process that took the port. True where /proc cannot tell."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    if not inodes:
        return False
    wanted = {f"socket:[{i}]" for i in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return True
        except (OSError, ValueError, IndexError):
            continue
    return False
