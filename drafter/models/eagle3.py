"""EAGLE-3 drafter heads, as vLLM 0.32 serves them (``method: "eagle3"``, ``llama_eagle3.py``).

An EAGLE-3 head is one decoder layer fed the target's fused low / middle / high hidden states and
its own token embedding. For the token ``x_{t+1}`` the target emitted after position ``t``::

    g_t   = fc(cat[a_t^(1), a_t^(2), a_t^(3)])               # the target's aux hidden states at t
    e     = input_layernorm(embed(x_{t+1}));  n = hidden_norm(g_t)
    r     = n if norm_before_residual else g_t
    u     = r + o_proj(attn(q,k,v = proj(cat[e, n])))        # q/k/v take 2H inputs
    out   = u + mlp(post_attention_layernorm(u))              # pre-norm output: fed to the next step
    q     = lm_head(norm(out))                                # logits over the draft vocabulary → x_{t+2}

Facts taken from vLLM 0.32's source, which this module reproduces:

* **Layer** — ``llama_eagle3.py`` ``LlamaDecoderLayer`` (layer 0): ``embeds = input_layernorm(embeds)``,
  ``_norm_before_residual`` / ``_norm_after_residual`` (residual = the hidden state after / before
  ``hidden_norm``), ``qkv_proj`` over ``cat([embeds, hidden])`` (embedding first), then the fused
  ``post_attention_layernorm(h, residual)`` and the MLP; ``LlamaModel.forward`` ends with
  ``norm(h, residual)`` and returns ``(normed, prenorm)``: logits from the first, the second fed back
  into the next draft step (``norm_output`` false).
* **Aux hidden states** — ``interfaces.py`` ``_maybe_add_hidden_state``: id ``i`` is ``hidden + residual``
  entering decoder layer ``i`` (0 = embeddings); default ids ``(2, L // 2, L − 3)``
  (``get_eagle3_default_aux_hidden_state_layers``), else ``eagle_aux_hidden_state_layer_ids``.
  :mod:`drafter.data.capture` stores the same ids as ``hidden_layer_{i}``.
* **Draft vocabulary** — ``Eagle3LlamaForCausalLM.compute_logits``: ``lm_head`` has ``draft_vocab_size``
  rows; draft id ``d`` is target id ``d + d2t[d]``; every other target id gets −inf. ``t2d`` is skipped
  on load (kept in checkpoints for the EAGLE tools).
* **Embedding** — no ``embed_tokens`` in the checkpoint: vLLM shares the target's
  (``llm_base_proposer.py``); here it is a frozen copy of the target's.
* **Draft steps** — the same layer runs once per step, at position ``t + k − 1`` for step ``k``, reading
  the step-1 keys of positions ``0..t`` and its own earlier steps' keys (the proposer shared with MTP,
  :func:`drafter.models.mtp.reuse_mask`).
* **Checkpoints** — two layouts load: the *speculators* format (``config.json`` with
  ``speculators_model_type: eagle3``, ``transformer_layer_config``, ``speculators_config``; tensors
  ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and the original *EAGLE* layout
  (``architectures: [LlamaForCausalLMEagle3]``, tensors ``midlayer.*``); vLLM maps ``midlayer.`` to
  ``layers.0.`` (``hf_to_vllm_mapper``).

Example::

    cfg = Eagle3Config.for_target(target_config, draft_vocab_size=8192)
    head = Eagle3Draft(cfg)
    out = head.unroll(input_ids, aux_features, k_steps=3)   # out.logits[k-1]: [B, T, V_draft]
    save_eagle3(head, folder, verifier="org/target", speculative_tokens=3)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from drafter.models.checkpoint import read_tensors
from drafter.models.mtp import Unrolled, _StepCache, causal_mask, reuse_mask

Tensor = torch.Tensor

EAGLE3_DIR = "eagle3"  # a stage output's head folder: config.json + model.safetensors, what vLLM loads
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYOUTS = ("speculators", "eagle")
#: Frozen by default: the target's embedding (shared with the target when served).
DEFAULT_FROZEN: tuple[str, ...] = ("embed_tokens.*",)


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """vLLM's default aux hidden states for a target of ``num_hidden_layers`` decoder layers."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def capture_layers(cfg: "Eagle3Config") -> list[int]:
    """The ``capture.layers`` holding the head's aux hidden states: the ids themselves (the same semantics)."""
    return list(cfg.aux_layer_ids)


