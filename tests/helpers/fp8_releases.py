"""Synthetic FP8 releases written by the reference implementation (:mod:`drafter.quant.reference`).

* :func:`make_v3_release` — DeepSeek-V3 layout: MTP layer ``model.layers.{L}.*``, FP8 E4M3 in 128×128
  blocks with float32 ``<name>_scale_inv``, BF16 norms/head/embedding, F32 router bias, two shards + index;
* :func:`make_v41_dspark_release` — DeepSeek-V4.1 with a DSpark drafter: V4.1 attention names, ``main_proj``,
  the Markov and confidence heads, the V4 formats;
* :func:`make_v4_release` — DeepSeek-V4 layout: ``mtp.0..2.*``, FP8 32×32 with UE8M0 ``<module>.scale``
  (``float8_e8m0fnu``), MXFP4-packed routed experts (``U8`` nibbles + e8m0 ``.scale`` per 32 values),
  F32 hyper-connection parameters, BF16 norms;

Hand-made blocks are planted in the V4 fixture: a block whose maximum is exactly ``448·2^k``, one a
float32 ulp above it, an all-zero block, and a block whose maximum rounds down to 224 (the UE8M0
rounding edge the self-check reports as ``edge``).

Example::

    rel_dir, ref = make_v4_release(tmp_path / "v4")
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from drafter.quant.standin import fp8_tensors as _fp8_tensors
from drafter.quant.standin import write_release as _write

V3_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def make_v3_release(out_dir: Path, *, seed: int = 0, hidden: int = 192, inter: int = 160, experts: int = 2
                    ) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny DeepSeek-V3-layout checkpoint (FP8 128×128, float32 ``weight_scale_inv``). Returns ``(dir, floats)``:
    every tensor's float32 values before FP8/BF16 rounding."""
    rng = np.random.default_rng(seed)
    L, H, V = 1, hidden, 256
    p = f"model.layers.{L}."
    f32 = lambda *s: (rng.standard_normal(s) * s[-1] ** -0.5).astype(np.float32)  # noqa: E731
    mtp = {p + "enorm.weight": 1 + 0.1 * f32(H), p + "hnorm.weight": 1 + 0.1 * f32(H),
           p + "eh_proj.weight": f32(H, 2 * H), p + "input_layernorm.weight": 1 + 0.1 * f32(H),
           p + "post_attention_layernorm.weight": 1 + 0.1 * f32(H),
           p + "self_attn.q_a_proj.weight": f32(96, H), p + "self_attn.q_b_proj.weight": f32(2 * 48, 96),
           p + "self_attn.kv_a_proj_with_mqa.weight": f32(80, H), p + "self_attn.o_proj.weight": f32(H, 64),
           p + "mlp.gate.weight": f32(experts, H), p + "mlp.gate.e_score_correction_bias": np.zeros(experts, np.float32),
           p + "shared_head.norm.weight": 1 + 0.1 * f32(H), p + "shared_head.head.weight": f32(V, H),
           p + "embed_tokens.weight": f32(V, H)}
    for e in range(experts):
        mtp |= {p + f"mlp.experts.{e}.gate_proj.weight": f32(inter, H), p + f"mlp.experts.{e}.up_proj.weight": f32(inter, H),
                p + f"mlp.experts.{e}.down_proj.weight": f32(H, inter)}
    for n in ("gate_proj", "up_proj"):
        mtp[p + f"mlp.shared_experts.{n}.weight"] = f32(inter, H)
    mtp[p + "mlp.shared_experts.down_proj.weight"] = f32(H, inter)
    base = {"model.embed_tokens.weight": f32(V, H), "model.norm.weight": 1 + 0.1 * f32(H), "lm_head.weight": f32(V, H),
            "model.layers.0.self_attn.o_proj.weight": f32(H, 64)}
    floats = base | mtp
    shards: dict[str, dict[str, torch.Tensor]] = {V3_SHARDS[0]: {}, V3_SHARDS[1]: {}}
    for name, w in floats.items():
        dst = shards[V3_SHARDS[1] if name.startswith(p) else V3_SHARDS[0]]
        if w.ndim == 2 and any(s in name for s in (".self_attn.", ".mlp.experts.", ".mlp.shared_experts.")):
            dst |= _fp8_tensors(name, w, (128, 128), "float32", v4=False)
        elif name.endswith("e_score_correction_bias"):
            dst[name] = torch.from_numpy(w)
        else:
            dst[name] = torch.from_numpy(w).to(torch.bfloat16)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
              "num_hidden_layers": L, "num_nextn_predict_layers": 1, "vocab_size": V,
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}}
    _write(Path(out_dir), config, shards)
    return Path(out_dir), floats


