"""The A/B's result: ``ab_live.json`` (its name, :data:`AB_LIVE_JSON`, and its model, :class:`AbLiveResult`),
its summary keys (``t<T>/<drafter>/<method>/c<c>``), the means over rounds and the stage's flat metrics (see
:mod:`drafter.evaluation.ab_live`).

Example::

    ab = AbLiveResult.load(stage_dir)           # StageError "ab_live.json: missing key 'summary'"
    s = parse_summary(ab)                       # (T, drafter, method, c) -> SummaryEntry
    t, m = primary(ab)
    s.get((t, "candidate", m, 1), NO_ENTRY).tau
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, ClassVar

from drafter.core.errors import StageError
from drafter.core.results import HeldoutRecord, Part, ResultFile, missing_key
from drafter.evaluation.ab_live.sweep import ScheduleRecord

AB_LIVE_JSON = "ab_live.json"


class SummaryEntry(Part):
    """Means over rounds of one (temperature, drafter, draft sampling method, concurrency)."""

    tau: float | None = None
    tok_s: float | None = None
    latency_p50_s: float | None = None
    accept_rate_per_pos: list[float] = []
    ttft_mean_s: float | None = None  # older outputs: no server timing
    decode_tok_s: float | None = None
    rounds: int | None = None


NO_ENTRY = SummaryEntry()  # what a summary without the entry reads as (every number None)


class Lossless(Part):
    """The T=0 comparison of outputs with and without speculation."""

    prompts: int | None = None
    identical: int | None = None
    ok: bool | None = None
    mismatches: list[dict] = []


class Replay(Part):
    """What was replayed: turns, conversations, domains, ``max_tokens``, notes, the held-out set."""

    turns: int | None = None
    conversations: int | None = None
    domains: list[str] = []
    max_tokens: int | None = None
    notes: list[str] = []
    heldout: HeldoutRecord | None = None  # older outputs: the built-in split, not recorded


class AbLiveResult(ResultFile):
    """``ab_live.json``. Older outputs have one ``temperature`` (no ``temperatures``), summary keys
    ``<drafter>/<method>/c<c>``, no ``compiled`` (then None: not recorded) and no server timing."""

    NAME: ClassVar[str] = AB_LIVE_JSON
    num_speculative_tokens: int
    summary: dict[str, SummaryEntry]
    method: str | None = None
    temperatures: list[float] | None = None
    temperature: float | None = None  # older outputs: their one temperature
    compiled: bool | None = None  # older outputs: not recorded
    baseline_at: str | None = None
    engine_version: str | None = None
    runs: list[dict] = []
    draft_vocab: dict[str, int | None] | None = None
    plan: list[dict] | None = None
    lossless: Lossless | None = None  # null: the check did not run (ab_live.lossless_prompts = 0)
    unsupported: dict[str, str] | None = None
    replay: Replay | None = None
    servers: list[dict] | None = None
    server_args: list[str] | None = None
    hardware: dict | None = None
    seconds: float | None = None
    schedule: ScheduleRecord | None = None  # older outputs: no sweep, the fixed K is the released configuration
    benchmarks: list[dict] = []  # each benchmark's replay set at 1 user (heldout.benchmarks; older outputs: none)


def load_ab_live(stage_dir: str | Path) -> AbLiveResult:
    """The ``ab_live`` stage output's :class:`AbLiveResult`."""
    return AbLiveResult.load(stage_dir)


def save_ab_live(stage_dir: str | Path, result: dict) -> dict:
    """Write ``result`` (the stage's document) as ``stage_dir/ab_live.json``, checked against the model."""
    return AbLiveResult.write(stage_dir, result)


def as_ab_live(ab: Any) -> AbLiveResult:
    """``ab`` (an ab_live.json document or an :class:`AbLiveResult`) typed."""
    if isinstance(ab, AbLiveResult):
        return ab
    if not isinstance(ab, dict) or "summary" not in ab:
        raise missing_key(AB_LIVE_JSON, "summary")
    return AbLiveResult.of(ab)


def temp_tag(temperature: float) -> str:
    """A temperature in result keys and metric names: ``t0``, ``t1``, ``t0.7``."""
    return f"t{temperature:g}"


