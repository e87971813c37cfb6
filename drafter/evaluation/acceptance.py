"""Offline acceptance of a drafter on held-out windows (DESIGN.md, Metrics).

For draft position k (1..K) at window index t, the draft distribution q_k comes from the
drafter's k-th unrolled step and the target distribution p_k from the target's LM head applied to
the captured LM-head input at t+k. Three acceptance rules:

* ``t0``          greedy target (T=0): accepted iff argmax q_k = argmax p_k;
* ``t1_greedy``   T=1, greedy drafts (vLLM's default): α_k = p_k(argmax q_k);
* ``t1_prob``     T=1, probabilistic drafts: α_k = Σ_v min(p_k, q_k) (= 1 − TV).

τ = 1 + Σ_{k=1..K} Π_{j≤k} α_j, averaged over the positions t whose K predicted tokens all exist
in the window and are assistant tokens. ``alpha[k]`` is the mean α_k over those positions
(unconditional); ``accept_rate[k]`` = E[Π_{j≤k} α_j] / E[Π_{j<k} α_j] (conditional on reaching k).

DSpark block drafts (:func:`block_acceptance`): the same rules and τ, block position j of an anchor
standing for draft position j+1 (all positions of a block come from one pass of the draft).

Devices: each held-out window is moved to the drafter's device (:func:`model_device`) when it is used,
and every tensor made here is made there; the summaries (τ, α) are Python floats.

Example::

    stats = acceptance(drafter, head_weight, windows, k_steps=4)
    stats["t0"]["tau"], stats["t1_greedy"]["alpha"]
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from drafter.data.windows import Window

RULES = ("t0", "t1_greedy", "t1_prob")


def model_device(model, default: torch.Tensor) -> torch.device:
    """The device of ``model``'s (first) parameter; ``default``'s device for a model without any."""
    params = model.parameters() if hasattr(model, "parameters") else iter(())
    p = next(iter(params), None)
    return default.device if p is None else p.device


def drafter_input(drafter, win: Window) -> torch.Tensor:
    """What the drafter's first step reads at each position of ``win`` ([T, ·]): the target's LM-head input
    (MTP layers), or the captured aux hidden states concatenated (an EAGLE-3 head: ``reads_features``)."""
    if not getattr(drafter, "reads_features", False):
        return win.hidden
    if win.features is None:
        raise ValueError(f"window {win.row_id}@{win.start} has no features: load_windows(feature_layers=…) must read "
                         "the head's aux layers")
    return win.features


def target_logits(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """The target's logits from its captured LM-head input (post-final-norm hidden state)."""
    return hidden.float() @ head_weight.float().T


