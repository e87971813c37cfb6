"""The A/B's concurrency × K sweep and the schedule served from it (see :mod:`drafter.evaluation.schedule` for the
derivation and :mod:`drafter.evaluation.ab_live` for the rounds).

At the gate's temperature (greedy drafts) the fine-tuned drafter is measured at every K of ``ab_live.ks()`` and
every concurrency, beside no speculation. Its servers are named ``candidate`` at the served K (the gate's and the
card's fixed-K numbers, as before the sweep) and ``candidate-k<K>`` at the other Ks. From their tok/s per round the
schedule is derived (:func:`schedule_record`); one more server, ``schedule``, serves it and is measured at every
concurrency. What the release serves — the *released configuration* (:func:`released_configuration`) — is that
schedule, or the fixed K that was faster than it beyond its tolerance (each served with the drafter up to the users
where it pays, without it above): its measured speed (:func:`released_speeds`) is what the gate checks against no
speculation at each concurrency and what the card shows.

Example::

    sweep = sweep_of(ab_doc["runs"], temperature=0.0, method="greedy", served_k=2)
    rec = schedule_record(sweep, 0.02, {"method": "mtp"}, temperature=0.0, method="greedy")
    rec["speculative_config"]   # {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": …}
    released_speeds(AbLiveResult.of(ab_doc))[8]   # Speed(tok_s=…, no_spec=…, k=0, source="schedule (served)")
    released_configuration(AbLiveResult.of(ab_doc)).kind   # "schedule", or "fixed" (with .k and .limit)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import exp, log
from statistics import fmean
from typing import TYPE_CHECKING, Any

from drafter.core.results import Part
from drafter.evaluation.schedule import MAX_BATCH, beats, derive_schedule

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


def _schedule_speeds(ab: "AbLiveResult", conc: list[int]) -> dict[int, Speed]:
    """The schedule's speed at each concurrency of ``conc``: as served, up to the largest concurrency where the sweep
    found that speculation pays (``pays_up_to``), and above it wherever the served schedule is within the schedule's
    tolerance of no speculation; elsewhere no speculation's (vLLM 0.32 runs the drafter's first pass on every token
    even where the schedule turns speculation off, to keep its cache in sync, so a K = 0 range is not free). Not
    served (refused, or speculation pays nowhere): the sweep's mean for the scheduled K (no speculation's where
    K = 0)."""
    from drafter.evaluation.ab_live.results import NO_ENTRY, summary_of

    s, sched, out = summary_of(ab), ab.schedule, {}
    for c in conc:
        none = s.get((sched.temperature, "none", "none", c), NO_ENTRY).tok_s
        choice = next((ch for ch in sched.choices if ch.concurrency == c), None)
        k = choice.k if choice else None
        if sched.served:
            served = s.get((sched.temperature, SCHEDULE, sched.method, c), NO_ENTRY).tok_s
            if c <= sched.pays_up_to or (served and none and served >= none * (1 - sched.tolerance)):
                out[c] = Speed(c, served, none, k, "schedule (served)")
            else:
                ratio = f"{served / none:.2f}×" if served and none else "not measured"
                out[c] = Speed(c, none, none, 0, f"no speculation: the drafter is not loaded above "
                               f"{_users(sched.pays_up_to)}; the served schedule, with speculation off here, was "
                               f"{ratio} no speculation")
        elif choice is not None:
            by_k = sched.sweep.get(c, {})
            tok = fmean(by_k[k]) if by_k.get(k) else None
            why = "speculation pays nowhere" if sched.speculative_config is None else "not served"
            out[c] = Speed(c, tok, none, k, f"schedule ({why}: K={k}'s fixed-K measurement)")
    return out


def _fixed_speeds(ab: "AbLiveResult", conc: list[int], k: int) -> tuple[dict[int, Speed], int]:
    """Fixed K served up to the largest concurrency where K beats no speculation beyond noise at it and at every
    smaller measured one (the schedule's rule, :func:`drafter.evaluation.schedule.beats`), without the drafter above;
    and that limit (0: K pays nowhere)."""
    from drafter.evaluation.ab_live.results import NO_ENTRY, summary_of

    s, sched = summary_of(ab), ab.schedule
    limit = 0
    for c in conc:
        by_k = sched.sweep.get(c, {})
        if not (by_k.get(k) and by_k.get(0) and beats(by_k[k], by_k[0], sched.tolerance)):
            break
        limit = c
    out = {}
    for c in conc:
        none = s.get((sched.temperature, "none", "none", c), NO_ENTRY).tok_s
        tok = s.get((sched.temperature, sweep_name(k, ab.num_speculative_tokens), sched.method, c), NO_ENTRY).tok_s
        if c <= limit:
            out[c] = Speed(c, tok, none, k, f"fixed K={k}")
        else:
            ratio = f"{tok / none:.2f}×" if tok and none else "not measured"
            out[c] = Speed(c, none, none, 0, f"no speculation: the drafter is not loaded above {_users(limit)}; "
                           f"fixed K={k} was {ratio} no speculation here")
    return out, limit


def _users(c: int) -> str:
    return f"{c} user{'s' if c != 1 else ''}"


def _score(speeds: dict[int, Speed]) -> float:
    """The geometric mean of the speedups over no speculation (0 when one is not measured)."""
    ups = [sp.speedup for sp in speeds.values()]
    return 0.0 if not ups or any(u is None for u in ups) else exp(fmean(log(u) for u in ups))


@dataclass(frozen=True)
class Released:
    """The released configuration: ``kind`` ``schedule`` (the batch-size schedule), ``fixed`` (fixed ``k``),
    ``off`` (speculation pays nowhere: serve without it) or ``fixed (no sweep)`` (an A/B before the sweep); served
    with the drafter up to ``limit`` users and without it above (None: at every measured concurrency); its speed
    at each measured concurrency and why it was chosen."""

    kind: str
    k: int | None
    limit: int | None
    speeds: dict[int, Speed]
    why: str
    pays_up_to: int = 0

    def ranges(self, schedule: "ScheduleRecord | None" = None) -> list[list[int]] | None:
        """The K served per batch size, as vLLM's ``[from, to, K]`` ranges (the schedule's own for a schedule;
        fixed K up to the limit, 0 above); None for an A/B without a sweep."""
        if self.kind == "schedule" and schedule is not None:
            return [list(r) for r in schedule.ranges]
        if self.kind == "off":
            return [[1, MAX_BATCH, 0]]
        if self.kind == "fixed":
            top = self.limit or MAX_BATCH
            return [[1, top, self.k]] + ([[top + 1, MAX_BATCH, 0]] if top < MAX_BATCH else [])
        return None

    def speculative_config(self, schedule: "ScheduleRecord | None") -> dict | None:
        """The ``--speculative-config`` (without the drafter's ``model`` for a drafter served on its own, the A/B's
        folder): the schedule's, or its method and ``model`` with the fixed K; None: serve without speculation."""
        if self.kind == "off" or schedule is None or schedule.speculative_config is None:
            return None
        if self.kind == "schedule":
            return schedule.speculative_config
        base = {k: v for k, v in schedule.speculative_config.items() if k != "num_speculative_tokens_per_batch_size"}
        return {**base, "num_speculative_tokens": self.k}


