"""Progress for long work: a rich progress bar on a terminal, periodic log lines elsewhere
(Prefect logs, CI, containers), so a user always sees that work advances.

Example::

    with progress("capture", total=n_tokens, unit="tok") as bar:
        for batch in batches:
            ...
            bar.advance(len(batch))
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


class _LineBar:
    def __init__(self, name: str, total: float | None, unit: str, every_s: float = 5.0):
        self.name, self.total, self.unit, self.every_s = name, total, unit, every_s
        self.done = 0.0
        self.t0 = self._last = time.monotonic()

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s or (self.total and self.done >= self.total):
            self._last = now
            self._print(now)

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        tot = f"/{self.total:g}" if self.total else ""
        print(f"[{self.name}] {self.done:g}{tot} {self.unit} ({rate:.1f} {self.unit}/s)", file=sys.stderr, flush=True)


class _RichBar:
    def __init__(self, prog: Progress, task_id):
        self.prog, self.task_id = prog, task_id

    def advance(self, n: float = 1) -> None:
        self.prog.advance(self.task_id, n)


@contextmanager
def progress(name: str, total: float | None, unit: str = "it") -> Iterator[_LineBar | _RichBar]:
    if console.is_terminal:
        cols = [TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                TimeElapsedColumn(), TimeRemainingColumn()]
        with Progress(*cols, console=console, transient=False) as prog:
            yield _RichBar(prog, prog.add_task(name, total=total))
    else:
        bar = _LineBar(name, total, unit)
        yield bar
        if bar.done and (not bar.total or bar.done < bar.total):
            bar._print(time.monotonic())
