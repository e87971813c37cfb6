"""Offline acceptance evaluation: τ(K) and α per position of drafters on held-out windows, with
conversation-level bootstrap confidence intervals, per domain and per thinking mode, and the K that
maximizes the expected speed given the draft cost (DESIGN.md, Metrics).

* **One unroll gives every K.** Each drafter is unrolled ``k_max`` steps over a window; the α of
  draft position k under each rule (:func:`drafter.evaluation.acceptance.rule_alphas`) gives the chain
  products Π_{j≤k} α_j, and τ(K) = 1 + mean Σ_{k≤K} Π_{j≤k} α_j for every K ≤ k_max, over the same
  positions (those whose k_max predicted tokens all exist and are assistant tokens).
* **Bootstrap over conversations.** Positions of one conversation are correlated, so the intervals
  resample conversations (clusters) with replacement: one multinomial count matrix W [B, C]; with
  per-conversation sums S [C, M] and position counts n [C], each resample's mean is
  (W·S) / (W·n) — no loop over resamples. Drafters share W (paired resamples), which also gives the
  interval of the candidate − baseline difference.
* **Expected speed.** One speculative step costs one target forward plus K draft steps, each
  ``draft_cost`` of a forward, and yields τ(K) tokens: speed(K) = τ(K) / (1 + K·draft_cost), relative
  to plain decoding. The recommended K is its argmax.

Example::

    held = heldout_alphas({"baseline": d0, "candidate": d1}, head, windows, k_max=7)
    res = evaluate(held, labels, k_max=7, draft_cost=0.1)
    res["drafters"]["candidate"]["t0"]["tau_by_k"], res["recommended_k"]["candidate"]
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from drafter.evaluation.acceptance import RULES, drafter_input, model_device, rule_alphas, target_logits
from drafter.data.windows import Window

RULE_TITLES = {"t0": "T=0", "t1_greedy": "T=1, greedy drafts", "t1_prob": "T=1, probabilistic drafts"}
UNKNOWN = "unknown"


# --------------------------------------------------------------------------- α on held-out windows


@dataclass
class HeldoutAlphas:
    """α per eligible position: ``alphas[drafter][rule]`` [N, k_max] float64; ``conv`` [N] the index of
    each position's conversation in ``conversations`` (row ids)."""

    conversations: list[str]
    conv: np.ndarray
    alphas: dict[str, dict[str, np.ndarray]]
    k_max: int

    @property
    def positions(self) -> int:
        return int(self.conv.shape[0])