def released_configuration(ab: "AbLiveResult") -> Released:
    """What the release serves (gate's temperature), of the served schedule and each fixed K of the sweep (served up
    to the users where it beats no speculation, :func:`_fixed_speeds`): the fastest by the geometric mean of the
    speedups over no speculation at the measured concurrencies — the schedule unless a fixed K is faster beyond the
    schedule's tolerance (vLLM compiles a server whose K changes with the batch less fully, so a served schedule
    can run below the fixed K it schedules); among fixed Ks, the smaller within tolerance. An A/B without a sweep:
    the fine-tuned drafter at its fixed K."""
    from drafter.evaluation.ab_live.results import NO_ENTRY, primary, summary_of

    s = summary_of(ab)
    t0, m0 = primary(ab)
    conc = sorted({c for t, d, m, c in s if t == t0 and d == "none"})
    sched = ab.schedule
    if sched is None:
        k = ab.num_speculative_tokens
        speeds = {c: Speed(c, s.get((t0, "candidate", m0, c), NO_ENTRY).tok_s,
                           s.get((t0, "none", "none", c), NO_ENTRY).tok_s, None, f"fixed K={k}") for c in conc}
        return Released("fixed (no sweep)", k, None, speeds, "the A/B predates the concurrency sweep: the fixed K")
    sspeeds = _schedule_speeds(ab, conc)
    if sched.speculative_config is None:
        return Released("off", None, None, sspeeds, "no K beats no speculation at any measured concurrency")
    slimit = sched.pays_up_to if any(sp.source.startswith("no speculation") for sp in sspeeds.values()) else None
    sched_rel = Released("schedule", None, slimit if sched.served else None, sspeeds, "", sched.pays_up_to)
    fixed = []
    for k in sched.ks:
        speeds, limit = _fixed_speeds(ab, conc, k)
        if limit:
            fixed.append(Released("fixed", k, limit if limit < max(conc) else None, speeds, "", limit))
    best = max(fixed, key=lambda r: (_score(r.speeds), -r.k), default=None)
    if best is not None:  # the smallest K within tolerance of the fastest fixed K
        best = next(r for r in fixed if _score(r.speeds) >= _score(best.speeds) * (1 - sched.tolerance))
    ss = _score(sspeeds)
    how = "served" if sched.served else "derived from the fixed-K servers"
    if best is None or _score(best.speeds) <= ss * (1 + sched.tolerance):
        why = (f"the schedule ({how}): {ss:.2f}× no speculation (geometric mean over {', '.join(map(str, conc))} "
               f"users)" + (f"; the best fixed K={best.k} {_score(best.speeds):.2f}×" if best else ""))
        return Released("schedule", None, sched_rel.limit, sspeeds, why, sched.pays_up_to)
    why = (f"fixed K={best.k}" + (f" up to {_users(best.limit)}" if best.limit else "") + f": "
           f"{_score(best.speeds):.2f}× no speculation (geometric mean over {', '.join(map(str, conc))} users), "
           f"faster than the schedule ({how}) at {ss:.2f}× beyond its {sched.tolerance:.0%} tolerance")
    return Released("fixed", best.k, best.limit, best.speeds, why, best.pays_up_to)


