"""Feature capture on the tiny target: shapes, dtypes, masks, agreement with a direct forward
pass, zero/NaN row detection naming shard and rows, disk refusal, resume."""
from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from drafter.data import capture as C
from drafter.data.capture import capture_features, iter_feature_shards, load_target_model, tokenize_rows
from drafter.core.config import config_from_dict
from drafter.core.files import list_shards, tokenize_conversation, write_jsonl_atomic
from drafter.core.errors import StageError
from drafter.core.stage import Artifact
from drafter.stages import capture as capture_stage
from drafter.models.target import write_target_json


def conversation(i: int) -> list[dict]:
    msgs = [{"role": "user", "content": "Tell me about topic %d. " % i + "Details please. " * (i % 4)},
            {"role": "assistant", "content": "Topic %d is interesting " % i + "indeed, " * (i % 6 + 1)}]
    if i % 3 == 0:
        msgs += [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes: more %d." % i}]
    return msgs


ROWS = [{"id": f"r{i}", "split": "heldout" if i % 5 == 0 else "train", "domain": "general", "mode": "off",
         "messages": conversation(i), "scrubbed": {}} for i in range(14)]


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_target_model(tiny_target)


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target))


@pytest.fixture(scope="module")
def seqs(tokenizer):
    return tokenize_rows(tokenizer, ROWS, max_seq_len=80)


def stage_inputs(tmp_path, target, *shard_rows: list[dict]) -> dict[str, Artifact]:
    """The capture stage's inputs: ``prepare_target`` pointing at ``target``, ``scrub`` holding one shard per list."""
    pt = tmp_path / "prepare_target"
    pt.mkdir()
    write_target_json(pt, str(target.resolve()), source="path", name="tiny", revision=None)
    sc = tmp_path / "scrub"
    for k, rows in enumerate(shard_rows):
        write_jsonl_atomic(sc / "shards" / f"shard-{k:05d}.jsonl", rows)
    return {"prepare_target": Artifact("prepare_target", "p" * 16, pt), "scrub": Artifact("scrub", "s" * 16, sc)}


@pytest.fixture()
def inputs(tmp_path, tiny_target):
    return stage_inputs(tmp_path, tiny_target, ROWS[:6], ROWS[6:])


def run_stage(tmp_path, inputs, **capture):
    cfg = config_from_dict({"capture": {"layers": [0, 1, 2], "batch_tokens": 160, "shard_tokens": 200,
                                        "max_seq_len": 80, **capture}})
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return capture_stage.run(cfg, inputs, out), out


