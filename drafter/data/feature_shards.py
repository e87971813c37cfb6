"""The feature shard format of :mod:`drafter.data.capture` (``drafter-features/1``, described there):
tensor names, the checks a shard passes before it is written, byte-stable writing, and reading shards back.

Example::

    from drafter.data.feature_shards import iter_feature_shards
    for shard in iter_feature_shards(capture_artifact, "train"):
        h = shard.tensors["hidden_final"]            # [T, H]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from drafter.core.errors import StageError
from drafter.core.files import atomic_path, list_shards

FORMAT = "drafter-features/1"
SPLITS = ("train", "heldout")
FINAL = "hidden_final"


def layer_tensor_name(i: int) -> str:
    return f"hidden_layer_{i}"


def hidden_tensor_names(layers: Iterable[int]) -> list[str]:
    """Names of the hidden-state tensors a shard holds, final first."""
    return [FINAL] + [layer_tensor_name(i) for i in layers]

# --------------------------------------------------------------------------- checks


def _describe_rows(rows: list[int], offsets: torch.Tensor, row_ids: list[str], limit: int = 20) -> str:
    shown = ", ".join(map(str, rows[:limit])) + (f", … ({len(rows)} rows)" if len(rows) > limit else "")
    seq_idx = torch.searchsorted(offsets, torch.tensor(rows), right=True) - 1
    convs = list(dict.fromkeys(row_ids[int(k)] for k in seq_idx))
    conv = ", ".join(map(str, convs[:limit])) + (" …" if len(convs) > limit else "")
    return f"rows [{shown}] (conversations: {conv})"


def check_features(tensors: dict[str, torch.Tensor], shard: str, row_ids: list[str]) -> None:
    """Fail on token rows that are all zero or not finite in any hidden-state tensor, naming
    the shard, the tensor and the row indices (and their conversations). ``hidden_layer_0``
    (the embedding output) is exempt from the zero check: a padding token's embedding may
    legitimately be zero."""
    problems = []
    offsets = tensors["seq_offsets"]
    for name, t in tensors.items():
        if not name.startswith("hidden_"):
            continue
        nonfinite = (~torch.isfinite(t)).any(dim=-1)
        if bool(nonfinite.any()):
            rows = nonfinite.nonzero().flatten().tolist()
            problems.append(f"{name}: non-finite values in {_describe_rows(rows, offsets, row_ids)}")
        if name != layer_tensor_name(0):
            zero = (t == 0).all(dim=-1)
            if bool(zero.any()):
                rows = zero.nonzero().flatten().tolist()
                problems.append(f"{name}: all-zero {_describe_rows(rows, offsets, row_ids)}")
    if problems:
        raise StageError(f"capture shard {shard} has bad hidden states (shard not written):\n  " + "\n  ".join(problems))


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_feature_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    """Write one shard (safetensors format) atomically; returns its size in bytes.

    The header lists tensors and metadata in sorted order, so the same tensors give the same
    bytes (``safetensors.save_file`` orders metadata arbitrarily): a resumed capture is
    byte-identical to an uninterrupted one."""
    import struct

    header: dict = {"__metadata__": dict(sorted(meta.items()))}
    arrays, off = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} not supported in feature shards")
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + raw.numel()]}
        arrays.append(raw)
        off += raw.numel()
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hjson)))
            f.write(hjson)
            for raw in arrays:
                f.write(memoryview(raw.numpy()))
    return path.stat().st_size


def read_shard_metadata(path: Path) -> dict[str, str] | None:
    """The safetensors metadata of a shard, or ``None`` if the file is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:
        return None


# --------------------------------------------------------------------------- reading


@dataclass
class FeatureShard:
    """One feature shard, loaded: ``tensors`` (see module doc), ``meta`` (header metadata)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]

    @property
    def split(self) -> str:
        return self.meta["split"]

    @property
    def row_ids(self) -> list[str]:
        return json.loads(self.meta["row_ids"])

    @property
    def layers(self) -> list[int]:
        return json.loads(self.meta.get("layers", "[]"))

    @property
    def num_sequences(self) -> int:
        return int(self.tensors["seq_offsets"].numel()) - 1

    def sequence(self, k: int) -> dict[str, torch.Tensor]:
        """Per-token tensors of conversation ``k`` of this shard (views)."""
        a, b = (int(x) for x in self.tensors["seq_offsets"][k: k + 2])
        return {n: t[a:b] for n, t in self.tensors.items() if n != "seq_offsets"}


def iter_feature_shards(artifact, split: str, names: Iterable[str] | None = None) -> Iterator[FeatureShard]:
    """Feature shards of a capture output (an :class:`~drafter.core.stage.Artifact` or its directory)
    for ``split`` (``train`` / ``heldout``), in order. ``names`` limits which tensors are loaded
    (``input_ids``, ``loss_mask`` and ``seq_offsets`` always are)."""
    from safetensors import safe_open

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(getattr(artifact, "path", artifact))
    base = root / "features" if (root / "features").is_dir() else root
    for path in list_shards(base / split, "safetensors"):
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = list(f.keys())
            want = keys if names is None else [k for k in keys if k in set(names) | {"input_ids", "loss_mask", "seq_offsets"}]
            tensors = {k: f.get_tensor(k) for k in want}
        if meta.get("format") != FORMAT:
            raise StageError(f"{path}: not a feature shard of format {FORMAT} (got {meta.get('format')!r})")
        yield FeatureShard(path, tensors, meta)