def _plant_edges(w: np.ndarray) -> None:
    """Hand-made 32×32 blocks in the first block row of ``w`` (needs ≥ 4 block columns)."""
    w[:32, 0:32] *= 0.0
    w[0, 5] = 448.0 * 2.0 ** -6  # block max exactly 448·2^k → scale 2^k, q = 0x7E
    w[:32, 32:64] *= 0.0
    w[1, 33] = np.nextafter(np.float32(448.0 * 2.0 ** -6), np.float32(np.inf))  # one ulp above → scale 2^(k+1)
    w[:32, 64:96] = 0.0  # all zeros → amax floored at 1e-4
    blk = w[:32, 96:128]
    blk *= 0.1 / np.abs(blk).max()
    blk[2, 2] = 230.0 * 2.0 ** -10  # max/s = 230 rounds to 224: the UE8M0 rounding edge
    blk[3, 3] = 2.0 ** -9 * 2.0 ** -10  # an E4M3 subnormal


def _store_v4(out: dict, floats: dict[str, np.ndarray], *, fp8_parts, f32_parts) -> None:
    """V4 formats: 2-D weights named by ``fp8_parts`` as FP8 32×32 UE8M0 (+ ``.scale``), names with
    ``f32_parts`` as F32, the rest BF16."""
    for name, w in floats.items():
        if w.ndim == 2 and any(s in name for s in fp8_parts):
            out.update(_fp8_tensors(name, w, (32, 32), "ue8m0", v4=True))
        elif any(s in name for s in f32_parts):
            out[name] = torch.from_numpy(w)
        else:
            out[name] = torch.from_numpy(w).to(torch.bfloat16)


