"""Prompts for the `generate` stage: a built-in generator written for this project, and user files.

Built-in prompts come from combinatorial templates with seeded random slots, in four domains:
``general``, ``code``, ``math`` and ``agent`` (multi-turn: a system prompt describing tools, a user
task, and later user turns that carry tool output). No third-party prompt text is shipped.

A conversation is a list of ``{"role", "content"}`` messages (roles ``system``/``user``/``assistant``,
the roles every chat template knows). Assistant turns are *placeholders* (``content: None``): the
`generate` stage fills each one with the target's own answer, turn by turn.

Properties the pipeline relies on:

* **Deterministic**: the same seed gives the same prompts.
* **Prefix-stable**: prompt ``i`` does not depend on ``num_prompts``; asking for more prompts only
  appends new ones.
* **Fixed held-out split**: whether a prompt is held out depends only on its domain, its position
  within the domain and the seed, never on ``num_prompts``: held-out rows stay held out as the data
  set grows, so they are never used for training. Within each domain exactly one prompt in every
  ``1/heldout_fraction`` is held out (evenly spread, offset by the seed).
* **Distinct**: no two built-in prompts in one run have the same messages.

User files (JSONL or Parquet) hold one conversation per row in a ``messages`` column/key, and
optionally ``id``, ``domain`` and ``split`` (``train``/``heldout``). Rows without ``split`` are
split by a hash of their id (the id defaults to a hash of the messages, so it does not depend on
the file name or row order). Read with ``keep_answers=True`` (the user's held-out files,
:mod:`drafter.data.heldout`), the assistant turns are kept as written: they are the text evaluated (a missing or
empty one stays a placeholder, answered by the served target: :mod:`drafter.data.heldout_answers`).

Example::

    from drafter.data.prompts import builtin_prompts
    convs = builtin_prompts(64, seed=0)
    convs[0].domain, convs[0].split, convs[0].messages
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from drafter.core.config import DOMAINS, check_domains  # noqa: F401 - the prompt domains are part of the config's vocabulary
from drafter.core.errors import BadInputError, StageError
from drafter.data.prompt_templates import GENERATORS

if TYPE_CHECKING:
    from drafter.core.config import GenerateConfig

ROLES = ("system", "user", "assistant")
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Conversation:
    """One prompt: messages with assistant placeholders (``content: None``) to regenerate."""

    id: str
    domain: str
    split: str
    messages: tuple[dict, ...] = field(repr=False)
    source: str = "builtin"
    # where the row came from, for error messages: ``file:line`` (JSONL), ``file row N`` (Parquet);
    # empty for built-in prompts (their id says it)
    origin: str = ""

    @property
    def num_assistant_turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")


def _unit_hash(*parts: Any) -> float:
    """A stable number in [0, 1) from the parts (sha256, not Python's salted hash)."""
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def _domain_sequence(weights: dict[str, float]) -> Iterable[str]:
    """Smooth weighted round-robin: prefix-stable, and every prefix follows the weights closely."""
    active = {d: float(w) for d, w in weights.items() if w > 0}
    total = sum(active.values())
    current = {d: 0.0 for d in active}
    while True:
        for d in active:
            current[d] += active[d]
        best = max(active, key=lambda d: (current[d], -DOMAINS.index(d)))
        current[best] -= total
        yield best


def builtin_prompts(
    num_prompts: int,
    *,
    seed: int = 0,
    domains: dict[str, float] | None = None,
    heldout_fraction: float = 0.125,
) -> list[Conversation]:
    """The first ``num_prompts`` built-in prompts for ``seed`` (prefix-stable, fixed held-out split).

    >>> ps = builtin_prompts(8, seed=0)
    >>> [p.domain for p in ps[:4]]
    ['general', 'code', 'math', 'agent']
    """
    domains = dict(domains) if domains is not None else {d: 1.0 for d in DOMAINS}
    check_domains(domains)
    seen: set[str] = set()
    counts = {d: 0 for d in DOMAINS}
    out: list[Conversation] = []
    seq = _domain_sequence(domains)
    for _ in range(num_prompts):
        dom = next(seq)
        j = counts[dom]
        counts[dom] += 1
        # Draw until the conversation is new. Attempts depend only on earlier prompts, so the
        # sequence stays prefix-stable.
        for attempt in range(1000):
            rng = random.Random(f"drafter-prompts/{seed}/{dom}/{j}/{attempt}")
            msgs = GENERATORS[dom](rng)
            fp = json.dumps(msgs, sort_keys=True)
            if fp not in seen:
                break
        else:  # pragma: no cover - the template space is far larger than any run
            raise StageError(f"built-in prompt generator ran out of distinct {dom} prompts at #{j}")
        seen.add(fp)
        out.append(Conversation(
            id=f"{dom}-s{seed}-{j:05d}", domain=dom, split=_builtin_split(seed, dom, j, heldout_fraction),
            messages=tuple(msgs), source="builtin"))
    return out


def _builtin_split(seed: int, domain: str, j: int, fraction: float) -> str:
    """Held out iff the low-discrepancy point frac(offset + j·f) falls in [0, f): exactly one prompt in
    every 1/f of a domain, evenly spread, independent of how many prompts are drawn."""
    if fraction <= 0:
        return "train"
    offset = _unit_hash("heldout-offset", seed, domain)
    x = (offset + j * fraction) % 1.0
    return "heldout" if x < fraction else "train"


# --------------------------------------------------------------------------------------------
# User files
# --------------------------------------------------------------------------------------------


def _normalize_messages(msgs: Any, where: str, keep_answers: bool = False) -> tuple[dict, ...]:
    """Validate user messages; assistant contents become placeholders (they are regenerated), or, with
    ``keep_answers``, stay as written where they are given (a missing or empty answer is a placeholder: the
    served target gives it). A last user turn gets a placeholder answer after it."""
    if not isinstance(msgs, list) or not msgs:
        raise BadInputError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects, got {_short(msgs)}")
    out: list[dict] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadInputError(f"{where}: messages[{i}] must be an object with `role` and `content`, got {_short(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadInputError(
                f"{where}: messages[{i}].role is {_name_shown(role)}; allowed roles are {', '.join(ROLES)} "
                f"(put tool output into a user message)")
        if role == "system" and i != 0:
            raise BadInputError(f"{where}: messages[{i}] is a system message; only the first message may be one")
        if role != "assistant":
            if not isinstance(content, str) or not content.strip():
                raise BadInputError(f"{where}: messages[{i}].content ({role}) must be a non-empty string, got {_short(content)}")
            out.append({"role": role, "content": content})
        else:
            if content is not None and not isinstance(content, str):
                raise BadInputError(f"{where}: messages[{i}].content (assistant) must be a string or null, got {_short(content)}")
            if out and out[-1]["role"] == "assistant":
                raise BadInputError(f"{where}: messages[{i}] is a second assistant message in a row")
            if not out or out[-1]["role"] == "system":
                raise BadInputError(f"{where}: messages[{i}] is an assistant message before any user message")
            if keep_answers and isinstance(content, str) and not content.strip():
                content = None  # an empty answer: to be given by the served target
            out.append({"role": "assistant", "content": content if keep_answers else None})
    if not any(m["role"] == "user" for m in out):
        raise BadInputError(f"{where}: the conversation has no user message")
    if out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})  # answer the last user turn too
    return tuple(out)


