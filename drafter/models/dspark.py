"""DSpark block drafters for dense targets, as vLLM 0.32 serves them (``Qwen3DSparkModel``).

A DSpark draft proposes a whole block of ``B`` tokens in one parallel pass, then adds intra-block
dependency with a small sequential Markov head. For an anchor at position ``p`` (the last token
the target emitted; its own hidden state is not known yet) one step is::

    ctx_t   = fc(cat[target layer outputs at t])              t < p        # [H], once per token
    K_t,V_t = per layer: k_norm(k_proj(hidden_norm(ctx_t))), v_proj(…); RoPE at t
    x_j     = embed(anchor if j == 0 else noise_token)         j = 0..B−1, at positions p+j
    h       = norm(decoder layers over x: attention to [K_ctx | K_block], non-causal in the block)
    z_j     = s · lm_head(h_j)                                  (the target's LM head, shared)
    ℓ_j     = z_j + s · W2 · W1[y_{j−1}]                        y_{−1} = anchor; ℓ_j predicts x_{p+1+j}
    c_j     = σ(w · [h_j ; W1[y_{j−1}]] + b)                    confidence (adaptive verification)

Facts taken from vLLM 0.32's source, which this module reproduces:

* **Backbone** — ``model_executor/models/qwen3_dflash.py``: ``DFlashQwen3Model`` (Qwen3 decoder
  layers with per-head ``q_norm``/``k_norm``, neox RoPE, no sliding window unless configured) and
  ``precompute_and_store_context_kv``: the context states (``combine_hidden_states`` = ``fc`` over
  the concatenated aux hidden states) go through ``hidden_norm`` and then *each layer's own* K/V
  projection, ``k_norm`` and RoPE straight into that layer's KV cache — the context never runs
  through the decoder layers. ``_dflash_layer_causal``: without ``layer_types``/``is_causal`` every
  layer is non-causal, so the block's queries see each other.
* **Anchor-as-first-prediction** — ``v1/worker/gpu/spec_decode/dspark/speculator.py``: with
  ``sample_from_anchor`` (default) each request feeds exactly ``N = num_speculative_tokens`` query
  tokens, the anchor then ``N−1`` noise tokens (``mask_token_id`` / ``dspark_noise_token_id``), and
  every query position predicts the next token.
* **Markov head** — ``qwen3_dspark.py`` ``DSparkMarkovHead``: ``markov_w1`` an embedding
  ``[V, r]`` of the previously sampled token, ``markov_w2`` ``[V_draft, r]`` through the same
  ``LogitsProcessor`` (so scaled by ``logit_scale`` like the base logits), added to the base logits
  left to right (``_sample_sequential``); the first position's previous token is the anchor.
* **Confidence head** — ``DSparkConfidenceHead``: ``proj`` (``[1, H (+ r)]``, with bias, float32)
  over ``cat[h, markov_embed]`` when ``confidence_head_with_markov``, then a sigmoid
  (``compute_confidence``); fed the same ``h`` as the LM head (the backbone's normed output).
* **Aux layers** — ``spec_decode/eagle/eagle3_utils.py``: a dense DSpark's ``target_layer_ids``
  ``i`` read the residual stream *after* decoder layer ``i`` (aux index ``i + 1``), which
  :mod:`drafter.data.capture` stores as ``hidden_layer_{i+1}`` (:func:`capture_layers`).
* **Checkpoint** — ``Qwen3DSparkForCausalLM.load_weights``: tensors without the ``model.`` prefix
  (``layers.N.self_attn.q_proj.weight`` … ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
  ``markov_head.markov_w{1,2}.weight``, ``confidence_head.proj.{weight,bias}``); ``embed_tokens``
  and ``lm_head`` may be omitted and are then shared from the target (``load_dspark_model``).

Training (:meth:`DSparkDraft.forward`) runs many anchors of one sequence in one pass: the context
K/V of every position are computed once, and each anchor's block attends to the context strictly
before it (a boolean mask) and to its own block; the Markov head is teacher-forced
(``y_{j−1}`` = the data token ``x_{p+j}``, what an all-accepted draft would have sampled).

Example::

    cfg = DSparkConfig.for_target(target_config, target_layer_ids=[1, 3], block_size=5, markov_rank=64)
    draft = DSparkDraft(cfg)
    out = draft(input_ids, context_features, anchors, embed=target.embed_tokens, lm_head=target.lm_head)
    out.logits   # [B, M, block_size, V]: position j of anchor m predicts x[anchor + 1 + j]
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafter.models.checkpoint import read_tensors

Tensor = torch.Tensor

ARCHITECTURE = "Qwen3DSparkModel"
DSPARK_DIR = "dspark"  # a stage output's draft folder: config.json + model.safetensors, what vLLM loads
#: Frozen by default in DSpark training: nothing of the draft (the shared target embedding and LM
#: head are not the draft's parameters).
DEFAULT_FROZEN: tuple[str, ...] = ()


@dataclass
class DSparkConfig:
    """The draft's shape and DSpark fields; :meth:`to_hf` is the ``config.json`` vLLM loads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    target_layer_ids: list[int]
    block_size: int
    markov_rank: int
    noise_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    logit_scale: float = 1.0
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "target_hidden_size", "block_size",
                     "markov_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not problems and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        ids = list(self.target_layer_ids)
        if not ids or ids != sorted(set(ids)) or any(not isinstance(i, int) or i < 0 for i in ids):
            problems.append(f"target_layer_ids must be non-empty, unique, increasing layer indices, got {ids}")
        if isinstance(self.vocab_size, int) and not 0 <= self.noise_token_id < self.vocab_size:
            problems.append(f"noise_token_id {self.noise_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if problems:
            raise ValueError("DSpark config: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target_config, *, target_layer_ids: list[int], block_size: int, markov_rank: int,
                   noise_token_id: int | None = None, num_hidden_layers: int = 1, **overrides) -> "DSparkConfig":
        """A draft shaped like the target's decoder layers (hidden size, heads, MLP width, RoPE θ).
        The noise token defaults to the target's pad token, else its last vocabulary id."""
        t = target_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        if noise_token_id is None:
            pad = getattr(t, "pad_token_id", None)
            noise_token_id = pad if isinstance(pad, int) and 0 <= pad < t.vocab_size else t.vocab_size - 1
        rope = getattr(t, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(t, "rope_theta", 1_000_000.0)) if isinstance(rope, Mapping) else 1e6
        values = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=t.num_attention_heads,
                      num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
                      head_dim=head_dim, vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
                      target_layer_ids=list(target_layer_ids), block_size=block_size, markov_rank=markov_rank,
                      noise_token_id=noise_token_id, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
                      rope_theta=float(theta), max_position_embeddings=getattr(t, "max_position_embeddings", 32768))
        values.update(overrides)
        return cls(**values)

    def to_hf(self) -> dict:
        """``config.json`` of a standalone Qwen3 DSpark draft (``Qwen3DSparkModel``) for vLLM 0.32."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "float32",
            "logit_scale": self.logit_scale,
            # the DFlash backbone reads these from dflash_config (qwen3_dflash.py, eagle3_utils.py)
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.noise_token_id,
                              "use_aux_hidden_state": True},
            "use_aux_hidden_state": True,
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "dspark_block_size": self.block_size,
            "dspark_noise_token_id": self.noise_token_id,
            "mask_token_id": self.noise_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sample_from_anchor": True,
            "dspark_bonus_anchor": False,
            **self.extra,
        }

    @classmethod
    def from_hf(cls, data: Mapping, *, source: str = "config.json") -> "DSparkConfig":
        if ARCHITECTURE not in (data.get("architectures") or []):
            raise ValueError(f"{source}: architectures {data.get('architectures')} is not [{ARCHITECTURE!r}]")
        dflash = data.get("dflash_config") or {}
        ids = dflash.get("target_layer_ids") or data.get("dspark_target_layer_ids") or data.get("target_layer_ids")
        noise = dflash.get("mask_token_id", data.get("dspark_noise_token_id", data.get("mask_token_id")))
        block = data.get("block_size", data.get("dspark_block_size"))
        missing = [k for k, v in {"target_layer_ids": ids, "mask_token_id": noise, "block_size": block,
                                  "markov_rank": data.get("markov_rank")}.items() if v is None]
        if missing:
            raise ValueError(f"{source}: missing DSpark field(s) {', '.join(missing)}")
        if data.get("markov_head_type", "vanilla") != "vanilla" or data.get("sample_from_anchor", True) is not True:
            raise ValueError(f"{source}: only markov_head_type 'vanilla' with sample_from_anchor true is supported")
        known = set(cls.__dataclass_fields__) - {"extra", "target_layer_ids", "block_size", "noise_token_id"}
        values = {k: data[k] for k in known if k in data}
        try:
            return cls(target_layer_ids=list(ids), block_size=block, noise_token_id=noise, **values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e


def capture_layers(cfg: DSparkConfig) -> list[int]:
    """The ``capture.layers`` that hold this draft's context features: aux index ``i + 1`` for each
    target layer id ``i`` (the residual stream after layer ``i``)."""
    return [i + 1 for i in cfg.target_layer_ids]


def _qwen3_config(cfg: DSparkConfig):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
                       max_position_embeddings=cfg.max_position_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                       attention_bias=False)


class MarkovHead(nn.Module):
    """``markov_w1`` (embedding ``[V, r]``) and ``markov_w2`` (``[V_draft, r]``), vLLM's names."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, token_ids: Tensor) -> Tensor:
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: Tensor, scale: float = 1.0) -> Tensor:
        b = self.markov_w2(markov_embed)
        return b if scale == 1.0 else b * scale


