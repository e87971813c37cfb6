"""The result files of the data stages, typed: ``generate``'s ``summary.json``, ``scrub``'s and ``capture``'s
``report.json`` (their names live here only; the stages write through :meth:`~drafter.core.results.ResultFile.write`,
the card and the next stage read through the loaders)."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from drafter.core.results import ResultFile

GENERATE_SUMMARY_JSON = "summary.json"
SCRUB_REPORT_JSON = "report.json"
CAPTURE_REPORT_JSON = "report.json"


class GenerateSummary(ResultFile):
    """``generate``'s ``summary.json``: rows per split and domain, the engine, sampling, tokens, the user
    conversations' secrets removed before sending (per kind)."""

    NAME: ClassVar[str] = GENERATE_SUMMARY_JSON
    rows: int
    train_rows: int
    heldout_rows: int
    domains: dict[str, int] = {}
    engine: str = "?"
    engine_version: str | None = None
    sampling: dict = {}
    tokens_generated: int = 0
    input_secrets_by_kind: dict[str, int] = {}


class ScrubReport(ResultFile):
    """``scrub``'s ``report.json``: rows changed and secrets found per kind (generated text and user input)."""

    NAME: ClassVar[str] = SCRUB_REPORT_JSON
    rows: int
    rows_changed: int
    counts: dict[str, int]
    counts_generated: dict[str, int] = {}
    counts_input: dict[str, int] = {}
    kinds: list[str] = []


class CaptureReport(ResultFile):
    """``capture``'s ``report.json``: the feature format, tensors, layers and per-split tokens and sequences."""

    NAME: ClassVar[str] = CAPTURE_REPORT_JSON
    format: str | None = None
    layers: list[int] = []
    splits: dict[str, dict] = {}

    def split(self, name: str, what: str):
        """``splits[name][what]`` (None when the split or the figure is missing)."""
        return (self.splits.get(name) or {}).get(what)


def secrets_removed_by_generate(generate_dir: str | Path, kinds: list[str]) -> dict[str, int]:
    """Secrets `generate` removed from the user's conversations before sending them (its summary), per kind;
    zeros when the output has no summary."""
    found = GenerateSummary.load(generate_dir).input_secrets_by_kind if GenerateSummary.exists(generate_dir) else {}
    return {k: int(found.get(k, 0)) for k in kinds}
