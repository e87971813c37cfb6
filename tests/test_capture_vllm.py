"""`capture.engine: vllm` (issue 36): the capture stage through the serving env's vLLM writes the shards the
transformers engine writes (tensors within float tolerance, the same metadata), resumes without starting a
worker, and a failing worker is a StageError with its log's tail. The vLLM run needs the serving env
(DRAFTER_SERVE_PYTHON); the other tests run anywhere."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from drafter.core.config import config_from_dict
from drafter.core.errors import StageError
from drafter.core.files import list_shards
from drafter.core.stage import Artifact, key_config
from drafter.data import capture_vllm as V
from drafter.data.capture import Sequence
from drafter.data.feature_shards import iter_feature_shards, read_shard_metadata
from drafter.stages import capture as capture_stage
from tests.test_capture import conversation, stage_inputs


LONG = [{"role": "user", "content": "Write a long answer. " * 8},
        {"role": "assistant", "content": " ".join(f"word{k}" for k in range(120))}]  # several KV blocks (128 on CPU)
ROWS = [{"id": f"r{i}", "split": "heldout" if i % 5 == 0 else "train", "domain": "general", "mode": "off",
         "messages": conversation(i), "scrubbed": {}} for i in range(9)]
ROWS.append({"id": "long", "split": "train", "domain": "general", "mode": "off", "messages": LONG, "scrubbed": {}})
CAPTURE = {"layers": [0, 1], "batch_tokens": 256, "shard_tokens": 200, "max_seq_len": 400}


@pytest.fixture()
def inputs(tmp_path, tiny_target):
    return stage_inputs(tmp_path, tiny_target, ROWS)


def run_stage(tmp_path, inputs, name: str, serving: dict | None = None, **capture):
    cfg = config_from_dict({"capture": {**CAPTURE, **capture}, "serving": serving or {}})
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    return capture_stage.run(cfg, inputs, out), out


def shards(out) -> dict[str, object]:
    art = Artifact("capture", "c" * 16, out)
    return {f"{split}/{s.path.name}": s for split in ("train", "heldout") for s in iter_feature_shards(art, split)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_engine_writes_the_transformers_shards_and_resumes_without_a_worker(tmp_path, inputs, monkeypatch):
    from drafter.serving.server import ServingError, serving_python

    try:
        serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    m_hf, out_hf = run_stage(tmp_path, inputs, "hf")
    m_vl, out_vl = run_stage(tmp_path, inputs, "vllm", engine="vllm")
    assert m_vl == m_hf | {"tokens_per_s": m_vl["tokens_per_s"]}
    hf, vl = shards(out_hf), shards(out_vl)
    assert list(hf) == list(vl) and len(hf) >= 3
    long = next(s for s in vl.values() if "long" in s.row_ids)
    assert len(long.sequence(long.row_ids.index("long"))["input_ids"]) > 256  # truncated to 400: 4 KV blocks of 128
    for name, a in hf.items():
        b = vl[name]
        assert read_shard_metadata(a.path) == read_shard_metadata(b.path), name  # engine is in the report only
        assert set(a.tensors) == set(b.tensors) == {"input_ids", "loss_mask", "seq_offsets", "hidden_final",
                                                    "hidden_layer_0", "hidden_layer_1"}
        for t, ref in a.tensors.items():
            got = b.tensors[t]
            assert got.dtype == ref.dtype and got.shape == ref.shape, (name, t)
            if ref.is_floating_point():
                scale = float(ref.abs().max())
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} {t}")
            else:
                assert torch.equal(got, ref), (name, t)
    rep_hf, rep_vl = (json.loads((o / "report.json").read_text()) for o in (out_hf, out_vl))
    assert (rep_hf["engine"], rep_vl["engine"]) == ("transformers", "vllm")
    assert not (out_vl / "features" / V.WORK_DIR).exists()  # the per-request files are gone

    def no_worker(*a, **k):
        raise AssertionError("a resumed capture started a worker")

    before = {n: s.path.read_bytes() for n, s in vl.items()}
    monkeypatch.setattr(V, "run_worker", no_worker)
    m2, _ = run_stage(tmp_path, inputs, "vllm", engine="vllm")
    assert m2["shards_reused"] == m2["shards"] == len(before)
    assert {n: s.path.read_bytes() for n, s in shards(out_vl).items()} == before


def test_a_failing_worker_is_a_stage_error_with_its_log(tmp_path, inputs):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'worker started with' \"$@\"\necho 'boom: no vLLM here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StageError, match=r"(?s)exit status 3.*boom: no vLLM here") as e:
        run_stage(tmp_path, inputs, "bad", serving={"python": str(fake)}, engine="vllm")
    assert "drafter.serving.hidden_states" in str(e.value) and "worker.log" in str(e.value)
    assert not list_shards(tmp_path / "bad" / "features" / "train", "safetensors")


def test_a_missing_serving_env_is_a_stage_error(tmp_path, inputs):
    with pytest.raises(StageError, match="capture.engine=vllm needs the serving env"):
        run_stage(tmp_path, inputs, "none", serving={"python": str(tmp_path / "nope" / "python")}, engine="vllm")


def test_pack_shard_refuses_token_ids_that_differ_naming_the_row(tmp_path):
    H, aux = 4, [0, 2]
    seqs = [Sequence("row-a", "train", torch.tensor([1, 2, 3]), torch.tensor([False, True, True])),
            Sequence("row-b", "train", torch.tensor([4, 5]), torch.tensor([True, True]))]
    files = []
    for k, (s, ids) in enumerate(zip(seqs, ([1, 2, 3], [4, 6]))):
        f = tmp_path / f"q{k}.safetensors"
        save_file({"hidden_states": torch.randn(len(s), len(aux), H), "token_ids": torch.tensor(ids)}, str(f))
        files.append(f)
    with pytest.raises(StageError, match="row 'row-b'.*token ids differ"):
        V.pack_shard(seqs, files, aux, [0], torch.ones(H), 1e-5, "float32")
    save_file({"hidden_states": torch.randn(2, len(aux), H), "token_ids": torch.tensor([4, 5])}, str(files[1]))
    t = V.pack_shard(seqs, files, aux, [0], torch.ones(H), 1e-5, "bfloat16")
    assert t["hidden_final"].dtype == torch.bfloat16 and t["seq_offsets"].tolist() == [0, 3, 5]
    assert torch.allclose(t["hidden_final"].float().pow(2).mean(-1), torch.ones(5), atol=2e-2)  # RMS-normalised


def test_engine_settings():
    assert V.aux_layer_ids([1, 0, 1], 2) == [0, 1, 2] and V.aux_layer_ids([2], 2) == [2]
    with pytest.raises(StageError, match="out of range"):
        V.aux_layer_ids([3], 2)
    assert V.tensor_parallel_size([]) == 1
    assert V.tensor_parallel_size(["--block-size", "32", "--tensor-parallel-size", "8"]) == 8
    assert V.tensor_parallel_size(["-tp=4"]) == 4
    x = torch.randn(3, 8)
    w = torch.rand(8)
    ref = torch.nn.functional.rms_norm(x, (8,), w, 1e-6)
    torch.testing.assert_close(V.rms_norm(x, w, 1e-6), ref)


def test_the_default_engine_keeps_the_stage_key_and_vllm_changes_it():
    stage = capture_stage.STAGE
    default, explicit, vllm = (config_from_dict({"capture": c}) for c in ({}, {"engine": "transformers"},
                                                                           {"engine": "vllm"}))
    assert "engine" not in key_config(stage, default)["capture"]
    assert key_config(stage, default) == key_config(stage, explicit)
    assert key_config(stage, vllm)["capture"]["engine"] == "vllm"