def test_stage_shapes_dtypes_masks_and_direct_forward(tmp_path, inputs, model, tokenizer):
    metrics, out = run_stage(tmp_path, inputs)
    H, L = model.config.hidden_size, model.config.num_hidden_layers
    seen = {}
    for split in ("train", "heldout"):
        shards = list(iter_feature_shards(Artifact("capture", "c" * 16, out), split))
        assert shards, split
        assert [s.path.name for s in shards] == [f"shard-{i:05d}.safetensors" for i in range(len(shards))]
        for sh in shards:
            t = sh.tensors
            assert set(t) == {"input_ids", "loss_mask", "seq_offsets", "hidden_final",
                              "hidden_layer_0", "hidden_layer_1", "hidden_layer_2"}
            T = t["input_ids"].shape[0]
            assert t["input_ids"].dtype == torch.int64 and t["loss_mask"].dtype == torch.bool
            assert t["loss_mask"].shape == (T,) and t["seq_offsets"][0] == 0 and t["seq_offsets"][-1] == T
            for n in ("hidden_final", "hidden_layer_0", "hidden_layer_1", "hidden_layer_2"):
                assert t[n].shape == (T, H) and t[n].dtype == torch.float32
            assert sh.split == split and sh.layers == [0, 1, 2] and len(sh.row_ids) == sh.num_sequences
            assert sh.meta["num_tokens"] == str(T)
            for k, rid in enumerate(sh.row_ids):
                seen[rid] = split
                row = next(r for r in ROWS if r["id"] == rid)
                ids, mask = tokenize_conversation(tokenizer, row["messages"])
                s = sh.sequence(k)
                assert s["input_ids"].tolist() == ids[:80] and s["loss_mask"].int().tolist() == mask[:80]
                with torch.inference_mode():
                    ref = model(input_ids=s["input_ids"][None], output_hidden_states=True)
                    dec = model.model(input_ids=s["input_ids"][None]).last_hidden_state[0]
                # the capture's batched forward sums in another order than this single-sequence one: float32
                # differences of up to ~2e-4 deep in the stack (seen in CI); a wrong layer or position is off by ≫ 1e-2
                tol = {"atol": 1e-3, "rtol": 1e-3}
                # hidden_final is the LM-head input: it reproduces the logits and the decoder output
                torch.testing.assert_close(s["hidden_final"], dec, **tol)
                torch.testing.assert_close(model.lm_head(s["hidden_final"]), ref.logits[0], **tol)
                for i in range(L):  # state entering layer i (transformers' hidden_states[i])
                    torch.testing.assert_close(s[f"hidden_layer_{i}"], ref.hidden_states[i][0], **tol)
                    if i:  # the check can tell neighbouring layers apart
                        assert (ref.hidden_states[i][0] - ref.hidden_states[i - 1][0]).abs().max() > 1e-2
                # the last layer's output before the final norm: norm(hidden_layer_L) == hidden_final
                torch.testing.assert_close(model.model.norm(s[f"hidden_layer_{L}"]), s["hidden_final"], **tol)
    assert seen == {r["id"]: r["split"] for r in ROWS}

    truncated = sum(len(tokenize_conversation(tokenizer, r["messages"])[0]) > 80 for r in ROWS)
    total = sum(min(len(tokenize_conversation(tokenizer, r["messages"])[0]), 80) for r in ROWS)
    assert truncated > 0
    assert metrics["tokens"] == total and metrics["sequences"] == len(ROWS) and metrics["truncated"] == truncated
    files = list((out / "features").rglob("*.safetensors"))
    assert metrics["shards"] == len(files) > 2 and metrics["shards_reused"] == 0
    assert metrics["bytes_written"] == sum(f.stat().st_size for f in files)
    assert 0.9 < metrics["estimated_bytes"] / metrics["bytes_written"] < 1.2
    assert metrics["bytes_per_token"] == pytest.approx(metrics["bytes_written"] / total, rel=1e-3)
    assert metrics["bytes_per_token"] > 4 * H * 4 and metrics["tokens_per_s"] > 0
    assert (out / "report.json").is_file() and not list(out.rglob("*.tmp"))

    # a second try in the same directory keeps every shard
    m2, _ = run_stage(tmp_path, inputs)
    assert m2["shards_reused"] == m2["shards"] == metrics["shards"]


def test_bfloat16_storage(tmp_path, model, seqs):
    res = capture_features(model, seqs[:4], tmp_path, dtype="bfloat16", shard_tokens=10_000)
    (sh,) = list(iter_feature_shards(tmp_path, "train"))
    assert sh.tensors["hidden_final"].dtype == torch.bfloat16 and sh.meta["dtype"] == "bfloat16"
    assert res.metrics()["bytes_per_token"] < model.config.hidden_size * 2 + 64


def _poison_final_norm(monkeypatch, model, seq_len: int, rows: list[int], value: float):
    """Make the model's output (final norm) `value` at `rows` for the batch of length `seq_len`."""
    norm = model.model.norm
    orig = norm.forward

    def forward(h):
        out = orig(h)
        if h.shape[1] == seq_len:
            out = out.clone()
            out[0, rows] = value
        return out

    monkeypatch.setattr(norm, "forward", forward)


@pytest.mark.parametrize("value,what", [(0.0, "all-zero"), (float("nan"), "non-finite"), (float("inf"), "non-finite")])
def test_bad_rows_fail_naming_shard_and_rows(tmp_path, monkeypatch, model, seqs, value, what):
    train = [s for s in seqs if s.split == "train"]
    pick = sorted({len(s): s for s in train}.values(), key=len)[:3]  # distinct lengths: one per batch
    victim = pick[1]
    offset = len(pick[0])  # packed in plan order: pick[0] first, then the victim
    _poison_final_norm(monkeypatch, model, len(victim), [2, 5], value)
    with pytest.raises(StageError) as e:
        capture_features(model, pick, tmp_path, batch_tokens=16, shard_tokens=10_000)
    msg = str(e.value)
    assert "train/shard-00000.safetensors" in msg and "hidden_final" in msg and what in msg
    assert f"rows [{offset + 2}, {offset + 5}]" in msg and victim.row_id in msg
    assert "hidden_layer" not in msg
    assert not list(tmp_path.rglob("*.safetensors"))  # the bad shard was not written


