"""The stage store and the stage runner: keys, atomic publish, reuse, tampering, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.core import pipeline
from drafter.core import registry
from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageSkipped, StoreError
from drafter.core.stage import Stage, stage_key
from drafter.core.store import Store

CALLS: dict[str, int] = {}


def _count(name):
    CALLS[name] = CALLS.get(name, 0) + 1


def run_a(cfg, inputs, out: Path):
    _count("a")
    (out / "data.txt").write_text(f"a:{cfg.generate.seed}")
    return {"n": 1}


def run_b(cfg, inputs, out: Path):
    """Writes 3 'shards', one per call step; resumes from what the partial dir holds; fails once
    after the second shard when FAIL_ONCE is set (a kill mid-stage)."""
    _count("b")
    src = (inputs["a"].path / "data.txt").read_text()
    (out / "shards").mkdir(exist_ok=True)
    reused = 0
    for i in range(3):
        shard = out / "shards" / f"{i}.txt"
        if shard.exists():
            reused += 1
            continue
        tmp = shard.with_suffix(".tmp")
        tmp.write_text(f"{src}:{i}:{cfg.scrub.replacement}")
        tmp.rename(shard)
        if i == 1 and FAIL_ONCE["on"]:
            FAIL_ONCE["on"] = False
            raise RuntimeError("killed")
    return {"shards": 3, "reused": reused}


def run_c(cfg, inputs, out):
    _count("c")
    raise StageSkipped("needs CUDA")


FAIL_ONCE = {"on": False}
TOY = {
    "a": Stage("a", "1", (), ("generate",), run_a),
    "b": Stage("b", "1", ("a",), ("scrub",), run_b),
    "c": Stage("c", "1", ("b",), (), run_c),
}


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "ORDER", tuple(TOY))
    monkeypatch.setattr(registry, "get", lambda n: TOY[n])
    CALLS.clear()
    FAIL_ONCE["on"] = False
    return ReleaseConfig(store={"root": str(tmp_path / "store")}, retries=0)


def test_keys_depend_on_sections_and_inputs(toy):
    k1 = {p.stage.name: p.key for p in pipeline.plan(toy)}
    cfg2 = toy.model_copy(deep=True)
    cfg2.scrub.replacement = "X"  # only b's section changes → b and c (downstream) change
    k2 = {p.stage.name: p.key for p in pipeline.plan(cfg2)}
    assert k1["a"] == k2["a"] and k1["b"] != k2["b"] and k1["c"] != k2["c"]
    cfg3 = toy.model_copy(deep=True)
    cfg3.generate.seed = 5  # a changes → everything downstream changes through input keys
    k3 = {p.stage.name: p.key for p in pipeline.plan(cfg3)}
    assert all(k3[n] != k1[n] for n in "abc")
    assert stage_key(TOY["a"], toy, {}) == k1["a"] and len(k1["a"]) == 16


def test_second_run_recomputes_nothing(toy):
    s1 = pipeline.run_all(toy, echo=lambda *_: None)
    assert [r["status"] for r in s1["stages"]] == ["computed", "computed", "skipped"]
    s2 = pipeline.run_all(toy, echo=lambda *_: None)
    assert [r["status"] for r in s2["stages"]] == ["reused", "reused", "reused"]
    assert CALLS == {"a": 1, "b": 1, "c": 1}
    store = pipeline.open_store(toy)
    assert [r["run_id"] for r in store.runs()] == [s1["run_id"], s2["run_id"]]


def test_manifest_lists_files_with_hashes(toy):
    pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    store = pipeline.open_store(toy)
    key = pipeline.plan(toy, ["b"])[-1].key
    m = json.loads((store.final_dir("b", key) / "manifest.json").read_text())
    assert set(m["files"]) == {"shards/0.txt", "shards/1.txt", "shards/2.txt"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in m["files"].values())
    assert m["inputs"] == {"a": pipeline.plan(toy, ["a"])[0].key} and m["config"] == {"scrub": toy.scrub.model_dump()}
    assert m["status"] == "done" and m["metrics"] == {"shards": 3, "reused": 0}


@pytest.mark.parametrize("tamper", ["edit", "delete", "add", "manifest"])
def test_tampering_is_detected_and_named(toy, tamper):
    pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    store = pipeline.open_store(toy)
    key = pipeline.plan(toy, ["b"])[-1].key
    d = store.final_dir("b", key)
    if tamper == "edit":
        p = d / "shards/1.txt"
        p.write_text(p.read_text().replace("a", "b"))  # same size, different bytes
        match = "shards/1.txt does not match its sha256"
    elif tamper == "delete":
        (d / "shards/2.txt").unlink()
        match = "shards/2.txt is listed in the manifest but missing"
    elif tamper == "add":
        (d / "shards/extra.txt").write_text("x")
        match = "shards/extra.txt is not in the manifest"
    else:
        (d / "manifest.json").write_text("{not json")
        match = "manifest.json is not valid JSON"
    with pytest.raises(StoreError, match=match):
        pipeline.run_all(toy, echo=lambda *_: None)


def test_failure_leaves_no_published_dir_and_resumes(toy):
    FAIL_ONCE["on"] = True
    with pytest.raises(RuntimeError, match="killed"):
        pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    store = pipeline.open_store(toy)
    key = pipeline.plan(toy, ["b"])[-1].key
    assert not store.final_dir("b", key).exists()  # nothing partial published
    assert sorted(p.name for p in (store.partial_dir("b", key) / "shards").iterdir()) == ["0.txt", "1.txt"]
    failed = store.runs()[-1]
    assert failed["status"] == "failed" and "killed" in failed["error"]
    s = pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    b = s["stages"][-1]
    assert b["status"] == "computed" and b["metrics"]["reused"] == 2  # resumed from 2 finished shards
    assert not store.partial_dir("b", key).exists() and store.partials() == []
    m = json.loads((store.final_dir("b", key) / "manifest.json").read_text())
    assert m["resumed"] is True
    # same bytes as an uninterrupted run in a fresh store
    fresh = toy.model_copy(deep=True)
    fresh.store.root = str(Path(toy.store.root).parent / "fresh")
    pipeline.run_all(fresh, only=["b"], echo=lambda *_: None)
    m2 = json.loads((pipeline.open_store(fresh).final_dir("b", key) / "manifest.json").read_text())
    assert m2["files"] == m["files"]


def test_skipped_stage_records_reason_and_no_files(toy):
    s = pipeline.run_all(toy, echo=lambda *_: None)
    c = s["stages"][-1]
    assert c["status"] == "skipped" and c["reason"] == "needs CUDA"
    store = pipeline.open_store(toy)
    d = store.final_dir("c", c["key"])
    assert [p.name for p in d.iterdir()] == ["manifest.json"]


def test_missing_input_names_the_stage(toy):
    with pytest.raises(StoreError, match=r"needs the output of a .*drafter stage a"):
        pipeline.run_stage(toy, "b")


def test_unknown_stage(toy):
    with pytest.raises(KeyError, match="unknown stage"):
        pipeline.plan(toy, ["zzz"])


def test_fsspec_store_roundtrip(toy, tmp_path):
    """A remote (fsspec) store: files uploaded to an upload directory, the manifest naming it last;
    reused from the remote."""
    import fsspec

    toy.store.root = "memory://drafter-test-store"
    toy.store.cache_dir = str(tmp_path / "cache1")
    s1 = pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    fs = fsspec.filesystem("memory")
    key_b = s1["stages"][-1]["key"]
    assert fs.exists(f"/drafter-test-store/b/{key_b}/manifest.json")
    upload = json.loads(fs.cat_file(f"/drafter-test-store/b/{key_b}/manifest.json"))["upload"]
    assert upload.startswith(f".{key_b}.uploads/") and fs.exists(f"/drafter-test-store/b/{upload}/shards/2.txt")
    # a second machine (empty local cache) reuses the remote outputs without recomputing
    toy.store.cache_dir = str(tmp_path / "cache2")
    s2 = pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    assert [r["status"] for r in s2["stages"]] == ["reused", "reused"]
    assert CALLS == {"a": 1, "b": 1}
    # an upload without its manifest (interrupted) counts as absent
    fs.rm(f"/drafter-test-store/b/{key_b}/manifest.json")
    toy.store.cache_dir = str(tmp_path / "cache3")
    s3 = pipeline.run_all(toy, only=["b"], echo=lambda *_: None)
    assert s3["stages"][-1]["status"] == "computed"
    fs.rm("/drafter-test-store", recursive=True)


def test_store_verify_size_mode(tmp_path):
    st = Store(tmp_path / "s", verify="size")
    art, computed = st.produce("x", "k", lambda out: (out / "f").write_text("abc") and {}, {})
    assert computed
    (art.path / "f").write_text("abd")  # same size: size mode does not read the bytes
    assert st.find("x", "k") is not None
    (art.path / "f").write_text("abcd")
    with pytest.raises(StoreError, match="f has 4 bytes, manifest says 3"):
        st.find("x", "k")