def released_record(ab: "AbLiveResult") -> dict:
    """The released configuration as the gate's and ``release.json``'s ``released``: kind, fixed K, serve limit,
    where speculation pays, why, the K per batch size (``ranges``) and the ``--speculative-config`` (the A/B's
    drafter folder as ``model`` where the drafter is served on its own)."""
    r = released_configuration(ab)
    return {"kind": r.kind, "k": r.k, "serve_limit": r.limit, "pays_up_to": r.pays_up_to, "why": r.why,
            "ranges": r.ranges(ab.schedule), "speculative_config": r.speculative_config(ab.schedule)}


def limit_sentence(ab: "AbLiveResult") -> str:
    """Why the release serves without the drafter above its serve limit (empty without one)."""
    r = released_configuration(ab)
    if not r.limit:
        return ""
    why = ("a server with it loaded was slower than no speculation there even where the schedule turns speculation "
           "off (vLLM runs the drafter's first pass on every token to keep its cache in sync)" if r.kind == "schedule"
           else f"fixed K={r.k} did not beat no speculation beyond noise there")
    return f"Above {_users(r.limit)} serve the target without the drafter: {why}."


def released_speeds(ab: "AbLiveResult") -> dict[int, Speed]:
    """The released configuration's speed at each measured concurrency (gate's temperature,
    :func:`released_configuration`)."""
    return released_configuration(ab).speeds


def serve_limit(ab: "AbLiveResult") -> int | None:
    """The most concurrent users a server with the drafter is released for (:func:`released_configuration`); None
    when the released configuration serves it at every measured concurrency."""
    return released_configuration(ab).limit


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