@torch.no_grad()
def window_rule_alphas(drafters: Mapping[str, torch.nn.Module], head_weight: torch.Tensor, win: Window,
                       k_max: int) -> dict[str, dict[str, torch.Tensor]]:
    """α [m, k_max] per drafter and rule at the m eligible positions t of one window: the k_max
    predicted tokens x_{t+2}..x_{t+k_max+1} exist and are all assistant tokens. Draft step k at t is
    compared with the target at position t+k; the target's probabilities are computed once (only at
    the positions needed) and shared by the drafters; logits only at eligible positions. A drafter with a
    ``draft_vocab_ids`` attribute (token ids [V']) drafts only those tokens, as vLLM serves it with a draft
    vocabulary (drafter/serving/draft_vocab.py): its logits are computed on those rows of the head only
    and every other token gets −∞. The window is moved to ``head_weight``'s device, where the drafters are."""
    win = win.to(dev := head_weight.device)
    T = len(win.input_ids)
    n = T - k_max - 1
    empty = {d: {r: torch.zeros(0, k_max, device=dev) for r in RULES} for d in drafters}
    if n <= 0:
        return empty
    elig = torch.ones(n, dtype=torch.bool, device=dev)
    for k in range(1, k_max + 1):
        elig &= win.loss_mask[k + 1:k + 1 + n]
    t = elig.nonzero()[:, 0]
    if t.numel() == 0:
        return empty
    need = torch.unique(t[:, None] + torch.arange(1, k_max + 1, device=dev))  # target positions t+k
    row = torch.full((T,), -1, dtype=torch.long, device=dev)
    row[need] = torch.arange(len(need), device=dev)
    p_need = F.softmax(target_logits(win.hidden[need], head_weight), -1)
    out = {}
    for name, drafter in drafters.items():
        un = drafter.unroll(win.input_ids[None], drafter_input(drafter, win)[None], k_max, win.positions[None],
                            compute_logits=False)
        per = {r: [] for r in RULES}
        for k in range(1, k_max + 1):
            h = un.hidden[k - 1][0, t]
            if getattr(drafter, "own_vocab", False):  # an EAGLE-3 head: its own draft vocabulary → the target's ids
                q = drafter.target_logits(drafter.logits(k - 1, h).float())
            elif (ids := getattr(drafter, "draft_vocab_ids", None)) is not None:  # served over its draft vocabulary
                ids = torch.as_tensor(ids, device=dev)
                q = torch.full((len(t), p_need.shape[-1]), float("-inf"), device=dev)
                q[:, ids] = drafter.logits(k - 1, h, rows=ids).float()
            else:
                q = drafter.logits(k - 1, h)  # the draft of x_{t+k+1}
            a = rule_alphas(p_need[row[t + k]], q)              # the target at position t+k
            for r in RULES:
                per[r].append(a[r])
        out[name] = {r: torch.stack(v, 1) for r, v in per.items()}
    return out


def heldout_alphas(drafters: Mapping[str, torch.nn.Module], head_weight: torch.Tensor, windows: Iterable[Window],
                   k_max: int, on_window: Callable[[int], None] | None = None,
                   alphas_fn: Callable[[Window], dict] | None = None) -> HeldoutAlphas:
    """α of every drafter under every rule at every eligible position of ``windows``, with the
    conversation of each position (windows of one conversation form one bootstrap cluster).
    ``alphas_fn(window) → {drafter: {rule: [m, k_max]}}`` replaces the MTP unroll
    (:func:`window_rule_alphas`), e.g. for DSpark blocks (every drafter at the same m positions)."""
    if alphas_fn is None:
        alphas_fn = lambda win: window_rule_alphas(drafters, head_weight, win, k_max)  # noqa: E731
    states = {name: d.training for name, d in drafters.items()}
    for d in drafters.values():
        d.eval()
    conv_index: dict[str, int] = {}
    conv: list[np.ndarray] = []
    acc: dict[str, dict[str, list[np.ndarray]]] = {d: {r: [] for r in RULES} for d in drafters}
    try:
        for win in windows:
            a = alphas_fn(win)
            m = int(next(iter(a.values()))["t0"].shape[0]) if a else 0
            if m:
                ci = conv_index.setdefault(win.row_id, len(conv_index))
                conv.append(np.full(m, ci, dtype=np.int64))
                for d in drafters:
                    for r in RULES:
                        acc[d][r].append(a[d][r].double().cpu().numpy())
            if on_window:
                on_window(1)
    finally:
        for name, d in drafters.items():
            d.train(states[name])
    cat = (lambda xs: np.concatenate(xs)) if conv else (lambda xs: np.zeros((0, k_max)))
    return HeldoutAlphas(
        conversations=list(conv_index),
        conv=np.concatenate(conv) if conv else np.zeros(0, dtype=np.int64),
        alphas={d: {r: cat(acc[d][r]) for r in RULES} for d in drafters},
        k_max=k_max,
    )


# --------------------------------------------------------------------------- bootstrap