def rule_alphas(p: torch.Tensor, q_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """α of each rule at n positions, from the target's probabilities ``p`` [n, V] and the draft's
    logits ``q_logits`` [n, V] (any scale: softmax is taken here). Returns rule → [n]."""
    q_logits = q_logits.float()
    q_arg = q_logits.argmax(-1)
    return {
        "t0": (q_arg == p.argmax(-1)).float(),
        "t1_greedy": p.gather(-1, q_arg[:, None])[:, 0],
        "t1_prob": torch.minimum(p, F.softmax(q_logits, -1)).sum(-1),
    }


def window_alphas(drafter, head_weight: torch.Tensor, win: Window, k_steps: int,
                  vocab_mask: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """α per rule, shape [n, K] for the n = T−K−1 positions with all K targets; and their eligibility
    (all K predicted tokens are assistant tokens). ``vocab_mask`` (bool [V]): the draft drafts only
    those tokens (a draft vocabulary, as served). The window is moved to the drafter's device."""
    win = win.to(dev := model_device(drafter, head_weight))
    T = len(win.input_ids)
    n = T - k_steps - 1
    if n <= 0:
        return {r: torch.zeros(0, k_steps, device=dev) for r in RULES}, torch.zeros(0, dtype=torch.bool, device=dev)
    un = drafter.unroll(win.input_ids[None], drafter_input(drafter, win)[None], k_steps, win.positions[None])
    out = {r: [] for r in RULES}
    elig = torch.ones(n, dtype=torch.bool, device=dev)
    p_all = F.softmax(target_logits(win.hidden[1:T - 1], head_weight), -1)  # positions 1..T-2
    for k in range(1, k_steps + 1):
        q = un.logits[k - 1][0, :n]
        if getattr(drafter, "own_vocab", False):  # an EAGLE-3 head: its draft vocabulary → the target's ids
            q = drafter.target_logits(q)
        if vocab_mask is not None:
            q = q.masked_fill(~vocab_mask.to(dev), float("-inf"))
        a = rule_alphas(p_all[k - 1:k - 1 + n], q)  # the target at position t+k
        for r in RULES:
            out[r].append(a[r])
        elig &= win.loss_mask[k + 1:k + 1 + n]
    return {r: torch.stack(v, 1) for r, v in out.items()}, elig


def summarize(alphas: torch.Tensor) -> dict:
    """τ, α per position and conditional acceptance from α [N, K]."""
    if alphas.numel() == 0:
        return {"tau": 1.0, "alpha": [], "accept_rate": [], "positions": 0}
    chain = torch.cumprod(alphas.double(), dim=1)  # Π_{j≤k} α_j
    reach = torch.cat([torch.ones_like(chain[:, :1]), chain[:, :-1]], 1).mean(0)
    return {
        "tau": float(1 + chain.sum(1).mean()),
        "alpha": [float(x) for x in alphas.double().mean(0)],
        "accept_rate": [float(a / r) if r > 0 else 0.0 for a, r in zip(chain.mean(0), reach)],
        "positions": int(alphas.shape[0]),
    }


@torch.no_grad()
def acceptance(drafter, head_weight: torch.Tensor, windows: Iterable[Window], k_steps: int,
               vocab_mask: torch.Tensor | None = None) -> dict[str, dict]:
    """Acceptance under the three rules over all eligible positions of ``windows`` (the draft over
    ``vocab_mask``'s tokens only, when given)."""
    was_training = drafter.training
    drafter.eval()
    acc = {r: [] for r in RULES}
    for w in windows:
        a, elig = window_alphas(drafter, head_weight, w, k_steps, vocab_mask)
        for r in RULES:
            acc[r].append(a[r][elig])
    drafter.train(was_training)
    out = {}
    for r in RULES:
        out[r] = summarize(torch.cat(acc[r]) if acc[r] else torch.zeros(0, k_steps))
    return out


def _head(head_weight: torch.Tensor):
    w = head_weight.detach()
    return lambda h: h @ w.to(h.dtype).T


def block_forward(draft, embed: torch.nn.Module, head_weight: torch.Tensor, win: Window,
                  anchors: torch.Tensor, anchor_mask: torch.Tensor | None = None):
    """The draft's blocks at ``anchors`` [M] of one window, and the target's logits [M, K, V] at
    the positions each block predicts (``anchor + j``, clamped inside the window). The window is moved
    to the anchors' device (the draft's)."""
    if win.features is None:
        raise ValueError(f"window {win.row_id}@{win.start} has no features: load_windows(feature_layers=…) "
                         "must read the draft's target layers")
    win = win.to(anchors.device)
    K = draft.cfg.block_size
    T = len(win.input_ids)
    mask = None if anchor_mask is None else anchor_mask[None]
    out = draft(win.input_ids[None], win.features[None], anchors[None], embed=embed, lm_head=_head(head_weight),
                anchor_mask=mask, label_mask=win.loss_mask[None], start=win.start)
    rows = (anchors[:, None] + torch.arange(K, device=anchors.device)).clamp(max=T - 1)
    with torch.no_grad():  # blocks overlap: the target's logits once per distinct position
        uniq, inv = torch.unique(rows.flatten(), return_inverse=True)
        p_logits = target_logits(win.hidden[uniq], head_weight)[inv].view(*rows.shape, -1)
    return out, p_logits



def block_anchors(loss_mask: torch.Tensor, K: int) -> torch.Tensor:
    """[m] int64, increasing: the anchors ``p ≥ 1`` of a window whose ``K`` predicted tokens
    ``x[p+1..p+K]`` exist and are assistant tokens (``loss_mask`` [T]), on the mask's device."""
    T = len(loss_mask)
    if T - K <= 1:
        return torch.zeros(0, dtype=torch.long, device=loss_mask.device)
    full = loss_mask.bool().unfold(0, K, 1).all(-1)  # full[s]: x[s..s+K-1] are all assistant tokens
    return torch.nonzero(full[2:T - K + 1]).flatten() + 1  # s = p + 1 for p = 1..T-K-1


@torch.no_grad()
def window_block_alphas(draft, embed, head_weight: torch.Tensor, win: Window, chunk: int = 64):
    """α ``{rule: [m, K]}`` of a DSpark block draft at the ``m`` anchors ``p ≥ 1`` of one window whose
    ``K`` predicted tokens exist and are assistant tokens, and the confidence head's σ ``[m, K]``
    (None without the head). Block position ``j`` is compared with the target at ``p+j``; the Markov
    head is teacher-forced, which at T=0 is what serving computes for every position it reaches.
    The window is moved to the draft's device."""
    win = win.to(dev := model_device(draft, head_weight))
    K = draft.cfg.block_size
    cand = block_anchors(win.loss_mask, K)
    per = {r: [] for r in RULES}
    conf = []
    for i in range(0, len(cand), chunk):
        anchors = cand[i:i + chunk]
        out, p_logits = block_forward(draft, embed, head_weight, win, anchors)
        p = F.softmax(p_logits.float(), -1)
        cols = {r: [] for r in RULES}
        for j in range(K):
            a = rule_alphas(p[:, j], out.logits[0, :, j])
            for r in RULES:
                cols[r].append(a[r])
        for r in RULES:
            per[r].append(torch.stack(cols[r], 1))
        if out.confidence_logits is not None:
            conf.append(torch.sigmoid(out.confidence_logits[0].float()))
    alphas = {r: torch.cat(v) if v else torch.zeros(0, K, device=dev) for r, v in per.items()}
    has_head = getattr(draft, "confidence_head", None) is not None
    confidence = (torch.cat(conf) if conf else torch.zeros(0, K, device=dev)) if has_head else None
    return alphas, confidence


@torch.no_grad()
def block_acceptance(draft, embed, head_weight: torch.Tensor, windows: Iterable[Window], chunk: int = 64) -> dict[str, dict]:
    """Acceptance of a DSpark block draft (:mod:`drafter.models.dspark`) under the three rules over
    every eligible anchor of ``windows`` (:func:`window_block_alphas`); τ per block =
    1 + Σ_k Π_{j≤k} α_j. ``confidence`` (with a confidence head): σ of the head per position and
    the T=0 outcome, for :func:`drafter.evaluation.calibration.reliability`."""
    was_training = draft.training
    draft.eval()
    K = draft.cfg.block_size
    acc = {r: [] for r in RULES}
    conf, outcome = [], []
    for w in windows:
        alphas, c = window_block_alphas(draft, embed, head_weight, w, chunk)
        for r in RULES:
            acc[r].append(alphas[r])
        if c is not None:
            conf.append(c)
            outcome.append(alphas["t0"])
    draft.train(was_training)
    res = {r: summarize(torch.cat(acc[r]) if acc[r] else torch.zeros(0, K)) for r in RULES}
    if conf:
        res["confidence"] = {"confidence": torch.cat(conf), "accepted": torch.cat(outcome)}
    return res
