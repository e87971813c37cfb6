"""The user's own held-out set (``heldout.files``): JSONL/Parquet chat conversations, with their assistant
answers, that `eval_offline` and `ab_live` measure on in place of the built-in held-out split.

* **Read as the prompt files are** (:func:`drafter.data.prompts.load_user_file` with ``keep_answers``): the
  same schema and the same file:line errors, but the assistant turns are kept as written — they are the
  text evaluated (teacher-forced: the target's distribution on it), never regenerated. Every row is held
  out (a row marked ``split: train`` is an error); ids are unique across the files.
* **Never trained on** (:func:`check_not_trained_on`): each conversation's content hash
  (:func:`drafter.data.traffic.conversation_hash`, the retrain ledger's hash) against every training
  conversation — the train split of the built-in prompts and of ``generate.user_files``, which holds both
  the bootstrap's and the fine-tune's half. An overlap is a :class:`~drafter.core.errors.BadInputError`
  raised by preflight, before any stage, naming the held-out file:line, the training row and the count.
* **Scrubbed before anything is written** (:func:`heldout_rows`): with ``cfg.scrub``'s rules, exactly as
  the user's training conversations are (:func:`drafter.data.scrub.scrub_conversations`).
* **Named in every report** (:func:`describe_builtin`, :func:`describe_files`): ``built-in held-out split
  (96 conversations)`` or ``user held-out files chats.jsonl (40 conversations, sha256 0123456789abcdef…)``;
  with the conversations `eval_offline` cut at ``capture.max_seq_len`` (:func:`record_truncation`):
  ``…; 3 cut at capture.max_seq_len=1024 tokens``.
* **Lengths checked before any stage** (preflight, with the target's tokenizer): `ab_live` replays each
  user turn with the messages before it as the prompt, so a replayed prompt that cannot fit the served
  context (``serving.max_model_len − ab_live.max_tokens``) is refused, naming its file:line, length and the
  limit (:func:`check_replay_lengths`); a conversation longer than ``capture.max_seq_len`` is measured on its
  first ``max_seq_len`` tokens, as capture cuts every conversation — counted and said
  (:func:`count_truncated`), not refused.
* **Keyed**: the stages that read the files (`eval_offline`, `ab_live`) have :func:`fingerprint` (size +
  sha256 of each file) in their key, so a changed file is measured again; `train` does not read them.

* **Made from the built-in split at T > 0** (:func:`resample_heldout`, ``drafter heldout-sample``): the
  held-out prompts with every answer sampled by the served target, so offline T > 0 acceptance is measured
  on text like a live T > 0 replay's rather than on the split's greedy answers.

Example::

    convs = load_heldout(cfg.heldout.files)
    check_not_trained_on(convs, build_prompts(cfg.generate))     # preflight
    rows, info = user_heldout(cfg)           # scrubbed rows: what eval_offline captures and ab_live replays
    info["text"]                             # 'user held-out files chats.jsonl (40 conversations, sha256 …)'
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.errors import BadInputError
from drafter.data.prompts import Conversation, load_user_file

if TYPE_CHECKING:
    from drafter.core.config import ReleaseConfig
    from drafter.data.scrub import Scrubber

SETTING = "heldout.files"
MODE = "default"  # rendered with the chat template's own defaults (no template arguments)


def load_heldout(files: list[str]) -> list[Conversation]:
    """The conversations of the held-out ``files``, in order, answers kept (a missing or empty one a placeholder
    for the served target to give: :mod:`drafter.data.heldout_answers`). Raises :class:`BadInputError`
    naming the file:line (Parquet: ``file row N``) on a malformed row, a row marked ``split: train`` or an id
    used twice (an identical conversation without an explicit id is kept once)."""
    convs: list[Conversation] = []
    seen: dict[str, Conversation] = {}
    for f in files:
        for c in load_user_file(f, heldout_fraction=1.0, keep_answers=True, setting=SETTING):
            if c.split != "heldout":
                raise BadInputError(f"{c.origin}: `split` is {c.split!r}, but every conversation of a held-out file "
                                    f"({SETTING}) is held out; remove the field, or move the row to generate.user_files")
            prev = seen.get(c.id)
            if prev is not None:
                if prev.messages == c.messages and c.id.startswith("user-"):
                    continue  # the same conversation twice
                raise BadInputError(f"held-out conversation id {c.id!r} appears twice: in {prev.origin} and in "
                                    f"{c.origin}; give each conversation its own `id`")
            seen[c.id] = c
            convs.append(c)
    return convs


def check_not_trained_on(heldout: list[Conversation], prompts: list[Conversation], setting: str = SETTING) -> None:
    """Raise :class:`BadInputError` when a held-out conversation is also a training conversation (a
    ``train``-split one of ``prompts``, :func:`drafter.data.prompts.build_prompts`), compared by content hash;
    the message names the first such held-out file:line, the training row it repeats, and how many overlap."""
    from drafter.data.traffic import conversation_hash

    train: dict[str, Conversation] = {}
    for c in prompts:
        if c.split == "train":
            train.setdefault(conversation_hash(c), c)
    hits = [(h, train[k]) for h in heldout if (k := conversation_hash(h)) in train]
    if not hits:
        return
    first, other = hits[0]
    also = [h.origin for h, _ in hits[1:4]]
    more = f", also {', '.join(also)}" + (" …" if len(hits) > 4 else "") if also else ""
    raise BadInputError(
        f"{first.origin}: this held-out conversation is also a training conversation "
        f"({other.origin or f'built-in prompt {other.id}'}); {len(hits)} of the {len(heldout)} conversations of "
        f"{setting} are in the train split{more}. A drafter must not be evaluated on what it was trained on: remove "
        f"them from {setting}, or from generate.user_files")


def heldout_rows(convs: list[Conversation], scrubber: "Scrubber") -> list[dict]:
    """The held-out conversations as conversation rows (``id``, ``split: heldout``, ``domain``, ``mode``,
    ``messages`` with the answers), scrubbed with ``scrubber`` first: the rows `eval_offline` captures and
    `ab_live` replays (:func:`drafter.data.replay.replay_turns`)."""
    from drafter.data.scrub import scrub_conversations

    convs, _, _ = scrub_conversations(convs, scrubber)
    return [_row(c) for c in convs]


def _row(c: Conversation) -> dict:
    return {"id": c.id, "split": "heldout", "domain": c.domain, "mode": MODE, "chat_template_kwargs": {},
            "messages": [dict(m) for m in c.messages]}


# ------------------------------------------------------------------------------------- lengths


def _tokens(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict | None = None) -> int:
    """Tokens of ``messages`` rendered with the chat template and tokenized as the engines and capture do
    (no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_replay_lengths(convs: list[Conversation], tokenizer, *, num_turns: int, max_model_len: int,
                         max_tokens: int) -> int:
    """Raise :class:`BadInputError` when a turn `ab_live` replays from the (scrubbed) held-out ``convs``
    cannot fit the served context: its prompt — every message before the turn, the file's own earlier answers
    included, rendered with the target's chat template — longer than ``max_model_len − max_tokens`` tokens
    (vLLM refuses such a request). The turns are those :func:`drafter.data.replay.replay_turns` picks.
    The message names the file:line, the turn, its length and the limit. Returns the longest prompt, in tokens."""
    from drafter.data.generate import prompt_token_limit
    from drafter.data.replay import replay_turns

    limit = prompt_token_limit(max_model_len, max_tokens)
    if not convs:
        return 0
    origin = {c.id: c.origin or f"held-out conversation {c.id}" for c in convs}
    turns, _ = replay_turns([_row(c) for c in convs], num_turns)
    longest = 0
    for t in turns:
        n = _tokens(tokenizer, t.messages, True, t.template_kwargs)
        longest = max(longest, n)
        if n > limit:
            k = sum(m["role"] == "assistant" for m in t.messages) + 1
            raise BadInputError(
                f"{origin[t.conv_id]}: ab_live replays assistant turn {k} of this held-out conversation with a prompt "
                f"of {n} tokens (the messages before it, with the target's chat template), more than the {limit} the "
                f"server accepts (serving.max_model_len={max_model_len} minus ab_live.max_tokens={max_tokens}); "
                f"shorten or drop the conversation in {SETTING}, or raise serving.max_model_len")
    return longest


def count_truncated(convs: list[Conversation], tokenizer, max_seq_len: int) -> dict:
    """How many (scrubbed) held-out ``convs`` are longer than ``max_seq_len`` tokens, which `eval_offline`'s
    capture cuts there (as `capture` cuts every conversation: :func:`drafter.data.capture.tokenize_rows`), and
    how many of those have no answer token before the cut (nothing of them is measured). Each conversation is
    tokenized whole, with the target's chat template, as capture does.

    Returns ``{"conversations", "truncated", "unmeasured", "longest", "longest_origin", "max_seq_len"}``."""
    res = {"conversations": len(convs), "truncated": 0, "unmeasured": 0, "longest": 0, "longest_origin": "",
           "max_seq_len": max_seq_len}
    for c in convs:
        msgs = [dict(m) for m in c.messages]
        n = _tokens(tokenizer, msgs, False)
        if n > res["longest"]:
            res["longest"], res["longest_origin"] = n, c.origin or f"held-out conversation {c.id}"
        if n > max_seq_len:
            res["truncated"] += 1
            first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            if _tokens(tokenizer, msgs[:first], True) >= max_seq_len:
                res["unmeasured"] += 1
    return res


def describe_truncation(counts: dict) -> str | None:
    """The preflight's line for :func:`count_truncated`'s ``counts``; None when nothing is cut."""
    n, m = counts["truncated"], counts["max_seq_len"]
    if not n:
        return None
    lost = (f"; {counts['unmeasured']} of them have no answer token before the cut and are not measured at all"
            if counts["unmeasured"] else "")
    return (f"{SETTING}: {n} of the {counts['conversations']} held-out conversations are longer than "
            f"capture.max_seq_len={m} tokens (the longest, {counts['longest_origin']}, has {counts['longest']}); "
            f"eval_offline measures their first {m} tokens, as capture cuts every conversation{lost}; raise "
            "capture.max_seq_len to measure them whole")


def record_truncation(info: dict, truncated: int, max_seq_len: int) -> dict:
    """The record of the held-out set (:func:`describe_files`) with the number of its conversations that
    `eval_offline`'s capture cut at ``capture.max_seq_len`` (:attr:`drafter.data.capture.CaptureResult.truncated`):
    ``truncated`` and ``max_seq_len`` fields, and ``text`` ending ``; 3 cut at capture.max_seq_len=1024 tokens``."""
    out = dict(info, truncated=int(truncated), max_seq_len=int(max_seq_len))
    if truncated:
        out["text"] = f"{info['text']}; {truncated} cut at capture.max_seq_len={max_seq_len} tokens"
    return out


def fingerprint(cfg: "ReleaseConfig") -> list[dict]:
    """Size + sha256 of each held-out file: part of the key of every stage that reads them."""
    from drafter.core.store import file_fingerprints

    return file_fingerprints(cfg.heldout.files, SETTING)


def describe_builtin(conversations: int) -> dict:
    """The record of a measurement on the built-in held-out split (``eval_offline.json`` / ``ab_live.json``)."""
    return {"source": "builtin", "conversations": conversations,
            "text": f"built-in held-out split ({conversations} conversations)"}


def describe_files(fingerprints: list[dict], conversations: int) -> dict:
    """The record of a measurement on the user's held-out files: their names (never the local path), sizes,
    sha256 and the number of conversations read from them."""
    files = [{"name": Path(f["path"]).name, "size": f["size"], "sha256": f["sha256"]} for f in fingerprints]
    names = ", ".join(f["name"] for f in files)
    shas = ", ".join(f["sha256"][:16] + "…" for f in files)
    return {"source": "files", "conversations": conversations, "files": files,
            "text": f"user held-out files {names} ({conversations} conversations, sha256 {shas})"}


def user_heldout(cfg: "ReleaseConfig") -> tuple[list[dict], dict]:
    """The scrubbed rows of ``heldout.files`` and their record (:func:`describe_files`)."""
    from drafter.data.scrub import scrubber_for

    from drafter.data.heldout_answers import refuse_unanswered

    fps = fingerprint(cfg)
    convs = refuse_unanswered(load_heldout(cfg.heldout.files))
    return heldout_rows(convs, scrubber_for(cfg.scrub)), describe_files(fps, len(convs))


def resample_heldout(cfg: "ReleaseConfig", model_dir: str | Path, out_file: str | Path, *, temperature: float,
                     work_dir: str | Path, log=print) -> dict:
    """Regenerate every assistant turn of the built-in held-out conversations at ``temperature`` with the
    served target (``cfg.serving``'s backend; ``cfg.generate``'s prompts, seed, top-p, max tokens and
    concurrency), and write them to ``out_file`` as a held-out file (JSONL: ``id``, ``domain``, ``messages``)
    for ``heldout.files``. The built-in split's text is generated at ``generate.temperature`` (0 by
    default), while a live replay at T > 0 samples its own continuations: offline T > 0 figures measured on
    this file predict the live ones (the held-out prompts are the same, so it is never trained on).

    ``work_dir`` holds the generation's shards (a retry resumes there); ``out_file`` is written atomically,
    only once every turn was generated. Returns the generation summary plus ``file``, ``conversations``,
    ``temperature``. Raises :class:`BadInputError` for a temperature below 0 and
    :class:`~drafter.core.errors.StageError` when the split has no conversation or generation failed."""
    from contextlib import ExitStack

    from drafter.core.errors import StageError
    from drafter.core.files import iter_rows, write_jsonl_atomic
    from drafter.data.generate import backend_factory, generate_dataset
    from drafter.data.prompts import build_prompts
    from drafter.data.scrub import scrub_conversations, scrubber_for

    if not temperature >= 0:
        raise BadInputError(f"temperature must be >= 0, got {temperature}")
    g = cfg.generate.model_copy(update={"temperature": float(temperature), "max_failed_fraction": 0.0})
    convs, _, _ = scrub_conversations(build_prompts(g), scrubber_for(cfg.scrub))
    convs = [c for c in convs if c.split == "heldout"]
    if not convs:
        raise StageError(f"the built-in held-out split is empty (generate.num_prompts {g.num_prompts}, "
                         f"generate.heldout_fraction {g.heldout_fraction}): nothing to resample")
    work = Path(work_dir)
    log(f"resampling {len(convs)} held-out conversations at T={temperature:g} with {cfg.serving.backend} → {out_file}")
    with ExitStack() as stack:
        backend = backend_factory(stack, model_dir, cfg.serving, g, work / "server.log")
        summary = generate_dataset(convs, backend, work, g, target={"name": str(model_dir)}, modes=[MODE])
    rows = [{"id": r["id"], "domain": r["domain"], "messages": r["messages"]} for r in iter_rows(work / "shards")]
    write_jsonl_atomic(Path(out_file), rows)
    return summary | {"file": str(out_file), "conversations": len(rows), "temperature": float(temperature)}