def resample_counts(n_clusters: int, samples: int, seed: int) -> np.ndarray:
    """[samples, n_clusters]: how often each cluster is drawn in each resample (C draws with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=samples).astype(np.float64)


def cluster_means(values: np.ndarray, cluster: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values`` [N, M] over positions (point estimate, [M]) and over each resample of the
    clusters ([B, M]); ``cluster`` [N] in 0..C−1, every cluster with at least one position."""
    C = counts.shape[1]
    sums = np.zeros((C, values.shape[1]))
    np.add.at(sums, cluster, values)
    n = np.bincount(cluster, minlength=C).astype(np.float64)
    return sums.sum(0) / n.sum(), (counts @ sums) / (counts @ n)[:, None]


def interval(boot: np.ndarray, confidence: float) -> np.ndarray:
    """Percentile interval [M, 2] of bootstrap values [B, M]."""
    lo = (1 - confidence) / 2
    return np.quantile(boot, [lo, 1 - lo], axis=0).T


def _chain_values(alphas: np.ndarray) -> np.ndarray:
    """[N, 2K]: Σ_{k≤K} Π_{j≤k} α_j for K = 1..k_max (τ − 1), then α_k (per position)."""
    return np.concatenate([np.cumsum(np.cumprod(alphas, axis=1), axis=1), alphas], axis=1)


def rule_summary(alphas: np.ndarray, cluster: np.ndarray, counts: np.ndarray, confidence: float) -> dict:
    """τ(K) and α_k with intervals, conditional acceptance, positions, for one drafter and rule."""
    K = alphas.shape[1]
    if alphas.shape[0] == 0:
        return {"tau_by_k": [1.0] * K, "tau_ci": [[1.0, 1.0]] * K, "alpha": [0.0] * K, "alpha_ci": [[0.0, 0.0]] * K,
                "accept_rate": [0.0] * K, "positions": 0, "conversations": 0}
    point, boot = cluster_means(_chain_values(alphas), cluster, counts)
    ci = interval(boot, confidence)
    chain = np.cumprod(alphas, axis=1).mean(0)
    reach = np.concatenate([[1.0], chain[:-1]])
    return {
        "tau_by_k": [float(1 + x) for x in point[:K]],
        "tau_ci": [[float(1 + a), float(1 + b)] for a, b in ci[:K]],
        "alpha": [float(x) for x in point[K:]],
        "alpha_ci": [[float(a), float(b)] for a, b in ci[K:]],
        "accept_rate": [float(c / r) if r > 0 else 0.0 for c, r in zip(chain, reach)],
        "positions": int(alphas.shape[0]),
        "conversations": int(len(np.unique(cluster))),
    }


def _compact(cluster: np.ndarray) -> tuple[np.ndarray, int]:
    uniq, inv = np.unique(cluster, return_inverse=True)
    return inv.reshape(-1), len(uniq)


# --------------------------------------------------------------------------- domains and modes


def row_mode(row: dict) -> str:
    """A conversation's thinking mode as it was rendered: ``chat_template_kwargs.enable_thinking``
    when present, else the recorded ``mode`` (``default`` = the chat template has no thinking
    switch), else ``unknown``."""
    kw = row.get("chat_template_kwargs")
    if isinstance(kw, dict) and "enable_thinking" in kw:
        return "thinking" if kw["enable_thinking"] else "non-thinking"
    mode = row.get("mode")
    if not mode:
        return UNKNOWN
    m = str(mode).lower().replace("_", "-")
    return {"think": "thinking", "on": "thinking", "nothink": "non-thinking", "no-thinking": "non-thinking",
            "off": "non-thinking"}.get(m, m)


def conversation_labels(rows: Iterable[dict]) -> dict[str, dict[str, str]]:
    """row id → {"domain": …, "mode": …} from the conversation rows (generate/scrub output);
    a missing field is ``unknown``."""
    return {str(r["id"]): {"domain": str(r.get("domain") or UNKNOWN), "mode": row_mode(r)} for r in rows if "id" in r}


# --------------------------------------------------------------------------- speed


