"""`generate` stage: regenerate every assistant turn of the training prompts with the served target.

Inputs: the `prepare_target` output (the model directory, its chat template and provenance).
Computes: the prompt list — built-in prompts (general, code, math, multi-turn agent; seeded, with a
fixed held-out split) and the user's JSONL/Parquet files — then, with the target served by vLLM
(``serving.backend: vllm``; started via :func:`drafter.serving.server.serve`) or loaded in-process by
transformers (``serving.backend: transformers``), every assistant turn, turn by turn, in the
thinking modes the chat template supports (see :mod:`drafter.data.generate`).
Secrets: user-file conversations are scrubbed with ``cfg.scrub``'s rules (:func:`drafter.data.scrub.
scrub_conversations`: message contents, and ids/domains holding a secret) right after they are read,
before anything is sent to the server or written — so neither the text nor the token ids of this
stage's output hold the user's secrets (``scrub`` is among this stage's sections: new rules mean a
new key). The `scrub` stage still scrubs the generated text (a model may invent secret-like strings)
and adds these input counts to its own.
Writes: ``shards/shard-*.jsonl`` (one conversation per row, format in :mod:`drafter.data.generate`),
``shard_stats/shard-*.json``, ``server.log`` (vLLM's log) and ``summary.json`` (with
``input_secrets``: secrets removed from the input, per kind; never the secrets).
Reports: ``rows``, ``train_rows``, ``heldout_rows``, ``failed`` (requests), ``tokens_generated``,
``tok_per_s``, ``engine``, ``seconds``, ``shards_reused``, ``input_secrets`` and
``input_secrets_<kind>`` for every kind.
Resumes: shards finished on an earlier try are kept; the engine is not started when all are done.
Fails: at once (before any engine starts) when a conversation's prompt cannot fit
``serving.max_model_len − generate.max_tokens`` tokens (naming its file:line); when more than
``generate.max_failed_fraction`` of the requests fail after retries.
"""
from __future__ import annotations

import hashlib
import logging
import time
from contextlib import ExitStack
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.files import remove_partial_files
from drafter.core.errors import StageError
from drafter.data.generate import (
    backend_factory,
    check_prompt_lengths,
    generate_dataset,
    load_tokenizer,
    template_supports_thinking,
    thinking_modes,
)
from drafter.data.prompts import build_prompts
from drafter.data.reports import GenerateSummary
from drafter.data.scrub import scrub_conversations, scrubber_for
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.core.store import file_fingerprints
from drafter.models.target import chat_template_text, target_dir, target_info

log = logging.getLogger(__name__)


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    t0 = time.monotonic()
    g, serving = cfg.generate, cfg.serving
    model_dir = target_dir(inputs["prepare_target"])
    info = target_info(inputs["prepare_target"])
    template = chat_template_text(model_dir)
    if not template:
        raise StageError(f"target {model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
    target = {"name": info.get("name"), "revision": info.get("revision"),
              "chat_template_sha256": info.get("chat_template_sha256") or hashlib.sha256(template.encode()).hexdigest()}
    supported = template_supports_thinking(template)
    modes = thinking_modes(g.thinking, supported)
    scrubber = scrubber_for(cfg.scrub)
    convs, input_secrets, input_changed = scrub_conversations(build_prompts(g), scrubber)
    # before any engine starts: a conversation that cannot fit the server's context fails the stage
    # now, named by its file:line, instead of failing its requests at the end
    check_prompt_lengths(convs, load_tokenizer(model_dir), modes, max_model_len=serving.max_model_len,
                         max_tokens=g.max_tokens)
    remove_partial_files(out)

    servers = []
    with ExitStack() as stack:
        # the backend is made only if some shard still needs generating: a retry that finds every
        # shard finished does not start the engine
        backend = backend_factory(stack, model_dir, serving, g, out / "server.log", servers)
        summary = generate_dataset(convs, backend, out, g, target=target, modes=modes)

    seconds = round(time.monotonic() - t0, 2)
    summary |= {
        "seconds": seconds,
        "engine_start_s": servers[0].startup_s if servers else None,
        "target": target,
        "thinking_supported": supported,
        "modes": modes,
        "sampling": {"temperature": g.temperature, "top_p": g.top_p, "max_tokens": g.max_tokens, "seed": g.seed},
        "prompts": len(convs),
        "domains": _count(c.domain for c in convs),
        "input_secrets": sum(input_secrets.values()),
        "input_secrets_by_kind": {k: input_secrets.get(k, 0) for k in scrubber.all_kinds},
        "input_conversations_scrubbed": input_changed,
    }
    if not supported and g.thinking != "off":
        summary["note"] = note = (f"generate.thinking={g.thinking!r}, but the chat template has no enable_thinking switch: "
                           "every row was generated in the template's only mode ('default')")
        log.warning(note)
    GenerateSummary.write(out, summary)
    return {
        "rows": summary["rows"], "train_rows": summary["train_rows"], "heldout_rows": summary["heldout_rows"],
        "failed": summary["failed"], "requests": summary["requests"],
        "tokens_generated": summary["tokens_generated"], "tok_per_s": summary["tok_per_s"],
        "engine": summary.get("engine", ""), "engine_version": summary.get("engine_version", ""),
        "seconds": seconds, "shards": summary["shards"], "shards_reused": summary["shards_reused"],
        "input_secrets": summary["input_secrets"],
        **{f"input_secrets_{k}": v for k, v in summary["input_secrets_by_kind"].items()},
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def fingerprint(cfg: ReleaseConfig) -> list[dict]:
    """User prompt files are read from outside the store: their size + sha256 go into the key."""
    return file_fingerprints(cfg.generate.user_files, "generate.user_files")


STAGE = Stage(
    name="generate",
    version="2",  # 2: user conversations scrubbed before generation; input secret counts
    inputs=("prepare_target",),
    sections=("generate", "serving", "scrub"),
    run=run,
    description="Regenerate every assistant turn of built-in and user prompts with the served target",
    fingerprint=fingerprint,
)
