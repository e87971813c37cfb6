"""Calibration of a confidence estimate: reliability bins and the expected calibration error.

``reliability(confidence, outcome, bins)`` splits [0, 1] into equal-width bins of the predicted
confidence; per bin: the count, the mean confidence and the observed frequency of the outcome.
ECE = Σ_b (n_b / N) · |freq_b − conf_b| (empty bins count 0). For a DSpark confidence head the
outcome is whether the draft at that block position is accepted at T=0. Both functions copy their
inputs to the CPU first (from whatever device the draft ran on) and compute there.

``fit_platt(confidence, outcome)`` → ``(a, b)``: Platt scaling, the maximum-likelihood
c' = σ(a · logit(c) + b) on a calibration set the model was not trained on (a head trained for
several passes over its data learns the acceptance it reaches there, above what unseen text gets).
A linear confidence head takes it exactly into its weights
(:meth:`drafter.models.dspark.ConfidenceHead.recalibrate`).

Example::

    rel = reliability(conf, accepted, bins=10); rel["ece"]
    a, b = fit_platt(conf_calibration, accepted_calibration)   # then head.recalibrate(a, b)
    plot_reliability(rel, "reliability.png", "confidence head, held-out")
"""
from __future__ import annotations

from pathlib import Path

import torch

from drafter.core.files import atomic_path


def reliability(confidence: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> dict:
    c = confidence.detach().double().flatten().cpu()  # a host computation over a few numbers per position
    y = outcome.detach().double().flatten().cpu()
    if c.shape != y.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and outcome {tuple(outcome.shape)} differ in size")
    if bins < 1:
        raise ValueError(f"bins must be ≥ 1, got {bins}")
    if c.numel() and (bool((c < 0).any()) or bool((c > 1).any())):
        raise ValueError("confidence values must lie in [0, 1]")
    idx = (c * bins).long().clamp(max=bins - 1)
    rows, ece = [], 0.0
    n = c.numel()
    for b in range(bins):
        m = idx == b
        k = int(m.sum())
        row = {"lo": b / bins, "hi": (b + 1) / bins, "count": k,
               "confidence": float(c[m].mean()) if k else None, "frequency": float(y[m].mean()) if k else None}
        if k:
            ece += k / n * abs(row["frequency"] - row["confidence"])
        rows.append(row)
    return {"bins": rows, "ece": ece if n else None, "n": n,
            "mean_confidence": float(c.mean()) if n else None, "mean_outcome": float(y.mean()) if n else None}


def fit_platt(confidence: torch.Tensor, outcome: torch.Tensor) -> tuple[float, float]:
    """Platt scaling of ``confidence`` (in (0, 1)) against the 0/1 ``outcome``: the ``(a, b)`` that minimise
    the binary cross-entropy of σ(a · logit(c) + b) (float64, L-BFGS; convex in a, b). Raises ValueError
    when the outcomes are all equal (the optimum is at infinity) or the sizes differ."""
    c = confidence.detach().double().flatten().cpu()  # a host computation over a few numbers per position
    y = outcome.detach().double().flatten().cpu()
    if c.shape != y.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and outcome {tuple(outcome.shape)} differ in size")
    if c.numel() and (bool((c < 0).any()) or bool((c > 1).any())):
        raise ValueError("confidence values must lie in [0, 1]")
    pos = float(y.sum())
    if pos == 0 or pos == y.numel():
        raise ValueError(f"Platt scaling needs both outcomes: {int(pos)} of {y.numel()} positions accepted")
    z = torch.logit(c, eps=1e-6)
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = (float(v) for v in ab.detach())
    if not (torch.isfinite(ab).all() and a > 0):
        raise ValueError(f"Platt scaling gave a = {a}, b = {b}: the confidence carries no usable ranking")
    return a, b


def plot_reliability(rel: dict, path: Path, title: str) -> Path:
    """Reliability diagram (observed frequency against mean confidence per bin, the diagonal, counts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = [r for r in rel["bins"] if r["count"]]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    ax.bar([(r["lo"] + r["hi"]) / 2 for r in full], [r["frequency"] for r in full],
           width=1 / len(rel["bins"]) * 0.9, alpha=0.6, label="observed acceptance")
    ax.plot([r["confidence"] for r in full], [r["frequency"] for r in full], "o-", label="per bin")
    ece = rel["ece"]
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accepted (T=0)",
           title=f"{title}\nECE {ece:.3f} over {rel['n']} positions" if ece is not None else title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return Path(path)
