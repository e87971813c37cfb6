"""Typed result files against the files a real `make demo` wrote before the models existed
(tests/data/demo-results, see its README), and the rule that one module owns each result file's name.

* every file loads through its owner's model, and nothing of the document is lost (``.raw`` is the file);
* the gate computed now from the demo's ab_live.json and eval_offline.json (config: configs/demo.yaml) gives
  the checks and numbers the demo's gate.json recorded, plus the check against no speculation that refuses it;
* the release report renders from those files;
* a result file's name appears in the code (a string constant that is not a docstring) only in its owner.
"""
from __future__ import annotations

import ast
import importlib
import json
import shutil
from pathlib import Path

import pytest

from drafter.core.results import ResultFile

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tests" / "data" / "demo-results"


def _all_models() -> list[type[ResultFile]]:
    for p in sorted((ROOT / "drafter").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    seen, todo = [], list(ResultFile.__subclasses__())
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.append(c)
            todo += c.__subclasses__()
    return [c for c in seen if "NAME" in vars(c)]


def _models() -> dict[str, type[ResultFile]]:
    from drafter.data.reports import CaptureReport, GenerateSummary, ScrubReport
    from drafter.evaluation.ab_live import AbLiveResult
    from drafter.evaluation.gate import GateResult
    from drafter.evaluation.offline_result import OfflineResult
    from drafter.quant.layout import FP8ReleaseInfo
    from drafter.quant.verify import VerifyResult
    from drafter.release.hub import PublishPlan, PublishResult
    from drafter.training.run import TrainResult

    return {"ab_live/ab_live.json": AbLiveResult, "eval_offline/eval_offline.json": OfflineResult,
            "gate/gate.json": GateResult, "train/result.json": TrainResult, "bootstrap_drafter/result.json": TrainResult,
            "verify_fp8/verify.json": VerifyResult, "publish/publish-plan.json": PublishPlan,
            "publish/publish.json": PublishResult, "quantize_fp8/release.json": FP8ReleaseInfo,
            "generate/summary.json": GenerateSummary, "scrub/report.json": ScrubReport,
            "capture/report.json": CaptureReport}


@pytest.mark.parametrize("rel", sorted(_models()))
def test_a_file_the_demo_wrote_before_the_models_loads_whole(rel):
    model = _models()[rel]
    path = DEMO / rel
    assert path.name == model.NAME
    doc = json.loads(path.read_text())
    m = model.load(path.parent)
    assert m.raw == doc  # nothing lost
    assert m.model_dump(mode="json", exclude_unset=True).keys() == doc.keys()  # every key kept (unknown ones too)


def test_the_typed_fields_hold_the_demo_numbers():
    from drafter.evaluation.ab_live import load_ab_live
    from drafter.evaluation.gate import load_gate
    from drafter.evaluation.offline_result import load_eval_offline
    from drafter.training.run import load_train_result

    ab = load_ab_live(DEMO / "ab_live")
    raw = json.loads((DEMO / "ab_live/ab_live.json").read_text())
    assert ab.num_speculative_tokens == raw["num_speculative_tokens"] == 2
    assert len(ab.summary) == len(raw["summary"]) > 0
    ev = load_eval_offline(DEMO / "eval_offline")
    assert set(ev.drafters) == set(json.loads((DEMO / "eval_offline/eval_offline.json").read_text())["drafters"])
    g = load_gate(DEMO / "gate")
    assert g.verdict == "pass" and len(g.checks) > 3
    tr = load_train_result(DEMO / "train")
    assert tr.final.t0.tau > tr.baseline.t0.tau > 1.0  # the demo's fine-tune beat the bootstrap at T=0


def test_the_gate_decides_now_what_it_decided_then_and_refuses_what_was_slower_than_no_speculation():
    """The checks of then decide as then; the check against no speculation (issue 35) refuses this demo's release:
    its fixed K = 2 served 0.85× no speculation at 1 user and 0.34× at 8."""
    from drafter.core.config import load_config
    from drafter.evaluation.ab_live import load_ab_live
    from drafter.evaluation.gate import gate_decision
    from drafter.evaluation.offline_result import load_eval_offline

    cfg = load_config(ROOT / "configs/demo.yaml")
    now = gate_decision(load_ab_live(DEMO / "ab_live"), load_eval_offline(DEMO / "eval_offline"), cfg.gate)
    then = json.loads((DEMO / "gate/gate.json").read_text())
    assert then["verdict"] == "pass" and now["verdict"] == "refused"
    assert now["failed"] == then["failed"] + ["no_spec/c1", "no_spec/c8"]
    old_checks = [c for c in now["checks"] if not c["name"].startswith("no_spec/")]
    assert [(c["name"], c["passed"], c["value"], c["threshold"]) for c in old_checks] == \
        [(c["name"], c["passed"], c["value"], c["threshold"]) for c in then["checks"]]
    speed = {c["name"]: c for c in now["checks"] if c["name"].startswith("no_spec/")}
    assert speed["no_spec/c8"]["value"] == 91.661 and speed["no_spec/c8"]["reference"] == 270.069
    assert "0.34×" in speed["no_spec/c8"]["detail"] and "at 8 concurrent users" in speed["no_spec/c8"]["detail"]
    assert round(speed["no_spec/c1"]["value"] / speed["no_spec/c1"]["reference"], 2) == 0.85
    assert now["key_numbers"] == then["key_numbers"]


def test_the_release_report_is_what_the_old_code_printed_from_the_same_files(tmp_path):
    """release-report.md: the report the code of commit 5fc0878 (before the models) rendered from these files."""
    from drafter.evaluation.report import release_report

    summary = json.loads((DEMO / "run-summary.json").read_text())
    for s in summary["stages"]:  # the stages' outputs: the demo's files, in a store-like tree
        d = tmp_path / s["stage"]
        if (DEMO / s["stage"]).is_dir():
            shutil.copytree(DEMO / s["stage"], d)
        s["path"] = str(d)
    text = release_report(summary)
    assert "**gate**: pass" in text and "| fine-tuned | 1.738 | 1.779 |" in text
    assert text == (DEMO / "release-report.md").read_text()


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module except documentation: docstrings and config fields' ``description=``
    (f-strings' literal parts included)."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "description" and isinstance(node.value, ast.Constant):
            docs.add(id(node.value))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_a_result_file_name_is_written_only_in_its_owner():
    owners: dict[str, set[str]] = {}
    for model in _all_models():
        owners.setdefault(model.NAME, set()).add(model.__module__)
    assert {"ab_live.json", "eval_offline.json", "gate.json", "result.json", "verify.json", "summary.json",
            "report.json", "publish.json", "publish-plan.json", "release.json"} <= set(owners)
    offenders = []
    for root in ("drafter", "drafter_prefect", "flows"):
        for p in sorted((ROOT / root).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for line, text in _string_constants(p):
                for name, mods in owners.items():
                    if name in text and module not in mods:
                        offenders.append(f"{p.relative_to(ROOT)}:{line} {name!r} (owner: {', '.join(sorted(mods))})")
    assert offenders == []


def test_the_owner_rule_sees_a_reader_that_walks_json_itself(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""Reads ab_live.json (a docstring: allowed)."""\nX = open("x/ab_live.json")\n'
                 'Y = Field(1, description="the A/B\'s ab_live.json")\n')
    assert [t for _, t in _string_constants(p)] == ["x/ab_live.json"]
