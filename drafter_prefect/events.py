"""Prefect events of a release, for automations (deployments/automations.yaml turns them into
notifications through a webhook block):

* ``drafter.release.failed`` — the run failed: payload ``stage``, ``error`` (one line), ``error_type``,
  ``run_id``;
* ``drafter.release.gate-refused`` — the gate refused the candidate: payload ``failed`` (check names),
  ``checks`` (each with its value, reference and threshold), ``report`` (the gate's markdown), ``run_id``;
* ``drafter.release.champion-kept`` — a retrain's candidate did not beat the last release (drafter_prefect/retrain.py):
  payload ``champion`` and ``candidate`` (offline τ, live τ, tok/s at 1 user; the champion's release id
  and source), ``reasons``, ``k``, ``gate`` (verdict, failed checks), ``challenge_run``.

Every event's resource is ``drafter.release.<release name>``. No secret is ever part of a payload:
errors are already redacted where they are raised (URLs, values of secret fields).

Example::

    emit_release_event("failed", cfg.name, {"stage": "generate", "error": "…", "run_id": run_id})
"""
from __future__ import annotations

from typing import Any

from prefect.events import emit_event

FAILED = "drafter.release.failed"
GATE_REFUSED = "drafter.release.gate-refused"
CHAMPION_KEPT = "drafter.release.champion-kept"


def emit_release_event(kind: str, release_name: str, payload: dict[str, Any]) -> None:
    """Emit ``drafter.release.<kind>`` about the release ``release_name``."""
    emit_event(event=f"drafter.release.{kind}",
               resource={"prefect.resource.id": f"drafter.release.{release_name}",
                         "prefect.resource.name": release_name},
               payload=payload)


def failure_event(release_name: str, run_id: str | None, stage: str | None, exc: BaseException) -> None:
    """The event of a failed run: ``gate-refused`` with the gate's checks, else ``failed`` with the error."""
    from drafter.evaluation.gate import GateRefused

    if isinstance(exc, GateRefused):
        res = getattr(exc, "result", None) or {}
        emit_release_event("gate-refused", release_name, {
            "run_id": run_id, "failed": res.get("failed", []), "checks": res.get("checks", []),
            "report": str(exc)})
        return
    first = (str(exc).strip().splitlines() or [""])[0]
    emit_release_event("failed", release_name, {
        "run_id": run_id, "stage": stage, "error_type": type(exc).__name__, "error": first[:2000]})