@dataclass
class Eagle3Config:
    """The head's shape and EAGLE-3 fields (a Llama decoder layer)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    norm_before_residual: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not problems:
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                f"num_key_value_heads ({self.num_key_value_heads})")
            if self.draft_vocab_size > self.vocab_size:
                problems.append(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        ids = list(self.aux_layer_ids)
        if not ids or ids != sorted(set(ids)) or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            problems.append(f"aux_layer_ids must be non-empty, unique, increasing layer ids ≥ 0, got {ids}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r}: only silu (Llama's MLP) is supported")
        if problems:
            raise ValueError("EAGLE-3 config: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target_config, *, aux_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None,
                   **overrides) -> "Eagle3Config":
        """A head shaped like the target's decoder layers (hidden size, heads, MLP width, RoPE); aux layers
        default to vLLM's choice for the target's depth, the draft vocabulary to the whole vocabulary."""
        t = target_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        rope = dict(getattr(t, "rope_parameters", None) or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(t, "rope_theta", 10000.0))}
        values = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_attention_heads=t.num_attention_heads,
                      num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
                      head_dim=head_dim, vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size or t.vocab_size,
                      target_hidden_size=t.hidden_size,
                      aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None
                      else default_aux_layer_ids(t.num_hidden_layers),
                      rms_norm_eps=getattr(t, "rms_norm_eps", 1e-5), rope_parameters=rope,
                      max_position_embeddings=getattr(t, "max_position_embeddings", 8192))
        values.update(overrides)
        return cls(**values)

    def llama(self) -> dict:
        """The decoder layer's Llama config (``transformer_layer_config`` / the EAGLE layout's body)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(self.rope_parameters),
            "rope_theta": self.rope_parameters.get("rope_theta"),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def to_speculators(self, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int) -> dict:
        """``config.json`` in the speculators format (``vllm/transformers_utils/configs/speculators``)."""
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": self.llama(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": False,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
            },
            "torch_dtype": "float32",
            **self.extra,
        }

    def to_eagle(self) -> dict:
        """``config.json`` of the original EAGLE-3 layout (``LlamaForCausalLMEagle3``)."""
        return {
            **self.llama(),
            "architectures": [EAGLE_ARCHITECTURE],
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True},
            **self.extra,
        }

    @classmethod
    def from_hf(cls, data: Mapping, *, source: str = "config.json") -> tuple["Eagle3Config", str]:
        """The config and the layout (``speculators`` | ``eagle``) of a head's ``config.json``."""
        if data.get("speculators_config") is not None or data.get("speculators_model_type") is not None:
            if data.get("speculators_model_type") != "eagle3":
                raise ValueError(f"{source}: speculators_model_type {data.get('speculators_model_type')!r} is not 'eagle3'")
            layer = data.get("transformer_layer_config")
            if not isinstance(layer, Mapping):
                raise ValueError(f"{source}: no transformer_layer_config (the speculators format needs one)")
            layout, top = "speculators", data
            ids = data.get("eagle_aux_hidden_state_layer_ids")
            nbr = data.get("norm_before_residual", True)  # vLLM's default for this format
        elif EAGLE_ARCHITECTURE in (data.get("architectures") or []):
            layout, layer, top = "eagle", data, data
            ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            nbr = data.get("norm_before_residual", False)  # vLLM's default for a plain Llama config
        else:
            raise ValueError(f"{source}: neither a speculators EAGLE-3 config (speculators_model_type: eagle3) nor "
                             f"the EAGLE layout (architectures [{EAGLE_ARCHITECTURE!r}]); got architectures "
                             f"{data.get('architectures')}")
        if layer.get("model_type", "llama") != "llama":
            raise ValueError(f"{source}: model_type {layer.get('model_type')!r}: only Llama EAGLE-3 heads are supported")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{source}: num_hidden_layers {layer.get('num_hidden_layers')}: only one-layer heads are supported")
        for flag in ("norm_before_fc", "fc_norm", "norm_output", "attention_bias"):
            if top.get(flag) or layer.get(flag):
                raise ValueError(f"{source}: {flag} is set; this head supports the plain EAGLE-3 layer only")
        if ids is None:
            raise ValueError(f"{source}: no eagle_aux_hidden_state_layer_ids (name the target's aux layers)")
        rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", float(layer.get("rope_theta", 10000.0)))
        try:
            cfg = cls(hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
                      num_attention_heads=layer["num_attention_heads"],
                      num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
                      head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                      vocab_size=layer["vocab_size"],
                      draft_vocab_size=top.get("draft_vocab_size") or layer["vocab_size"],
                      target_hidden_size=top.get("target_hidden_size") or layer["hidden_size"],
                      aux_layer_ids=list(ids), rms_norm_eps=layer.get("rms_norm_eps", 1e-5), rope_parameters=rope,
                      max_position_embeddings=layer.get("max_position_embeddings", 8192),
                      hidden_act=layer.get("hidden_act", "silu"), norm_before_residual=bool(nbr))
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e
        return cfg, layout


