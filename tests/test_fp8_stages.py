"""The quantize_fp8 and verify_fp8 stages on a tiny embedded-layout target (stand-in FP8 release)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError
from drafter.models import TRAINED_NAME
from drafter.quant.dropin import DROPIN_NAME
from drafter.core.stage import Artifact
from drafter.stages import quantize_fp8, verify_fp8
from drafter.stages.verify_fp8 import unsupported_reason
from drafter.models.target import MTP_SHARD


def _make(root, **dims):
    from tests.helpers.targets import make_tiny_target

    model = make_tiny_target(root / "pt" / "model", **dims)
    (root / "pt" / "target.json").write_text(json.dumps({"model_dir": "model", "source": "embedded", "name": "tiny"}))
    mtp = {k: v.float() for k, v in load_file(str(model / MTP_SHARD)).items()}
    (root / "boot").mkdir()
    save_file(mtp, str(root / "boot" / TRAINED_NAME))
    g = torch.Generator().manual_seed(1)
    trained = {k: (v + 0.01 * torch.randn(v.shape, generator=g)) if ".self_attn." in k or "norm" in k else v
               for k, v in mtp.items()}
    (root / "train").mkdir()
    save_file(trained, str(root / "train" / TRAINED_NAME))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Dimensions that are not multiples of the 128×128 block (the amax is taken over padded blocks)."""
    return _make(tmp_path_factory.mktemp("fp8stage"), hidden_size=160, intermediate_size=192)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """Every FP8 matrix a multiple of 128 in both dimensions, as in real releases: what vLLM's block-FP8
    kernels accept (on a CPU with AMX the CPU kernel runs it; without, the engine says why not)."""
    return _make(tmp_path_factory.mktemp("fp8aligned"), hidden_size=256, intermediate_size=256, num_heads=2,
                 num_kv_heads=1, head_dim=128)


def _inputs(root):
    return {"prepare_target": Artifact("prepare_target", "p", root / "pt"),
            "bootstrap_drafter": Artifact("bootstrap_drafter", "b", root / "boot", {"status": "done"}),
            "train": Artifact("train", "t", root / "train")}


def _cfg(rule="float32", vllm=False):
    c = ReleaseConfig()
    return c.model_copy(update={"quantize_fp8": c.quantize_fp8.model_copy(update={"demo_release_scale": rule}),
                                "verify_fp8": c.verify_fp8.model_copy(update={"vllm_load": vllm})})


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """quantize_fp8 run once per rule on ``tiny`` (read-only: a test that changes it works on a copy):
    ``rule -> (metrics, out)``."""
    done = {}
    for rule in ("float32", "ue8m0"):
        out = tmp_path_factory.mktemp(f"q-{rule}")
        done[rule] = quantize_fp8.STAGE.run(_cfg(rule), _inputs(tiny), out), out
    return done