def run_key(drafter: str, method: str | None, concurrency: int, temperature: float) -> str:
    """Summary key: ``t<T>/<drafter>/<method or none>/c<c>``, e.g. ``t0/candidate/greedy/c1``."""
    return f"{temp_tag(temperature)}/{drafter}/{method or 'none'}/c{concurrency}"


SummaryKey = tuple  # (temperature, drafter, method or "none", concurrency)


def temperatures(ab: AbLiveResult | dict) -> list[float]:
    """The temperatures of an ab_live.json (``temperatures``; an older output's one ``temperature``)."""
    ab = as_ab_live(ab)
    if ab.temperatures:
        return sorted(float(t) for t in ab.temperatures)
    return [float(ab.temperature or 0.0)]


def parse_summary(ab: AbLiveResult | dict) -> dict[SummaryKey, Any]:
    """An ab_live.json's ``summary`` by ``(temperature, drafter, method or "none", concurrency)``: its
    :class:`SummaryEntry` values (a plain document gives its own entry dicts).

    Keys are ``t<T>/<drafter>/<method>/c<c>``; an older output's ``<drafter>/<method>/c<c>`` is read at its
    one temperature. A malformed key raises :class:`StageError` naming it.
    """
    doc = as_ab_live(ab)
    entries = ab["summary"] if isinstance(ab, dict) else doc.summary
    legacy_t = temperatures(doc)[0]
    out: dict[SummaryKey, Any] = {}
    for key, entry in entries.items():
        parts = key.split("/")
        if len(parts) == 3:
            parts = [temp_tag(legacy_t), *parts]
        try:
            if len(parts) != 4 or not parts[0].startswith("t") or not parts[3].startswith("c"):
                raise ValueError
            out[(float(parts[0][1:]), parts[1], parts[2], int(parts[3][1:]))] = entry
        except ValueError:
            raise StageError(f"{AB_LIVE_JSON}: summary key {key!r} is not "
                             "t<temperature>/<drafter>/<method>/c<concurrency>") from None
    return out


def summary_of(ab: AbLiveResult | dict) -> dict[SummaryKey, SummaryEntry]:
    """:func:`parse_summary` with typed entries, whatever ``ab`` is."""
    return parse_summary(as_ab_live(ab))


def matrix(ab: AbLiveResult | dict) -> dict[float, list[str]]:
    """Temperature → the draft sampling methods measured there (in the order they ran), from the summary."""
    out: dict[float, list[str]] = {}
    for t, d, m, _ in parse_summary(ab):
        out.setdefault(t, [])
        if d != "none" and m not in out[t]:
            out[t].append(m)
    return dict(sorted(out.items()))


def primary_of(plan: dict[float, list[str]]) -> tuple[float, str]:
    """``(temperature, method)`` of the primary measurement of a temperature → draft sampling methods plan: the
    lowest temperature, greedy drafts when planned there (else its first method)."""
    t = min(plan)
    methods = plan[t] or ["greedy"]
    return t, "greedy" if "greedy" in methods else methods[0]


def primary(ab: AbLiveResult | dict) -> tuple[float, str]:
    """:func:`primary_of` an A/B result's measured matrix. The gate checks it; the stage's plain metric names
    carry it."""
    return primary_of(matrix(ab) or {temperatures(ab)[0]: []})


