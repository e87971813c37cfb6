"""How long each test file takes, the order `make test` hands the files to its workers, and the summary it prints.

- ``tests/data/test_durations.json``: seconds per test file (setup + call + teardown of its tests) of the last
  measured run, written from that run's junit XML: ``python -m tests.durations build/test-results.xml``.
- :func:`work_order`: the work units longest first (the longest-processing-time rule: the workers finish close
  together); a file not measured yet counts as the median file.
- :class:`RunSummary`: at the end of every run, the slowest tests and files, each worker's busy time, the
  run's wall time (the controller's view of every worker's reports) and how busy the machine's cores were
  (``/proc/stat``), overall and per 5 minutes: where they sat idle, more workers could run.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "data" / "test_durations.json"


def known_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text())["files"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def work_order(units, groups: dict[str, str] | None = None, durations: dict[str, float] | None = None) -> list[str]:
    """The work units (test files, or the names of ``groups`` of files: ``{file: group}``) longest first; a unit
    takes the sum of its files' seconds, a file not measured yet the median file's. Ties in name order."""
    known = known_durations() if durations is None else durations
    default = statistics.median(known.values()) if known else 30.0
    groups = groups or {}
    files = {u for u in units if u not in groups.values()} | {f for f, g in groups.items() if g in units}
    seconds: dict[str, float] = defaultdict(float)
    for f in files:
        seconds[groups.get(f, f)] += known.get(f, default)
    return sorted(units, key=lambda u: (-seconds[u], u))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def durations_from_junit(xml_path: Path) -> dict[str, float]:
    """Seconds per test file from a junit XML of pytest (``time`` = setup + call + teardown)."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml_path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        for n in range(len(parts), 0, -1):  # tests.test_x or tests.test_x.TestClass
            rel = "/".join(parts[:n]) + ".py"
            if (ROOT / rel).is_file():
                out[rel] += float(case.get("time") or 0)
                break
    return {k: round(v, 1) for k, v in sorted(out.items())}


def cpu_times(stat: str | None = None) -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores from ``/proc/stat``'s ``cpu`` line (idle = idle + iowait);
    None where there is no /proc/stat."""
    try:
        line = (stat if stat is not None else Path("/proc/stat").read_text()).splitlines()[0].split()
        values = [float(v) for v in line[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return None
    total = sum(values)
    return total - values[3] - values[4], total


def busy_share(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float | None:
    """The share of core time that was busy between two :func:`cpu_times` readings."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


class CoreUsage:
    """Reads :func:`cpu_times` every ``every_s`` seconds on a daemon thread: the cores' busy share over the
    whole run and per window."""

    def __init__(self, every_s: float = 300.0) -> None:
        self.samples = [cpu_times()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True)
        self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(cpu_times())

    def stop(self) -> tuple[float | None, list[float | None]]:
        """(overall busy share, busy share per window)."""
        self._stop.set()
        self.samples.append(cpu_times())
        windows = [busy_share(a, b) for a, b in zip(self.samples, self.samples[1:])]
        return busy_share(self.samples[0], self.samples[-1]), windows


class RunSummary:
    """Prints, after pytest's own summary: the slowest tests and files, each worker's busy time, the wall time and
    the cores' busy share (:class:`CoreUsage`)."""

    def __init__(self, top: int = 15) -> None:
        self.top = top
        self.t0 = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)
        self.worker_of: dict[str, str] = {}
        self.cores = CoreUsage()

    def pytest_runtest_logreport(self, report) -> None:
        self.tests[report.nodeid] += report.duration
        node = getattr(report, "node", None)  # pytest-xdist's controller: the worker that ran it
        self.worker_of[report.nodeid] = node.gateway.id if node is not None else "main"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.tests:
            return
        tr = terminalreporter
        wall = time.monotonic() - self.t0
        files: dict[str, float] = defaultdict(float)
        busy: dict[str, float] = defaultdict(float)
        for nodeid, s in self.tests.items():
            files[file_of(nodeid)] += s
            busy[self.worker_of[nodeid]] += s
        tr.section(f"slowest {self.top} tests (setup + call + teardown)")
        for nodeid, s in sorted(self.tests.items(), key=lambda kv: -kv[1])[:self.top]:
            tr.write_line(f"{s:8.1f} s  {self.worker_of[nodeid]:<5} {nodeid}")
        tr.section(f"slowest {self.top} files")
        for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:self.top]:
            tr.write_line(f"{s:8.1f} s  {f}")
        tr.write_line("workers busy: " + ", ".join(f"{w} {s / 60:.1f} min" for w, s in sorted(busy.items())))
        tr.write_line(f"tests: {len(self.tests)}, {sum(self.tests.values()) / 60:.1f} min of test time in "
                      f"{wall / 60:.1f} min wall")
        overall, windows = self.cores.stop()
        if overall is not None:
            per = " ".join("-" if w is None else f"{100 * w:.0f}" for w in windows)
            tr.write_line(f"cores busy: {100 * overall:.0f} % of {os.cpu_count()} over the run; per 5 min: {per}")


def main(argv: list[str]) -> int:
    xml = Path(argv[0]) if argv else ROOT / "build" / "test-results.xml"
    files = durations_from_junit(xml)
    if not files:
        print(f"{xml}: no test cases", file=sys.stderr)
        return 2
    DURATIONS.write_text(json.dumps({"source": "junit XML of a `make test` run (python -m tests.durations)",
                                     "files": files}, indent=1) + "\n")
    print(f"{DURATIONS.relative_to(ROOT)}: {len(files)} files, {sum(files.values()) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
