"""Drafter training losses: plain functions on one draft position.

Every loss takes the draft logits ``[N, V]``, the target (logits ``[N, V]`` or token ids ``[N]``)
and a mask ``[N]`` (1 = a position that counts; float: the rows' weights), computes in float32 whatever
the input dtype, and returns ``(loss, stats)``: the masked mean loss (a scalar with gradient w.r.t. the draft
logits only) and detached statistics (mean α, and λ for the hybrid). Definitions
(``../shared/DESIGN.md``, Losses), with p = target, q = draft:

* ``kl``        KL(p‖q) = Σ p (log p − log q)
* ``tv``        TV = ½ Σ |p − q|
* ``lk_alpha``  −log α, α = Σ min(p, q) = 1 − TV (the acceptance rate of probabilistic drafts)
* ``lk_hybrid`` λ·KL + (1−λ)·TV, λ = exp(−η·sg[α]) — KL while the drafter is poor, TV near the goal
* ``ce``        −log q(token) on data tokens
* ``ce_l1``     ce_w·CE + l1_w·‖p − q‖₁

Example::

    loss, stats = lk_hybrid(draft_logits, target_logits, mask, eta=3.0)
    loss.backward(); stats["alpha"], stats["lambda"]
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
_EPS = 1e-12


def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True):
    """``torch.autocast(device_type, dtype, enabled)``, or nothing for a device type without autocast
    (``meta``, where the tests run every path: there is no arithmetic to cast)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """The mean of ``x`` over the rows ``mask`` keeps (bool or 0/1: 0 when it keeps none), or its mean
    weighted by ``mask`` (float weights: Σ w·x / Σ w)."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    den = m.sum()
    return (x * m).sum() / (den if mask.is_floating_point() else den.clamp_min(1.0))


def _probs(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0):
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} differ in shape")
    logq = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    logp = F.log_softmax(target_logits.detach().float() / temperature, dim=-1)
    return logp, logq


def acceptance(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """α per row = Σ_v min(p_v, q_v) (probabilistic drafts); no gradient."""
    with torch.no_grad():
        logp, logq = _probs(draft_logits, target_logits, temperature)
        return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def kl(draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0):
    logp, logq = _probs(draft_logits, target_logits, temperature)
    p = logp.exp()
    per = (p * (logp - logq)).sum(-1)
    alpha = torch.minimum(p, logq.exp()).sum(-1).detach()
    return _masked_mean(per, mask), {"alpha": _masked_mean(alpha, mask).item()}


def tv(draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0):
    logp, logq = _probs(draft_logits, target_logits, temperature)
    p, q = logp.exp(), logq.exp()
    per = 0.5 * (p - q).abs().sum(-1)
    return _masked_mean(per, mask), {"alpha": _masked_mean((1 - per).detach(), mask).item()}


def lk_alpha(draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0):
    logp, logq = _probs(draft_logits, target_logits, temperature)
    alpha = torch.minimum(logp.exp(), logq.exp()).sum(-1)
    per = -torch.log(alpha.clamp_min(_EPS))
    return _masked_mean(per, mask), {"alpha": _masked_mean(alpha.detach(), mask).item()}


def lk_hybrid(draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, eta: float = 3.0,
              temperature: float = 1.0, fused: bool = True):
    """λ·KL + (1−λ)·TV per row (module doc). ``fused`` (the default) computes it with :class:`LKHybridRows`:
    the value and the gradient w.r.t. the draft logits in one pass over cache-sized row chunks, equal to
    the autograd computation (``fused=False``, the reference) within float32 rounding."""
    if fused:
        if draft_logits.shape != target_logits.shape:
            raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits "
                             f"{tuple(target_logits.shape)} differ in shape")
        per, alpha, lam = LKHybridRows.apply(draft_logits, target_logits.detach(), float(eta), float(temperature))
        return _masked_mean(per, mask), {"alpha": _masked_mean(alpha, mask).item(), "lambda": _masked_mean(lam, mask).item()}
    logp, logq = _probs(draft_logits, target_logits, temperature)
    p, q = logp.exp(), logq.exp()
    kl_per = (p * (logp - logq)).sum(-1)
    tv_per = 0.5 * (p - q).abs().sum(-1)
    alpha = (1 - tv_per).detach()  # sg[α]
    lam = torch.exp(-eta * alpha)
    per = lam * kl_per + (1 - lam) * tv_per
    return _masked_mean(per, mask), {"alpha": _masked_mean(alpha, mask).item(), "lambda": _masked_mean(lam, mask).item()}


CHUNK_ROWS = 8  # rows of [rows, V] worked on at once by LKHybridRows on a CPU: 1.5 MB per float32 temporary at V = 49k
GPU_CHUNK_BYTES = 128 * 2**20  # on an accelerator: rows per chunk so that one float32 [rows, V] temporary is ≤ this
CHUNK_TEMPORARIES = 6  # float32 [rows, V] temporaries a chunk holds at once (log q, log p, q, p, q − p, the gradient's)


def chunk_rows(device_type: str, vocab: int) -> int:
    """Rows of ``[rows, V]`` logits :class:`LKHybridRows` works on at once on ``device_type``: on the CPU
    :data:`CHUNK_ROWS` (a chunk stays in cache: the loss is memory-bound there); on a GPU (and ``meta``, which
    stands in for one) as many as keep one float32 temporary within :data:`GPU_CHUNK_BYTES` — a GPU pays a
    launch and a wait per small op, so 8-row chunks left it idle (~3,400 tokens/s at the demo's size on an
    H200 against ~7,000 in one chunk)."""
    if device_type == "cpu":
        return CHUNK_ROWS
    return max(CHUNK_ROWS, GPU_CHUNK_BYTES // (4 * max(int(vocab), 1)))


class LKHybridRows(torch.autograd.Function):
    """Per row of ``[N, V]`` logits: ``(per, α, λ)`` of lk_hybrid, with the gradient of ``per`` w.r.t. the
    draft logits worked out in the forward — the autograd of the reference keeps a dozen ``[N, V]``
    float32 intermediates and walks them again backward (memory-bound: at the demo's V = 49,152 this was
    most of a K = 2 training step on 2 CPU cores); here each chunk of :func:`chunk_rows` rows (8 on a CPU: it
    stays in cache; up to 128 MiB per temporary on a GPU) is worked on at once and only the gradient is kept.
    With z the draft logits, q = softmax(z/T), p the target's, and
    λ = exp(−η·sg[α]) a constant: ∂KL/∂z = (q − p)/T; ∂TV/∂z = q ⊙ (s − ⟨q, s⟩)/T with s = ½·sign(q − p)
    (0 where q = p, as autograd's |·|). α and λ carry no gradient."""

    @staticmethod
    def forward(ctx, draft_logits: Tensor, target_logits: Tensor, eta: float, temperature: float):
        n, dev = draft_logits.shape[0], draft_logits.device
        per, alpha, lam = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
        grad = torch.empty(draft_logits.shape, dtype=torch.float32, device=dev) if ctx.needs_input_grad[0] else None
        rows = chunk_rows(dev.type, draft_logits.shape[-1])
        with torch.no_grad(), autocast(dev.type, enabled=False):
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                logq = F.log_softmax(draft_logits[r0:r1].float() / temperature, dim=-1)
                logp = F.log_softmax(target_logits[r0:r1].float() / temperature, dim=-1)
                q, p = logq.exp(), logp.exp()
                kl = logp.sub_(logq).mul_(p).sum(-1)
                d = q.sub(p)  # q − p
                tv = d.abs().sum(-1).mul_(0.5)
                a = 1 - tv
                lm = torch.exp(-eta * a)
                per[r0:r1] = lm * kl + (1 - lm) * tv
                alpha[r0:r1], lam[r0:r1] = a, lm
                if grad is not None:
                    s = torch.sign(d).mul_(0.5)
                    g = s.sub_((q * s).sum(-1, keepdim=True)).mul_(q).mul_((1 - lm)[:, None])
                    g.add_(d.mul_(lm[:, None]))
                    if temperature != 1.0:
                        g.div_(temperature)
                    grad[r0:r1] = g
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.dtype = draft_logits.dtype
        ctx.mark_non_differentiable(alpha, lam)
        return per, alpha, lam

    @staticmethod
    def backward(ctx, grad_per: Tensor, _grad_alpha, _grad_lam):
        (grad,) = ctx.saved_tensors
        return (grad * grad_per[:, None]).to(ctx.dtype), None, None, None


def ce(draft_logits: Tensor, tokens: Tensor, mask: Tensor | None = None):
    if tokens.shape != draft_logits.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match draft logits {tuple(draft_logits.shape)}")
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    per = -logq.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    acc = (draft_logits.argmax(-1) == tokens).float()
    return _masked_mean(per, mask), {"accuracy": _masked_mean(acc, mask).item()}


def ce_l1(draft_logits: Tensor, target_logits: Tensor, tokens: Tensor, mask: Tensor | None = None,
          ce_w: float = 0.1, l1_w: float = 0.9, temperature: float = 1.0):
    if tokens.shape != draft_logits.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match draft logits {tuple(draft_logits.shape)}")
    logp, logq = _probs(draft_logits, target_logits, temperature)
    # CE on the data tokens from the same log-softmax (at temperature 1 it is ce()'s; one pass, not two)
    logq_ce = logq if temperature == 1.0 else F.log_softmax(draft_logits.float(), dim=-1)
    ce_loss = _masked_mean(-logq_ce.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1), mask)
    acc = (logq_ce.detach().argmax(-1) == tokens).float()
    l1 = (logp.exp() - logq.exp()).abs().sum(-1)
    loss = ce_w * ce_loss + l1_w * _masked_mean(l1, mask)
    return loss, {"alpha": _masked_mean((1 - 0.5 * l1).detach(), mask).item(), "accuracy": _masked_mean(acc, mask).item()}