def _llama_config(cfg: Eagle3Config):
    from transformers import LlamaConfig

    c = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                    num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
                    hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
                    rope_parameters=dict(cfg.rope_parameters), attention_bias=False, mlp_bias=False)
    c._attn_implementation = "sdpa"  # takes the explicit additive masks of mtp.causal_mask / reuse_mask
    return c


class Eagle3Layer(nn.Module):
    """vLLM's EAGLE-3 layer 0: ``input_layernorm`` (embedding), ``hidden_norm``, attention with q/k/v over
    ``2H`` inputs, ``post_attention_layernorm``, Llama MLP. Returns the pre-norm output."""

    def __init__(self, lcfg, norm_before_residual: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        H, eps = lcfg.hidden_size, lcfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = LlamaAttention(lcfg, layer_idx=0)
        hd, nh, nkv = lcfg.head_dim, lcfg.num_attention_heads, lcfg.num_key_value_heads
        self.self_attn.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(lcfg)

    def forward(self, embeds: Tensor, hidden: Tensor, position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor,
                cache: _StepCache | None = None) -> Tensor:
        e = self.input_layernorm(embeds)
        n = self.hidden_norm(hidden)
        residual = n if self.norm_before_residual else hidden
        a, _ = self.self_attn(torch.cat([e, n], dim=-1), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, cache=cache)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head: ``embed_tokens`` (the target's, frozen), ``fc``, ``layers.0``, ``norm``, ``lm_head``
    (``draft_vocab_size`` rows) and the ``d2t`` / ``t2d`` vocabulary maps (buffers), vLLM's names.

    ``device="meta"`` builds it without allocating weights (load with ``assign=True``).

    The training and evaluation loops drive it through the MTP drafter's interface (``unroll``, ``logits``):
    ``reads_features`` tells them to feed the window's aux features instead of the LM-head input, and
    ``own_vocab`` that its logits are already over its draft vocabulary (:meth:`target_logits` scatters them)."""

    reads_features = True
    own_vocab = True

    def __init__(self, cfg: Eagle3Config, *, device: str | torch.device | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.cfg = cfg
        lcfg = _llama_config(cfg)
        H = cfg.hidden_size
        with torch.device(device or "cpu"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.fc = nn.Linear(cfg.target_hidden_size * len(cfg.aux_layer_ids), H, bias=False)
            self.layers = nn.ModuleList([Eagle3Layer(lcfg, cfg.norm_before_residual)])
            self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[: cfg.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary_emb = LlamaRotaryEmbedding(lcfg)  # inv_freq is a non-persistent buffer

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, target_ids) -> None:
        """Set ``d2t`` / ``t2d`` from the target ids of the draft vocabulary (draft id order)."""
        ids = torch.as_tensor(list(target_ids), dtype=torch.long)
        V, Vd = self.cfg.vocab_size, self.cfg.draft_vocab_size
        if ids.numel() != Vd or ids.unique().numel() != Vd or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"draft vocabulary: need {Vd} distinct target ids in [0, {V}), got {ids.numel()} "
                             f"({ids.unique().numel()} distinct, range {int(ids.min())}..{int(ids.max())})")
        with torch.no_grad():
            self.d2t.copy_((ids - torch.arange(Vd)).to(self.d2t.device))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True

    def draft_ids(self) -> Tensor:
        """The target id of each draft id (``d + d2t[d]``), on the head's device."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ computation
    def combine(self, features: Tensor) -> Tensor:
        """``fc`` over the concatenated aux hidden states ``[..., n·H_t]`` (vLLM's ``combine_hidden_states``)."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(f"aux features have width {features.shape[-1]}, the head's fc takes {self.fc.in_features} "
                             f"({len(self.cfg.aux_layer_ids)} target layers × {self.cfg.target_hidden_size})")
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, layer_idx: int, hidden: Tensor, rows: Tensor | None = None) -> Tensor:
        """Draft-vocabulary logits ``lm_head(norm(hidden))`` of a pre-norm output (``layer_idx`` is
        accepted for the MTP interface: one layer). ``rows``: a subset of draft ids."""
        n = self.norm(hidden)
        if rows is None:
            return self.lm_head(n)
        return nn.functional.linear(n, self.lm_head.weight[rows])

    def target_logits(self, draft_logits: Tensor) -> Tensor:
        """Draft-vocabulary logits scattered to the target vocabulary, −inf elsewhere (vLLM's ``compute_logits``)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.draft_ids()] = draft_logits
        return out

    def step(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor,
             cache: _StepCache | None = None) -> Tensor:
        """One pass of the layer: ``input_ids`` ``[B, T]`` (the token after each position), ``hidden``
        ``[B, T, H]`` (``fc`` output or the previous step's pre-norm output). Returns the pre-norm output."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        pos_emb = self.rotary_emb(hidden, position_ids)
        return self.layers[0](emb, hidden, pos_emb, attention_mask, cache)

    def forward_step(self, layer_idx: int, input_ids: Tensor, features: Tensor,
                     position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """vLLM's first pass over a sequence (causal): ``input_ids`` ``[B, T]`` the token after each position,
        ``features`` ``[B, T, n·H_t]``. Returns ``(pre-norm output, draft-vocabulary logits)`` (the MTP interface:
        the offline draft-cost timing runs it)."""
        B, T = input_ids.shape
        hidden = self.combine(features)
        if position_ids is None:
            position_ids = torch.arange(T, device=hidden.device).expand(B, T)
        out = self.step(input_ids, hidden, position_ids, causal_mask(T, hidden.dtype, hidden.device))
        return out, self.logits(layer_idx, out)

    def unroll(self, input_ids: Tensor, features: Tensor, k_steps: int, position_ids: Tensor | None = None, *,
               compute_logits: bool = True) -> Unrolled:
        """K-step training-time test over a window (teacher-forced on the data tokens).

        ``input_ids`` ``[B, T]`` are the data tokens; ``features`` ``[B, T, n·H_t]`` the target's aux hidden
        states at each position (``aux_layer_ids`` order). Step 1 at index ``t``: token ``x_{t+1}``, hidden
        ``fc(features_t)`` → predicts ``x_{t+2}``; step ``k``: token ``x_{t+k}``, the head's own pre-norm
        output of step ``k−1`` at ``t``, position ``t+k−1``, attention as vLLM's proposer gives it
        (:func:`drafter.models.mtp.reuse_mask`) → predicts ``x_{t+k+1}``. Logits are over the draft vocabulary.
        """
        B, T = input_ids.shape
        if features.shape[:2] != (B, T):
            raise ValueError(f"features {tuple(features.shape)} do not match input_ids {(B, T)}")
        if k_steps < 1:
            raise ValueError(f"k_steps must be ≥ 1, got {k_steps}")
        hidden = self.combine(features)
        dev, dtype = hidden.device, hidden.dtype
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).expand(B, T)
        idx = torch.arange(T, device=dev)
        cache = _StepCache() if k_steps > 1 else None
        outs, logits, valid = [], [], []
        for k in range(1, k_steps + 1):
            tok = torch.zeros_like(input_ids)
            if k < T:
                tok[:, : T - k] = input_ids[:, k:]
            mask = reuse_mask(T, k, dtype, dev) if k > 1 else causal_mask(T, dtype, dev)
            out = self.step(tok, hidden, position_ids + (k - 1), mask, cache)
            outs.append(out)
            if compute_logits:
                logits.append(self.logits(0, out))
            valid.append((idx + k + 1 < T).expand(B, T))
            hidden = out
        return Unrolled(hidden=outs, logits=logits if compute_logits else None, valid=valid)


# ------------------------------------------------------------------ checkpoints

_SKIP_ON_SAVE = ("rotary_emb.", "embed_tokens.")


def checkpoint_tensors(head: Eagle3Draft, layout: str = "speculators", *, with_embedding: bool = False) -> dict[str, Tensor]:
    """The checkpoint's tensors under the layout's names (``layers.0.`` or ``midlayer.``); ``d2t`` / ``t2d`` only
    with a draft vocabulary smaller than the target's (vLLM 0.32 refuses them otherwise: "There is no module or
    parameter named 'draft_id_to_target_id'")."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    out = {}
    whole = head.cfg.draft_vocab_size == head.cfg.vocab_size  # no maps: vLLM has no d2t parameter then
    for k, v in head.state_dict().items():
        if k.startswith(_SKIP_ON_SAVE) and not (with_embedding and k.startswith("embed_tokens.")):
            continue
        if whole and k in ("d2t", "t2d"):
            continue
        name = k.replace("layers.0.", "midlayer.", 1) if layout == "eagle" else k
        out[name] = v.detach().contiguous()
    return out


def save_eagle3(head: Eagle3Draft, out: Path, *, layout: str = "speculators", verifier: str = "",
                verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                dtype: torch.dtype | None = None, with_embedding: bool = False) -> list[Path]:
    """``config.json`` + ``model.safetensors`` in ``out`` (temporary names, then renamed). ``verifier``:
    the target's name or path (the speculators config names it; vLLM serves it when only the head is given)."""
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(head, layout, with_embedding=with_embedding)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    if layout == "speculators":
        cfg = head.cfg.to_speculators(verifier=verifier, verifier_architectures=verifier_architectures or ["LlamaForCausalLM"],
                                      speculative_tokens=speculative_tokens)
        layer = cfg["transformer_layer_config"]
    else:
        cfg = layer = head.cfg.to_eagle()
    if dtype is not None:
        cfg["torch_dtype"] = layer["torch_dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp_w, tmp_c = out / ".model.safetensors.tmp", out / ".config.json.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp_w.replace(out / "model.safetensors")
    tmp_c.replace(out / "config.json")
    return [out / "config.json", out / "model.safetensors"]


def load_eagle3(path: Path, *, embed_tokens: Tensor | None = None) -> tuple[Eagle3Draft, str]:
    """A head and its layout from a folder with ``config.json`` and ``*.safetensors`` (either layout).
    Unknown, missing, mis-shaped or non-finite tensors are errors naming the file and tensor. Without an
    ``embed_tokens`` tensor in the folder, ``embed_tokens`` (the target's) must be given."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no EAGLE-3 config")
    cfg, layout = Eagle3Config.from_hf(json.loads(cfg_file.read_text()), source=str(cfg_file))
    head = Eagle3Draft(cfg)
    expected = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary_emb.")}
    got = read_tensors(path, expected, "EAGLE-3 head", cfg_file, rename=lambda n: n.replace("midlayer.", "layers.0.", 1))
    if "embed_tokens.weight" not in got:
        if embed_tokens is None:
            raise ValueError(f"{path}: no embed_tokens in the checkpoint; pass the target's embedding")
        if tuple(embed_tokens.shape) != tuple(expected["embed_tokens.weight"].shape):
            raise ValueError(f"the target's embedding has shape {tuple(embed_tokens.shape)}, the head ({cfg_file}) "
                             f"needs {tuple(expected['embed_tokens.weight'].shape)}")
        got["embed_tokens.weight"] = embed_tokens
    if "d2t" not in got and cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} but no d2t map")
    optional = {"d2t", "t2d"}
    missing = sorted(set(expected) - set(got) - optional)
    if missing:
        raise ValueError(f"{path}: missing EAGLE-3 tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in got.items()}, strict=False)
    if "d2t" in got and "t2d" not in got:
        head.set_draft_vocab(head.draft_ids().tolist())
    ids = head.draft_ids()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: d2t maps draft ids outside [0, {cfg.vocab_size}) or onto the same target id twice")
    head.embed_tokens.weight.requires_grad_(False)
    return head, layout


__all__ = ["DEFAULT_FROZEN", "EAGLE3_DIR", "EAGLE_ARCHITECTURE", "LAYOUTS", "SPECULATORS_ARCHITECTURE", "Eagle3Config",
           "Eagle3Draft", "Eagle3Layer", "capture_layers", "checkpoint_tensors", "default_aux_layer_ids", "load_eagle3", "save_eagle3"]
