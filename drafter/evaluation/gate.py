"""The release gate: the candidate (fine-tuned) drafter is released only if, live in vLLM, it is not
worse than the baseline (released) drafter beyond the configured tolerances, its live τ is close
enough to the offline prediction, and speculation stayed lossless.

Checks (each with its numbers, see :class:`Check`):

* ``lossless`` — the A/B's T=0 outputs with and without speculation were identical (on ≥ 1 prompt);
* ``tau/<method>/c<c>`` — candidate live τ ≥ baseline live τ · (1 − ``tau_tolerance``);
* ``tok_s/<method>/c<c>`` — candidate tok/s ≥ baseline tok/s · (1 − ``tok_s_tolerance``);
* ``live_vs_offline/<method>/c<c>`` — candidate live τ / offline τ ≥ ``min_live_offline_ratio``, the
  offline τ taken at the live K under the matching rule (T=0 → ``t0``; T>0 → ``t1_greedy`` for greedy
  drafts, ``t1_prob`` for probabilistic ones);
* ``no_spec/c<c>`` — at every measured concurrency, the released configuration
  (:func:`~drafter.evaluation.ab_live.sweep.released_configuration`: the schedule derived from the A/B's sweep, as
  served, or the fixed K that was faster than it beyond its tolerance; each up to the users where speculation
  pays, and no speculation above them where a server with the drafter was slower; an A/B without a sweep: the fixed
  K) is not slower than no speculation: tok/s ≥ no speculation's · (1 − ``tok_s_tolerance``);
* ``schedule/c<c>`` — where the served schedule is the released configuration, its tok/s is within
  ``tok_s_tolerance`` of the best fixed choice the sweep measured there (no speculation or one K). Where a fixed K is
  released instead, the report says why (``released``), with both speeds.

The τ, tok/s and live-vs-offline checks run at the A/B's lowest temperature (every draft sampling method
measured there: at T=0 greedy only). The other temperatures and methods are listed in the gate document
(``live_matrix``, a table in the report) for information: they do not change the verdict.

Verdict: ``pass`` (every check passed), ``forced`` (some failed, ``force`` set: recorded in the card),
``refused`` (some failed): the stage raises :class:`GateRefused` with the report, stopping the flow
before anything is published.

The document is ``gate.json`` (:data:`GATE_JSON`), read through :class:`GateResult`.

Example::

    res = gate_decision(AbLiveResult.load(ab_dir), OfflineResult.load(ev_dir), cfg.gate)
    res["verdict"], [c["name"] for c in res["checks"] if not c["passed"]]
    GateResult.load(gate_dir).verdict
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from drafter.core.config import GateConfig
from drafter.core.errors import StageError
from drafter.evaluation.ab_live import (AB_LIVE_JSON, NO_ENTRY, AbLiveResult, as_ab_live, compile_mode,
                                        matrix_markdown, matrix_rows, primary, run_key, summary_of, temperatures)
from drafter.evaluation.ab_live.sweep import best_fixed, released_record, released_speeds
from drafter.evaluation.offline_result import OfflineResult
from drafter.core.results import Part, ResultFile, missing_key

GATE_JSON = "gate.json"


class GateRefused(StageError):
    """The release gate refused the candidate; the message is the gate's report (why).
    Permanent: the same measurements give the same verdict, so it is never retried."""

    permanent = True

    def __init__(self, report: str, result: dict | None = None):
        super().__init__(report)
        self.result = result  # the gate.json document (verdict, failed checks with their numbers)

    def __reduce__(self):  # keeps ``result`` across pickling (Prefect's task results)
        return (type(self), (str(self), self.result))


@dataclass
class Check:
    name: str
    passed: bool
    value: float | None  # the candidate's number (or the ratio, for live_vs_offline)
    reference: float | None  # what it is compared with (baseline number, offline τ)
    threshold: float | None  # the value must be ≥ this
    detail: str


class CheckRecord(Part):
    """A :class:`Check` as ``gate.json`` records it."""

    name: str
    passed: bool
    value: float | None = None
    reference: float | None = None
    threshold: float | None = None
    detail: str = ""


class GateResult(ResultFile):
    """``gate.json``: :func:`gate_decision`'s (or :func:`gate_without_live`'s) document."""

    NAME: ClassVar[str] = GATE_JSON
    verdict: str  # pass, forced, refused
    forced: bool = False
    force: bool | None = None
    failed: list[str] = []
    checks: list[CheckRecord] = []
    tolerances: dict = {}
    num_speculative_tokens: int | None = None
    temperature: float | None = None  # of the live checks; None without a live A/B
    temperatures: list[float] = []
    compiled: bool | None = None
    unsupported: dict[str, str] = {}
    key_numbers: dict[str, float | None] = {}
    live_matrix: list[dict] = []
    schedule: dict | None = None  # ab_live.json's schedule (older outputs and a gate without live numbers: none)
    released: dict | None = None  # what the release serves (sweep.released_record; older outputs: none)


def load_gate(stage_dir: str | Path) -> GateResult:
    """The ``gate`` output's :class:`GateResult`."""
    return GateResult.load(stage_dir)


