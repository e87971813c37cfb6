"""A draft vocabulary: the subset of the target's vocabulary an MTP drafter may propose.

A drafter's output head is the target's: a (vocab × hidden) matrix that every draft pass reads whole
to pick one token. On the embedded target (49,152 × 576 in float32, 113 MB) that read is most of a draft
pass on a CPU, whose speed is memory bandwidth. The tokens a drafter gets accepted on are the ones the
target writes, and a few thousand of them cover nearly all of what it writes; restricting the draft head
to those rows makes each draft pass that much cheaper. Lossless: the target still verifies every draft, so
what is served is unchanged; a token outside the set can only be produced by the target, never drafted.

The set is built from the training split (every token the target wrote or read there) plus the lowest
token ids (a BPE tokenizer numbers its merges by frequency), up to ``size``. It is stored next to the
served model as ``draft_vocab.safetensors`` (one int64 tensor ``token_ids``, sorted); the project's vLLM
plugin (drafter/serving/vllm_fixes.py) reads it when vLLM loads an MTP drafter from that directory.
A vLLM without the plugin ignores the file and drafts over the whole vocabulary.

This module imports neither vLLM nor Prefect.

Example::

    ids = build_draft_vocab(train_rows, vocab_size=49152, size=8192)
    save_draft_vocab(ids, served_dir / DRAFT_VOCAB_FILE)
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from drafter.core.errors import StageError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
TENSOR = "token_ids"


def build_draft_vocab(token_lists: Iterable[Iterable[int]], *, vocab_size: int, size: int) -> list[int]:
    """The sorted draft vocabulary of ``size`` ids in [0, vocab_size): every id seen in ``token_lists``
    (most frequent first, when they are more than ``size``), then the lowest unseen ids up to ``size``."""
    from collections import Counter

    if not 0 < size <= vocab_size:
        raise StageError(f"draft vocabulary size {size} must be in 1..{vocab_size} (the target's vocab_size)")
    counts: Counter[int] = Counter()
    for ids in token_lists:
        counts.update(ids)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise StageError(f"token id(s) {sorted(bad)[:5]} outside the target's vocabulary of {vocab_size}")
    chosen = [t for t, _ in counts.most_common(size)]
    seen = set(chosen)
    nxt = 0
    while len(chosen) < size:
        if nxt not in seen:
            chosen.append(nxt)
        nxt += 1
    return sorted(chosen)


def save_draft_vocab(ids: list[int], path: Path | str, *, metadata: dict[str, str] | None = None) -> Path:
    import torch

    from drafter.core.files import save_safetensors

    path = Path(path)
    save_safetensors({TENSOR: torch.tensor(sorted(ids), dtype=torch.int64)}, str(path),
                     metadata={"format": "pt", **(metadata or {})})
    return path


def load_draft_vocab(path: Path | str, vocab_size: int | None = None):
    """The ``token_ids`` tensor of a draft vocabulary file, checked: 1-D int64, sorted, unique, in range."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    tensors = load_file(str(path))
    if TENSOR not in tensors:
        raise StageError(f"{path}: no tensor {TENSOR!r} (has {sorted(tensors)})")
    ids = tensors[TENSOR]
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise StageError(f"{path}: {TENSOR} must be a non-empty 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise StageError(f"{path}: {TENSOR} must be sorted and unique")
    if int(ids[0]) < 0 or (vocab_size is not None and int(ids[-1]) >= vocab_size):
        raise StageError(f"{path}: {TENSOR} holds ids outside [0, {vocab_size})")
    return ids