class ConfidenceHead(nn.Module):
    """``proj``: ``[1, H (+ r)]`` with bias, computed in float32; returns logits (σ gives confidence)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True, dtype=torch.float32)

    def forward(self, hidden: Tensor, markov_embed: Tensor) -> Tensor:
        x = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
        return self.proj(x.float()).squeeze(-1)

    @torch.no_grad()
    def recalibrate(self, a: float, b: float) -> None:
        """Fold Platt scaling into ``proj``: afterwards the logit is ``a · old logit + b`` (exact: w ← a·w,
        bias ← a·bias + b), so the served head (vLLM's, same tensors) gives the recalibrated confidence."""
        self.proj.weight.mul_(a)
        self.proj.bias.mul_(a).add_(b)


@dataclass
class DSparkOutput:
    logits: Tensor  # [B, M, K, V]: with the (teacher-forced) Markov bias
    base_logits: Tensor  # [B, M, K, V]: the backbone's, before the Markov bias
    confidence_logits: Tensor | None  # [B, M, K]; σ gives the confidence
    hidden: Tensor  # [B, M, K, H]: the backbone's normed output
    labels: Tensor  # [B, M, K]: x[anchor + 1 + j] (0 where out of range)
    valid: Tensor  # [B, M, K] bool: the label exists (anchor + 1 + j < T)


class DSparkDraft(nn.Module):
    """The trainable DSpark draft: ``layers``, ``fc``, ``hidden_norm``, ``norm``, ``markov_head``,
    ``confidence_head`` (names as in the checkpoint vLLM loads). The embedding and LM head are the
    target's, passed to :meth:`forward`."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.cfg = cfg
        qcfg = _qwen3_config(cfg)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(qcfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.target_hidden_size * len(cfg.target_layer_ids), cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = (ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0),
                                               cfg.confidence_head_with_markov)
                                if cfg.enable_confidence_head else None)
        self.rotary = Qwen3RotaryEmbedding(qcfg)

    # ------------------------------------------------------------------ pieces
    def combine(self, features: Tensor) -> Tensor:
        """``fc`` over the concatenated target layer outputs ``[..., n·H_t]`` (vLLM's ``combine_hidden_states``)."""
        expected = self.fc.in_features
        if features.shape[-1] != expected:
            raise ValueError(f"context features have width {features.shape[-1]}, the draft's fc takes {expected} "
                             f"({len(self.cfg.target_layer_ids)} target layers × {self.cfg.target_hidden_size})")
        return self.fc(features)

    def _rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary(x, positions)
        return cos, sin

    def _context_kv(self, attn, ctx_normed: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        B, T, _ = ctx_normed.shape
        hd, nkv = self.cfg.head_dim, self.cfg.num_key_value_heads
        k = attn.k_norm(attn.k_proj(ctx_normed).view(B, T, nkv, hd)).transpose(1, 2)
        v = attn.v_proj(ctx_normed).view(B, T, nkv, hd).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    @staticmethod
    def _block_mask(anchors: Tensor, T: int, K: int, device) -> Tensor:
        """Which keys each block query reads, ``[B, 1, MK, T + MK]``: the context strictly before its
        anchor (``T`` keys), and its own block (``M·K`` keys, ``K`` per block of ``anchors`` ``[B, M]``)."""
        B, M = anchors.shape
        ctx_ok = torch.arange(T, device=device).view(1, 1, T) < anchors.unsqueeze(-1)  # [B, M, T]
        ctx_ok = ctx_ok.unsqueeze(2).expand(B, M, K, T).reshape(B, M * K, T)
        blk = torch.arange(M, device=device).repeat_interleave(K)
        blk_ok = (blk.view(-1, 1) == blk.view(1, -1)).expand(B, M * K, M * K)
        return torch.cat([ctx_ok, blk_ok], dim=-1).unsqueeze(1)  # [B, 1, MK, T + MK]

    def _layer(self, layer, h: Tensor, mask: Tensor, q_rope: tuple[Tensor, Tensor], ctx: Tensor,
               ctx_rope: tuple[Tensor, Tensor]) -> Tensor:
        """One decoder layer over the block queries ``h`` ``[B, MK, H]``: attention (``mask``) to the context's
        keys / values (from ``ctx`` ``[B, T, H]``) and the blocks' own, then the MLP; each with its residual."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, repeat_kv

        cfg = self.cfg
        B, MK = h.shape[0], h.shape[1]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        attn = layer.self_attn
        residual = h
        hn = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(hn).view(B, MK, nh, hd)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hn).view(B, MK, nkv, hd)).transpose(1, 2)
        v = attn.v_proj(hn).view(B, MK, nkv, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *q_rope)
        kc, vc = self._context_kv(attn, ctx, *ctx_rope)
        keys = repeat_kv(torch.cat([kc, k], dim=2), nh // nkv)
        vals = repeat_kv(torch.cat([vc, v], dim=2), nh // nkv)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=hd ** -0.5)
        h = residual + attn.o_proj(o.transpose(1, 2).reshape(B, MK, nh * hd))
        residual = h
        return residual + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, input_ids: Tensor, features: Tensor, anchors: Tensor, *, embed: nn.Module,
                lm_head: nn.Module, anchor_mask: Tensor | None = None,
                label_mask: Tensor | None = None, start: Tensor | int = 0) -> DSparkOutput:
        """Draft blocks for every anchor of every sequence in one pass.

        ``input_ids`` ``[B, T]``; ``features`` ``[B, T, n·H_t]`` (the target layer outputs at every
        position, concatenated in ``target_layer_ids`` order); ``anchors`` ``[B, M]`` positions
        ``1 ≤ p < T``; ``anchor_mask`` ``[B, M]`` (False = padding anchor, its block attends only to
        itself and its outputs are to be ignored); ``label_mask`` ``[B, T]`` (True = a token to train
        on: padding and prompt tokens are not) narrows ``valid``; ``start`` (int or ``[B]``) is the
        absolute position of index 0 (a window cut from a conversation): RoPE sees ``start + t``."""
        cfg = self.cfg
        B, T = input_ids.shape
        M, K = anchors.shape[1], cfg.block_size
        if features.shape[:2] != (B, T):
            raise ValueError(f"features {tuple(features.shape)} do not match input_ids {tuple(input_ids.shape)}")
        if anchors.shape[0] != B:
            raise ValueError(f"anchors {tuple(anchors.shape)} do not match the batch of input_ids {tuple(input_ids.shape)}")
        if anchor_mask is None:
            anchor_mask = torch.ones_like(anchors, dtype=torch.bool)
        used = anchors[anchor_mask]
        if used.numel() and (int(used.min()) < 1 or int(used.max()) >= T):
            raise ValueError(f"anchors must lie in [1, {T}), got {int(used.min())}..{int(used.max())}")
        device = input_ids.device
        j = torch.arange(K, device=device)
        block_pos = anchors.unsqueeze(-1) + j  # [B, M, K]
        # block inputs: the anchor token, then noise tokens
        anchor_tok = input_ids.gather(1, anchors.clamp(0, T - 1))
        block_ids = torch.full((B, M, K), cfg.noise_token_id, dtype=input_ids.dtype, device=device)
        block_ids[..., 0] = anchor_tok
        label_pos = block_pos + 1
        valid = (label_pos < T) & anchor_mask.unsqueeze(-1)
        if label_mask is not None:
            valid &= label_mask.bool().gather(1, label_pos.clamp(max=T - 1).view(B, -1)).view(B, M, K)
        labels = torch.where(valid, input_ids.gather(1, label_pos.clamp(max=T - 1).view(B, -1)).view(B, M, K),
                             torch.zeros((), dtype=input_ids.dtype, device=device))
        prev = input_ids.gather(1, block_pos.clamp(max=T - 1).view(B, -1)).view(B, M, K)  # y_{j−1} = x[p + j]

        offset = torch.as_tensor(start, device=device).reshape(-1, 1).expand(B, 1)
        ctx = self.hidden_norm(self.combine(features.to(self.fc.weight.dtype)))  # [B, T, H]
        ctx_cos, ctx_sin = self._rope(ctx, torch.arange(T, device=device).expand(B, T) + offset)
        q_pos = block_pos.view(B, M * K) + offset
        x = embed(block_ids.view(B, M * K)).to(ctx.dtype)
        q_cos, q_sin = self._rope(x, q_pos)

        mask = self._block_mask(anchors, T, K, device)
        h = x
        for layer in self.layers:
            h = self._layer(layer, h, mask, (q_cos, q_sin), ctx, (ctx_cos, ctx_sin))
        hidden = self.norm(h).view(B, M, K, cfg.hidden_size)

        s = cfg.logit_scale
        base = lm_head(hidden)
        m_embed = self.markov_head.embed(prev)
        if s != 1.0:  # (a scale of 1, the default, would cost two full [.., V] passes for nothing)
            base = base * s
        logits = base + self.markov_head.bias(m_embed, s)
        conf = self.confidence_head(hidden, m_embed) if self.confidence_head is not None else None
        return DSparkOutput(logits=logits, base_logits=base, confidence_logits=conf, hidden=hidden,
                            labels=labels, valid=valid)


@torch.no_grad()
def draft_greedy(draft: DSparkDraft, hidden: Tensor, base_logits: Tensor, anchor_tokens: Tensor) -> tuple[Tensor, Tensor | None]:
    """Serving's sequential stage at T=0 (vLLM ``DSparkSpeculator._sample_sequential`` with greedy
    drafts): left to right, ``ℓ_j = z_j + s·W2·W1[y_{j−1}]``, ``y_j = argmax ℓ_j``, ``y_{−1}`` = the
    anchor; the confidence of position ``j`` is σ(head(``h_j``, ``W1[y_{j−1}]``)). ``hidden``
    ``[N, K, H]`` and ``base_logits`` ``[N, K, V]`` from the backbone, ``anchor_tokens`` ``[N]``.
    Returns the draft tokens ``[N, K]`` and the confidences ``[N, K]`` (None without a head)."""
    N, K, _ = base_logits.shape
    prev = anchor_tokens
    tokens, embeds = [], []
    for j in range(K):
        e = draft.markov_head.embed(prev)
        embeds.append(e)
        prev = (base_logits[:, j] + draft.markov_head.bias(e, draft.cfg.logit_scale)).argmax(-1)
        tokens.append(prev)
    conf = None
    if draft.confidence_head is not None:
        conf = torch.sigmoid(draft.confidence_head(hidden, torch.stack(embeds, dim=1)))
    return torch.stack(tokens, dim=1), conf


def sample_anchors(lengths: Tensor, loss_mask: Tensor, num_anchors: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` distinct anchor positions per row, drawn uniformly among positions ``p ≥ 1``
    whose next token is a training token (``loss_mask[p + 1]``, ``p + 1 < lengths[b]``). Returns
    ``(anchors [B, M], mask [B, M])`` on ``loss_mask``'s device, sorted; rows with fewer candidates are
    padded (mask False). The draw is a permutation from the CPU ``generator`` (torch's global one by
    default, as checkpointed), whatever the device: the same anchors on every device."""
    B, T = loss_mask.shape
    dev = loss_mask.device
    out = torch.ones((B, num_anchors), dtype=torch.long, device=dev)
    ok = torch.zeros((B, num_anchors), dtype=torch.bool, device=dev)
    # p with p+1 a training token inside the row, p ≥ 1
    usable = loss_mask[:, 2:].bool() & (torch.arange(2, max(T, 2), device=dev) < lengths.to(dev)[:, None])
    for b in range(B):
        cand = torch.nonzero(usable[b]).flatten() + 1
        if cand.numel() == 0:
            continue
        perm = torch.randperm(cand.numel(), generator=generator)[:num_anchors].to(dev)
        pick = cand[perm].sort().values
        out[b, : pick.numel()] = pick
        ok[b, : pick.numel()] = True
    return out, ok


def block_acceptance(logits: Tensor, labels: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Greedy (T=0) acceptance per block: a position is accepted iff it and every earlier one in its
    block are argmax-correct. Returns ``accepted`` ``[B, M, K]`` bool, ``correct`` (per position,
    the confidence head's target) and ``tau`` per block (accepted prefix + 1 bonus)."""
    correct = (logits.argmax(-1) == labels) & valid
    accepted = torch.cumprod(correct.int(), dim=-1).bool()
    return {"correct": correct, "accepted": accepted, "tau": 1 + accepted.sum(-1)}


# ------------------------------------------------------------------ checkpoint


def state_for_vllm(draft: DSparkDraft) -> dict[str, Tensor]:
    """The tensors of the checkpoint, under vLLM's names (the rotary cache is not a weight)."""
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if not k.startswith("rotary.")}


def save_dspark(draft: DSparkDraft, out: Path, *, dtype: torch.dtype | None = None) -> list[Path]:
    """``config.json`` + ``model.safetensors`` in ``out`` (written to temporary names, then renamed)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_for_vllm(draft)
    if dtype is not None:  # the confidence head stays float32, as vLLM builds it
        tensors = {k: (v if k.startswith("confidence_head.") else v.to(dtype)) for k, v in tensors.items()}
    cfg = draft.cfg.to_hf()
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    tmp_w, tmp_c = out / ".model.safetensors.tmp", out / ".config.json.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp_w.replace(out / "model.safetensors")
    tmp_c.replace(out / "config.json")
    return [out / "config.json", out / "model.safetensors"]


def load_dspark(path: Path) -> DSparkDraft:
    """A draft from a folder with ``config.json`` and ``*.safetensors`` (names as vLLM loads them);
    unknown, missing or mis-shaped tensors are errors naming the file and tensor."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no DSpark config")
    cfg = DSparkConfig.from_hf(json.loads(cfg_file.read_text()), source=str(cfg_file))
    draft = DSparkDraft(cfg)
    expected = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}
    # embed_tokens / lm_head are shared from the target, d2t / t2d are vocabulary maps: not the draft's parameters
    got = read_tensors(path, expected, "DSpark draft", cfg_file, skip=lambda n: n in (
        "embed_tokens.weight", "lm_head.weight") or n.startswith(("d2t", "t2d")))
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"{path}: missing DSpark tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    draft.load_state_dict({k: v.to(expected[k].dtype) for k, v in got.items()}, strict=False)
    return draft


__all__ = ["ARCHITECTURE", "DSPARK_DIR", "ConfidenceHead", "DSparkConfig", "DSparkDraft", "DSparkOutput", "MarkovHead",
           "block_acceptance", "capture_layers", "draft_greedy", "load_dspark", "sample_anchors", "save_dspark", "state_for_vllm"]
