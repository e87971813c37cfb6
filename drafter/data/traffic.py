"""Fresh traffic for a scheduled retrain: the conversations of glob patterns of JSONL/Parquet files,
deduplicated by content within the run and against every earlier retrain (a ledger of content
hashes kept in the store, ``records/traffic-seen.txt``).

Example::

    seen = load_seen(store)
    t = new_traffic(["/data/traffic/*.jsonl"], seen)
    if len(t.new) >= cfg.retrain.min_new_rows:
        path = write_snapshot(t.new, out_dir)        # becomes generate.user_files
        ...                                          # the release runs
        record_seen(store, seen | set(t.hashes))     # only after it succeeded
"""
from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from drafter.core.errors import BadInputError
from drafter.data.prompts import Conversation, load_user_file, placeholder_answers

LEDGER = "traffic-seen.txt"


def conversation_hash(conv: Conversation) -> str:
    """The content hash of a conversation: its messages (roles and texts; assistant turns are regenerated,
    so their text does not count: :func:`~drafter.data.prompts.placeholder_answers`), not its id or file.
    A held-out conversation read with its answers hashes like the same conversation read for training."""
    return hashlib.sha256(json.dumps(placeholder_answers(conv.messages), sort_keys=True).encode()).hexdigest()


@dataclass
class Traffic:
    files: list[str]
    rows: int = 0  # conversations read
    new: list[Conversation] = field(default_factory=list)  # never seen (first of each content)
    hashes: list[str] = field(default_factory=list)  # of ``new``
    seen_before: int = 0  # rows an earlier retrain already used
    duplicates: int = 0  # rows repeating another row of this run


def find_files(patterns: list[str]) -> list[str]:
    """Every file matching the glob ``patterns`` (sorted); a pattern that matches nothing is an error."""
    files: set[str] = set()
    for pat in patterns:
        found = [f for f in glob.glob(pat, recursive=True) if Path(f).is_file()]
        if not found:
            raise BadInputError(f"retrain: no traffic file matches {pat!r}; check the pattern (retrain.traffic or the "
                                "flow's `traffic` parameter)")
        files.update(found)
    return sorted(files)


def new_traffic(patterns: list[str], seen: set[str], heldout_fraction: float = 0.125) -> Traffic:
    """Read the traffic files and keep the conversations whose content is in neither ``seen`` nor earlier in this run."""
    t = Traffic(files=find_files(patterns))
    here: set[str] = set()
    for f in t.files:
        for conv in load_user_file(f, heldout_fraction=heldout_fraction):
            t.rows += 1
            h = conversation_hash(conv)
            if h in seen:
                t.seen_before += 1
            elif h in here:
                t.duplicates += 1
            else:
                here.add(h)
                t.new.append(conv)
                t.hashes.append(h)
    return t


def write_snapshot(convs: list[Conversation], out_dir: Path) -> Path:
    """The new conversations as one JSONL file named by its content (``traffic-<sha16>.jsonl``), the file
    the release's ``generate.user_files`` points at: the same new traffic gives the same file and key."""
    lines = [json.dumps({"id": c.id, "domain": c.domain, "split": c.split, "messages": list(c.messages)},
                        sort_keys=True) for c in convs]
    text = "".join(line + "\n" for line in lines)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"traffic-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        tmp = path.with_name("." + path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def load_seen(store) -> set[str]:
    """The content hashes earlier retrains used (:meth:`drafter.core.store.Store.read_record`)."""
    text = store.read_record(LEDGER) or ""
    return {ln.strip() for ln in text.splitlines() if ln.strip()}


def record_seen(store, hashes: set[str]) -> str:
    """Replace the ledger with ``hashes`` (sorted, one per line)."""
    return store.write_record(LEDGER, "".join(h + "\n" for h in sorted(hashes)))