def _mxfp4_experts(out: dict, rng, prefix: str, experts: int, inter: int, H: int) -> None:
    """Routed experts in MXFP4: two E2M1 nibbles per byte, one e8m0 scale per 32 values."""
    for e in range(experts):
        for wn, (r, c) in (("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter))):
            k = prefix + f"ffn.experts.{e}.{wn}"
            out[k + ".weight"] = torch.from_numpy(rng.integers(0, 256, (r, c // 2), dtype=np.uint8))
            out[k + ".scale"] = torch.from_numpy(rng.integers(118, 128, (r, -(-c // 32)), dtype=np.uint8)).view(
                torch.float8_e8m0fnu)


def make_v4_release(out_dir: Path, *, seed: int = 0, hidden: int = 128, inter: int = 80, experts: int = 2,
                    n_mtp: int = 3) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny DeepSeek-V4-layout checkpoint (``mtp.0..n-1``; FP8 32×32 UE8M0; MXFP4 routed experts)."""
    rng = np.random.default_rng(seed)
    H, V, HC = hidden, 256, 4
    f32 = lambda *s: (rng.standard_normal(s) * s[-1] ** -0.5).astype(np.float32)  # noqa: E731
    floats: dict[str, np.ndarray] = {"embed.weight": f32(V, H), "norm.weight": 1 + 0.1 * f32(H), "head.weight": f32(V, H),
                                     "layers.0.attn.wo.weight": f32(H, H)}
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    base, mtp = shards.values()
    for i in range(n_mtp):
        p = f"mtp.{i}."
        fl = {p + "enorm.weight": 1 + 0.1 * f32(H), p + "hnorm.weight": 1 + 0.1 * f32(H), p + "norm.weight": 1 + 0.1 * f32(H),
              p + "e_proj.weight": f32(H, H), p + "h_proj.weight": f32(H, H), p + "attn_norm.weight": 1 + 0.1 * f32(H),
              p + "attn.wq.weight": f32(H, H), p + "attn.wkv.weight": f32(H // 2 + 8, H), p + "attn.wo.weight": f32(H, H),
              p + "ffn_norm.weight": 1 + 0.1 * f32(H), p + "ffn.gate.weight": f32(experts, H),
              p + "ffn.gate.bias": np.zeros(experts, np.float32),
              p + "ffn.shared_experts.w1.weight": f32(inter, H), p + "ffn.shared_experts.w3.weight": f32(inter, H),
              p + "ffn.shared_experts.w2.weight": f32(H, inter),
              p + "hc_attn_fn": f32(HC, H), p + "hc_attn_base": f32(HC), p + "hc_attn_scale": np.ones(3, np.float32),
              p + "hc_ffn_fn": f32(HC, H), p + "hc_ffn_base": f32(HC), p + "hc_ffn_scale": np.ones(3, np.float32)}
        if i == 0:
            _plant_edges(fl[p + "attn.wq.weight"])
        floats |= fl
        _store_v4(mtp, fl, fp8_parts=(".attn.w", "_proj.", ".shared_experts."), f32_parts=("hc_", ".bias"))
        _mxfp4_experts(mtp, rng, p, experts, inter, H)
    for name, w in floats.items():
        if not name.startswith("mtp."):
            base[name] = torch.from_numpy(w).to(torch.bfloat16)
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "dim": H, "num_hidden_layers": 1,
              "num_nextn_predict_layers": n_mtp, "vocab_size": V, "hc_mult": HC,
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}}
    _write(Path(out_dir), config, shards)
    return Path(out_dir), floats


def make_v41_dspark_release(out_dir: Path, *, seed: int = 0, hidden: int = 128, inter: int = 64, experts: int = 2,
                            stages: int = 3, q_lora: int = 64, kv: int = 64, heads: int = 2, head_dim: int = 64,
                            o_lora: int = 64, rank: int = 32) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny DeepSeek-V4.1 checkpoint with a DSpark drafter under ``mtp.0..stages-1``
    (:mod:`drafter.models.dspark_v41`): FP8 32×32 UE8M0 attention, shared experts and ``main_proj``;
    MXFP4 routed experts; F32 router bias, attention sinks, hyper-connections and confidence head;
    BF16 norms and Markov head. Returns ``(dir, floats)``."""
    rng = np.random.default_rng(seed)
    H, V, HC = hidden, 256, 4
    f32 = lambda *s: (rng.standard_normal(s) * s[-1] ** -0.5).astype(np.float32)  # noqa: E731
    floats: dict[str, np.ndarray] = {"embed.weight": f32(V, H), "norm.weight": 1 + 0.1 * f32(H), "head.weight": f32(V, H),
                                     "layers.0.attn.wo_a.weight": f32(o_lora, heads * head_dim)}
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    base, mtp = shards.values()
    fp8_parts = (".attn.wq_a.", ".attn.wkv.", ".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".shared_experts.", ".main_proj.")
    f32_parts = ("hc_", ".gate.bias", "attn_sink", "confidence_head.")
    for i in range(stages):
        p = f"mtp.{i}."
        fl = {p + "attn.wq_a.weight": f32(q_lora, H), p + "attn.wkv.weight": f32(kv, H),
              p + "attn.wq_b.weight": f32(heads * head_dim, q_lora), p + "attn.wo_a.weight": f32(o_lora, heads * head_dim),
              p + "attn.wo_b.weight": f32(H, o_lora), p + "attn.q_norm.weight": 1 + 0.1 * f32(q_lora),
              p + "attn.kv_norm.weight": 1 + 0.1 * f32(kv), p + "attn.attn_sink": f32(heads),
              p + "attn_norm.weight": 1 + 0.1 * f32(H), p + "ffn_norm.weight": 1 + 0.1 * f32(H),
              p + "ffn.gate.weight": f32(experts, H), p + "ffn.gate.bias": np.zeros(experts, np.float32),
              p + "ffn.shared_experts.w1.weight": f32(inter, H), p + "ffn.shared_experts.w3.weight": f32(inter, H),
              p + "ffn.shared_experts.w2.weight": f32(H, inter),
              p + "hc_attn_fn": f32(HC, H), p + "hc_attn_base": f32(HC), p + "hc_attn_scale": np.ones(3, np.float32),
              p + "hc_ffn_fn": f32(HC, H), p + "hc_ffn_base": f32(HC), p + "hc_ffn_scale": np.ones(3, np.float32)}
        if i == 0:
            fl |= {p + "main_proj.weight": f32(H, 3 * H), p + "main_norm.weight": 1 + 0.1 * f32(H)}
            _plant_edges(fl[p + "attn.wq_a.weight"])
        if i == stages - 1:
            fl |= {p + "norm.weight": 1 + 0.1 * f32(H), p + "markov_head.embed.weight": f32(V, rank),
                   p + "markov_head.head.weight": f32(V, rank), p + "confidence_head.proj.weight": f32(1, H + rank)}
        floats |= fl
        _store_v4(mtp, fl, fp8_parts=fp8_parts, f32_parts=f32_parts)
        _mxfp4_experts(mtp, rng, p, experts, inter, H)
    for name, w in floats.items():
        if not name.startswith("mtp."):
            base[name] = torch.from_numpy(w).to(torch.bfloat16)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dim": H, "hidden_size": H,
              "num_hidden_layers": 1, "num_nextn_predict_layers": stages, "vocab_size": V, "hc_mult": HC,
              "dspark_target_layer_ids": [0, 0, 0], "dspark_markov_rank": rank, "enable_confidence_head": True,
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}}
    _write(Path(out_dir), config, shards)
    return Path(out_dir), floats