def summarize(runs: list[dict]) -> dict:
    """Means over rounds per (temperature, drafter, draft sample method, concurrency), keyed by :func:`run_key`."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(run_key(r["drafter"], r["draft_sample_method"], r["concurrency"], r["temperature"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        drafts = sum(r["num_drafts"] for r in rs)
        k = max((len(r["accepted_per_pos"]) for r in rs), default=0)
        acc = [sum(r["accepted_per_pos"][p] for r in rs if p < len(r["accepted_per_pos"])) for p in range(k)]
        p50s = [r["latency_s"]["p50"] for r in rs if r["latency_s"]["p50"] is not None]
        ttfts = [r["server"]["ttft_mean_s"] for r in rs if (r.get("server") or {}).get("ttft_mean_s") is not None]
        dec = [r["server"]["decode_tok_s"] for r in rs if (r.get("server") or {}).get("decode_tok_s") is not None]
        out[key] = {
            "tau": round(statistics.fmean(taus), 4) if taus else None,
            "tok_s": round(statistics.fmean(r["tok_s"] for r in rs), 3),
            "latency_p50_s": round(statistics.fmean(p50s), 4) if p50s else None,
            "accept_rate_per_pos": [round(a / drafts, 4) for a in acc] if drafts else [],
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "decode_tok_s": round(statistics.fmean(dec), 3) if dec else None,
            "rounds": len(rs),
        }
    return out


def _ratio(x: float | None, ref: float | None, nd: int = 4) -> float | None:
    return round(x / ref, nd) if x and ref else None


def flat_metrics(result: AbLiveResult | dict, concurrency: list[int]) -> dict:
    """The stage's flat metrics.

    The primary measurement (:func:`primary`) keeps the plain names: ``tau_live_<drafter>`` (smallest
    concurrency), ``tok_s_c<c>_<drafter>``, ``speedup_c<c>_<drafter>`` (vs no speculation at the same
    temperature), ``decode_tok_s_c<c1>_<drafter>``, ``decode_speedup_c<c1>_<drafter>``; every other temperature
    and method adds ``_t<T>_<method>`` to the first three (no speculation: ``tok_s_c<c>_none_t<T>``), e.g.
    ``speedup_c1_candidate_t1_probabilistic``.
    """
    ab = as_ab_live(result)
    s = summary_of(ab)
    t0, m0 = primary(ab)
    c1 = min(concurrency)
    out: dict = {}

    def e(t: float, d: str, m: str, c: int) -> SummaryEntry:
        return s.get((t, d, m, c), NO_ENTRY)

    def speeds(field: str, t: float, m: str, c: int, prefix: str, sfx: str) -> None:
        ref = getattr(e(t, "none", "none", c), field)
        for d in ("baseline", "candidate"):
            x = getattr(e(t, d, m, c), field)
            out[f"{prefix}tok_s_c{c}_{d}{sfx}"] = x
            out[f"{prefix}speedup_c{c}_{d}{sfx}"] = _ratio(x, ref)

    combos = [(t0, m0)] + [(t, m) for t, ms in matrix(ab).items() for m in ms if (t, m) != (t0, m0)]
    for i, (t, m) in enumerate(combos):
        sfx = "" if i == 0 else f"_{temp_tag(t)}_{m}"
        for d in ("baseline", "candidate"):
            out[f"tau_live_{d}{sfx}"] = e(t, d, m, c1).tau
        for c in concurrency:
            if all(t != tt for tt, _ in combos[:i]):  # no speculation: once per temperature
                none_sfx = "" if t == t0 else f"_{temp_tag(t)}"
                out[f"tok_s_c{c}_none{none_sfx}"] = e(t, "none", "none", c).tok_s
            speeds("tok_s", t, m, c, "", sfx)
    out[f"decode_tok_s_c{c1}_none"] = e(t0, "none", "none", c1).decode_tok_s
    speeds("decode_tok_s", t0, m0, c1, "decode_", "")  # server side, prefill excluded
    if ab.schedule is not None:
        from drafter.evaluation.ab_live.sweep import released_configuration
        rel = released_configuration(ab)
        for c, sp in rel.speeds.items():
            out[f"tok_s_c{c}_released"] = sp.tok_s
            out[f"speedup_c{c}_released"] = _ratio(sp.tok_s, sp.no_spec)
        out["schedule_served"] = ab.schedule.served
        out["released_kind"] = rel.kind
        out["released_k"] = rel.k
        out["serve_limit"] = rel.limit
        out["speculation_pays_up_to"] = rel.pays_up_to
    for b in ab.benchmarks:  # each benchmark's own replay set at 1 user
        if b["drafter"] != "none":
            out[f"tau_live_{b['drafter']}_{b['benchmark']}"] = b.get("tau")
    out["lossless_ok"] = ab.lossless.ok if ab.lossless else None
    out["lossless_identical"] = ab.lossless.identical if ab.lossless else None
    out["temperature"] = t0
    out["draft_sample_method"] = m0
    out["temperatures"] = temperatures(ab)
    out["compiled"] = ab.compiled
    out["num_speculative_tokens"] = ab.num_speculative_tokens
    out["engine_version"] = ab.engine_version
    return out
