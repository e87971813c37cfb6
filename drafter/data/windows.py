"""Training/evaluation windows cut from captured features.

A window is a contiguous slice of one conversation: its token ids, assistant-only loss mask,
the target's LM-head input (``hidden_final``) and the absolute positions of its tokens. Windows
never cross conversations and are never padded (the drafter's attention masks assume neither).

The captured ``train`` split is divided into two disjoint halves by a hash of the row id:
``bootstrap`` (the demo's stand-in released drafter learns from it) and ``finetune``.

Windows are loaded on the CPU; :meth:`Window.to` moves one to the model's device when it is used.

Example::

    wins = load_windows(capture_dir, split="train", part="finetune", window=256)
    wins[0].input_ids.shape, wins[0].hidden.shape     # [T], [T, H]
    wins[0].to("cuda").positions                        # on the GPU
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.data.capture import iter_feature_shards
from drafter.core.errors import StageError


@dataclass
class Window:
    row_id: str
    start: int  # position of the first token in its conversation
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    hidden: torch.Tensor  # [T, H] float32: the target's LM-head input
    features: torch.Tensor | None = None  # [T, n·H]: captured layers concatenated (``feature_layers``), or None

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def positions(self) -> torch.Tensor:
        """[T] int64: the absolute positions of the tokens, on the window's device."""
        return torch.arange(self.start, self.start + len(self.input_ids), device=self.device)

    def to(self, device: torch.device | str) -> "Window":
        """This window with its tensors on ``device``: a new Window, or ``self`` when they are already there
        (``Tensor.to`` returns the tensor itself then: no copy)."""
        tensors = (self.input_ids, self.loss_mask, self.hidden, self.features)
        moved = tuple(None if t is None else t.to(device) for t in tensors)
        if all(m is t for m, t in zip(moved, tensors)):
            return self
        return Window(self.row_id, self.start, *moved)


def row_part(row_id: str) -> str:
    """`bootstrap` or `finetune`: a stable half of the train split, decided by the row id alone."""
    return "bootstrap" if hashlib.sha256(row_id.encode()).digest()[0] % 2 == 0 else "finetune"


def in_calibration_slice(row_id: str, fraction: float) -> bool:
    """Whether conversation ``row_id`` belongs to the calibration slice of ``fraction`` of a training part
    (a stable hash of the row id alone, independent of the bootstrap/finetune halves)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"calibration fraction must lie in [0, 1), got {fraction}")
    h = int.from_bytes(hashlib.sha256(b"calibration:" + row_id.encode()).digest()[:4], "big")
    return h < fraction * 2 ** 32


def load_windows(capture, split: str, part: str = "all", window: int = 256, min_tokens: int = 8,
                 max_windows: int | None = None, feature_layers: list[int] | tuple[int, ...] = ()) -> list[Window]:
    """Cut the captured conversations of ``split`` (and ``part`` of it) into windows of at most
    ``window`` tokens; windows shorter than ``min_tokens`` are dropped (too short for K steps).
    ``feature_layers``: captured ``hidden_layer_{i}`` tensors to concatenate into ``Window.features``
    (a DSpark draft's context; :func:`drafter.models.dspark.capture_layers`)."""
    from drafter.data.capture import layer_tensor_name

    if part not in ("bootstrap", "finetune", "all"):
        raise ValueError(f"part must be bootstrap, finetune or all; got {part!r}")
    extra = [layer_tensor_name(i) for i in feature_layers]
    out: list[Window] = []
    for shard in iter_feature_shards(capture, split, names=["hidden_final", *extra]):
        if "hidden_final" not in shard.tensors:
            raise StageError(f"{shard.path}: no hidden_final tensor (capture must store the LM-head input)")
        lacking = [n for n in extra if n not in shard.tensors]
        if lacking:
            raise StageError(f"{shard.path}: no {', '.join(lacking)} tensor(s): capture.layers must include "
                             f"{list(feature_layers)} (it stored {shard.meta.get('layers', '[]')})")
        ids = shard.row_ids
        for k in range(shard.num_sequences):
            rid = ids[k]
            if part != "all" and row_part(rid) != part:
                continue
            seq = shard.sequence(k)
            n = len(seq["input_ids"])
            for a in range(0, n, window):
                b = min(a + window, n)
                if b - a < min_tokens:
                    continue
                feats = torch.cat([seq[n][a:b].float() for n in extra], dim=-1) if extra else None
                out.append(Window(rid, a, seq["input_ids"][a:b].long(), seq["loss_mask"][a:b].bool(),
                                  seq["hidden_final"][a:b].float(), feats))
                if max_windows is not None and len(out) >= max_windows:
                    return out
    if not out:
        where = Path(getattr(capture, "path", capture))
        raise StageError(f"{where}: no {split} windows (part {part}) of at least {min_tokens} tokens in the captured features")
    return out


def window_order(n: int, seed: int, index: int) -> int:
    """The window used at position ``index`` of the data stream: a fresh seeded permutation each
    epoch, so the order depends only on (seed, index) — a resumed run sees the same data."""
    epoch, i = divmod(index, n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return int(torch.randperm(n, generator=g)[i])