def _short(v: Any) -> str:
    """A bad value in an error message: its type and size, never its text (rows may hold secrets)."""
    from drafter.core.errors import describe_value

    return describe_value(v)


def _name_shown(v: Any) -> str:
    """A role or key name in an error message: shown when it looks like a name (``tool``), else described."""
    import re

    if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,31}", v):
        return repr(v)
    return _short(v)


def _user_row(row: Any, where: str, heldout_fraction: float, source: str,
              keep_answers: bool = False) -> Conversation:
    if not isinstance(row, dict):
        raise BadInputError(f"{where}: each row must be an object with a `messages` list, got {_short(row)}")
    if "messages" not in row:
        raise BadInputError(f"{where}: row has no `messages` field (keys: {', '.join(_name_shown(k) for k in row) or 'none'})")
    msgs = _normalize_messages(row["messages"], where, keep_answers)
    rid = row.get("id")
    if rid is None:  # the hash of the messages as regenerated: kept answers do not change a row's id
        rid = "user-" + hashlib.sha256(json.dumps(placeholder_answers(msgs), sort_keys=True).encode()).hexdigest()[:16]
    elif not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        raise BadInputError(f"{where}: `id` must be a non-empty string or integer, got {_short(rid)}")
    rid = str(rid)
    domain = row.get("domain") or "user"
    if not isinstance(domain, str):
        raise BadInputError(f"{where}: `domain` must be a string, got {_short(domain)}")
    split = row.get("split")
    if split is None:
        split = "heldout" if _unit_hash("heldout-user", rid) < heldout_fraction else "train"
    elif split not in SPLITS:
        raise BadInputError(f"{where}: `split` must be one of {', '.join(SPLITS)}, got {_short(split)}")
    return Conversation(id=rid, domain=domain, split=split, messages=msgs, source=source, origin=where)