def position_weights(k: int, gamma: float = 4.0) -> Tensor:
    """Weights of draft positions 0..k-1: exp(−i/γ) (position 0, the first draft, weighs 1). A CPU
    tensor, read as Python floats (``float(weights[k])``) whatever the model's device."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return torch.tensor([math.exp(-i / gamma) for i in range(k)], dtype=torch.float32)


def position_loss(cfg, q: Tensor, p: Tensor | None, tokens: Tensor, fused: bool = True, mask: Tensor | None = None):
    """The loss ``cfg.loss`` (a TrainConfig: loss, η, ce_w, l1_w) of one draft position's logits ``q``
    against the target's logits ``p`` (None for ``ce``) and the data tokens, averaged over the rows with
    weights ``mask`` (None: a plain mean). ``fused=False``: lk_hybrid's reference autograd computation
    (bench/train.py's reference path)."""
    if cfg.loss == "ce":
        return ce(q, tokens, mask)
    if cfg.loss == "ce_l1":
        return ce_l1(q, p, tokens, mask, ce_w=cfg.ce_w, l1_w=cfg.l1_w)
    if cfg.loss == "lk_hybrid":
        return lk_hybrid(q, p, mask, eta=cfg.eta, fused=fused)
    return LOSSES[cfg.loss](q, p, mask)


LOSSES = {"kl": kl, "tv": tv, "lk_alpha": lk_alpha, "lk_hybrid": lk_hybrid, "ce": ce, "ce_l1": ce_l1}