def save_gate(stage_dir: str | Path, res: dict) -> dict:
    """Write ``res`` as ``stage_dir/gate.json``, checked against :class:`GateResult`."""
    return GateResult.write(stage_dir, res)


def offline_rule(temperature: float, draft_sample_method: str | None) -> str:
    """The offline acceptance rule that predicts a live measurement."""
    if temperature == 0:
        return "t0"
    return "t1_prob" if draft_sample_method == "probabilistic" else "t1_greedy"


def _fmt(v: float | None, nd: int = 3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def _lossless_check(ab: AbLiveResult) -> Check:
    ab.require("lossless")
    ll = ab.lossless  # null: the check was not run (no prompts)
    prompts, identical = (ll.prompts or 0, ll.identical or 0) if ll else (0, 0)
    ok, mism = (bool(ll.ok), ll.mismatches) if ll else (False, [])
    detail = f"{identical}/{prompts} prompts identical at T=0 with and without speculation"
    if mism:
        detail += "; first mismatches: " + ", ".join(f"prompt {m.get('prompt')} at token {m.get('first_diff_token')}"
                                                     for m in mism[:5])
    if prompts == 0:
        detail = "the lossless check ran on no prompts (ab_live.lossless_prompts = 0)"
    return Check("lossless", ok and prompts > 0, float(identical), float(prompts), float(prompts), detail)


def _tau_check(tag: str, ct: float | None, bt: float | None, cfg: GateConfig) -> Check:
    if ct is None or bt is None:
        return Check(f"tau/{tag}", False, ct, bt, None, f"live τ not measured (candidate {_fmt(ct)}, baseline {_fmt(bt)})")
    thr = bt * (1 - cfg.tau_tolerance)
    return Check(f"tau/{tag}", ct >= thr, ct, bt, thr, f"candidate live τ {ct:.3f} vs baseline {bt:.3f} (must be ≥ "
                 f"{thr:.3f}, tolerance {cfg.tau_tolerance:.0%})")


def _tok_s_check(tag: str, c: int, cs: float | None, bs: float | None, cfg: GateConfig) -> Check:
    if cs is None:
        raise missing_key(AB_LIVE_JSON, "tok_s", f"summary candidate/{tag}")
    if bs is None:
        raise missing_key(AB_LIVE_JSON, "tok_s", f"summary baseline/{tag}")
    thr = bs * (1 - cfg.tok_s_tolerance)
    return Check(f"tok_s/{tag}", cs >= thr, cs, bs, thr, f"candidate {cs:.1f} tok/s vs baseline {bs:.1f} (must be ≥ "
                 f"{thr:.1f}, tolerance {cfg.tok_s_tolerance:.0%}) at {c} concurrent user{'s' if c > 1 else ''}")


def _live_vs_offline_check(tag: str, ct: float | None, by_k: list[float], k: int, rule: str, cfg: GateConfig) -> Check:
    name, ratio_min = f"live_vs_offline/{tag}", cfg.min_live_offline_ratio
    if k > len(by_k):
        return Check(name, False, None, None, ratio_min, f"no offline prediction at K={k}: eval_offline measured "
                     f"K ≤ {len(by_k)} (raise eval_offline.k_max to ≥ {k})")
    off = by_k[k - 1]
    if ct is None:
        return Check(name, False, None, off, ratio_min, "live τ not measured")
    ratio = ct / off
    return Check(name, ratio >= ratio_min, ratio, off, ratio_min, f"live τ {ct:.3f} / offline τ {off:.3f} ({rule}, "
                 f"K={k}) = {ratio:.3f} (must be ≥ {ratio_min:.2f})")


def _users(c: int) -> str:
    return f"{c} concurrent user{'s' if c > 1 else ''}"


def speed_checks(ab: AbLiveResult, cfg: GateConfig) -> list[Check]:
    """``no_spec/c<c>`` at every measured concurrency and, where the schedule was served, ``schedule/c<c>``."""
    out = []
    tol = cfg.tok_s_tolerance
    for c, sp in released_speeds(ab).items():
        if sp.no_spec is None:
            raise missing_key(AB_LIVE_JSON, "tok_s", f"summary none/c{c}")
        thr = sp.no_spec * (1 - tol)
        what = f"the released configuration ({sp.source}{'' if sp.k is None else f', K={sp.k} here'})"
        if sp.tok_s is None:
            out.append(Check(f"no_spec/c{c}", False, None, sp.no_spec, thr, f"{what} not measured at {_users(c)}"))
        else:
            out.append(Check(f"no_spec/c{c}", sp.tok_s >= thr, sp.tok_s, sp.no_spec, thr,
                             f"{what}: {sp.tok_s:.1f} tok/s vs no speculation {sp.no_spec:.1f} ({sp.speedup:.2f}×; must "
                             f"be ≥ {thr:.1f}, tolerance {tol:.0%}) at {_users(c)}"))
        best = best_fixed(ab, c)
        if sp.source == "schedule (served)" and best is not None and sp.tok_s is not None:
            k, tok = best
            bthr = tok * (1 - tol)
            name = "no speculation" if k == 0 else f"K={k}"
            out.append(Check(f"schedule/c{c}", sp.tok_s >= bthr, sp.tok_s, tok, bthr,
                             f"the served schedule {sp.tok_s:.1f} tok/s vs the best fixed choice ({name}) {tok:.1f} "
                             f"(must be ≥ {bthr:.1f}, tolerance {tol:.0%}) at {_users(c)}"))
    return out


def gate_checks(ab: AbLiveResult | dict, ev: OfflineResult | dict, cfg: GateConfig) -> list[Check]:
    """Every check of the gate from ``ab_live.json`` and ``eval_offline.json`` (their models: :class:`AbLiveResult`,
    :class:`OfflineResult`)."""
    ab = as_ab_live(ab)
    checks = [_lossless_check(ab)]
    summary = summary_of(ab)
    k = int(ab.num_speculative_tokens)
    temperature = temperatures(ab)[0]
    cands = sorted((m, c) for t, d, m, c in summary if d == "candidate" and t == temperature)
    if not cands:
        raise StageError(f"{AB_LIVE_JSON}: summary has no candidate entry at temperature {temperature:g} "
                         f"({run_key('candidate', '<method>', '<c>', temperature)}); entries: {sorted(ab.summary)}")
    offline = OfflineResult.of(ev).drafter("candidate")
    for method, c in cands:
        cand = summary[(temperature, "candidate", method, c)]
        base = summary.get((temperature, "baseline", method, c))
        if base is None:
            raise StageError(f"{AB_LIVE_JSON}: summary has {run_key('candidate', method, c, temperature)} but no "
                             f"{run_key('baseline', method, c, temperature)}")
        tag = f"{method}/c{c}"
        checks.append(_tau_check(tag, cand.tau, base.tau, cfg))
        checks.append(_tok_s_check(tag, c, cand.tok_s, base.tok_s, cfg))
        rule = offline_rule(temperature, method)
        if rule not in offline:
            raise missing_key(OfflineResult.NAME, rule, "drafters.candidate")
        checks.append(_live_vs_offline_check(tag, cand.tau, offline[rule].tau_by_k, k, rule, cfg))
    return checks + speed_checks(ab, cfg)


def gate_decision(ab: AbLiveResult | dict, ev: OfflineResult | dict, cfg: GateConfig) -> dict:
    """The ``gate.json`` document: verdict, forced, every check with its numbers, key numbers."""
    ab, ev = as_ab_live(ab), OfflineResult.of(ev)
    checks = gate_checks(ab, ev, cfg)
    failed = [c.name for c in checks if not c.passed]
    verdict = "pass" if not failed else ("forced" if cfg.force else "refused")
    summary = summary_of(ab)
    temperature, method = primary(ab)  # the key numbers: lowest temperature, greedy drafts
    key = {}
    for d in ("baseline", "candidate", "none"):
        s = summary.get((temperature, d, "none" if d == "none" else method, 1), NO_ENTRY)
        key[f"tok_s_c1_{d}"] = s.tok_s
        if d != "none":
            key[f"tau_live_{d}"] = s.tau
    k = ab.num_speculative_tokens
    rule = offline_rule(temperature, method)
    for d in ("baseline", "candidate"):
        key[f"tau_offline_{d}"] = ev.tau(d, rule, k)
    return {
        "verdict": verdict,
        "forced": verdict == "forced",
        "force": cfg.force,
        "failed": failed,
        "checks": [asdict(c) for c in checks],
        "tolerances": cfg.model_dump(exclude={"force"}),
        "num_speculative_tokens": k,
        "temperature": temperature,  # of the live checks
        "temperatures": temperatures(ab),
        "compiled": ab.compiled,
        "unsupported": ab.unsupported or {},
        "key_numbers": key,
        "live_matrix": matrix_rows(ab),  # every temperature and draft sampling method, for information
        "schedule": ab.raw.get("schedule"),
        "released": released_record(ab),
    }


def gate_without_live(reason: str, cfg: GateConfig) -> dict:
    """The ``gate.json`` document when there is no live measurement (``ab_live`` was skipped): the
    release cannot prove itself in the engine, so the gate refuses unless forced."""
    check = Check("live", False, None, None, None, f"no live A/B measurement: ab_live was skipped ({reason})")
    return {"verdict": "forced" if cfg.force else "refused", "forced": cfg.force, "force": cfg.force,
            "failed": [check.name], "checks": [asdict(check)], "tolerances": cfg.model_dump(exclude={"force"}),
            "num_speculative_tokens": None, "temperature": None, "temperatures": [], "compiled": None,
            "unsupported": {}, "key_numbers": {}, "live_matrix": []}


def gate_report(result: GateResult | dict) -> str:
    """Markdown: the verdict, why, and every check with its numbers."""
    res = GateResult.of(result)
    v = res.verdict
    head = {"pass": "PASS — every check passed; the release proceeds.",
            "forced": "FORCED — the gate refused, but `gate.force` is set; the release proceeds and the card records it.",
            "refused": "REFUSED — the release stops before publishing."}[v]
    lines = [f"## Release gate: {head}", ""]
    if res.failed:
        lines += ["Failed checks:", ""]
        lines += [f"- **{c.name}**: {c.detail}" for c in res.checks if not c.passed]
        lines.append("")
        if v == "refused":
            lines += ["To release anyway, set `gate.force: true` (recorded in the card), or widen the tolerances "
                      "in the `gate` config section.", ""]
    lines += ["| check | result | value | reference | threshold | detail |", "|---|---|---|---|---|---|"]
    for c in res.checks:
        lines.append(f"| {c.name} | {'pass' if c.passed else 'FAIL'} | {_fmt(c.value)} | "
                     f"{_fmt(c.reference)} | {_fmt(c.threshold)} | {c.detail} |")
    if res.released:
        lines.append(f"\nReleased configuration: {res.released['why']}.")
    for method, why in res.unsupported.items():
        lines.append(f"\nNot measured: draft sampling `{method}` ({why}).")
    if res.live_matrix:
        temps = res.temperatures or [res.temperature]
        lines += ["", f"### The A/B at every temperature and draft sampling (informational: the live checks above "
                  f"use T={res.temperature:g})", "",
                  f"Temperature{'s' if len(temps) > 1 else ''} {', '.join(f'{t:g}' for t in temps)}; servers "
                  f"{compile_mode(res.compiled)}; speedup = tok/s over no speculation at the same temperature "
                  "and concurrency.", "", matrix_markdown(res.live_matrix).rstrip("\n")]
    return "\n".join(lines) + "\n"
