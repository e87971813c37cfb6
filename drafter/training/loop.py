"""Acceptance-targeted drafter training: K-step unrolled drafting, one loss per draft position.

Read top to bottom: the per-window loss, the learning-rate schedule, the loop. For each window
the drafter drafts K steps (step k fed its own hidden state from step k−1 and the data token
x_{t+k}); the target distribution at step k is the target's LM head applied to the captured
LM-head input at t+k (recomputed, never stored); the step losses are weighted exp(−k/γ).

With a draft vocabulary (``train.draft_vocab_size``, :class:`VocabHead`) the drafter trains as vLLM
serves it (drafter/serving/draft_vocab.py): both its logits and the target's are computed over those
tokens only, so every loss compares the draft with the target's distribution restricted to the draft
vocabulary (renormalised over it); CE counts only data tokens inside it. The output head, the most
expensive part of a step, then costs |V'|/|V| of the whole-vocabulary one.

The loop checkpoints every ``checkpoint_every`` steps into ``workdir/ckpt`` (model, optimizer,
step, history; written atomically). A retry resumes from the last checkpoint: the data order is
a function of (seed, index), so the resumed run reaches the same final weights as an
uninterrupted one.

Example::

    result = train(drafter, head_weight, train_windows, eval_windows, cfg.train, workdir)
    result["final"]["t0"]["tau"]
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from dataclasses import dataclass

from drafter.training import losses as L
from drafter.evaluation.acceptance import acceptance, drafter_input, model_device, target_logits
from drafter.core.config import TrainConfig
from drafter.core.hardware import compute_dtype, native_bf16
from drafter.models import freeze
from drafter.models.experts import set_experts
from drafter.training.compiled import compile_layers
from drafter.training.frozen import frozen_dtype_of, hold_frozen
from drafter.core.progress import progress
from drafter.data.windows import Window, window_order


TOKEN_LOSSES = ("ce", "ce_l1")  # the losses that read the data token


@dataclass(frozen=True)
class VocabHead:
    """A draft vocabulary for training: ``ids`` [V'] (token ids), ``weight`` [V', H] (those rows of the
    target's head, for the target's logits) and ``index`` [V] (a token's position in ``ids``, −1 outside)."""
    ids: torch.Tensor
    weight: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, ids, head_weight: torch.Tensor) -> "VocabHead":
        """Checked on the host (``ids``: a list or tensor), then made on ``head_weight``'s device."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        V = head_weight.shape[0]
        if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= V or len(ids.unique()) != len(ids):
            raise ValueError(f"a draft vocabulary must be distinct token ids in [0, {V}); got {len(ids)} ids")
        dev = head_weight.device
        ids = ids.to(dev)
        index = torch.full((V,), -1, dtype=torch.long, device=dev)
        index[ids] = torch.arange(len(ids), device=dev)
        return cls(ids, head_weight.detach()[ids].contiguous(), index)

    def mask(self) -> torch.Tensor:
        """bool [V]: the tokens the drafter may draft."""
        return self.index >= 0


def window_loss(drafter, head_weight: torch.Tensor, win: Window, cfg: TrainConfig, weights: torch.Tensor,
                fused: bool = True, vocab: VocabHead | None = None):
    """Weighted sum over draft positions of the configured loss on one window → (loss, per-step stats).
    ``fused``: see :func:`drafter.training.losses.position_loss`. ``vocab``: train over a draft
    vocabulary (the module docstring); ``head_weight`` stays the whole head.

    Logits (the expensive [tokens, vocab] part) are computed only where the predicted token is an
    assistant token — the only positions the loss counts; the hidden-state chain runs everywhere.
    The window is moved to the drafter's device; ``weights`` (:func:`~drafter.training.losses.position_weights`)
    are read as Python floats. :func:`batch_loss` of one window.
    """
    return batch_loss(drafter, head_weight, [win], cfg, weights, fused=fused, vocab=vocab)


def batch_loss(drafter, head_weight: torch.Tensor, wins: list[Window], cfg: TrainConfig, weights: torch.Tensor,
               fused: bool = True, vocab: VocabHead | None = None):
    """The mean over ``wins`` (windows of one length T) of :func:`window_loss`, with the drafter run once
    over the ``[B, T]`` batch and each draft position's head and loss once over all windows' rows →
    (loss, per-step stats: α / λ / accuracy averaged over the windows). A window without an assistant
    token counts as loss 0. Equal to the mean of the windows' losses within float rounding (a row's
    weight in the batch is its window's weight w_k / (Σ_k' w_k' · n_k) / B)."""
    dev = model_device(drafter, head_weight)
    wins = [w.to(dev) for w in wins]
    B, T = len(wins), len(wins[0].input_ids)
    if any(len(w.input_ids) != T for w in wins):
        raise ValueError(f"batch_loss: windows of one length only; got {sorted({len(w.input_ids) for w in wins})}")
    ids, mask = torch.stack([w.input_ids for w in wins]), torch.stack([w.loss_mask for w in wins])
    un = drafter.unroll(ids, torch.stack([drafter_input(drafter, w) for w in wins]), cfg.k_steps,
                        torch.stack([w.positions for w in wins]), compute_logits=False)
    target, row_of = None, None
    if cfg.loss != "ce":  # the target's logits at positions j = 1..T-2 whose next token counts, once for every step
        nb, nj = torch.nonzero(mask[:, 2:T], as_tuple=True)
        nj = nj + 1
        with torch.no_grad():
            target = target_logits(torch.stack([w.hidden for w in wins])[nb, nj],
                                   head_weight if vocab is None else vocab.weight)
        row_of = torch.full((B, T), -1, dtype=torch.long, device=dev)
        row_of[nb, nj] = torch.arange(len(nb), device=dev)
    rows = None if vocab is None or getattr(drafter, "own_vocab", False) else vocab.ids  # EAGLE-3: its own rows
    steps = _draft_rows(ids, mask, cfg, vocab)
    if not steps:  # no assistant token in these windows: nothing to learn, but keep the graph valid
        return un.hidden[0].sum() * 0.0, []
    wsum = sum(float(weights[k - 1]) * (n > 0).float() for k, _, _, _, n in steps)  # [B]: Σ_k w_k where k has rows
    total, stats = 0.0, []
    for k, b, t, tokens, n in steps:
        q = drafter.logits(k - 1, un.hidden[k - 1][b, t], rows=rows)
        p = None if target is None else target[row_of[b, t + k]]  # the target at position t+k
        w = float(weights[k - 1])
        if B == 1:  # one window: the weighted sum of its per-step means, divided by Σ w_k below
            loss_k, st = L.position_loss(cfg, q, p, tokens, fused=fused)
            total = total + w * loss_k
        else:  # Σ_rows c·x with c = w_k / (wsum_b · n_b) / B: the mean over windows of each window's loss
            c = w / (wsum[b] * n[b]) / B
            loss_k, st = L.position_loss(cfg, q, p, tokens, fused=fused, mask=c)
            total = total + loss_k * c.sum()
        stats.append({"loss": float(loss_k.detach()), **st})
    return (total / sum(float(weights[k - 1]) for k, *_ in steps) if B == 1 else total), stats


