"""The turns a live replay sends: each assistant turn of the held-out conversations, with every message before it
(`ab_live` replays them; preflight checks their lengths against the served context)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from drafter.core.errors import StageError

REPLAY_DOMAIN = "agent"


@dataclass(frozen=True)
class ReplayTurn:
    """One request of the replay: an assistant turn of a held-out conversation and what came before it."""

    conv_id: str
    domain: str
    message_index: int  # index of the assistant message in the conversation
    messages: list[dict] = field(repr=False)  # the prompt: every message before it
    template_kwargs: dict = field(default_factory=dict, repr=False)


def _assistant_count(row: dict) -> int:
    return sum(1 for m in row.get("messages", []) if m.get("role") == "assistant")


def _turns_of(row: dict) -> list[ReplayTurn]:
    msgs = row["messages"]
    return [ReplayTurn(conv_id=row["id"], domain=row.get("domain", "?"), message_index=i,
                       messages=[{"role": m["role"], "content": m["content"]} for m in msgs[:i]],
                       template_kwargs=dict(row.get("chat_template_kwargs") or {}))
            for i, m in enumerate(msgs) if m.get("role") == "assistant" and i > 0]


def replay_turns(rows: Iterable[dict], num_turns: int, split: str = "heldout",
                 domain: str = REPLAY_DOMAIN) -> tuple[list[ReplayTurn], list[str]]:
    """The first ``num_turns`` assistant turns of the ``split`` conversations, multi-turn ``domain`` first.

    Conversations are taken whole, in id order: every turn of the first agent conversation, then
    the next one's, so later turns carry the earlier ones (as an agent's requests do). With fewer
    than ``num_turns`` such turns, other domains' multi-turn conversations of the split fill up,
    then (still short) the split's single-turn ones; each fallback is said in the returned notes.
    Raises :class:`StageError` when the split has no conversation at all.
    """
    held = sorted((r for r in rows if r.get("split") == split and r.get("messages")), key=lambda r: r["id"])
    if not held:
        raise StageError(f"no {split!r} conversations to replay (the generate output has none)")
    tiers = [
        (f"multi-turn {domain}", [r for r in held if r.get("domain") == domain and _assistant_count(r) > 1]),
        ("other domains' multi-turn", [r for r in held if r.get("domain") != domain and _assistant_count(r) > 1]),
        ("single-turn", [r for r in held if _assistant_count(r) == 1]),
    ]
    turns: list[ReplayTurn] = []
    notes: list[str] = []
    for i, (what, tier) in enumerate(tiers):
        if len(turns) >= num_turns:
            break
        before = len(turns)
        for r in tier:
            turns += _turns_of(r)
            if len(turns) >= num_turns:
                break
        added = min(len(turns), num_turns) - before
        if i > 0 and added:
            notes.append(f"only {before} {split} turns from {tiers[0][0]} conversations; "
                         f"{added} more taken from {what} conversations")
    turns = turns[:num_turns]
    if len(turns) < num_turns:
        notes.append(f"ab_live.num_turns={num_turns} but the {split} split has only {len(turns)} assistant turns: "
                     f"replaying {len(turns)}")
    return turns, notes
