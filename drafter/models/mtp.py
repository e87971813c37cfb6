"""DeepSeek-style MTP drafters: one ``MTPLayer`` per draft module, chained or reused, as vLLM serves them.

An MTP layer (DeepSeek-V3 §2.2) turns the hidden state ``h`` of position ``t`` and the embedding of
the next token into the hidden state that predicts the token after it::

    x   = eh_proj(cat[enorm(emb(x_{t+1})), hnorm(h_t)])       # Linear 2H→H, embedding first
    g   = decoder_block(x)                                     # the target's own block class (MoE MLP)
    q   = shared_head.head(shared_head.norm(g))                # logits for x_{t+2}

Facts taken from vLLM 0.32's source (``vllm/model_executor/models/`` and ``vllm/v1/``), which this
module reproduces so that what is trained is what is served:

* **Embedding zeroed at position 0** — ``glm4_moe_mtp.py`` and ``deepseek_mtp.py``,
  ``*MultiTokenPredictorLayer.forward``: ``inputs_embeds = torch.where(positions == 0, 0, inputs_embeds)``
  before ``enorm``. Here: the same, keyed on ``position_ids == 0``.
* **Residual handling** — both files: ``hidden, residual = mtp_block(positions, eh_proj(...), residual=None)``
  then ``hidden = residual + hidden``: exactly the output of a standard pre-norm decoder layer, which
  is what transformers' ``Glm4MoeDecoderLayer`` / ``DeepseekV3DecoderLayer`` return.
* **Logits** — ``compute_logits``: ``shared_head.head(shared_head.norm(hidden))`` on the *pre-norm*
  block output (``SharedHead.forward`` is the norm only).
* **Hidden state recycled into the next draft step** — ``vllm/v1/spec_decode/llm_base_proposer.py``
  ``model_returns_tuple``: for ``Glm4MoeMTPModel`` (the embedded target's MTP, ``glm4_moe_mtp.py``) the
  model returns one tensor, so the *pre-norm* block output is fed back; for ``DeepSeekMTPModel``
  (DeepSeek-V3, ``deepseek_mtp.py``) it returns ``(hidden, shared_head(hidden))`` and the *post-norm*
  ``shared_head.norm(hidden)`` is fed back (\"matches SGLang's deepseek_nextn\"). ``recycle_normed``
  selects between the two.
* **What step 1 receives from the target** — ``glm4_moe.py`` ``Glm4MoeModel.forward`` (and
  ``deepseek_v2.py`` line ~1589) returns ``self.norm(hidden, residual)``: the *post-final-norm* hidden
  state, i.e. the LM-head input, which ``gpu_model_runner.py`` passes as ``target_hidden_states``.
  ``llm_base_proposer.py`` ``set_inputs_first_pass`` shifts the token ids left by one (position ``t``
  gets token ``x_{t+1}`` with ``h_t``) and keeps the target's positions.
* **Several draft steps with one MTP layer** (``num_nextn_predict_layers: 1``, the V1 proposer
  ``llm_base_proposer.py`` and the V2 ``spec_decode/mtp`` speculator): the same layer runs again for
  every step (``spec_step_idx % num_mtp_layers``, ``glm4_moe_mtp.py``/``deepseek_mtp.py``), one token per
  request, at position ``t+k-1`` for step ``k`` (``_update_positions_dependent_metadata``: positions + 1),
  fed the previous step's recycled hidden state and its draft token. Its attention reads the layer's
  KV cache: the step-1 entries of the context (positions ``0..t``, written by the first pass from the
  target's hidden states) plus the entries its own earlier draft steps wrote (positions ``t+1..t+k-1``).
* **Several MTP layers** (``v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py``, used when
  ``min(num_mtp_layers, num_speculative_tokens) > 1``): module ``k`` (``spec_step_idx=k``, so layer
  ``k % n``) re-runs over the whole sequence at the *same* positions, token ids shifted left by one more
  and the previous module's recycled hidden states as input; i.e. plain causal attention per module.

:meth:`MTPDrafter.unroll` implements both regimes exactly (``n_layers == 1``: reuse with the KV
structure above; ``n_layers > 1``: chaining), so the K-step unrolled training sees the same
computation as serving, with the data tokens standing in for accepted drafts.

Example::

    from drafter.models import load_drafter, EmbeddedGlm4MoeLayout
    drafter = load_drafter(model_dir, EmbeddedGlm4MoeLayout())
    out = drafter.unroll(input_ids, target_hidden, k_steps=4)   # out.logits[k-1]: [B, T, V]
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

#: Frozen by default: the shared embedding and the routed experts (the bulk of an MoE layer).
DEFAULT_FROZEN: tuple[str, ...] = ("embed_tokens.*", "*.mlp.experts.*")


class SharedHead(nn.Module):
    """``shared_head.norm`` + ``shared_head.head`` (the drafter's own copy of the final norm and LM head)."""

    def __init__(self, hidden_size: int, vocab_size: int, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(self.norm(hidden))


class OnePassMoE(nn.Module):
    """The decoder block's MoE MLP (transformers' ``Glm4MoeMoE``, ``DeepseekV3MoE``: ``gate``, routed
    ``experts``, ``shared_experts``), holding the same submodules under the same names, computed with two
    exact shortcuts where they apply. The embedded target's MTP block is written as E identical routed
    experts, every token routed to all of them, plus an all-zero shared expert (DESIGN.md, "The embedded
    default"): three MLP passes whose sum is one.

    * **One routed pass.** With ``top_k == E`` every token goes to every expert, so when the experts are
      identical Σ_e w_e·expert_e(x) = (Σ_e w_e)·expert_0(x): one pass instead of E. The routing weights
      receive ⟨g, expert(x)⟩ each, as in the general path. Trainable experts: in the general path expert
      e's gradient is Jᵀ(w_e·g) (J: the expert's Jacobian at x), so the experts get identical gradients,
      and stay identical after a step, only if w_e is the same for every e at every token; the shortcut
      is then taken with each expert receiving 1/E of the one pass's gradient, otherwise the general path.
    * **No shared pass.** An all-zero shared expert (``down(act(gate(x))·up(x))``, no biases) outputs exactly
      0 and its weights receive exactly zero gradient (each product has a zero factor), so it stays zero
      under training; it is skipped (its parameters get no ``.grad``: AdamW leaves them at 0, as it would
      with a zero gradient).

    The conditions are checked at every forward (``torch.equal`` on the expert weights, ``any`` on the
    shared expert's: a few ms against the block's pass), so a checkpoint or a training step that breaks
    them runs the general path. ``shortcuts = False`` always runs transformers' own forward (the reference
    of ``bench/train.py`` and the tests).
    """

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.config = getattr(moe, "config", None)
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.general_cls = type(moe)  # transformers' class: its forward runs on these same submodules
        self.shortcuts = True

    def _one_pass_exact(self, topk_weights: Tensor) -> bool:
        """Every token routed to every expert, the experts identical, and — when they are trained — the
        routing weights equal at every token."""
        ex = self.experts
        if (getattr(self.gate, "top_k", None) != getattr(ex, "num_experts", -1) or not hasattr(ex, "gate_up_proj")
                or getattr(ex, "has_bias", False) or getattr(ex, "is_transposed", False)
                or not getattr(ex, "is_concatenated", True)):
            return False
        ws = (ex.gate_up_proj, ex.down_proj)
        if not all(torch.equal(w[0], w[e]) for w in ws for e in range(1, ex.num_experts)):
            return False
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return bool((topk_weights == topk_weights[:, :1]).all())
        return True

    def _zero_shared(self) -> bool:
        return not any(p.any() for p in self.shared_experts.parameters())

    def _one_pass(self, x: Tensor) -> Tensor:
        """expert_0(x) as transformers' eager loop computes it; a trainable weight enters as
        w_0 + Σ_e (w_e − sg[w_e]) / E: the value of w_0 (the experts are identical), 1/E of the gradient to each."""
        ex = self.experts

        def weight(w: Tensor) -> Tensor:
            if not (w.requires_grad and torch.is_grad_enabled()):
                return w[0]
            return w[0].detach() + sum(w[e] - w[e].detach() for e in range(ex.num_experts)) / ex.num_experts

        gate, up = F.linear(x, weight(ex.gate_up_proj)).chunk(2, dim=-1)
        return F.linear(ex.act_fn(gate) * up, weight(ex.down_proj))

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not self.shortcuts:
            return self.general_cls.forward(self, hidden_states)
        _, topk_weights, topk_indices = self.gate(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self._one_pass_exact(topk_weights):
            routed = (self._one_pass(x) * topk_weights.sum(-1, keepdim=True)).to(x.dtype)
        else:
            routed = self.experts(x, topk_indices, topk_weights)
        out = routed.view(hidden_states.shape)
        return out if self._zero_shared() else out + self.shared_experts(hidden_states)


class MTPLayer(nn.Module):
    """One DeepSeek-V3-style MTP module: ``enorm``, ``hnorm``, ``eh_proj``, ``mtp_block``, ``shared_head``.

    ``decoder_layer_cls(config, layer_idx)`` is the target's own transformers decoder layer class
    (``Glm4MoeDecoderLayer`` for the embedded target, ``DeepseekV3DecoderLayer`` for DeepSeek-V3); with
    ``layer_idx >= config.first_k_dense_replace`` it carries the MoE MLP, as vLLM builds it.
    ``forward`` follows vLLM 0.32's ``Glm4MoeMultiTokenPredictorLayer.forward`` (``glm4_moe_mtp.py``) and
    ``DeepSeekMultiTokenPredictorLayer.forward`` (``deepseek_mtp.py``) line by line: embedding zeroed
    where ``position == 0``, ``enorm``/``hnorm``, ``eh_proj(cat[e, h])`` (embedding first), the decoder
    block, and ``residual + hidden`` (the block's output). It returns that *pre-norm* output; logits are
    ``shared_head(out)``.
    """

    def __init__(self, config, layer_idx: int, decoder_layer_cls: type[nn.Module], norm_cls: type[nn.Module]):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm_cls(H, eps=eps)
        self.hnorm = norm_cls(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = decoder_layer_cls(config, layer_idx)
        mlp = getattr(self.mtp_block, "mlp", None)
        if all(hasattr(mlp, n) for n in ("gate", "experts", "shared_experts")):  # an MoE MLP
            self.mtp_block.mlp = OnePassMoE(mlp)
        self.shared_head = SharedHead(H, config.vocab_size, norm_cls(H, eps=eps))

    def forward(
        self,
        inputs_embeds: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor,
        cache: "_StepCache | None" = None,
    ) -> Tensor:
        e = torch.where(position_ids.unsqueeze(-1) == 0, torch.zeros_like(inputs_embeds), inputs_embeds)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        return self.mtp_block(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            cache=cache,
        )


class _StepCache:
    """The KV cache of one MTP layer across unrolled draft steps (the part of transformers' ``Cache``
    API that the decoder layers call: ``update(key, value, layer_idx) -> (all_keys, all_values)``).

    Keys/values of each step are appended along the sequence axis, so step ``k`` sees
    ``[step 1 | step 2 | … | step k]``; :func:`reuse_mask` says which of them each query may read.
    """

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int | None = None, *args, **kwargs):
        if self.k is None:
            self.k, self.v = key_states, value_states
        else:
            self.k = torch.cat([self.k, key_states], dim=-2)
            self.v = torch.cat([self.v, value_states], dim=-2)
        return self.k, self.v


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean ``[Tq, Tk]`` "may attend" matrix as the additive ``[1, 1, Tq, Tk]`` mask transformers takes."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_mask(T: int, dtype: torch.dtype, device=None) -> Tensor:
    """Additive causal mask ``[1, 1, T, T]`` (0 where key ≤ query, the dtype's minimum elsewhere)."""
    i = torch.arange(T, device=device)
    return _additive(i[None, :] <= i[:, None], dtype)


def reuse_mask(T: int, step: int, dtype: torch.dtype, device=None) -> Tensor:
    """Additive mask ``[1, 1, T, step*T]`` for draft step ``step`` (1-based) of a reused single MTP layer.

    The query of chain ``t`` (started from the target's ``h_t``) reads the step-1 keys of positions
    ``0..t`` (the context, written by vLLM's first pass) and its own keys of steps ``2..step``
    (written by its earlier draft steps) — the KV cache vLLM's proposer gives it.
    """
    i = torch.arange(T, device=device)
    blocks = [i[None, :] <= i[:, None]] + [i[None, :] == i[:, None]] * (step - 1)
    return _additive(torch.cat(blocks, dim=1), dtype)


@dataclass
class Unrolled:
    """Result of :meth:`MTPDrafter.unroll`, one entry per draft step ``k = 1..K`` (list index ``k-1``).

    * ``hidden[k-1]`` ``[B, T, H]``: the step's pre-norm output (logits = ``drafter.logits(k-1, hidden)``).
    * ``logits[k-1]`` ``[B, T, V]`` (``None`` with ``compute_logits=False``): at index ``t``, the draft
      distribution for token ``x_{t+k+1}``; the matching target distribution is the target's at
      position ``t+k`` (its logits from ``h_{t+k}``).
    * ``valid[k-1]`` ``[B, T]`` bool: ``t + k + 1 < T`` (the predicted token exists in the window).
    """

    hidden: list[Tensor]
    logits: list[Tensor] | None
    valid: list[Tensor]


class MTPDrafter(nn.Module):
    """A shared (frozen) embedding, ``n_layers`` :class:`MTPLayer` s and the target's rotary embedding.

    ``config`` is the target's transformers config (``Glm4MoeConfig``, ``DeepseekV3Config``, …);
    layer ``i`` is built as decoder layer ``config.num_hidden_layers + i`` (its index in the release).
    ``recycle_normed``: feed ``shared_head.norm(out)`` (DeepSeek-V3 in vLLM) instead of ``out``
    (GLM-4-MoE in vLLM) into the next draft step; see the module docstring.
    ``device="meta"`` builds the layers without allocating weights (load with ``assign=True``).
    """

    def __init__(
        self,
        config,
        *,
        n_layers: int,
        decoder_layer_cls: type[nn.Module],
        norm_cls: type[nn.Module],
        rotary_cls: type[nn.Module],
        recycle_normed: bool,
        device: str | torch.device | None = None,
    ):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be ≥ 1, got {n_layers}")
        if getattr(config, "_attn_implementation", None) in (None, "flash_attention_2", "flex_attention"):
            config._attn_implementation = "sdpa"  # takes the explicit additive masks built here
        if getattr(config, "_experts_implementation", None) is None:
            config._experts_implementation = "eager"  # transformers' reference loop over the experts
        self.config = config
        self.n_layers = n_layers
        self.recycle_normed = recycle_normed
        self.mtp_start = config.num_hidden_layers
        with torch.device(device or "cpu"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                MTPLayer(config, self.mtp_start + i, decoder_layer_cls, norm_cls) for i in range(n_layers)
            )
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary_emb = rotary_cls(config)  # inv_freq is a non-persistent buffer: always real

    def set_shortcuts(self, on: bool) -> None:
        """Turn the exact shortcuts of :class:`OnePassMoE` on (the default) or off (transformers' own
        forward everywhere: the reference computation)."""
        for m in self.modules():
            if isinstance(m, OnePassMoE):
                m.shortcuts = on

    # ------------------------------------------------------------------ one step

    def logits(self, layer_idx: int, hidden: Tensor, rows: Tensor | None = None) -> Tensor:
        """``shared_head.head(shared_head.norm(hidden))`` of layer ``layer_idx % n_layers``; with ``rows``
        (token ids [V']) only those rows of the head: logits [..., V'] over a draft vocabulary."""
        head = self.layers[layer_idx % self.n_layers].shared_head
        if rows is None:
            return head(hidden)
        return F.linear(head.norm(hidden), head.head.weight[rows])

    def _recycle(self, layer: MTPLayer, out: Tensor) -> Tensor:
        return layer.shared_head.norm(out) if self.recycle_normed else out

    def _run(self, layer_idx, input_ids, hidden, position_ids, attention_mask, cache):
        layer = self.layers[layer_idx % self.n_layers]
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        pos_emb = self.rotary_emb(hidden, position_ids)
        out = layer(emb, hidden, position_ids, pos_emb, attention_mask, cache)
        return layer, out

    def forward_step(
        self,
        layer_idx: int,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One MTP pass over a sequence with causal attention (vLLM's first pass / one chained module).

        ``input_ids`` ``[B, T]`` holds the token *after* each position (``x_{t+1}`` at ``t``), ``hidden``
        ``[B, T, H]`` the input hidden state of each position (the target's post-final-norm ``h_t`` for
        the first step), ``position_ids`` ``[B, T]`` (default ``0..T-1``). Returns ``(hidden_out, logits)``:
        the hidden state to feed the next step (pre- or post-norm per ``recycle_normed``) and the logits.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = causal_mask(T, hidden.dtype, hidden.device)
        layer, out = self._run(layer_idx, input_ids, hidden, position_ids, mask, None)
        return self._recycle(layer, out), layer.shared_head(out)

    # ------------------------------------------------------------------ K-step unrolled drafting

    def unroll(
        self,
        input_ids: Tensor,
        target_hidden: Tensor,
        k_steps: int,
        position_ids: Tensor | None = None,
        *,
        compute_logits: bool = True,
    ) -> Unrolled:
        """K-step unrolled drafting over a window, for training (teacher-forced on the data tokens).

        ``input_ids`` ``[B, T]`` are the data tokens ``x_0..x_{T-1}``; ``target_hidden`` ``[B, T, H]`` the
        target's post-final-norm hidden states ``h_0..h_{T-1}`` (the LM-head input); ``position_ids``
        ``[B, T]`` their positions (default ``0..T-1``).

        Step 1 at index ``t``: token ``x_{t+1}``, hidden ``h_t`` → predicts ``x_{t+2}``. Step ``k``:
        token ``x_{t+k}``, the drafter's own recycled hidden state from step ``k-1`` at the same index
        ``t`` → predicts ``x_{t+k+1}``. With one MTP layer it is reused for every step, at position
        ``t+k-1`` with the KV cache vLLM gives it (:func:`reuse_mask`); with several, step ``k`` uses
        layer ``(k-1) % n`` over the whole window at the same positions (vLLM's multi-module MTP).
        """
        B, T = input_ids.shape
        if target_hidden.shape[:2] != (B, T):
            raise ValueError(f"target_hidden {tuple(target_hidden.shape)} does not match input_ids {(B, T)}")
        if k_steps < 1:
            raise ValueError(f"k_steps must be ≥ 1, got {k_steps}")
        dev, dtype = target_hidden.device, target_hidden.dtype
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).expand(B, T)
        idx = torch.arange(T, device=dev)
        reuse = self.n_layers == 1 and k_steps > 1
        cache = _StepCache() if reuse else None

        hidden_outs, logits, valid = [], [], []
        hidden = target_hidden
        for k in range(1, k_steps + 1):
            # token x_{t+k} at index t (past the window's end: token 0, those positions are not valid)
            tok = torch.zeros_like(input_ids)
            if k < T:
                tok[:, : T - k] = input_ids[:, k:]
            if reuse:
                pos, mask = position_ids + (k - 1), reuse_mask(T, k, dtype, dev)
            else:
                pos, mask = position_ids, causal_mask(T, dtype, dev)
            layer, out = self._run(k - 1, tok, hidden, pos, mask, cache)
            hidden_outs.append(out)
            if compute_logits:
                logits.append(layer.shared_head(out))
            valid.append((idx + k + 1 < T).expand(B, T))
            hidden = self._recycle(layer, out)
        return Unrolled(hidden=hidden_outs, logits=logits if compute_logits else None, valid=valid)


# ---------------------------------------------------------------------- freezing


def _matcher(pattern: str):
    """``re:<regex>`` (``re.fullmatch``) or an fnmatch glob."""
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.fullmatch(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def freeze(model: nn.Module, patterns: Sequence[str] | Iterable[str] = DEFAULT_FROZEN) -> tuple[int, int]:
    """Freeze the parameters whose name matches any pattern; make all others trainable.

    Names are ``model.named_parameters()`` names, e.g. ``embed_tokens.weight``,
    ``layers.0.eh_proj.weight``, ``layers.0.mtp_block.mlp.experts.gate_up_proj`` (transformers fuses
    the routed experts in memory). A pattern is an fnmatch glob, or ``re:<regex>`` (full match).
    Returns ``(n_trainable, n_frozen)`` parameter *elements*. Example::

        freeze(drafter, ["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"])
    """
    matchers = [_matcher(p) for p in patterns]
    n_train = n_frozen = 0
    for name, p in model.named_parameters():
        frozen = any(m(name) for m in matchers)
        p.requires_grad_(not frozen)
        if frozen:
            n_frozen += p.numel()
        else:
            n_train += p.numel()
    return n_train, n_frozen