def _draft_rows(ids: torch.Tensor, mask: torch.Tensor, cfg: TrainConfig, vocab: VocabHead | None) -> list[tuple]:
    """Per draft step k with rows that count: ``(k, b, t, tokens, n)`` — the window b and position t of each
    row whose predicted token x_{t+k+1} is an assistant token (inside the draft vocabulary for a token loss),
    that token (its draft-vocabulary index then), and ``n`` [B] the rows of each window."""
    B, T = ids.shape
    out = []
    for k in range(1, cfg.k_steps + 1):
        n = T - k - 1  # positions whose predicted token x_{t+k+1} exists
        if n <= 0:
            break
        b, t = torch.nonzero(mask[:, k + 1:k + 1 + n], as_tuple=True)  # positions t that count
        tokens = ids[b, k + 1 + t]
        if vocab is not None and cfg.loss in TOKEN_LOSSES:  # a token outside the draft vocabulary: not a label
            inside = vocab.index[tokens] >= 0
            b, t, tokens = b[inside], t[inside], vocab.index[tokens[inside]]
        if len(b):
            n_rows = torch.zeros(B, dtype=torch.long, device=b.device).index_add_(0, b, torch.ones_like(b))
            out.append((k, b, t, tokens, n_rows))
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio · lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress_ = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress_)))


