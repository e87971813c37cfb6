"""Work done once: a stored output is hashed once per process, the flow accepts the preflight report of the
same config, and the flow and `run_all` run stages through the pipeline's one sequence (`run_plan`)."""
from __future__ import annotations

import pytest

from drafter.core import pipeline
from drafter.core import store as store_mod
from drafter.core.errors import StoreError
from drafter.data.preflight import preflight
from tests.test_store import toy  # noqa: F401 — the toy-stage fixture


@pytest.fixture
def hashes(monkeypatch):
    """Paths passed to the store's sha256 (its verification), in order."""
    seen: list[str] = []
    real = store_mod.sha256_file

    def counting(path, *a, **kw):
        seen.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(store_mod, "sha256_file", counting)
    return seen


def test_a_stored_output_is_hashed_once_per_process(toy, hashes):
    pipeline.run_all(toy, echo=lambda *_: None)
    st = pipeline.open_store(toy)
    b = next(p for p in pipeline.plan(toy) if p.stage.name == "b")
    shard_files = 3
    store_mod._VERIFIED.clear()  # as in a new process
    hashes.clear()
    # preflight (the store's outputs), the flow's presence check, the stage's reuse check, its inputs
    preflight(toy, ["b"], check_lengths=False)
    first = len(hashes)
    assert first >= shard_files + 1  # a's data.txt and b's 3 shards hashed by preflight …
    st.find("b", b.key)
    pipeline.run_stage(toy, "b", st)
    pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    assert len(hashes) == first  # … and by nothing after it
    assert len(set(hashes)) == len(hashes)  # each file once


def test_a_file_changed_after_verification_is_verified_again(toy, hashes):
    pipeline.run_all(toy, echo=lambda *_: None)
    st = pipeline.open_store(toy)
    b = next(p for p in pipeline.plan(toy) if p.stage.name == "b")
    art = st.find("b", b.key)
    shard = art.path / "shards" / "0.txt"
    shard.write_text(shard.read_text() + "tampered")
    with pytest.raises(StoreError, match="shards/0.txt has .* bytes"):
        st.find("b", b.key)


def test_a_size_check_does_not_stand_for_a_hash(toy, hashes):
    """A `verify="size"` store's check is remembered as a size check: a sha256 store hashes afterwards."""
    pipeline.run_all(toy, echo=lambda *_: None)
    b = next(p for p in pipeline.plan(toy) if p.stage.name == "b")
    root = toy.store.root
    store_mod._VERIFIED.clear()  # as in a new process
    hashes.clear()
    store_mod.Store(root, verify="size").find("b", b.key)
    assert hashes == []
    store_mod.Store(root).find("b", b.key)
    assert len(hashes) == 3  # b's shards


def test_run_plan_runs_the_injected_runner_in_order_and_returns_the_failure(toy):
    st = pipeline.open_store(toy)
    planned = pipeline.plan(toy)
    ran: list[str] = []

    def runner(p):
        ran.append(p.stage.name)
        if p.stage.name == "b":
            raise ConnectionError("worker lost")
        return pipeline.run_stage(toy, p.stage.name, st)

    lines: list[str] = []
    out = pipeline.run_plan(toy, planned, st, runner, echo=lines.append)
    assert ran == ["a", "b"]  # c never started
    assert out.failed is not None and out.failed[0] == "b" and isinstance(out.failed[1], ConnectionError)
    s = out.summary
    assert s["status"] == "failed" and s["error"] == "b: ConnectionError: worker lost"
    assert [r["status"] for r in s["stages"]] == ["computed", "failed"]
    assert len(lines) == 1 and lines[0].startswith("a ")
    assert st.runs()[-1]["run_id"] == s["run_id"]  # written to the store before returning


def test_run_all_raises_the_failed_stage_error_after_writing_the_summary(toy):
    from tests.test_store import FAIL_ONCE

    FAIL_ONCE["on"] = True
    with pytest.raises(RuntimeError, match="killed"):
        pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    last = pipeline.open_store(toy).runs()[-1]
    assert last["status"] == "failed" and last["error"] == "b: RuntimeError: killed"


def test_the_release_flow_accepts_the_report_of_the_same_config(prefect_harness, toy, monkeypatch):
    import drafter_prefect.release as rel

    calls: list[list[str] | None] = []
    real = rel.run_preflight

    def counting(cfg, stages=None, **kw):
        calls.append(stages)
        return real(cfg, stages, **kw)

    monkeypatch.setattr(rel, "run_preflight", counting)
    report = preflight(toy, ["b"])
    assert report.covers(toy, ["b"]) and not report.covers(toy, None)
    rel.release(config=toy, stages=["b"], preflight=report)
    assert calls == []  # accepted: not checked again
    rel.release(config=toy, stages=["b"])
    assert calls == [["b"]]  # no report: the flow checks
    other = toy.model_copy(deep=True)
    other.scrub.replacement = "[X]"
    rel.release(config=other, stages=["b"], preflight=report)
    assert calls == [["b"], ["b"]]  # a report of another config is not accepted
    partial = preflight(toy, ["b"], check_lengths=False)
    rel.release(config=toy, stages=["b"], preflight=partial)
    assert len(calls) == 3  # nor one that skipped checks
