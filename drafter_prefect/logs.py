"""The release flow's log while ``drafter release`` runs it: tracebacks go to a file, the terminal gets one line."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator


class _NoTraceback(logging.Formatter):
    """The terminal's formatter during ``drafter release``: a record's message without its traceback
    (the record itself keeps it, for the log file and Prefect's database)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        bare = logging.makeLogRecord(record.__dict__)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return self.inner.format(bare)


def _release_log_path() -> Path | None:
    """``$PREFECT_HOME/drafter-logs/release-<UTC time>-<pid>.log`` (None where it cannot be created)."""
    from datetime import datetime, timezone

    from prefect.settings import PREFECT_HOME

    d = Path(PREFECT_HOME.value()).expanduser() / "drafter-logs"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return d / f"release-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}.log"


@contextlib.contextmanager
def flow_log() -> Iterator[Path | None]:
    """While the release flow runs: every log record (Prefect's and the pipeline's, tracebacks included) also
    goes to a log file (:func:`_release_log_path`), and the terminal shows the records without their
    tracebacks, so that a failure ends in one `error: …` line. Yields the file's path (None if it could not be
    created); the file is removed when the block ends without an error (Prefect's database keeps the logs)."""
    root = logging.getLogger()
    from prefect.logging.handlers import PrefectConsoleHandler

    std = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)
                or (type(h) is logging.StreamHandler and h.stream in std)]
    saved = [(h, h.formatter) for h in consoles]
    path = _release_log_path()
    fh = None
    if path is not None:
        try:
            fh = logging.FileHandler(path, encoding="utf-8", delay=True)
        except OSError:
            path = None
    if fh is not None:
        fh.setLevel(logging.INFO)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s - %(message)s"))
        root.addHandler(fh)
    for h, fmt in saved:
        h.setFormatter(_NoTraceback(fmt))
    ok = False
    try:
        yield path
        ok = True
    finally:
        for h, fmt in saved:
            h.setFormatter(fmt)
        if fh is not None:
            root.removeHandler(fh)
            fh.close()
            if ok and path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
