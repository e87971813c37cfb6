"""DSpark block training: one loss over many anchors' blocks per window (DESIGN.md, Losses).

For a window, anchors are drawn among the positions whose next token is an assistant token
(:func:`drafter.models.dspark.sample_anchors`); the draft proposes each anchor's block in one pass
(:meth:`DSparkDraft.forward`, Markov head teacher-forced). Block position ``j`` of anchor ``p``
predicts ``x[p+1+j]``; its target distribution is the target's LM head on the captured LM-head
input at ``p+j``. Per position the configured loss (``ce_l1`` = 0.1·CE + 0.9·‖p − q‖₁ in the
DeepSeek-V4.1 recipe, ``lk_hybrid`` for the ablation, any of :data:`losses.LOSSES`), weighted
exp(−j/γ); plus ``confidence_w`` × the confidence head's binary cross-entropy against whether the
position is accepted at T=0 (argmax of the draft = argmax of the target), what the head estimates
for vLLM's adaptive verification.

Example::

    loss, stats = block_loss(draft, embed, head_weight, win, train_cfg, anchors=256, confidence_w=0.1)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter.data.windows import Window
from drafter.evaluation.acceptance import block_forward, model_device
from drafter.models.dspark import DSparkDraft, sample_anchors
from drafter.training import losses as L


def block_loss(draft: DSparkDraft, embed: torch.nn.Module, head_weight: torch.Tensor, win: Window, cfg, *,
               anchors: int, confidence_w: float, generator: torch.Generator | None = None):
    """Weighted loss over the block positions of up to ``anchors`` anchors of ``win`` → (loss, per-position stats).

    ``cfg`` is a :class:`~drafter.core.config.TrainConfig` (loss, γ, η, ce_w, l1_w). The window is moved
    to the draft's device; ``head_weight`` and ``embed`` must be there already."""
    win = win.to(model_device(draft, head_weight))
    lengths = torch.tensor([len(win.input_ids)], device=win.device)
    a, ok = sample_anchors(lengths, win.loss_mask[None], anchors, generator)
    out, p_logits = block_forward(draft, embed, head_weight, win, a[0], ok[0])
    valid = out.valid[0]
    weights = L.position_weights(draft.cfg.block_size, cfg.gamma)
    # one [M, V] view per block position (unbind: its backward writes the logits' gradient once, where
    # indexing [:, j] would allocate and fill a whole [M, K, V] gradient per position)
    q_by_pos = out.logits[0].unbind(1)
    total, wsum, stats = 0.0, 0.0, []
    for j in range(draft.cfg.block_size):
        sel = valid[:, j]
        if not bool(sel.any()):
            stats.append({})
            continue
        q, p, tokens = q_by_pos[j][sel], p_logits[sel, j], out.labels[0, sel, j]
        loss_j, st = L.position_loss(cfg, q, p, tokens)
        if out.confidence_logits is not None and confidence_w > 0:
            accepted = (q.detach().argmax(-1) == p.argmax(-1)).float()
            bce = F.binary_cross_entropy_with_logits(out.confidence_logits[0, sel, j], accepted)
            loss_j = loss_j + confidence_w * bce
            st = {**st, "confidence_bce": float(bce.detach())}
        w = float(weights[j])
        total = total + w * loss_j
        wsum += w
        stats.append({"loss": float(loss_j.detach()), **st})
    if wsum == 0:  # no anchor with a training token after it: keep the graph valid
        return out.logits.sum() * 0.0, stats
    return total / wsum, stats
