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


def _parse_summary(ab: dict) -> dict[tuple[str, str, int], dict]:
    """ab_live ``summary`` keys ``<drafter>/<method or none>/c<c>`` → (drafter, method, c)."""
    out = {}
    for key, entry in _need(ab, "summary", "ab_live.json").items():
        parts = key.split("/")
        if len(parts) != 3 or not parts[2].startswith("c") or not parts[2][1:].isdigit():
            raise StageError(f"ab_live.json: summary key {key!r} is not <drafter>/<method>/c<concurrency>")
        out[(parts[0], parts[1], int(parts[2][1:]))] = entry
    return out


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

    summary = _parse_summary(ab)
    k = int(_need(ab, "num_speculative_tokens", "ab_live.json"))
    temperature = float(ab.get("temperature", 0.0))
    cands = sorted(key for key in summary if key[0] == "candidate")
    if not cands:
        raise StageError("ab_live.json: summary has no candidate entry (candidate/<method>/c<c>); "
                         f"entries: {sorted('/'.join(map(str, k)) for k in summary)}")
    drafters = _need(ev, "drafters", "eval_offline.json")
    offline = _need(drafters, "candidate", "eval_offline.json drafters")
    for _, method, c in cands:
        cand = summary[("candidate", method, c)]
        base = summary.get(("baseline", method, c))
        if base is None:
            raise StageError(f"ab_live.json: summary has candidate/{method}/c{c} but no baseline/{method}/c{c}")
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
    summary = _parse_summary(ab)
    key = {}
    for d in ("baseline", "candidate", "none"):
        s = summary.get((d, "none" if d == "none" else "greedy", 1)) or {}
        key[f"tok_s_c1_{d}"] = s.get("tok_s")
        if d != "none":
            key[f"tau_live_{d}"] = s.get("tau")
    k = ab.get("num_speculative_tokens")
    rule = offline_rule(float(ab.get("temperature", 0.0)), "greedy")
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
        "temperature": ab.get("temperature", 0.0),
        "unsupported": ab.get("unsupported") or {},
        "key_numbers": key,
    }


def gate_without_live(reason: str, cfg: GateConfig) -> dict:
    """The ``gate.json`` document when there is no live measurement (``ab_live`` was skipped): the
    release cannot prove itself in the engine, so the gate refuses unless forced."""
    check = Check("live", False, None, None, None, f"no live A/B measurement: ab_live was skipped ({reason})")
    return {"verdict": "forced" if cfg.force else "refused", "forced": cfg.force, "force": cfg.force,
            "failed": [check.name], "checks": [asdict(check)], "tolerances": cfg.model_dump(exclude={"force"}),
            "num_speculative_tokens": None, "temperature": None, "unsupported": {}, "key_numbers": {}}


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
        lines.append(f"\nNot measured: {method} draft sampling ({why}).")
    return "\n".join(lines) + "\n"
