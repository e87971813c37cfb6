"""What a failed server start says: the root-cause lines of a vLLM log, ahead of its tail."""
from __future__ import annotations

import re
from pathlib import Path

# the "(Worker pid=…) ERROR 12-01 20:18:49 [file.py:953] " prefix of a vLLM log line
_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\]\s*)?")
_EXCEPTION = re.compile(r"^(?:[\w.]+)?(?:Error|Exception): .+")
# the engine's wrappers around the real error: not worth a line of their own
_WRAPPERS = ("Engine core initialization failed", "WorkerProc initialization failed", "See stack trace for root cause")


def root_causes(lines: list[str], most: int = 6) -> list[str]:
    """The distinct exception lines of a log, in order, minus the engine's wrappers; an exception line
    ending in ':' (vLLM lists its reasons on the following lines) takes the next two lines along."""
    bare = [_LOG_PREFIX.sub("", ln).strip() for ln in lines]
    out: list[str] = []
    for i, ln in enumerate(bare):
        if not _EXCEPTION.match(ln) or any(w in ln for w in _WRAPPERS):
            continue
        if ln.endswith(":"):
            ln = " ".join([ln, *[x for x in bare[i + 1:i + 3] if x]])
        if ln not in out:
            out.append(ln)
    return out[:most]


def log_tail(path: Path | None, n: int = 40) -> str:
    """The last ``n`` lines of a server log, led by the errors found anywhere in it (the root cause of a
    failed start is often far above the tail, which holds only the engine's wrapper tracebacks)."""
    if path is None or not Path(path).is_file():
        return "(no log)"
    lines = Path(path).read_text(errors="replace").splitlines()
    causes = root_causes(lines)
    head = ["errors in the log:", *(f"  {c}" for c in causes), "last lines:"] if causes else []
    return "\n".join(head + lines[-n:])