@pytest.mark.parametrize("rule", ["float32", "ue8m0"])
def test_quantize_then_verify(tiny, quantized, tmp_path, rule):
    cfg = _cfg(rule)
    m, q_out = quantized[rule]
    assert m["release"] == "stand-in" and m["rule"] == rule
    assert m["block"] == ("128x128" if rule == "float32" else "32x32")
    assert m["fp8_tensors"] == 4  # q/k/v/o moved in training; experts frozen (kept), shared experts kept too
    assert 0 < m["max_fp8_rel_error"] < 0.05 and ".self_attn." in m["max_fp8_rel_error_tensor"]
    err = json.loads((q_out / "fp8" / "fp8-error.json").read_text())["tensors"]
    assert all(v["action"].startswith("kept") for k, v in err.items() if ".mlp.experts." in k)
    idx = json.loads((q_out / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    drafter = {k for k, v in idx.items() if v == DROPIN_NAME}
    assert drafter and all(k.startswith("model.layers.2.") for k in drafter)
    assert all(v != DROPIN_NAME for k, v in idx.items() if not k.startswith("model.layers.2."))

    v_out = tmp_path / "v"
    v_out.mkdir()
    vm = verify_fp8.STAGE.run(cfg, {"prepare_target": _inputs(tiny)["prepare_target"],
                                    "quantize_fp8": Artifact("quantize_fp8", "q", q_out)}, v_out)
    assert vm["blocks_differ"] == 0 and vm["blocks_identical"] + vm["blocks_edge"] == vm["blocks_total"] > 0
    assert vm["dropin_keys_ok"] is True and vm["vllm_load"] == "skipped (verify_fp8.vllm_load: false)"
    assert "Part 1" in (v_out / "verify.md").read_text()


def test_verify_fails_on_a_tampered_release(tiny, quantized, tmp_path):
    import shutil

    cfg = _cfg("float32")
    q_out = tmp_path / "q"
    shutil.copytree(quantized["float32"][1], q_out)  # the stage's output, then one byte of it changed
    shard = q_out / "release" / "model-mtp-fp8.safetensors"
    ts = load_file(str(shard))
    name = "model.layers.2.mlp.experts.0.down_proj.weight"
    b = ts[name].view(torch.uint8).clone()
    i = int(b.bitwise_and(0x7F).flatten().argmax())  # a block maximum (448) made smaller
    b.view(-1)[i] = (int(b.view(-1)[i]) & 0x80) | 0x70
    blk = ((i // b.shape[1]) // 128, (i % b.shape[1]) // 128)
    ts[name] = b.view(torch.float8_e4m3fn)
    save_file(ts, str(shard))
    v_out = tmp_path / "v"
    v_out.mkdir()
    with pytest.raises(StageError, match=rf"{name}: 1/\d+ blocks differ, first at block \({blk[0]}, {blk[1]}\)"):
        verify_fp8.STAGE.run(cfg, {"prepare_target": _inputs(tiny)["prepare_target"],
                                   "quantize_fp8": Artifact("quantize_fp8", "q", q_out)}, v_out)


def test_unsupported_reason_reads_the_engine_log():
    log = ("(Worker pid=1) ERROR 11-29 22:00:23 [multiproc_executor.py:953] ValueError: Failed to find a kernel that "
           "can implement the ScaledMM linear layer. Reasons: \n(Worker pid=1) ERROR 11-29 [x.py:1] CPUFp8BlockScaledMMKernel "
           "requires AMX tile support (Sapphire Rapids or newer)..\n")
    r = unsupported_reason(log)
    assert r.startswith("Failed to find a kernel") and "AMX" in r
    assert unsupported_reason("ERROR ... KeyError: 'model.layers.2.eh_proj.weight_scale_inv'") is None
    shape = ("(Worker pid=1) ERROR 12-01 [fp8_utils.py:1326] ValueError: Weight output_partition_size = 576 is not "
             "divisible by weight quantization block_n = 128.\n")
    assert unsupported_reason(shape) == "Weight output_partition_size = 576 is not divisible by weight quantization block_n = 128."


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DRAFTER_SERVE_PYTHON"), reason="needs the serving env (DRAFTER_SERVE_PYTHON)")
def test_vllm_loads_the_dropin_or_says_why_not(aligned, tmp_path):
    cfg = _cfg("float32", vllm=True)  # a float32 target, as the demo serves it: fp8 is served in bfloat16
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"dtype": "float32"})})
    q_out = tmp_path / "q"
    q_out.mkdir()
    quantize_fp8.STAGE.run(cfg, _inputs(aligned), q_out)
    v_out = tmp_path / "v"
    v_out.mkdir()
    vm = verify_fp8.STAGE.run(cfg, {"prepare_target": _inputs(aligned)["prepare_target"],
                                    "quantize_fp8": Artifact("quantize_fp8", "q", q_out)}, v_out)
    log = (v_out / "vllm.log").read_text()
    if vm["vllm_load"] != "ok":  # never a silent pass: the engine's own reason, found in its log
        assert vm["vllm_load"].startswith("unsupported: ")
        assert vm["vllm_load"].split(": ", 1)[1].split(" Reasons")[0] in log
    assert json.loads((v_out / "verify.json").read_text())["vllm_load"] == vm["vllm_load"]


def test_non_fp8_release_without_bootstrap_skips_both_stages(tiny, tmp_path):
    from drafter.core.errors import StageSkipped

    inputs = _inputs(tiny) | {"bootstrap_drafter": Artifact("bootstrap_drafter", "b", tiny / "boot", {"status": "skipped"})}
    with pytest.raises(StageSkipped, match="not FP8"):
        quantize_fp8.STAGE.run(_cfg(), inputs, tmp_path)
    skipped = Artifact("quantize_fp8", "q", tmp_path, {"status": "skipped", "reason": "the released drafter is not FP8"})
    with pytest.raises(StageSkipped, match="quantize_fp8 was skipped.*not FP8"):
        verify_fp8.STAGE.run(_cfg(), {"prepare_target": inputs["prepare_target"], "quantize_fp8": skipped}, tmp_path)
