"""Conversation data shared by the stages: JSONL shards written atomically, and chat
tokenization with an assistant-only loss mask.

Shards are ``<dir>/shard-00000.jsonl, shard-00001.jsonl, …`` with one JSON object per line.
A shard is written under a temporary name and renamed into place when complete, so a shard
that exists is whole: a stage resumes by skipping the shards it finds.

Example::

    from drafter.core.files import iter_rows, tokenize_conversation, write_jsonl_atomic

    for row in iter_rows(generate_artifact.path / "shards"):
        ids, mask = tokenize_conversation(tokenizer, row["messages"], row_id=row["id"])
        # ids: token ids of the whole conversation (chat template applied)
        # mask[i] == 1 iff ids[i] was written by the assistant (the tokens to train on)
"""
from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from drafter.core.errors import StageError, describe_value

SHARD_PREFIX = "shard-"
TMP_SUFFIX = ".tmp"


# --------------------------------------------------------------------------- files


def shard_name(index: int, ext: str = "jsonl") -> str:
    """``shard_name(3) == "shard-00003.jsonl"``."""
    return f"{SHARD_PREFIX}{index:05d}.{ext}"


def shard_index(path: str | Path) -> int:
    """Inverse of :func:`shard_name`: ``shard_index("a/shard-00003.jsonl") == 3``."""
    stem = Path(path).name.split(".", 1)[0]
    if not stem.startswith(SHARD_PREFIX):
        raise ValueError(f"{path} is not a shard file name (expected {SHARD_PREFIX}NNNNN.ext)")
    return int(stem[len(SHARD_PREFIX):])


def list_shards(directory: str | Path, ext: str = "jsonl") -> list[Path]:
    """Finished shards of ``directory`` (sorted by index; temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{SHARD_PREFIX}*.{ext}") if p.is_file())


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block
    succeeds (the temporary file is removed otherwise). Readers never see a partial file.

    Example::

        with atomic_path(out / "x.safetensors") as tmp:
            save_file(tensors, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, atomically and byte-reproducibly.

    safetensors writes its ``__metadata__`` map in an arbitrary order that changes from process to
    process, so the same tensors gave different files (a resumed training run differed from an
    uninterrupted one). The header is rewritten here with every key sorted: the same tensors and
    metadata always give the same bytes.
    """
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        normalize_safetensors_header(tmp)


def normalize_safetensors_header(path: str | Path) -> None:
    """Rewrite a safetensors file's JSON header with sorted keys (tensor data offsets unchanged)."""
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        if "__metadata__" in header and header["__metadata__"] is not None:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (n - len(text))
        if len(text) != n:  # cannot happen for a header safetensors wrote (same content, other order)
            raise ValueError(f"{path}: normalized safetensors header is {len(text)} bytes, the file's is {n}")
        f.seek(8)
        f.write(text)


def remove_partial_files(directory: str | Path) -> int:
    """Delete leftovers of interrupted atomic writes under ``directory``; returns how many."""
    directory = Path(directory)
    n = 0
    if directory.is_dir():
        for p in directory.rglob(f".*{TMP_SUFFIX}"):
            p.unlink()
            n += 1
    return n


def write_json_atomic(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> int:
    """Write ``rows`` as JSON Lines to ``path`` atomically; returns the number of rows."""
    n = 0
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
                f.write("\n")
                n += 1
    return n


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Rows of one JSONL file; a bad line raises :class:`StageError` naming file and line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise StageError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield row


def read_jsonl(path: str | Path) -> list[dict]:
    return list(iter_jsonl(path))


def iter_rows(directory: str | Path) -> Iterator[dict]:
    """Every row of every shard of ``directory``, in shard order."""
    for p in list_shards(directory):
        yield from iter_jsonl(p)


# --------------------------------------------------------------------------- tokenization


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    *,
    row_id: str | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of a chat conversation (its chat template applied) and its loss mask.

    ``loss_mask[i] == 1`` exactly for the tokens the assistant wrote: for each assistant turn
    ``j``, the conversation up to ``j`` rendered with ``add_generation_prompt=True`` must be a
    token prefix of the whole conversation; the turn's tokens are what the encoding of
    ``messages[:j+1]`` adds beyond that prefix (its text and end-of-turn marker). A template
    that rewrites earlier turns (so that the prefix property breaks) raises :class:`StageError`
    naming ``row_id`` and the turn.

    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``).

    Example::

        ids, mask = tokenize_conversation(tok, [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}])
        tok.decode([t for t, m in zip(ids, mask) if m])   # 'hello<|im_end|>\\n'
    """
    where = f"row {row_id!r}" if row_id is not None else "conversation"
    kw = dict(template_kwargs or {})
    if not messages:
        raise StageError(f"{where}: no messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise StageError(f"{where}: message {j} has no 'role' (it is {describe_value(m)})")
    full = _render(tokenizer, messages, False, kw)
    mask = [0] * len(full)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_check_prefix(full, _render(tokenizer, messages[:j], True, kw), where, j, "generation prompt"))
        end = len(_check_prefix(full, _render(tokenizer, messages[: j + 1], False, kw), where, j, "turn"))
        if end < start:
            raise StageError(f"{where}: assistant turn {j} ends (token {end}) before it starts (token {start})")
        mask[start:end] = [1] * (end - start)
    return full, mask


def _check_prefix(full: list[int], prefix: list[int], where: str, turn: int, what: str) -> list[int]:
    n = len(prefix)
    if full[:n] != prefix:
        bad = next((i for i, (a, b) in enumerate(zip(full, prefix)) if a != b), min(n, len(full)))
        raise StageError(
            f"{where}: the chat template breaks the prefix property at assistant turn {turn}: the "
            f"{what} encoding ({n} tokens) differs from the full conversation at token {bad}. "
            "The template rewrites earlier turns (e.g. strips reasoning from history); split the "
            "conversation into one row per assistant turn, or use a template without that rewrite."
        )
    return prefix