def expected_speedup(tau_by_k: list[float], draft_cost: float, block: bool = False) -> list[float]:
    """speed(K) / speed(plain decoding) = τ(K) / (1 + K·draft_cost), for K = 1..len(tau_by_k); a block
    draft (DSpark) proposes its K tokens in one pass: τ(K) / (1 + draft_cost)."""
    return [t / (1 + (1 if block else k) * draft_cost) for k, t in enumerate(tau_by_k, start=1)]


def recommend_k(speedups: list[float]) -> int:
    """The K (1-based) with the highest expected speed (the smallest such K on ties)."""
    return int(np.argmax(speedups)) + 1


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device | None = None) -> float:
    """Median wall time of ``fn()``; on a CUDA ``device`` each run waits for its kernels to finish."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_draft_cost(target_model, drafter, window: Window, repeats: int = 5, warmup: int = 1) -> dict:
    """Time one draft step (the MTP layer + its head) against one target forward (all layers + LM
    head) over the same tokens of ``window`` on this machine; median of ``repeats`` after ``warmup``.
    Returns ``{"draft_s", "target_s", "ratio", "tokens"}``. The window is moved to the drafter's device."""
    window = window.to(model_device(drafter, window.hidden))
    ids, hidden, pos = window.input_ids[None], drafter_input(drafter, window)[None], window.positions[None]
    nxt = torch.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]
    target_s = _median_seconds(lambda: target_model(input_ids=ids, position_ids=pos), repeats, warmup, ids.device)
    draft_s = _median_seconds(lambda: drafter.forward_step(0, nxt, hidden, pos), repeats, warmup, ids.device)
    return {"draft_s": draft_s, "target_s": target_s, "ratio": draft_s / target_s, "tokens": int(ids.shape[1])}


@torch.inference_mode()
def measure_block_cost(target_model, draft, embed, head_weight: torch.Tensor, window: Window, repeats: int = 5,
                       warmup: int = 1) -> dict:
    """Time a DSpark draft's pass (blocks tiling ``window``: every B-th position an anchor, so as many
    query tokens as the window has, with its LM head) against one target forward over the same
    tokens; median of ``repeats`` after ``warmup``. ``ratio`` = the cost of one block pass relative to
    one target step at equal tokens. Returns ``{"draft_s", "target_s", "ratio", "tokens"}``. The window
    is moved to the draft's device."""
    from drafter.evaluation.acceptance import _head

    window = window.to(model_device(draft, head_weight))
    ids, pos = window.input_ids[None], window.positions[None]
    T, K = ids.shape[1], draft.cfg.block_size
    anchors = torch.arange(1, T, K, device=ids.device)[None]
    target_s = _median_seconds(lambda: target_model(input_ids=ids, position_ids=pos), repeats, warmup, ids.device)
    draft_s = _median_seconds(lambda: draft(ids, window.features[None], anchors, embed=embed, lm_head=_head(head_weight),
                                            start=window.start), repeats, warmup, ids.device)
    return {"draft_s": draft_s, "target_s": target_s, "ratio": draft_s / target_s, "tokens": int(T)}


# --------------------------------------------------------------------------- the evaluation


