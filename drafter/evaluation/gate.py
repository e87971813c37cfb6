"""The release gate: the candidate (fine-tuned) drafter is released only if, live in vLLM, it is not
worse than the baseline (released) drafter beyond the configured tolerances, its live τ is close
enough to the offline prediction, and speculation stayed lossless.

Checks (each with its numbers, see :class:`Check`):

* ``lossless`` — the A/B's T=0 outputs with and without speculation were identical (on ≥ 1 prompt);
* ``tau/<method>/c<c>`` — candidate live τ ≥ baseline live τ · (1 − ``tau_tolerance``);
* ``tok_s/<method>/c<c>`` — candidate tok/s ≥ baseline tok/s · (1 − ``tok_s_tolerance``);
* ``live_vs_offline/<method>/c<c>`` — candidate live τ / offline τ ≥ ``min_live_offline_ratio``, the
  offline τ taken at the live K under the matching rule (T=0 → ``t0``; T>0 → ``t1_greedy`` for greedy
  drafts, ``t1_prob`` for probabilistic ones).

The τ, tok/s and live-vs-offline checks run at the A/B's lowest temperature (every draft sampling method
measured there: at T=0 greedy only). The other temperatures and methods are listed in the gate document
(``live_matrix``, a table in the report) for information: they do not change the verdict.

Verdict: ``pass`` (every check passed), ``forced`` (some failed, ``force`` set: recorded in the card),
``refused`` (some failed): the stage raises :class:`GateRefused` with the report, stopping the flow
before anything is published.

Example::

    res = gate_decision(ab_live_json, eval_offline_json, cfg.gate)
    res["verdict"], [c["name"] for c in res["checks"] if not c["passed"]]
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from drafter.core.config import GateConfig
from drafter.core.errors import StageError
from drafter.evaluation.ab_live import (compile_mode, matrix_markdown, matrix_rows, parse_summary, primary,
                                        run_key, temperatures)


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


def offline_rule(temperature: float, draft_sample_method: str | None) -> str:
    """The offline acceptance rule that predicts a live measurement."""
    if temperature == 0:
        return "t0"
    return "t1_prob" if draft_sample_method == "probabilistic" else "t1_greedy"


def _need(d: Any, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise StageError(f"{where}: missing key {key!r}")
    return d[key]


def _fmt(v: float | None, nd: int = 3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def gate_checks(ab: dict, ev: dict, cfg: GateConfig) -> list[Check]:
    """Every check of the gate from ``ab_live.json`` and ``eval_offline.json`` (schemas in their stages)."""
    checks: list[Check] = []
    ll = _need(ab, "lossless", "ab_live.json") or {}  # null: the check was not run (no prompts)
    prompts, identical, ok = ll.get("prompts", 0), ll.get("identical", 0), bool(ll.get("ok"))
    mism = ll.get("mismatches") or []
    detail = f"{identical}/{prompts} prompts identical at T=0 with and without speculation"
    if mism:
        detail += "; first mismatches: " + ", ".join(f"prompt {m.get('prompt')} at token {m.get('first_diff_token')}"
                                                     for m in mism[:5])
    if prompts == 0:
        detail = "the lossless check ran on no prompts (ab_live.lossless_prompts = 0)"
    checks.append(Check("lossless", ok and prompts > 0, float(identical), float(prompts), float(prompts), detail))

    summary = parse_summary(ab)
    k = int(_need(ab, "num_speculative_tokens", "ab_live.json"))
    temperature = temperatures(ab)[0]
    cands = sorted((m, c) for t, d, m, c in summary if d == "candidate" and t == temperature)
    if not cands:
        raise StageError(f"ab_live.json: summary has no candidate entry at temperature {temperature:g} "
                         f"({run_key('candidate', '<method>', '<c>', temperature)}); entries: {sorted(ab['summary'])}")
    drafters = _need(ev, "drafters", "eval_offline.json")
    offline = _need(drafters, "candidate", "eval_offline.json drafters")
    for method, c in cands:
        cand = summary[(temperature, "candidate", method, c)]
        base = summary.get((temperature, "baseline", method, c))
        if base is None:
            raise StageError(f"ab_live.json: summary has {run_key('candidate', method, c, temperature)} but no "
                             f"{run_key('baseline', method, c, temperature)}")
        tag = f"{method}/c{c}"
        ct, bt = cand.get("tau"), base.get("tau")
        if ct is None or bt is None:
            checks.append(Check(f"tau/{tag}", False, ct, bt, None,
                                f"live τ not measured (candidate {_fmt(ct)}, baseline {_fmt(bt)})"))
        else:
            thr = bt * (1 - cfg.tau_tolerance)
            checks.append(Check(f"tau/{tag}", ct >= thr, ct, bt, thr,
                                f"candidate live τ {ct:.3f} vs baseline {bt:.3f} (must be ≥ {thr:.3f}, "
                                f"tolerance {cfg.tau_tolerance:.0%})"))
        cs, bs = _need(cand, "tok_s", f"ab_live.json summary candidate/{tag}"), _need(base, "tok_s", f"ab_live.json summary baseline/{tag}")
        thr = bs * (1 - cfg.tok_s_tolerance)
        checks.append(Check(f"tok_s/{tag}", cs >= thr, cs, bs, thr,
                            f"candidate {cs:.1f} tok/s vs baseline {bs:.1f} (must be ≥ {thr:.1f}, "
                            f"tolerance {cfg.tok_s_tolerance:.0%}) at {c} concurrent user{'s' if c > 1 else ''}"))
        rule = offline_rule(temperature, method)
        by_k = _need(offline, rule, "eval_offline.json drafters.candidate")["tau_by_k"]
        if k > len(by_k):
            checks.append(Check(f"live_vs_offline/{tag}", False, None, None, cfg.min_live_offline_ratio,
                                f"no offline prediction at K={k}: eval_offline measured K ≤ {len(by_k)} "
                                f"(raise eval_offline.k_max to ≥ {k})"))
        elif ct is None:
            checks.append(Check(f"live_vs_offline/{tag}", False, None, by_k[k - 1], cfg.min_live_offline_ratio,
                                "live τ not measured"))
        else:
            off = by_k[k - 1]
            ratio = ct / off
            checks.append(Check(f"live_vs_offline/{tag}", ratio >= cfg.min_live_offline_ratio, ratio, off,
                                cfg.min_live_offline_ratio,
                                f"live τ {ct:.3f} / offline τ {off:.3f} ({rule}, K={k}) = {ratio:.3f} "
                                f"(must be ≥ {cfg.min_live_offline_ratio:.2f})"))
    return checks


def gate_decision(ab: dict, ev: dict, cfg: GateConfig) -> dict:
    """The ``gate.json`` document: verdict, forced, every check with its numbers, key numbers."""
    checks = gate_checks(ab, ev, cfg)
    failed = [c.name for c in checks if not c.passed]
    verdict = "pass" if not failed else ("forced" if cfg.force else "refused")
    summary = parse_summary(ab)
    temperature, method = primary(ab)  # the key numbers: lowest temperature, greedy drafts
    key = {}
    for d in ("baseline", "candidate", "none"):
        s = summary.get((temperature, d, "none" if d == "none" else method, 1)) or {}
        key[f"tok_s_c1_{d}"] = s.get("tok_s")
        if d != "none":
            key[f"tau_live_{d}"] = s.get("tau")
    k = ab.get("num_speculative_tokens")
    rule = offline_rule(temperature, method)
    for d in ("baseline", "candidate"):
        by_k = ev.get("drafters", {}).get(d, {}).get(rule, {}).get("tau_by_k", [])
        key[f"tau_offline_{d}"] = by_k[k - 1] if k and k <= len(by_k) else None
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
        "compiled": ab.get("compiled"),
        "unsupported": ab.get("unsupported") or {},
        "key_numbers": key,
        "live_matrix": matrix_rows(ab),  # every temperature and draft sampling method, for information
    }


def gate_without_live(reason: str, cfg: GateConfig) -> dict:
    """The ``gate.json`` document when there is no live measurement (``ab_live`` was skipped): the
    release cannot prove itself in the engine, so the gate refuses unless forced."""
    check = Check("live", False, None, None, None, f"no live A/B measurement: ab_live was skipped ({reason})")
    return {"verdict": "forced" if cfg.force else "refused", "forced": cfg.force, "force": cfg.force,
            "failed": [check.name], "checks": [asdict(check)], "tolerances": cfg.model_dump(exclude={"force"}),
            "num_speculative_tokens": None, "temperature": None, "temperatures": [], "compiled": None,
            "unsupported": {}, "key_numbers": {}, "live_matrix": []}


def gate_report(res: dict) -> str:
    """Markdown: the verdict, why, and every check with its numbers."""
    v = res["verdict"]
    head = {"pass": "PASS — every check passed; the release proceeds.",
            "forced": "FORCED — the gate refused, but `gate.force` is set; the release proceeds and the card records it.",
            "refused": "REFUSED — the release stops before publishing."}[v]
    lines = [f"## Release gate: {head}", ""]
    if res["failed"]:
        lines += ["Failed checks:", ""]
        lines += [f"- **{c['name']}**: {c['detail']}" for c in res["checks"] if not c["passed"]]
        lines.append("")
        if v == "refused":
            lines += ["To release anyway, set `gate.force: true` (recorded in the card), or widen the tolerances "
                      "in the `gate` config section.", ""]
    lines += ["| check | result | value | reference | threshold | detail |", "|---|---|---|---|---|---|"]
    for c in res["checks"]:
        lines.append(f"| {c['name']} | {'pass' if c['passed'] else 'FAIL'} | {_fmt(c['value'])} | "
                     f"{_fmt(c['reference'])} | {_fmt(c['threshold'])} | {c['detail']} |")
    for method, why in res.get("unsupported", {}).items():
        lines.append(f"\nNot measured: draft sampling `{method}` ({why}).")
    if res.get("live_matrix"):
        temps = res.get("temperatures") or [res["temperature"]]
        lines += ["", f"### The A/B at every temperature and draft sampling (informational: the live checks above "
                  f"use T={res['temperature']:g})", "",
                  f"Temperature{'s' if len(temps) > 1 else ''} {', '.join(f'{t:g}' for t in temps)}; servers "
                  f"{compile_mode(res.get('compiled'))}; speedup = tok/s over no speculation at the same temperature "
                  "and concurrency.", "", matrix_markdown(res["live_matrix"]).rstrip("\n")]
    return "\n".join(lines) + "\n"
