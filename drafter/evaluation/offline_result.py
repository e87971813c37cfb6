"""``eval_offline.json`` (:data:`EVAL_OFFLINE_JSON`): the document :func:`drafter.evaluation.offline.evaluate`
builds and the ``eval_offline`` stage completes, typed (:class:`OfflineResult`) for its readers — the gate, the
report, the card, the champion challenge. Kept apart from :mod:`drafter.evaluation.offline` so that reading it
does not import torch.

Example::

    ev = OfflineResult.load(stage_dir)           # StageError "eval_offline.json: missing key 'drafters'"
    ev.tau(who="candidate", rule="t0", k=4)      # None beyond k_max
    ev.drafters["candidate"]["t0"].tau_ci[3]
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from drafter.core.results import HeldoutRecord, Part, ResultFile, missing_key

EVAL_OFFLINE_JSON = "eval_offline.json"


class GroupSummary(Part):
    """τ(K) and α of one domain or mode."""

    tau_by_k: list[float] = []
    tau_ci: list[list[float]] = []
    alpha: list[float] = []
    positions: int | None = None
    conversations: int | None = None


class RuleSummary(GroupSummary):
    """One drafter under one rule: τ(K) and α_k with intervals, per domain and per mode."""

    alpha_ci: list[list[float]] = []
    accept_rate: list[float] = []
    by_domain: dict[str, GroupSummary] = {}
    by_mode: dict[str, GroupSummary] = {}


class Calibration(Part):
    """A confidence head's reliability (:func:`drafter.evaluation.calibration.reliability`)."""

    ece: float | None = None
    n: int | None = None
    mean_confidence: float | None = None
    mean_outcome: float | None = None
    bins: list[dict] = []


class OfflineResult(ResultFile):
    """``eval_offline.json``. ``drafters``: drafter (``baseline``, ``candidate``) → rule (``t0``, ``t1_greedy``,
    ``t1_prob``) → :class:`RuleSummary`; ``difference``: rule → candidate − baseline. Outputs from before a field
    was recorded lack it: ``heldout`` (the built-in split), ``bootstrap_unit`` (conversations), ``windows``,
    ``calibration``, ``draft_vocab``, ``device``."""

    NAME: ClassVar[str] = EVAL_OFFLINE_JSON
    drafters: dict[str, dict[str, RuleSummary]]
    difference: dict[str, GroupSummary] = {}
    k_max: int | None = None
    drafting: str | None = None  # "block" (DSpark) or "chain"
    draft_cost: float | None = None
    draft_cost_measured: bool | None = None
    confidence: float | None = None
    bootstrap_samples: int | None = None
    bootstrap_unit: str = "conversation"
    positions: int | None = None
    conversations: int | None = None
    speed_rule: str | None = None
    expected_speedup: dict[str, list[float]] = {}
    recommended_k: dict[str, int] = {}
    windows: int | None = None
    heldout: HeldoutRecord | None = None
    device: str | None = None
    draft_vocab: dict[str, int | None] | None = None
    calibration: dict[str, Calibration] = {}
    draft_cost_timing: dict | None = None

    def drafter(self, who: str, where: str = "drafters") -> dict[str, RuleSummary]:
        """``drafters[who]``; :class:`StageError` naming the file and the key when it is not there."""
        if who not in self.drafters:
            raise missing_key(EVAL_OFFLINE_JSON, who, where)
        return self.drafters[who]

    def rule(self, who: str, rule: str) -> RuleSummary:
        """``drafters[who][rule]``; :class:`StageError` naming the file and the key when it is not there."""
        d = self.drafter(who)
        if rule not in d:
            raise missing_key(EVAL_OFFLINE_JSON, rule, f"drafters.{who}")
        return d[rule]

    def tau(self, who: str, rule: str, k: int | None) -> float | None:
        """Offline τ of ``who`` under ``rule`` at ``k`` drafts; None when not measured (no such drafter, rule or K)."""
        by_k = ((self.drafters.get(who) or {}).get(rule) or RuleSummary()).tau_by_k
        return by_k[k - 1] if k and 1 <= k <= len(by_k) else None


def load_eval_offline(stage_dir: str | Path) -> OfflineResult:
    """The ``eval_offline`` output's :class:`OfflineResult`."""
    return OfflineResult.load(stage_dir)


def save_eval_offline(stage_dir: str | Path, res: dict) -> dict:
    """Write ``res`` (:func:`drafter.evaluation.offline.evaluate`'s document, completed by the stage) as
    ``stage_dir/eval_offline.json``, checked against :class:`OfflineResult`."""
    return OfflineResult.write(stage_dir, res)
