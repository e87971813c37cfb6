"""`drafter runs` on a store whose run summaries have the wrong shape (issue 33, class 7): every skipped
summary gets one `warning:` line on stderr with its path and what is wrong with it, the good ones are
still listed (exit 0), and a store where every summary is bad exits 1 saying how many were skipped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drafter.core.store import Store, run_summary_problem
from drafter.cli import app


def summary(run_id: str, started: str = "2026-01-01T00:00:00") -> dict:
    return {"run_id": run_id, "release": "r", "store": "s", "status": "completed", "error": None,
            "started_at": started, "finished_at": started, "computed": ["generate"], "reused": ["prepare_target"],
            "stages": [{"stage": "prepare_target", "key": "a" * 16, "status": "reused", "path": "p", "metrics": {},
                        "seconds": 0.1, "compute_seconds": 3.0, "reason": None},
                       {"stage": "generate", "key": "k" * 16, "status": "computed", "path": "p",
                        "metrics": {"rows": 3}, "seconds": 1.0, "compute_seconds": 0.0, "reason": None}]}


def bad(change) -> dict:
    s = summary("run-bad", "2026-06-01T00:00:00")  # newer than the good one: it would be "the latest"
    change(s)
    return s


# (name, summary of the wrong shape, what the warning must say) — each passed today's checks and
# then crashed `drafter runs` (or was listed as the latest run)
WRONG_SHAPES = [
    ("stage-name-a-number", bad(lambda s: s["stages"][1].update(stage=5)), "`stages[1].stage` is 5 (a number), not a string"),
    ("key-null", bad(lambda s: s["stages"][1].update(key=None)), "`stages[1].key` is null, not a string"),
    ("status-a-number", bad(lambda s: s["stages"][0].update(status=3)), "`stages[0].status` is 3 (a number), not a string"),
    ("computed-not-names", bad(lambda s: s.update(computed=[1])), "`computed[0]` is 1 (a number), not a stage name"),
    ("reused-not-names", bad(lambda s: s.update(reused=[{"stage": "x"}])), "`reused[0]` is an object, not a stage name"),
    ("seconds-a-boolean", bad(lambda s: s["stages"][1].update(seconds=True)),
     "`stages[1].seconds` is true (a boolean), not a number of seconds"),
    ("run-id-empty", bad(lambda s: s.update(run_id="")), "`run_id` is '' (a string), not a non-empty string"),
    ("reused-without-compute-time", bad(lambda s: s["stages"][0].pop("compute_seconds")),
     "`stages[0].compute_seconds` is missing, not a number of seconds"),
    ("metrics-a-list", bad(lambda s: s["stages"][1].update(metrics=[1, 2])), "`stages[1].metrics` is a list, not an object"),
    ("stages-an-object", bad(lambda s: s.update(stages={"generate": {}})), "`stages` is an object, not a list"),
]


def write_runs(root: Path, files: dict[str, object]) -> Path:
    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (runs / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return runs


def warnings_of(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


@pytest.mark.parametrize("name,wrong,says", WRONG_SHAPES, ids=[w[0] for w in WRONG_SHAPES])
def test_a_summary_of_the_wrong_shape_is_skipped_with_one_warning_naming_it(tmp_path, name, wrong, says):
    runs = write_runs(tmp_path / "store", {"a.json": summary("run-a"), "z.json": wrong})
    for args in (["--all"], [], ["--json"]):
        res = CliRunner().invoke(app, ["runs", "--store", str(tmp_path / "store"), *args])
        assert res.exit_code == 0, (res.output, res.exception)
        (warning,) = warnings_of(res.stderr)
        assert str(runs / "z.json") in warning and says in warning and "skipped" in warning, warning
        assert "Traceback" not in res.output and "run-bad" not in res.stdout
        if args == ["--json"]:
            assert json.loads(res.stdout)["run_id"] == "run-a"
        else:
            assert "latest run run-a" in res.stdout
    assert run_summary_problem(summary("run-a")) is None


def test_one_line_per_skipped_file_and_the_good_ones_listed(tmp_path):
    runs = write_runs(tmp_path / "store", {
        "a.json": summary("run-a", "2026-01-01T00:00:00"),
        "b.json": '{"run_id": "run-b", ',  # truncated
        "c.json": bad(lambda s: s["stages"][1].update(stage=5)),
        "d.json": [summary("run-d")],  # a list around a summary
        "e.json": summary("run-e", "2026-02-01T00:00:00"),
    })
    res = CliRunner().invoke(app, ["runs", "--store", str(tmp_path / "store"), "--all"])
    assert res.exit_code == 0, res.output
    warnings = warnings_of(res.stderr)
    assert [w.split()[3].rstrip(":") for w in warnings] == [str(runs / n) for n in ("b.json", "c.json", "d.json")]
    assert "is not valid JSON (line 1" in warnings[0] and "`stages[1].stage` is 5" in warnings[1]
    assert "is a list, not a JSON object" in warnings[2]
    assert not warnings_of(res.stdout)  # warnings go to stderr only
    assert "run-a" in res.stdout and "latest run run-e" in res.stdout
    got: list[str] = []
    assert [r["run_id"] for r in Store(tmp_path / "store").runs(warn=got.append)] == ["run-a", "run-e"]
    assert len(got) == 3 and all("\n" not in w for w in got)


def test_every_summary_bad_exits_1_and_says_how_many_were_skipped(tmp_path):
    write_runs(tmp_path / "store", {"b.json": "not json", "c.json": bad(lambda s: s.update(computed=[1]))})
    res = CliRunner().invoke(app, ["runs", "--store", str(tmp_path / "store")])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert len(warnings_of(res.stderr)) == 2
    assert "no runs recorded" in res.stderr and "2 run summaries skipped" in res.stderr
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    res = CliRunner().invoke(app, ["runs", "--store", str(empty)])
    assert res.exit_code == 1 and "no runs recorded" in res.stdout and not res.stderr