def evaluate(held: HeldoutAlphas, labels: Mapping[str, Mapping[str, str]], *, draft_cost: float,
             draft_cost_measured: bool, samples: int = 1000, seed: int = 0, confidence: float = 0.95,
             speed_rule: str = "t0", block: bool = False) -> dict:
    """The ``eval_offline.json`` document: per drafter and rule τ(K), α_k (with intervals), per domain
    and per mode; the paired candidate − baseline difference; expected speed and recommended K.
    ``block``: the drafters are block drafts (DSpark; one pass per step, see :func:`expected_speedup`)."""
    K = held.k_max
    cluster, C = _compact(held.conv)
    counts = resample_counts(max(C, 1), samples, seed)
    conv_labels = [labels.get(rid, {}) for rid in held.conversations]
    groups: dict[str, dict[str, np.ndarray]] = {}
    for field in ("domain", "mode"):
        per = np.array([str(lab.get(field) or UNKNOWN) for lab in conv_labels] or [UNKNOWN])
        groups[field] = {g: np.isin(held.conv, np.flatnonzero(per == g)) for g in sorted(set(per.tolist()))}

    def grouped(alphas: np.ndarray, field: str) -> dict:
        out = {}
        for gi, (g, mask) in enumerate(groups[field].items()):
            if not mask.any():
                continue
            cl, Cg = _compact(held.conv[mask])
            s = rule_summary(alphas[mask], cl, resample_counts(Cg, samples, seed + 1 + gi), confidence)
            out[g] = {k: s[k] for k in ("tau_by_k", "tau_ci", "alpha", "positions", "conversations")}
        return out

    drafters = {}
    for name, per_rule in held.alphas.items():
        drafters[name] = {}
        for rule in RULES:
            a = per_rule[rule]
            s = rule_summary(a, cluster, counts, confidence)
            s["by_domain"] = grouped(a, "domain")
            s["by_mode"] = grouped(a, "mode")
            drafters[name][rule] = s

    difference = {}
    if {"baseline", "candidate"} <= set(held.alphas) and held.positions:
        for rule in RULES:
            vals = _chain_values(held.alphas["candidate"][rule]) - _chain_values(held.alphas["baseline"][rule])
            point, boot = cluster_means(vals, cluster, counts)
            ci = interval(boot, confidence)
            difference[rule] = {"tau_by_k": [float(x) for x in point[:K]],
                                "tau_ci": [[float(a), float(b)] for a, b in ci[:K]]}

    speed = {name: expected_speedup(d[speed_rule]["tau_by_k"], draft_cost, block) for name, d in drafters.items()}
    return {
        "k_max": K,
        "drafting": "block" if block else "chain",
        "draft_cost": draft_cost,
        "draft_cost_measured": draft_cost_measured,
        "confidence": confidence,
        "bootstrap_samples": samples,
        "bootstrap_unit": "conversation",
        "positions": held.positions,
        "conversations": C,
        "drafters": drafters,
        "difference": difference,
        "speed_rule": speed_rule,
        "expected_speedup": speed,
        "recommended_k": {name: recommend_k(s) for name, s in speed.items()},
    }


def _subset(held: HeldoutAlphas, keep: np.ndarray) -> HeldoutAlphas:
    """The positions of ``held`` whose conversation index is in ``keep`` (a boolean mask over conversations)."""
    mask = keep[held.conv] if held.positions else np.zeros(0, dtype=bool)
    return HeldoutAlphas(conversations=held.conversations, conv=held.conv[mask],
                         alphas={d: {r: a[mask] for r, a in per.items()} for d, per in held.alphas.items()},
                         k_max=held.k_max)


def concat_alphas(a: HeldoutAlphas, b: HeldoutAlphas) -> HeldoutAlphas:
    """The positions of ``a`` then those of ``b``, each set's conversations kept apart (a conversation measured in
    both, on two texts, is two bootstrap clusters)."""
    n = len(a.conversations)
    return HeldoutAlphas(conversations=a.conversations + b.conversations, conv=np.concatenate([a.conv, b.conv + n]),
                         alphas={d: {r: np.concatenate([x, b.alphas[d][r]]) for r, x in per.items()}
                                 for d, per in a.alphas.items()},
                         k_max=a.k_max)


