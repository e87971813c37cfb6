"""How long each test file takes, the order `make test` hands the files to its workers, and the summary it prints.

- ``tests/data/test_durations.json``: seconds per test file (setup + call + teardown of its tests) of the last
  measured run, written from that run's junit XML: ``python -m tests.durations build/test-results.xml``.
- :func:`work_order`: the work units longest first (the longest-processing-time rule: the workers finish close
  together); a file not measured yet counts as the median file.
- :class:`RunSummary`: at the end of every run, the slowest tests and files, each worker's busy time and the
  run's wall time (the controller's view of every worker's reports).
"""
from __future__ import annotations

import json
import statistics
import sys
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


class RunSummary:
    """Prints, after pytest's own summary: the slowest tests and files, each worker's busy time, the wall time."""

    def __init__(self, top: int = 15) -> None:
        self.top = top
        self.t0 = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)
        self.worker_of: dict[str, str] = {}

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
