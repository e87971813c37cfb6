"""The order `make test` hands test files to its workers (longest first, by the last measured run) and the
per-file times read from a run's junit XML (tests/durations.py)."""
from __future__ import annotations

from tests.durations import busy_share, cpu_times, durations_from_junit, work_order


def test_units_go_longest_first_with_groups_summed_and_unmeasured_files_as_the_median():
    known = {"tests/a.py": 10.0, "tests/b.py": 50.0, "tests/x.py": 30.0, "tests/y.py": 25.0}
    groups = {"tests/x.py": "g", "tests/y.py": "g"}
    units = {"tests/a.py", "tests/b.py", "tests/c.py", "g"}
    # g = 30 + 25, c unmeasured = median(10, 50, 30, 25) = 27.5
    assert work_order(units, groups, known) == ["g", "tests/b.py", "tests/c.py", "tests/a.py"]
    assert work_order(units, groups, known) == work_order(sorted(units, reverse=True), groups, known)  # order-free
    assert work_order({"tests/b.py", "tests/a.py"}, None, {}) == ["tests/a.py", "tests/b.py"]  # nothing measured: names


def test_junit_times_are_summed_per_file(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_durations" name="a" time="1.25"/>'
                   '<testcase classname="tests.test_durations" name="b" time="2.5"/>'
                   '<testcase classname="tests.test_store" name="c" time="4"/>'
                   '<testcase classname="tests.nowhere" name="d" time="9"/>'
                   '</testsuite></testsuites>')
    assert durations_from_junit(xml) == {"tests/test_durations.py": 3.8, "tests/test_store.py": 4.0}


def test_the_cores_busy_share_counts_idle_and_iowait_as_idle():
    a = cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    b = cpu_times("cpu  250 10 90 900 70 5 5 0 0 0\n")
    assert a == (150.0, 1000.0) and b == (360.0, 1330.0)
    assert busy_share(a, b) == (360 - 150) / (1330 - 1000)  # 210 busy of 330
    assert busy_share(a, a) is None and busy_share(None, b) is None
    assert cpu_times("") is None and cpu_times("cpu x") is None


def test_each_worker_gets_its_share_of_the_cores():
    from tests.helpers.torch_threads import threads_per_worker

    assert threads_per_worker(2, cores=2) == 1  # make test: two workers, two cores
    assert threads_per_worker(2, cores=16) == 8 and threads_per_worker(3, cores=16) == 5
    assert threads_per_worker(4, cores=2) == 1 and threads_per_worker(0, cores=2) == 2  # at least one
