"""`gate` stage: the release proceeds only if the candidate drafter holds up live.

Inputs: `ab_live` (``ab_live.json``: live τ and tok/s per drafter, draft method and concurrency, the
lossless check) and `eval_offline` (``eval_offline.json``: the offline τ prediction per K and rule).
Computes: the checks of :mod:`drafter.evaluation.gate` — candidate vs baseline live τ and tok/s within the
configured tolerances at every measured concurrency, candidate live τ within
``min_live_offline_ratio`` of the offline prediction at the live K and matching rule, lossless output.
With ``ab_live`` skipped (no vLLM) there is no live evidence: the gate refuses unless forced.
Refused (and ``gate.force`` not set): raises :class:`drafter.evaluation.gate.GateRefused` whose message is the
report, so the flow stops before any later stage (nothing is published).
Writes (pass or forced): ``gate.json`` (verdict, forced, every check with its numbers) and ``gate.md``.
Reports: ``gate`` (pass / forced), ``forced``, ``failed_checks``, live and offline τ, tok/s at 1 user.
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.evaluation.ab_live import load_ab_live
from drafter.evaluation.gate import GateRefused, gate_decision, gate_report, gate_without_live, save_gate
from drafter.evaluation.offline_result import load_eval_offline


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    if inputs["ab_live"].status == "skipped":
        res = gate_without_live(inputs["ab_live"].manifest.get("reason") or "no reason recorded", cfg.gate)
    else:
        ab = load_ab_live(inputs["ab_live"].path)
        ev = load_eval_offline(inputs["eval_offline"].path)
        res = gate_decision(ab, ev, cfg.gate)
    report = gate_report(res)
    if res["verdict"] == "refused":
        raise GateRefused(report, result=res)
    save_gate(out, res)
    (out / "gate.md").write_text(report)
    metrics: Metrics = {"gate": res["verdict"], "forced": res["forced"], "checks": len(res["checks"]),
                        "failed_checks": len(res["failed"])}
    if res["failed"]:
        metrics["failed"] = ", ".join(res["failed"])
    metrics |= {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res["key_numbers"].items()}
    return metrics


STAGE = Stage(
    name="gate",
    version="1",
    inputs=("eval_offline", "ab_live"),
    sections=("gate",),
    run=run,
    description="Release gate: the candidate's live τ and tok/s vs the baseline's, live vs offline τ, lossless, and the "
                "released configuration vs no speculation at every concurrency",
)
