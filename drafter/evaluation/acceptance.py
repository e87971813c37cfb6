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


def window_alphas(drafter, head_weight: torch.Tensor, win: Window, k_steps: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """α per rule, shape [n, K] for the n = T−K−1 positions with all K targets; and their eligibility
    (all K predicted tokens are assistant tokens)."""
    T = len(win.input_ids)
    n = T - k_steps - 1
    if n <= 0:
        return {r: torch.zeros(0, k_steps) for r in RULES}, torch.zeros(0, dtype=torch.bool)
    un = drafter.unroll(win.input_ids[None], win.hidden[None], k_steps, win.positions[None])
    out = {r: [] for r in RULES}
    elig = torch.ones(n, dtype=torch.bool)
    p_all = F.softmax(target_logits(win.hidden[1:T - 1], head_weight), -1)  # positions 1..T-2
    for k in range(1, k_steps + 1):
        a = rule_alphas(p_all[k - 1:k - 1 + n], un.logits[k - 1][0, :n])  # the target at position t+k
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
def acceptance(drafter, head_weight: torch.Tensor, windows: Iterable[Window], k_steps: int) -> dict[str, dict]:
    """Acceptance under the three rules over all eligible positions of ``windows``."""
    was_training = drafter.training
    drafter.eval()
    acc = {r: [] for r in RULES}
    for w in windows:
        a, elig = window_alphas(drafter, head_weight, w, k_steps)
        for r in RULES:
            acc[r].append(a[r][elig])
    drafter.train(was_training)
    out = {}
    for r in RULES:
        out[r] = summarize(torch.cat(acc[r]) if acc[r] else torch.zeros(0, k_steps))
    return out
