"""The A/B's concurrency × K sweep and the schedule served from it (see :mod:`drafter.evaluation.schedule` for the
derivation and :mod:`drafter.evaluation.ab_live` for the rounds).

At the gate's temperature (greedy drafts) the fine-tuned drafter is measured at every K of ``ab_live.ks()`` and
every concurrency, beside no speculation. Its servers are named ``candidate`` at the served K (the gate's and the
card's fixed-K numbers, as before the sweep) and ``candidate-k<K>`` at the other Ks. From their tok/s per round the
schedule is derived (:func:`schedule_record`); one more server, ``schedule``, serves it and is measured at every
concurrency. What the release serves — the *released configuration* — is that schedule: its measured speed
(:func:`released_speeds`) is what the gate checks against no speculation at each concurrency and what the card
shows.

Example::

    sweep = sweep_of(ab_doc["runs"], temperature=0.0, method="greedy", served_k=2)
    rec = schedule_record(sweep, 0.02, {"method": "mtp"}, temperature=0.0, method="greedy")
    rec["speculative_config"]   # {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": …}
    released_speeds(AbLiveResult.of(ab_doc))[8]   # Speed(tok_s=…, no_spec=…, k=0, source="schedule (served)")
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any

from drafter.core.results import Part
from drafter.evaluation.schedule import derive_schedule

if TYPE_CHECKING:
    from drafter.evaluation.ab_live.results import AbLiveResult

SCHEDULE = "schedule"  # the drafter name of the server that serves the schedule
_SWEEP = re.compile(r"^candidate-k(\d+)$")


def sweep_name(k: int, served_k: int) -> str:
    """The drafter name of the fine-tuned drafter's server at ``k``: ``candidate`` at the served K,
    ``candidate-k<k>`` at the others."""
    return "candidate" if k == served_k else f"candidate-k{k}"


def sweep_k(drafter: str, served_k: int) -> int | None:
    """The K of a fine-tuned drafter's server name (:func:`sweep_name`); None for any other drafter."""
    if drafter == "candidate":
        return served_k
    m = _SWEEP.match(drafter)
    return int(m.group(1)) if m else None


def served_drafter(drafter: str) -> str:
    """Which weights a server of ``drafter`` serves: ``candidate-k<K>`` and ``schedule`` serve the fine-tuned one."""
    return "candidate" if drafter == SCHEDULE or _SWEEP.match(drafter) else drafter


def drafter_order(drafter: str) -> tuple[int, int]:
    """Table order: no speculation, the released drafter, the fine-tuned one by K, the schedule."""
    m = _SWEEP.match(drafter)
    if m:
        return 2, int(m.group(1))
    return {"none": (0, 0), "baseline": (1, 0), "candidate": (2, 0), SCHEDULE: (3, 0)}.get(drafter, (4, 0))


def sweep_of(runs: list[dict], temperature: float, method: str, served_k: int) -> dict[int, dict[int, list[float]]]:
    """The sweep of an A/B's runs: concurrency → K (0: no speculation) → tok/s of each round, at ``temperature``
    with ``method`` drafts."""
    out: dict[int, dict[int, list[float]]] = {}
    for r in sorted(runs, key=lambda r: r.get("round", 0)):
        if r["temperature"] != temperature or r.get("tok_s") is None:
            continue
        d = r["drafter"]
        k = 0 if d == "none" else (sweep_k(d, served_k) if r.get("draft_sample_method") == method else None)
        if k is None:
            continue
        out.setdefault(int(r["concurrency"]), {}).setdefault(k, []).append(float(r["tok_s"]))
    return dict(sorted(out.items()))


class ScheduleChoice(Part):
    concurrency: int
    k: int
    tok_s: float | None = None
    no_spec_tok_s: float | None = None
    why: str = ""


class ScheduleRecord(Part):
    """``ab_live.json``'s ``schedule``: the sweep, the choice per measured concurrency, the ranges vLLM serves, the
    ``--speculative-config`` (None: speculation pays nowhere, serve without it) and whether the schedule server ran
    (``served``; ``refusal``: the engine's reason when it did not)."""

    temperature: float
    method: str
    tolerance: float
    ks: list[int]
    sweep: dict[int, dict[int, list[float]]]
    choices: list[ScheduleChoice]
    ranges: list[list[int]]
    speculative_config: dict | None = None
    pays_up_to: int = 0
    served: bool = False
    refusal: str | None = None