def with_t1_text(res: dict, res_t1: dict, rules: tuple[str, ...] = ("t1_greedy", "t1_prob")) -> dict:
    """:func:`evaluate`'s document ``res`` (measured on text answered at T=0) with its T=1 ``rules`` taken from
    ``res_t1`` (the same conversations sampled at T=1 by the served target): per drafter, the paired difference and,
    when the speed rule is one of them, the expected speed and recommended K. ``t1_text`` records the T=1 set."""
    out = dict(res, drafters={d: dict(per) for d, per in res["drafters"].items()}, difference=dict(res["difference"]))
    for d, per in out["drafters"].items():
        for r in rules:
            per[r] = res_t1["drafters"][d][r]
    for r in rules:
        if r in res_t1["difference"]:
            out["difference"][r] = res_t1["difference"][r]
    if res["speed_rule"] in rules:
        out["expected_speedup"], out["recommended_k"] = res_t1["expected_speedup"], res_t1["recommended_k"]
    out["t1_text"] = {"rules": list(rules), "positions": res_t1["positions"],
                      "conversations": res_t1["conversations"],
                      "benchmark_positions": res_t1.get("benchmark_positions", 0)}
    return out


def evaluate_with_benchmarks(held: HeldoutAlphas, labels: Mapping[str, Mapping[str, str]], benchmarks: list[str],
                             **kw) -> dict:
    """:func:`evaluate` of the held-out set, with each benchmark (a domain of ``benchmarks``) measured apart: the
    overall figures, difference and recommended K are the held-out set's alone, and each benchmark is one more
    ``by_domain`` entry (τ(K) with intervals over its own conversations). No benchmark: :func:`evaluate`."""
    if not benchmarks:
        return evaluate(held, labels, **kw)
    dom = np.array([str(labels.get(rid, {}).get("domain") or UNKNOWN) for rid in held.conversations] or [UNKNOWN])
    is_bench = np.isin(dom, benchmarks)
    res = evaluate(_subset(held, ~is_bench), labels, **kw)
    bench = evaluate(_subset(held, is_bench), labels, **kw)
    for name, per_rule in res["drafters"].items():
        for rule, s in per_rule.items():
            s["by_domain"].update(bench["drafters"][name][rule]["by_domain"])
    res["benchmark_positions"] = bench["positions"]
    return res


