"""The DeepSeek-V4.1 DSpark release layout (drafter/models/dspark_v41.py) on a synthetic V4.1
checkpoint: the layout checked and its names routed by vLLM's own V4.1 loader, routed experts frozen,
trained tensors through the FP8 drop-in (32×32 UE8M0 re-quantized, MXFP4 experts and untouched tensors
kept byte-identical, the index rewritten), and bad inputs named."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open

from drafter.core.errors import StageError
from drafter.models.dspark_v41 import describe, load_trainable, role_of, trainable_keys, write_trained
from drafter.quant.dropin import DROPIN_NAME, build_dropin, check_dropin
from drafter.quant.verify import check_tensor
from drafter.quant.release import open_release
from tests.helpers.fp8_releases import make_v41_dspark_release


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    d, floats = make_v41_dspark_release(tmp_path_factory.mktemp("v41") / "rel")
    return open_release(d), floats


def test_the_layout_is_recognised_and_experts_are_frozen(v41):
    rel, _ = v41
    assert (rel.rule, rel.block) == ("ue8m0", (32, 32))
    lay = describe(rel.drafter_keys)
    assert (lay.stages, lay.experts) == (3, 2)
    assert lay.roles["mtp.0.main_proj.weight"] == "model: main_proj.weight"
    assert lay.roles["mtp.2.markov_head.embed.weight"] == "model: markov_head.embed.weight"
    assert lay.roles["mtp.1.attn.wq_b.scale"] == "scale of mtp.1.attn.wq_b.weight"
    assert role_of("mtp.1.main_proj.weight", 3) is None  # the combiner lives under mtp.0 only
    keys = trainable_keys(rel)
    assert not any(".ffn.experts." in k for k in keys)
    assert not any(k.endswith(".scale") for k in keys)
    assert {"mtp.0.attn.wq_a.weight", "mtp.1.hc_ffn_fn", "mtp.2.confidence_head.proj.weight", "mtp.0.attn.attn_sink",
            "mtp.2.ffn.gate.bias"} <= set(keys)
    assert "mtp.0.attn.wkv.weight" not in trainable_keys(rel, freeze=("mtp.*.ffn.experts.*", "re:\\.attn\\.wkv\\."))


def test_vllms_v41_loader_routes_every_name(v41, tmp_path):
    """vLLM 0.32's DSparkDeepseekV4ForCausalLM._remap_dspark_name (serving env) maps each tensor of the
    layout to the parameter it loads: the combiner and heads to the model, the rest to layer i."""
    from drafter.serving.server import ServingError, serving_python

    try:
        py = serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    rel, _ = v41
    (tmp_path / "names.json").write_text(json.dumps(rel.drafter_keys))
    code = ("import json, sys; from types import SimpleNamespace as N; "
            "from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM as M; "
            "s = N(model=N(confidence_head=object())); names = json.load(open(sys.argv[1])); "
            "json.dump({n: M._remap_dspark_name(s, n) for n in names}, open(sys.argv[2], 'w'))")
    r = subprocess.run([py, "-c", code, str(tmp_path / "names.json"), str(tmp_path / "map.json")], capture_output=True,
                       text=True, timeout=600, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    mapped = json.loads((tmp_path / "map.json").read_text())
    assert mapped["mtp.0.main_proj.weight"] == "model.main_proj.weight"
    assert mapped["mtp.2.markov_head.embed.weight"] == "model.markov_head.markov_w1.weight"
    assert mapped["mtp.2.markov_head.head.weight"] == "model.markov_head.markov_w2.weight"
    assert mapped["mtp.2.confidence_head.proj.weight"] == "model.confidence_head.proj.weight"
    assert mapped["mtp.2.norm.weight"] == "model.norm.weight"
    roles = describe(rel.drafter_keys).roles
    for k, v in mapped.items():
        if roles[k].startswith("stage"):
            assert v == f"model.layers.{k.split('.')[1]}.{k.split('.', 2)[2]}", (k, v)
        elif roles[k].startswith("scale of "):  # next to its weight, wherever that goes
            assert v == mapped[roles[k].removeprefix("scale of ")].removesuffix(".weight") + ".scale", (k, v)
        else:
            assert v == f"model.{k.split('.', 2)[2]}".replace("markov_head.embed", "markov_head.markov_w1").replace(
                "markov_head.head", "markov_head.markov_w2"), (k, v)


def test_trained_tensors_through_the_fp8_dropin(v41, tmp_path):
    rel, _ = v41
    t = load_trainable(rel)
    g = torch.Generator().manual_seed(0)
    moved = [k for k in t if any(s in k for s in (".attn.wq_a.", ".attn.wo_b.", "markov_head", "confidence_head",
                                                  "main_proj", "hc_attn_fn", "attn_sink"))]
    for k in moved:
        t[k] = t[k] + 0.01 * torch.randn(t[k].shape, generator=g)
    trained = write_trained(t, tmp_path / "trained.safetensors")
    doc = build_dropin(rel, trained, tmp_path / "fp8")
    chk = check_dropin(rel, tmp_path / "fp8")
    assert chk["ok"], chk["problems"]
    tensors = doc["tensors"]
    fp8_moved = [k for k in moved if k in rel.fp8]
    assert {k.split(".", 2)[2] for k in fp8_moved} >= {"attn.wq_a.weight", "attn.wo_b.weight", "main_proj.weight"}
    assert all(tensors[k]["action"] == "fp8 ue8m0 32x32" and 0 < tensors[k]["fp8_rel_error"] < 0.05 for k in fp8_moved)
    assert all(tensors[k]["action"] == "cast F32" for k in moved if "hc_" in k or "attn_sink" in k or "confidence" in k)
    assert all(tensors[k]["action"] == "cast BF16" for k in moved if "markov_head" in k)
    experts = [k for k in rel.drafter_keys if ".ffn.experts." in k and k.endswith(".weight")]
    assert experts and all(tensors[k]["action"].startswith("kept") for k in experts)
    untouched = [k for k in t if k not in moved]
    assert untouched and all(tensors[k]["action"] == "kept (unchanged by training)" for k in untouched)
    assert chk["kept_hash_equal"] == chk["kept"] > 0
    idx = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for k, v in idx.items() if v == DROPIN_NAME} == set(rel.drafter_keys)
    assert idx["embed.weight"] == rel.weight_map["embed.weight"]
    with safe_open(str(tmp_path / "fp8" / DROPIN_NAME), "pt") as f:
        for k in fp8_moved:
            assert check_tensor(f.get_tensor(k), f.get_tensor(rel.fp8[k]), rel.block, rel.rule, k).differ == 0
        assert f.get_tensor("mtp.1.hc_attn_fn").dtype == torch.float32


def test_bad_inputs_are_named(v41, tmp_path):
    rel, _ = v41
    keys = [k for k in rel.drafter_keys if k != "mtp.2.markov_head.head.weight"]
    with pytest.raises(ValueError, match="missing 1 tensor.*mtp.2.markov_head.head.weight"):
        describe(keys, where="rel")
    with pytest.raises(ValueError, match="not in the V4.1 DSpark layout: mtp.1.main_proj.weight"):
        describe(rel.drafter_keys + ["mtp.1.main_proj.weight"], where="rel")
    with pytest.raises(ValueError, match="no mtp.\\* tensors"):
        describe(["embed.weight"])
    # a routed expert changed in training: the drop-in does not write MXFP4
    t = load_trainable(rel, freeze=())
    k = "mtp.0.ffn.experts.0.w1.weight"
    assert k not in t  # packed MXFP4: never a trainable float
    t2 = {"mtp.0.ffn.gate.weight": load_trainable(rel)["mtp.0.ffn.gate.weight"]}
    with safe_open(str(rel.path_of(k)), "pt") as f:
        t2[k] = f.get_tensor(k).float() + 1
    with pytest.raises(StageError, match=f"tensor {k} is in the trained weights but the release stores it as U8"):
        build_dropin(rel, write_trained(t2, tmp_path / "bad.safetensors"), tmp_path / "fp8bad")
