"""Test fixtures in third-party release formats (the embedded target's is :mod:`tests.helpers.targets`).

Example::

    from tests.helpers.deepseek import make_tiny_deepseek_v3_mtp
    model_dir, reference = make_tiny_deepseek_v3_mtp(tmp_path / "v3")
"""
from __future__ import annotations

import json
from pathlib import Path

V3_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def tiny_deepseek_v3_config(
    *,
    vocab_size: int = 512,
    hidden_size: int = 192,
    num_hidden_layers: int = 2,
    n_routed_experts: int = 4,
    num_nextn_predict_layers: int = 1,
) -> dict:
    """A tiny DeepSeek-V3 ``config.json`` (MLA attention, grouped sigmoid routing, MoE in the MTP layer).

    ``hidden_size`` 192 is 1.5 FP8 blocks, so block-wise scales are exercised (full and partial blocks).
    Default (non-YaRN) RoPE; everything else as DeepSeek-V3's config with smaller numbers.
    """
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 320,
        "moe_intermediate_size": 160,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_shared_experts": 1,
        "n_routed_experts": n_routed_experts,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": num_nextn_predict_layers,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "dtype": "bfloat16",
    }


def _is_fp8_weight(name: str) -> bool:
    """Which V3 tensors are FP8: the 2-D linear weights of the decoder block (attention, experts,
    shared experts). Norms, the router, ``eh_proj``, the embedding and ``shared_head.head`` stay BF16
    (router bias F32). The loader does not rely on this list: it dequantizes whatever has a ``_scale_inv``."""
    if not name.endswith(".weight") or "norm" in name or name.endswith("mlp.gate.weight"):
        return False
    return any(s in name for s in (".self_attn.", ".mlp.experts.", ".mlp.shared_experts."))


def make_tiny_deepseek_v3_mtp(out_dir: Path, *, seed: int = 0, **config_kw) -> tuple[Path, dict]:
    """Write a tiny DeepSeek-V3-format checkpoint holding the embedding, the final norm, ``lm_head`` and
    the MTP layer(s) ``model.layers.{L}.*`` (the base decoder layers are left out: only the MTP layer is
    read), sharded in two files with ``model.safetensors.index.json``.

    Block weights are random, stored as FP8 E4M3 + float32 ``weight_scale_inv`` (128×128 blocks,
    ``s = amax/448``); norms BF16; router weight BF16, its bias F32. Returns ``(out_dir, reference)``:
    ``reference`` maps every release name to the float32 tensor the file was made from (before FP8 /
    BF16 rounding), for comparing a dequantized load against.
    """
    import torch
    from drafter.core.files import save_safetensors

    from drafter.models.layouts import DeepSeekV3Layout, quantize_fp8_blocks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_deepseek_v3_config(**config_kw)
    layout = DeepSeekV3Layout()
    drafter = layout.build(config, device="meta")
    shapes = {k: tuple(v.shape) for k, v in layout.to_release(drafter).items()}
    g = torch.Generator().manual_seed(seed)
    H = config["hidden_size"]
    reference: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            t = torch.zeros(shape) if name.endswith("e_score_correction_bias") else 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
        reference[name] = t
    reference["model.embed_tokens.weight"] = reference[layout.embed_key(drafter.mtp_start)]
    reference["model.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    reference["lm_head.weight"] = torch.randn(config["vocab_size"], H, generator=g) * H ** -0.5

    base, mtp = {}, {}
    for name, t in reference.items():
        dst = mtp if layout.is_mtp_key(name, drafter) else base
        if _is_fp8_weight(name):
            w8, s = quantize_fp8_blocks(t)
            dst[name], dst[name + "_scale_inv"] = w8, s
        elif name.endswith("e_score_correction_bias"):
            dst[name] = t.float()
        else:
            dst[name] = t.to(torch.bfloat16)
    for shard, tensors in zip(V3_SHARDS, (base, mtp)):
        save_safetensors({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / shard), metadata={"format": "pt"})
    weight_map = {k: V3_SHARDS[0] for k in sorted(base)} | {k: V3_SHARDS[1] for k in sorted(mtp)}
    total = sum(v.numel() * v.element_size() for v in list(base.values()) + list(mtp.values()))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir, reference