def dist_info() -> tuple[int, int]:
    """(rank, world size) under torchrun (torch.distributed initialized), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_grads(params, world: int) -> None:
    """Average gradients over ranks (what DDP does; the drafter's unroll is not a module forward)."""
    import torch.distributed as dist

    for p in params:  # every rank reduces every parameter, in the same order (a None grad is a zero one)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def _save_checkpoint(path: Path, drafter, opt, step: int, history: list) -> None:
    """Tensors and plain JSON-like values only (no pickled objects), so that it loads with
    ``torch.load(weights_only=True)``: a checkpoint file cannot run code. The window order is a
    function of the step; torch's global RNG state is kept as a uint8 tensor, the history as JSON values."""
    trainable = {k: v for k, v in drafter.named_parameters() if v.requires_grad}
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save({"step": step, "model": {k: v.detach().clone() for k, v in trainable.items()},
                "optimizer": opt.state_dict(), "history": json.loads(json.dumps(history)),
                "torch_rng_state": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, drafter, opt) -> tuple[int, list]:
    ck = torch.load(path, map_location="cpu", weights_only=True)
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for k, v in ck["model"].items():
            params[k].copy_(v)
    opt.load_state_dict(ck["optimizer"])
    if "torch_rng_state" in ck:
        torch.set_rng_state(ck["torch_rng_state"])
    return ck["step"], ck["history"]


def _optimizer(drafter, cfg: TrainConfig) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """The trainable parameters (those :func:`~drafter.models.freeze` left trainable) and their AdamW."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return params, torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def _resume(latest: Path, drafter, opt, max_steps: int, log: Callable[[str], None]) -> tuple[int, list]:
    """(step, history) of the checkpoint ``latest`` loaded into ``drafter`` and ``opt``; (0, []) without one."""
    if not latest.is_file():
        return 0, []
    start, history = _load_checkpoint(latest, drafter, opt)
    log(f"train: resumed from checkpoint at step {start}/{max_steps}")
    return start, history


def _default_fns(drafter, head_weight: torch.Tensor, eval_windows: list[Window], cfg: TrainConfig, device,
                 loss_fn: Callable[[Window], tuple] | None, evaluate: Callable[[], dict] | None,
                 draft_vocab) -> tuple[Callable[[list[Window]], tuple], bool, Callable[[], dict]]:
    """``train``'s loss of a list of windows, whether it takes several at once, and its held-out check: the
    given ``loss_fn`` (one window at a time) and ``evaluate``, else the MTP unroll's (:func:`batch_loss`: a
    micro batch's windows of one length at once; :func:`~drafter.evaluation.acceptance.acceptance`) with
    ``head_weight`` on ``device`` in float32, over the draft vocabulary ``draft_vocab`` when given."""
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    head_weight = head_weight.detach().float().to(device)
    vocab = None if draft_vocab is None else VocabHead.of(draft_vocab, head_weight)
    if loss_fn is None:
        batch_fn, batched = lambda wins: batch_loss(drafter, head_weight, wins, cfg, weights, vocab=vocab), True  # noqa: E731
    else:
        batch_fn, batched = (lambda wins, one=loss_fn: one(wins[0].to(device))), False
    if evaluate is None:
        mask = None if vocab is None else vocab.mask()
        evaluate = lambda: acceptance(drafter, head_weight, eval_windows, cfg.k_steps, vocab_mask=mask)  # noqa: E731
    return batch_fn, batched, evaluate


def micro_batches(wins: list[Window], size: int, batched: bool = True) -> list[list[Window]]:
    """``wins`` in consecutive micro batches of ``size``, each split into runs of one length (first-seen
    order): the groups one forward takes (windows are never padded); one window each when not ``batched``."""
    if not batched:
        return [[w] for w in wins]
    out = []
    for i in range(0, len(wins), size):
        by_len: dict[int, list[Window]] = {}
        for w in wins[i:i + size]:
            by_len.setdefault(len(w.input_ids), []).append(w)
        out += by_len.values()
    return out


def _hold(drafter, cfg: TrainConfig, device: torch.device):
    """The frozen weights in ``train.frozen_dtype`` (:mod:`drafter.training.frozen`), then the routed experts'
    path (``train.experts``: it reads their dtype), the layers compiled under ``train.compile``
    (:mod:`drafter.training.compiled`; ``held["compiled"]``: how many), and the step's autocast:
    ``(held, experts, autocast)``."""
    held = hold_frozen(drafter, frozen_dtype_of(cfg, device.type))
    experts = set_experts(drafter, cfg.experts)  # None: no routed experts (a DSpark draft computes its own)
    held["compiled"] = compile_layers(drafter) if cfg.compile else 0
    return held, experts, L.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def _resolved_dtype(cfg: TrainConfig, device: torch.device, log: Callable[[str], None]) -> TrainConfig:
    """``cfg`` with ``dtype: auto`` resolved for ``device`` (:func:`~drafter.core.hardware.compute_dtype`); an
    explicit bfloat16 on a device that emulates it is kept, with a warning (it trains many times slower)."""
    dtype = compute_dtype(cfg.dtype, device)
    if cfg.dtype == "auto":
        log(f"train: dtype auto → {dtype} on {device.type}" + ("" if dtype == "bfloat16" else
            " (no native bf16 matmul here: float32 is faster)"))
    elif dtype == "bfloat16" and not native_bf16(device):
        log(f"train: warning: dtype bfloat16 on a {device.type} without native bf16 matmuls (emulated: many times "
            "slower than float32); set train.dtype: auto or float32")
    return cfg if dtype == cfg.dtype else cfg.model_copy(update={"dtype": dtype})


def _held_note(held: dict, experts: str | None) -> str:
    return ((f"; routed experts: {experts}" if experts else "")
            + (f"; {held['compiled']} layer(s) compiled (train.compile: the first steps compile)" if held["compiled"] else "")
            + (f"; {held['tensors']} frozen weight tensors held in {held['dtype']} ({held['bytes_saved'] / 2**20:,.1f} "
               "MiB less)" if held["tensors"] else ""))


def _under(ctx, fn: Callable[[], dict]) -> Callable[[], dict]:
    """``fn`` run inside the (re-entrant) context manager ``ctx``."""
    def run() -> dict:
        with ctx:
            return fn()
    return run


def _baseline_acceptance(path: Path, evaluate: Callable[[], dict], rank: int) -> dict:
    """The held-out acceptance before training: measured once (rank 0 keeps it in ``path``), read on a resume."""
    if path.is_file():
        return json.loads(path.read_text())
    baseline = evaluate()
    if rank == 0:
        path.write_text(json.dumps(baseline))
    return baseline


def _step_record(step: int, loss: float, lr: float, grad_norm: float, step_stats: list[list[dict]]) -> dict:
    """One step of the history: loss, lr, gradient norm, and α / λ / accuracy per draft position
    (``alpha_1`` …) averaged over the step's windows."""
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm}
    for k in range(max((len(s) for s in step_stats), default=0)):
        vals = [s[k] for s in step_stats if len(s) > k]
        for key in ("alpha", "lambda", "accuracy"):
            xs = [v[key] for v in vals if key in v]
            if xs:
                rec[f"{key}_{k + 1}"] = sum(xs) / len(xs)
    return rec


def _held_out_record(ev: dict, step: int, loss: float, log: Callable[[str], None]) -> dict:
    """The history's ``eval`` entry of a held-out check (τ and α per rule, a DSpark draft's calibration), logged."""
    out = {r: {"tau": v["tau"], "alpha": v["alpha"]} for r, v in ev.items() if "tau" in v}
    if "calibration" in ev:  # a DSpark draft's confidence head
        out["calibration"] = {"ece": ev["calibration"]["ece"]}
    log(f"train: step {step} loss {loss:.4f} held-out τ T=0 {ev['t0']['tau']:.3f} "
        f"T=1 {ev['t1_greedy']['tau']:.3f} α(T=0) {[round(a, 3) for a in ev['t0']['alpha']]}")
    return out


def _sum_over_ranks(tokens: int, device) -> int:
    """``tokens`` summed over all ranks."""
    import torch.distributed as dist

    count = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return int(count)


def train(drafter, head_weight: torch.Tensor, train_windows: list[Window], eval_windows: list[Window],
          cfg: TrainConfig, workdir: Path, log: Callable[[str], None] = print,
          stop_after: int | None = None, *, loss_fn: Callable[[Window], tuple] | None = None,
          evaluate: Callable[[], dict] | None = None, draft_vocab=None) -> dict:
    """Train ``drafter`` in place; returns the history and the held-out acceptance before and after.

    ``loss_fn(window) → (loss, per-position stats)`` and ``evaluate() → {rule: {"tau", "alpha", …}}``
    default to the MTP unroll (:func:`window_loss`, :func:`~drafter.evaluation.acceptance.acceptance`
    over ``eval_windows``); a DSpark draft passes its block loss and block acceptance.
    ``draft_vocab``: token ids the drafter drafts over, as served (``train.draft_vocab_size``): the default
    loss trains over them (:class:`VocabHead`) and the held-out checks mask the draft to them.
    ``stop_after``: stop (as if killed) after this many optimizer steps of this call — for tests.

    Devices: the step runs where ``drafter``'s parameters are (``head_weight`` is moved there; a custom
    ``loss_fn``/``evaluate`` must have its own tensors there); each training window is moved there when
    it is used, the held-out ones by the evaluation; bf16 autocast takes that device's type.
    """
    workdir = Path(workdir)
    latest = workdir / "ckpt" / "latest.pt"
    latest.parent.mkdir(parents=True, exist_ok=True)
    rank, world = dist_info()
    if rank != 0:
        log = lambda *_: None  # noqa: E731 — rank 0 speaks for all
    torch.manual_seed(cfg.seed)
    n_trainable, n_frozen = freeze(drafter, cfg.freeze)
    cfg = _resolved_dtype(cfg, device := model_device(drafter, head_weight), log)
    held, experts, autocast = _hold(drafter, cfg, device)
    params, opt = _optimizer(drafter, cfg)
    batch_fn, batched, evaluate = _default_fns(drafter, head_weight, eval_windows, cfg, device, loss_fn, evaluate, draft_vocab)
    evaluate = _under(autocast, evaluate) if held["tensors"] else evaluate  # bf16 frozen: checks under autocast too
    start, history = _resume(latest, drafter, opt, cfg.max_steps, log)
    baseline = _baseline_acceptance(workdir / "baseline_acceptance.json", evaluate, rank)
    log(f"train: {n_trainable:,} trainable / {n_frozen:,} frozen parameters; {len(train_windows)} windows; "
        f"held-out τ before: T=0 {baseline['t0']['tau']:.3f}, T=1 {baseline['t1_greedy']['tau']:.3f}" + _held_note(held, experts))

    per_step = cfg.micro_batch * cfg.grad_accum
    drafter.train()
    t0, tokens, done_now = time.monotonic(), 0, 0
    last_eval = None  # the held-out check at the last step is the result's `final`
    # each optimizer step consumes per_step × world windows of one seeded stream: rank r takes its
    # own slice, so N ranks × micro batch m see the windows of 1 rank × micro batch N·m
    with progress("train" if rank == 0 else f"train (rank {rank})", total=cfg.max_steps, unit="steps") as bar:
        bar.advance(start)
        for step in range(start, cfg.max_steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            step_loss, step_stats = 0.0, []
            first = (step * world + rank) * per_step  # this rank's slice of the step's windows
            wins = [train_windows[window_order(len(train_windows), cfg.seed, first + i)] for i in range(per_step)]
            for group in micro_batches(wins, cfg.micro_batch, batched):
                with autocast:
                    loss, stats = batch_fn(group)  # the mean over the group's windows
                (loss * len(group) / per_step).backward()
                step_loss += float(loss.detach()) * len(group) / per_step
                step_stats += [stats] * len(group)
                tokens += sum(len(w.input_ids) for w in group)
            if world > 1:
                _all_reduce_grads(params, world)
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = _step_record(step + 1, step_loss, lr_at(step, cfg), gnorm, step_stats)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
                last_eval = ev = evaluate()  # the loop's last step always evaluates: its check is the `final`
                rec["eval"] = _held_out_record(ev, step + 1, step_loss, log)
            history.append(rec)
            bar.advance(1)
            done_now += 1
            if rank == 0 and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.max_steps):
                _save_checkpoint(latest, drafter, opt, step + 1, history)
            if stop_after is not None and done_now >= stop_after and step + 1 < cfg.max_steps:
                raise KeyboardInterrupt(f"stopped after {done_now} steps (test)")
    seconds = time.monotonic() - t0
    if world > 1:  # tokens seen by all ranks together
        tokens = _sum_over_ranks(tokens, device)
    final = last_eval if last_eval is not None else evaluate()
    return {"history": history, "baseline": baseline, "final": final, "trainable": n_trainable, "frozen": n_frozen,
            "dtype": cfg.dtype, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
            "resumed_from": start, "world_size": world, "experts": experts,
            "frozen_dtype": held["dtype"] if held["tensors"] else "float32", "compiled": held["compiled"]}


def plot_curves(history: list[dict], path: Path, title: str) -> Path:
    """Loss and α per position (train), and held-out τ, against steps (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [h["loss"] for h in history])
    axes[0].set(title="training loss", xlabel="step")
    # α per position for distribution losses; for CE (no target distribution) the top-1 accuracy
    key, what = ("alpha", "α per draft position (train, T=1 probabilistic)")
    if not any(k.startswith("alpha_") for h in history for k in h):
        key, what = ("accuracy", "top-1 accuracy per draft position (train)")
    ks = sorted({int(k.split("_")[1]) for h in history for k in h if k.startswith(f"{key}_")})
    for k in ks:
        axes[1].plot(steps, [h.get(f"{key}_{k}", float("nan")) for h in history], label=f"position {k}")
    axes[1].set(title=what, xlabel="step", ylim=(0, 1))
    if ks:
        axes[1].legend()
    ev = [h for h in history if "eval" in h]
    for rule, label in (("t0", "T=0"), ("t1_greedy", "T=1 greedy drafts")):
        axes[2].plot([h["step"] for h in ev], [h["eval"][rule]["tau"] for h in ev], marker="o", label=label)
    axes[2].set(title="held-out τ", xlabel="step")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