# --------------------------------------------------------------------------- report and plots


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def render_markdown(res: dict) -> str:
    """The evaluation as markdown tables: τ(K) per rule with intervals, α per position, expected
    speed, per domain and per mode."""
    names = list(res["drafters"])
    K = res["k_max"]
    pct = round(100 * res["confidence"])
    lines = [f"## Offline acceptance (held-out: {res['conversations']} conversations, {res['positions']} positions)", ""]
    if res.get("heldout"):
        lines += [f"Held-out set: {res['heldout']['text']}; never trained on.", ""]
    if res.get("t1_text"):
        lines += ["T=1 rows: the conversations answered by the served target measured on their answers sampled at "
                  f"T=1 ({res['t1_text']['positions']} positions; the built-in split's, if any, on its own text).", ""]
    if (dv := (res.get("draft_vocab") or {}).get("candidate")):
        lines += [f"The fine-tuned drafter is measured over its draft vocabulary of {dv} tokens, as it is served "
                  f"(`train.draft_vocab_size`); the released one over the whole vocabulary.", ""]
    lines += [f"Intervals: {pct}% bootstrap over conversations ({res['bootstrap_samples']} resamples). "
              f"Draft cost: {res['draft_cost']:.4f} of a target forward "
              f"({'measured on this machine' if res['draft_cost_measured'] else 'configured'}).", ""]
    for rule in RULES:
        lines += [f"### τ by K — {RULE_TITLES[rule]}", ""]
        head = ["K"] + [f"τ {n} [{pct}% CI]" for n in names]
        if rule in res.get("difference", {}):
            head.append("candidate − baseline [CI]")
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in range(K):
            row = [str(k + 1)] + [f"{res['drafters'][n][rule]['tau_by_k'][k]:.3f} {_ci(res['drafters'][n][rule]['tau_ci'][k])}"
                                  for n in names]
            if rule in res.get("difference", {}):
                d = res["difference"][rule]
                row.append(f"{d['tau_by_k'][k]:+.3f} {_ci(d['tau_ci'][k])}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += ["### Acceptance per position (α_k, unconditional)", ""]
    head = ["rule", "drafter"] + [f"k={k + 1}" for k in range(K)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule in RULES:
        for n in names:
            lines.append("| " + " | ".join([RULE_TITLES[rule], n] + [f"{a:.3f}" for a in res["drafters"][n][rule]["alpha"]]) + " |")
    per = "1" if res.get("drafting") == "block" else "K"
    lines += ["", f"### Expected speed vs plain decoding (τ(K) / (1 + {per}·{res['draft_cost']:.4f}), {RULE_TITLES[res['speed_rule']]})", ""]
    head = ["drafter"] + [f"K={k + 1}" for k in range(K)] + ["recommended K"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        lines.append("| " + " | ".join([n] + [f"{s:.3f}×" for s in res["expected_speedup"][n]]
                                        + [str(res["recommended_k"][n])]) + " |")
    if res.get("drafting") == "block":
        lines += ["", f"Block drafting: one pass proposes the block's {K} tokens; τ at K < {K} is the prefix of "
                  f"that block (the draft is served with num_speculative_tokens = {K})."]
    for field, title in (("by_domain", "domain"), ("by_mode", "mode")):
        lines += ["", f"### τ by {title} ({RULE_TITLES['t0']} and {RULE_TITLES['t1_greedy']}, K={K})", ""]
        head = [title, "conversations", "positions"] + [f"τ {n} ({r})" for r in ("t0", "t1_greedy") for n in names]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        first = res["drafters"][names[0]]["t0"][field]
        for g, s in first.items():
            cells = [g, str(s["conversations"]), str(s["positions"])]
            cells += [f"{res['drafters'][n][r][field][g]['tau_by_k'][-1]:.3f}" for r in ("t0", "t1_greedy") for n in names]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


COLORS = {"baseline": "tab:gray", "candidate": "tab:blue"}


def plot_tau_vs_k(res: dict, path: Path) -> Path:
    """τ vs K per rule (one panel each), every drafter with its interval band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = np.arange(1, res["k_max"] + 1)
    fig, axes = plt.subplots(1, len(RULES), figsize=(5 * len(RULES), 4), sharey=True)
    for ax, rule in zip(axes, RULES):
        for n, d in res["drafters"].items():
            s = d[rule]
            ci = np.array(s["tau_ci"])
            ax.plot(ks, s["tau_by_k"], marker="o", label=n, color=COLORS.get(n))
            ax.fill_between(ks, ci[:, 0], ci[:, 1], alpha=0.2, color=COLORS.get(n))
        ax.set_title(RULE_TITLES[rule])
        ax.set_xlabel("K (draft tokens per step)")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("τ (mean accepted tokens per step)")
    axes[0].legend()
    fig.suptitle(f"Held-out τ vs K ({round(100 * res['confidence'])}% bootstrap CI over conversations)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_per_position(res: dict, path: Path) -> Path:
    """α_k per draft position per rule, every drafter with its interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = np.arange(1, res["k_max"] + 1)
    names = list(res["drafters"])
    width = 0.8 / max(len(names), 1)
    fig, axes = plt.subplots(1, len(RULES), figsize=(5 * len(RULES), 4), sharey=True)
    for ax, rule in zip(axes, RULES):
        for i, n in enumerate(names):
            s = res["drafters"][n][rule]
            a, ci = np.array(s["alpha"]), np.array(s["alpha_ci"])
            err = np.stack([a - ci[:, 0], ci[:, 1] - a]).clip(min=0)
            ax.bar(ks + (i - (len(names) - 1) / 2) * width, a, width, yerr=err, capsize=2, label=n,
                   color=COLORS.get(n))
        ax.set_title(RULE_TITLES[rule])
        ax.set_xlabel("draft position k")
        ax.set_xticks(ks)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("α_k (acceptance at position k)")
    axes[0].legend()
    fig.suptitle("Held-out acceptance per draft position")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