def test_layer0_zero_rows_are_allowed_but_nan_is_not():
    tensors = {"seq_offsets": torch.tensor([0, 4]), "hidden_layer_0": torch.zeros(4, 8),
               "hidden_final": torch.ones(4, 8)}
    C.check_features(tensors, "s.safetensors", ["a"])
    tensors["hidden_layer_0"][1, 3] = float("nan")
    with pytest.raises(StageError, match=r"(?s)s\.safetensors.*hidden_layer_0: non-finite values in rows \[1\] \(conversations: a\)"):
        C.check_features(tensors, "s.safetensors", ["a"])


def test_refuses_when_disk_is_too_small(tmp_path, monkeypatch, model, seqs):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 5000, 5000))
    called = []
    monkeypatch.setattr(C.HiddenStates, "__call__", lambda *a, **k: called.append(1))
    tokens = sum(len(s) for s in seqs)
    est = C.estimate_bytes(tokens, len(seqs), 2, model.config.hidden_size, "float32",
                           len(C.plan_shards(seqs, 200)))
    with pytest.raises(StageError) as e:
        capture_features(model, seqs, tmp_path / "f", layers=[1], shard_tokens=200, min_free_margin=1.5)
    msg = str(e.value)
    assert f"{est:,} bytes" in msg and "5,000 bytes" in msg and f"{int(1.5 * est):,}" in msg
    assert not called and not (tmp_path / "f").exists()


def test_stage_refuses_before_loading_model_work(tmp_path, monkeypatch, inputs):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(StageError, match=r"(?s)not enough disk for capture.*only 100 bytes"):
        run_stage(tmp_path, inputs)
    assert not list((tmp_path / "out").rglob("*.safetensors"))


def test_resume_keeps_finished_shards_and_gives_identical_results(tmp_path, model, seqs):
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(layers=[1], batch_tokens=128, shard_tokens=150)
    full = capture_features(model, seqs, a, **kw)
    shards = sorted(a.rglob("*.safetensors"))
    assert len(shards) >= 4
    # simulate an interrupted try: some shards finished, one half-written temp file, one corrupt
    shutil.copytree(a, b)
    kept = [p for p in sorted(b.rglob("*.safetensors"))]
    kept[-1].unlink()
    kept[-2].write_bytes(b"garbage")
    (kept[0].parent / ".shard-00009.safetensors.1234abcd.tmp").write_bytes(b"partial")
    mtimes = {p: p.stat().st_mtime_ns for p in kept[:-2]}
    res = capture_features(model, seqs, b, **kw)
    assert res.shards_reused == len(shards) - 2 and res.shards == full.shards
    assert res.tokens_computed == sum(sh["tokens"] for sh in res.shard_files if not sh["reused"])
    for p, t in mtimes.items():
        assert p.stat().st_mtime_ns == t  # kept, not rewritten
    for pa, pb in zip(shards, sorted(b.rglob("*.safetensors"))):
        assert pa.relative_to(a) == pb.relative_to(b)
        assert pa.read_bytes() == pb.read_bytes()
    assert res.bytes_written == full.bytes_written


def test_changed_inputs_invalidate_kept_shards(tmp_path, model, seqs):
    capture_features(model, seqs, tmp_path, shard_tokens=150)
    changed = [C.Sequence(s.row_id, s.split, s.input_ids.flip(0), s.loss_mask, s.truncated) for s in seqs]
    res = capture_features(model, changed, tmp_path, shard_tokens=150)
    assert res.shards_reused == 0


def test_bad_rows_and_layers_are_named(tokenizer, model):
    with pytest.raises(StageError, match=r"row 'x': split must be one of"):
        tokenize_rows(tokenizer, [{"id": "x", "split": "dev", "messages": conversation(1)}], 64)
    with pytest.raises(StageError, match=r"(?s)capture.layers \[7\] out of range.*2 decoder layers"):
        C.HiddenStates(model, [7])
