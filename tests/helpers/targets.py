"""Helpers for tests: tiny models in exactly the served target's format.

Example::

    from tests.helpers.targets import make_tiny_target
    model_dir = make_tiny_target(tmp_path / "tiny")   # seconds, deterministic
"""
from __future__ import annotations

from pathlib import Path

from drafter.models.target import dense_to_glm4_moe_mtp, glm4_moe_mtp_config, load_embedded_tokenizer, write_checkpoint

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention kernels


def make_tiny_target(
    out_dir: Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    max_position_embeddings: int = 2048,
    rope_theta: float = 100000.0,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random-weight target: GLM-4-MoE + one MTP layer, the SmolLM2 tokenizer and chat template.

    Same architecture, tensor names and files as the re-expressed embedded target (the last layer and
    the MTP block are 2-expert MoEs; the MTP layer starts as a copy of the last layer with
    ``eh_proj = [0 | I]``). Weights come from ``torch.Generator().manual_seed(seed)``; logits have
    clear margins so greedy decoding is stable. ``head_dim`` must be one vLLM's CPU attention supports
    (32, 64, 80, 96, 112, 128, ...). Returns ``out_dir``.
    """
    import torch

    dense, tok = _tiny_dense(num_layers=num_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
    H, I, vocab = hidden_size, intermediate_size, len(tok)
    config = glm4_moe_mtp_config(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype=dtype,
    )
    base, mtp = dense_to_glm4_moe_mtp(dense, num_layers, getattr(torch, dtype))
    return write_checkpoint(Path(out_dir), config, base, mtp, tok)


def _tiny_dense(*, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, seed):
    """Llama-named random weights with clear logit margins, and the SmolLM2 tokenizer."""
    import torch

    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim}: vLLM's CPU attention supports only {VLLM_CPU_HEAD_DIMS}")

    tok = load_embedded_tokenizer()
    vocab = len(tok)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g) * std

    H, I = hidden_size, intermediate_size
    dense: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(vocab, H, std=1.0),
        "model.norm.weight": 1.0 + rnd(H, std=0.1),
        "lm_head.weight": rnd(vocab, H, std=0.5),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        dense |= {
            p + "input_layernorm.weight": 1.0 + rnd(H, std=0.1),
            p + "post_attention_layernorm.weight": 1.0 + rnd(H, std=0.1),
            p + "self_attn.q_proj.weight": rnd(num_heads * head_dim, H, std=H ** -0.5),
            p + "self_attn.k_proj.weight": rnd(num_kv_heads * head_dim, H, std=H ** -0.5),
            p + "self_attn.v_proj.weight": rnd(num_kv_heads * head_dim, H, std=H ** -0.5),
            p + "self_attn.o_proj.weight": rnd(H, num_heads * head_dim, std=(num_heads * head_dim) ** -0.5),
            p + "mlp.gate_proj.weight": rnd(I, H, std=H ** -0.5),
            p + "mlp.up_proj.weight": rnd(I, H, std=H ** -0.5),
            p + "mlp.down_proj.weight": rnd(H, I, std=I ** -0.5),
        }
    return dense, tok


def make_tiny_llama_target(out_dir: Path, *, num_layers: int = 8, hidden_size: int = 64, intermediate_size: int = 128,
                           num_heads: int = 2, num_kv_heads: int = 1, head_dim: int = 32, rope_theta: float = 100000.0,
                           max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """Write a tiny random-weight *Llama* target (the EAGLE-3 tests' verifier): ``LlamaForCausalLM``, one
    ``model.safetensors``, the SmolLM2 tokenizer and chat template, the same weights as :func:`make_tiny_target`
    draws. Eight layers by default, so vLLM's default aux layers ``(2, L // 2, L − 3)`` = ``(2, 4, 5)`` are distinct."""
    import json

    from drafter.core.files import save_safetensors

    dense, tok = _tiny_dense(num_layers=num_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tok),
              "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
              "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": rope_theta,
              "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
              "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_safetensors(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(str(out))
    return out
