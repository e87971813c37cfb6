"""Fresh traffic for a scheduled retrain: the conversations of glob patterns of JSONL/Parquet files,
scrubbed, then deduplicated by content within the run and against every earlier retrain (a ledger of
content hashes kept in the store, ``records/traffic-seen.txt``).

**Secrets.** Traffic is what users typed: it holds API keys, passwords, tokens. Every conversation is
scrubbed with the release's rules (``cfg.scrub``, :func:`drafter.data.scrub.scrub_conversations`: message
contents, and ids/domains holding a secret) the moment it is read, before it is hashed, counted, written or
logged. :attr:`Traffic.new` holds only scrubbed conversations, so the snapshot file (which becomes
``generate.user_files``), the ledger, logs, artifacts and run summaries never see the raw text. An id that
``load_user_file`` derived from the raw content (``user-<hash>``, for rows without an ``id``) is derived again
from the scrubbed content.

**The ledger hashes scrubbed content.** ``records/traffic-seen.txt`` holds
:func:`conversation_hash` of each conversation *after* scrubbing: a SHA-256 of text that contains no
secret, so the ledger cannot confirm a guessed secret (a plain hash of raw text could: whoever guesses a
short conversation and its key can check the guess against the hash). Nothing is lost by not hashing the raw
text: two conversations that differ only in a secret are the same training data once scrubbed, so they are
rightly one conversation here. The same raw traffic under the same ``cfg.scrub`` gives the same scrubbed
conversations, so it is still recognised on the next run, and gives the same snapshot file (named by the
hash of its scrubbed content) and the same stage keys. Changing ``cfg.scrub`` changes what the scrubbed text
is: a conversation with a secret then counts as new once (it is new training data).
Ledgers written before traffic was scrubbed hold the raw hash of such conversations: a raw hash found there
still marks the conversation as seen, and :meth:`Traffic.ledger` replaces it by the scrubbed hash, so the
ledger sheds them as the traffic comes round again.

Example::

    seen = load_seen(store)
    t = new_traffic(["/data/traffic/*.jsonl"], seen, scrubber_for(cfg.scrub))
    if len(t.new) >= cfg.retrain.min_new_rows:
        path = write_snapshot(t.new, out_dir)        # becomes generate.user_files
        ...                                          # the release runs
        record_seen(store, t.ledger(seen))           # only after it succeeded
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.errors import BadInputError
from drafter.data.prompts import Conversation, load_user_file, placeholder_answers

if TYPE_CHECKING:
    from drafter.data.scrub import Scrubber

LEDGER = "traffic-seen.txt"
SETTING = "retrain.traffic (or the flow's `traffic` parameter)"


def conversation_hash(conv: Conversation) -> str:
    """The content hash of a conversation: its messages (roles and texts; assistant turns are regenerated,
    so their text does not count: :func:`~drafter.data.prompts.placeholder_answers`), not its id or file.
    A held-out conversation read with its answers hashes like the same conversation read for training.
    The retrain ledger takes it of scrubbed conversations only (:func:`scrub_traffic`)."""
    return hashlib.sha256(json.dumps(placeholder_answers(conv.messages), sort_keys=True).encode()).hexdigest()


def _derived_id(conv: Conversation) -> str:
    """The id :func:`~drafter.data.prompts.load_user_file` gives a row without an ``id``."""
    return "user-" + conversation_hash(conv)[:16]


def scrub_traffic(conv: Conversation, scrubber: "Scrubber") -> tuple[Conversation, Counter]:
    """``conv`` scrubbed (:func:`drafter.data.scrub.scrub_conversations`) and the count of secrets per kind.
    When something was removed and the id was derived from the raw content, it is derived again from the
    scrubbed content (a hash of the raw text must not travel with the scrubbed conversation)."""
    from drafter.data.scrub import scrub_conversations

    (clean,), counts, _ = scrub_conversations([conv], scrubber)
    if counts and clean.id == _derived_id(conv):
        clean = dataclasses.replace(clean, id=_derived_id(clean))
    return clean, counts


@dataclass
class Traffic:
    files: list[str]
    rows: int = 0  # conversations read
    new: list[Conversation] = field(default_factory=list)  # scrubbed, never seen (first of each content)
    hashes: list[str] = field(default_factory=list)  # of ``new`` (scrubbed content)
    seen_before: int = 0  # rows an earlier retrain already used
    duplicates: int = 0  # rows repeating another row of this run
    secrets: Counter = field(default_factory=Counter)  # secrets removed, per kind (all rows read)
    scrubbed: int = 0  # rows that held at least one secret
    legacy: dict[str, str] = field(default_factory=dict)  # raw hash in an old ledger → its scrubbed hash

    def ledger(self, seen: set[str]) -> set[str]:
        """The ledger once this traffic is used: ``seen``, the new hashes, and raw hashes of an earlier
        ledger replaced by their scrubbed ones."""
        return (set(seen) - set(self.legacy)) | set(self.legacy.values()) | set(self.hashes)

    def secrets_text(self) -> str:
        """``3 secret(s) removed from 2 conversation(s) (api_key 2, password 1)`` (counts, never text), or
        ``no secret found``."""
        if not self.secrets:
            return "no secret found"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.secrets.items()))
        return f"{sum(self.secrets.values())} secret(s) removed from {self.scrubbed} conversation(s) ({kinds})"


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


def read_traffic_file(path: str, heldout_fraction: float) -> list[Conversation]:
    """The conversations of one traffic file; a bad row raises :class:`BadInputError` naming the file:line
    (Parquet: ``file row N``), the problem (never the row's text) and what to do."""
    try:
        return load_user_file(path, heldout_fraction=heldout_fraction, setting=SETTING)
    except BadInputError as e:
        raise BadInputError(
            f"retrain traffic: {e}. Fix or delete that row in the traffic file (or move the file out of the "
            f"patterns of {SETTING}) and run the retrain again; nothing was written and no traffic was "
            "marked as used") from None


def new_traffic(patterns: list[str], seen: set[str], scrubber: "Scrubber",
                heldout_fraction: float = 0.125) -> Traffic:
    """Read the traffic files, scrub every conversation with ``scrubber`` and keep those whose scrubbed content
    is in neither ``seen`` nor earlier in this run. Nothing is written."""
    t = Traffic(files=find_files(patterns))
    here: set[str] = set()
    for f in t.files:
        for raw in read_traffic_file(f, heldout_fraction):
            t.rows += 1
            conv, counts = scrub_traffic(raw, scrubber)
            if counts:
                t.scrubbed += 1
                t.secrets.update(counts)
            h = conversation_hash(conv)
            old = conversation_hash(raw) if counts else h  # differs only when a secret was removed
            if h in seen or old in seen:
                t.seen_before += 1
                if old != h and old in seen:
                    t.legacy[old] = h  # an earlier ledger's hash of the raw text: replaced on record
            elif h in here:
                t.duplicates += 1
            else:
                here.add(h)
                t.new.append(conv)
                t.hashes.append(h)
    return t


def write_snapshot(convs: list[Conversation], out_dir: Path) -> Path:
    """The new conversations (:attr:`Traffic.new`: already scrubbed) as one JSONL file named by its content
    (``traffic-<sha16>.jsonl``), the file the release's ``generate.user_files`` points at: the same new traffic
    gives the same file and key."""
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
    """Replace the ledger with ``hashes`` (sorted, one per line): :meth:`Traffic.ledger`."""
    return store.write_record(LEDGER, "".join(h + "\n" for h in sorted(hashes)))