def schedule_record(sweep: dict[int, dict[int, list[float]]], tolerance: float, base_spec: dict, *,
                    temperature: float, method: str) -> dict:
    """The ``schedule`` document of a sweep (``served`` False until the schedule server ran)."""
    s = derive_schedule(sweep, tolerance)
    return {"temperature": temperature, "method": method, "tolerance": tolerance,
            "ks": sorted({k for by_k in sweep.values() for k in by_k if k > 0}),
            "sweep": {c: {k: v for k, v in sorted(by_k.items())} for c, by_k in sweep.items()},
            "choices": [{"concurrency": c.concurrency, "k": c.k, "tok_s": round(c.tok_s, 3),
                         "no_spec_tok_s": round(c.no_spec_tok_s, 3), "why": c.why} for c in s.choices],
            "ranges": [list(r) for r in s.ranges], "speculative_config": s.speculative_config(base_spec),
            "pays_up_to": s.pays_up_to, "served": False, "refusal": None}


@dataclass(frozen=True)
class Speed:
    """The released configuration's tok/s at one concurrency, no speculation's, the K served there (None: a
    fixed-K release) and where the number comes from."""

    concurrency: int
    tok_s: float | None
    no_spec: float | None
    k: int | None
    source: str

    @property
    def speedup(self) -> float | None:
        return self.tok_s / self.no_spec if self.tok_s and self.no_spec else None


def released_speeds(ab: "AbLiveResult") -> dict[int, Speed]:
    """The released configuration's speed at each measured concurrency (gate's temperature).

    With a served schedule: the schedule server's tok/s up to the largest concurrency where the sweep found that
    speculation pays (``pays_up_to``), and above it wherever the served schedule is within the schedule's tolerance
    of no speculation; elsewhere no speculation's — the release says to serve without the drafter above
    :func:`serve_limit` users (vLLM 0.32 runs the drafter's first pass on every token even where the schedule turns
    speculation off, to keep its cache in sync, so a K = 0 range is not free). A schedule that was not served (refused,
    or speculation pays nowhere): the sweep's mean for the scheduled K (no speculation's where K = 0). An older
    ``ab_live.json`` without a schedule: the fine-tuned drafter at its fixed K."""
    from drafter.evaluation.ab_live.results import NO_ENTRY, primary, summary_of

    s = summary_of(ab)
    t0, m0 = primary(ab)
    conc = sorted({c for t, d, m, c in s if t == t0 and d == "none"})
    sched = ab.schedule
    out: dict[int, Speed] = {}
    for c in conc:
        none = s.get((t0, "none", "none", c), NO_ENTRY).tok_s
        if sched is None:
            out[c] = Speed(c, s.get((t0, "candidate", m0, c), NO_ENTRY).tok_s, none, None,
                           f"fixed K={ab.num_speculative_tokens}")
            continue
        choice = next((ch for ch in sched.choices if ch.concurrency == c), None)
        k = choice.k if choice else None
        if sched.served:
            served = s.get((t0, SCHEDULE, sched.method, c), NO_ENTRY).tok_s
            if c <= sched.pays_up_to or (served and none and served >= none * (1 - sched.tolerance)):
                out[c] = Speed(c, served, none, k, "schedule (served)")
            else:
                ratio = f"{served / none:.2f}×" if served and none else "not measured"
                out[c] = Speed(c, none, none, 0, f"no speculation: the drafter is not loaded above "
                               f"{sched.pays_up_to} user{'s' if sched.pays_up_to != 1 else ''}; the served schedule, "
                               f"with speculation off here, was {ratio} no speculation")
        elif choice is not None:
            by_k = sched.sweep.get(c, {})
            tok = fmean(by_k[k]) if by_k.get(k) else None
            why = "speculation pays nowhere" if sched.speculative_config is None else "not served"
            out[c] = Speed(c, tok, none, k, f"schedule ({why}: K={k}'s fixed-K measurement)")
    return out


def serve_limit(ab: "AbLiveResult") -> int | None:
    """The most concurrent users a server with the drafter (serving the schedule) is released for: None when the
    served schedule is the released configuration at every measured concurrency (or there is no served schedule);
    else ``pays_up_to`` — above it the release is served without the drafter (:func:`released_speeds`)."""
    speeds = released_speeds(ab)
    if ab.schedule is None or not ab.schedule.served:
        return None
    return ab.schedule.pays_up_to if any(sp.source.startswith("no speculation") for sp in speeds.values()) else None


def best_fixed(ab: "AbLiveResult", c: int) -> tuple[int, float] | None:
    """The fastest fixed choice at concurrency ``c`` (K, mean tok/s; K = 0: no speculation) of the sweep."""
    if ab.schedule is None:
        return None
    by_k = ab.schedule.sweep.get(c) or {}
    means = {k: fmean(v) for k, v in by_k.items() if v}
    return max(means.items(), key=lambda kv: kv[1]) if means else None


def schedule_json(spec: dict[str, Any] | None) -> str | None:
    """The ``--speculative-config`` argument of a schedule, compact (what the card's usage line carries)."""
    import json

    return None if spec is None else json.dumps(spec, separators=(", ", ": "))
