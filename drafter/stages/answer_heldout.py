"""`answer_heldout` stage: the held-out conversations that have no answers yet, answered by the served target.

Planned only when something is to be answered (:func:`drafter.data.heldout_answers.answering_needed`): a
conversation of ``heldout.files`` without its assistant answers, every one of them with ``heldout.regenerate``,
and the prompts of ``heldout.benchmarks`` (read from installed packages: :mod:`drafter.data.benchmarks`).
Inputs: the target (``prepare_target``).
Computes: every assistant turn of those conversations with the served target at T=0, then again sampled at T=1
(seeded; one server for both) — ``serving``'s backend and ``generate``'s seed, top-p, max tokens and concurrency,
the generation code of the `generate` stage — their prompts and answers scrubbed with ``scrub``'s rules. The
conversations of the files that have their answers are kept as written. Its key: the files' size + sha256, the
benchmarks, the answering and generation settings, the serving and scrub sections and the target; never part of
`generate`, `capture` or `train`.
Writes: ``heldout.jsonl`` (answered at T=0: the rows `ab_live` replays and `eval_offline`'s T=0 rule reads),
``heldout-t1.jsonl`` (sampled at T=1: what its T=1 rules read), ``answers.json`` (what was answered, the files
and benchmarks with their license), ``server.log``.
Reports: answered, kept, one count per benchmark.
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.data.heldout_answers import answer, answer_fingerprint, answering_needed
from drafter.models.target import target_dir


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    record = answer(cfg, target_dir(inputs["prepare_target"]), out)
    return {"answered": record["answered"], "kept": record["kept"], "temperature": record["temperature"],
            **{f"prompts_{b['name']}": b["prompts"] for b in record["benchmarks"]}}


STAGE = Stage(
    name="answer_heldout",
    version="1",
    inputs=("prepare_target",),
    # generate's settings of the answers (temperature 0, top-p, max tokens, seed) are in the fingerprint, not the
    # whole generate section: its prompt mix and user files do not change these answers
    sections=("serving", "scrub"),
    run=run,
    fingerprint=answer_fingerprint,
    enabled=answering_needed,
    description="Only when something is to be answered: the prompt-only held-out conversations and the prompts of "
                "heldout.benchmarks, answered by the served target at T=0 and sampled at T=1",
)