def placeholder_answers(messages: Iterable[dict]) -> list[dict]:
    """``messages`` as the `generate` stage sees them: every assistant content a placeholder (``None``),
    and a placeholder answer after a last user turn — the form ids and content hashes are taken of, so a
    conversation read with its answers kept (a held-out file) hashes like the same one read for training."""
    out = [{"role": m["role"], "content": None if m["role"] == "assistant" else m["content"]} for m in messages]
    if out and out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})
    return out


def load_user_file(path: str | Path, *, heldout_fraction: float = 0.125, keep_answers: bool = False,
                   setting: str = "generate.user_files") -> list[Conversation]:
    """Conversations from a JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) file.

    Each row needs ``messages`` (a list of ``{role, content}``; in Parquet a list of structs or a JSON
    string); optional ``id``, ``domain``, ``split``. Bad rows raise :class:`BadInputError` (a
    :class:`StageError`) naming the file, the line (JSONL) or row (Parquet), and the problem; each
    conversation's ``origin`` is that same ``file:line`` / ``file row N``. ``keep_answers``: the
    assistant turns are kept where written instead of becoming placeholders (placeholders where missing or
    empty, one after a last user turn);
    ``setting`` is the config field the file came from, named in errors.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise BadInputError(f"prompt file {path} {what}; fix the path in {setting}")
    suffix = path.suffix.lower()
    convs: list[Conversation] = []
    if suffix in (".jsonl", ".json", ".ndjson"):
        try:
            f = path.open("rb")
        except OSError as e:
            raise BadInputError(f"prompt file {path}: cannot read it ({e.strerror}); check its permissions") from None
        with f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadInputError(
                        f"{where}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8; "
                        "save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadInputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                convs.append(_user_row(row, where, heldout_fraction, str(path), keep_answers))
    elif suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
            raise BadInputError(f"prompt file {path}: cannot read as Parquet ({type(e).__name__}); "
                                "check that it is a valid Parquet file, or give the rows as .jsonl") from None
        if "messages" not in table.column_names:
            raise BadInputError(f"prompt file {path}: no `messages` column (columns: {table.column_names})")
        for i, row in enumerate(table.to_pylist()):
            where = f"{path} row {i}"
            if isinstance(row.get("messages"), str):
                try:
                    row["messages"] = json.loads(row["messages"])
                except json.JSONDecodeError as e:
                    raise BadInputError(f"{where}: `messages` is a string but not valid JSON ({e.msg})") from None
            convs.append(_user_row(row, where, heldout_fraction, str(path), keep_answers))
    else:
        raise BadInputError(f"prompt file {path}: unknown format {suffix!r}; use .jsonl or .parquet")
    if not convs:
        raise BadInputError(f"prompt file {path} has no conversations; add rows with `messages`, or remove it from "
                            f"{setting}")
    return convs


def build_prompts(cfg: "GenerateConfig") -> list[Conversation]:
    """All conversations of a run: built-in prompts, then every user file in order.

    Ids are unique across the result; a repeated id raises :class:`BadInputError` naming both rows.
    Identical conversations without an explicit id (same hash id) are kept once.
    """
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed, domains=cfg.domains,
                            heldout_fraction=cfg.heldout_fraction) if cfg.num_prompts else []
    seen: dict[str, Conversation] = {c.id: c for c in convs}
    for f in cfg.user_files:
        for c in load_user_file(f, heldout_fraction=cfg.heldout_fraction):
            prev = seen.get(c.id)
            if prev is not None:
                if prev.messages == c.messages and c.id.startswith("user-"):
                    continue  # exact duplicate conversation
                raise BadInputError(f"prompt id {c.id!r} appears twice: in {prev.origin or prev.source} and in "
                                    f"{c.origin or c.source}; give each conversation its own `id`")
            seen[c.id] = c
            convs.append(c)
    return convs
