"""Locate the FP8 release of a target's drafter: its keys, its FP8 tensors and scales, its rule.

A release is a checkpoint directory (``config.json`` + ``model.safetensors.index.json`` + shards).
Its drafter keys are every ``mtp.*`` key (DeepSeek-V4 naming) or, otherwise, every key of the MTP
layers ``model.layers.{L}..{L+n-1}.*`` with ``L = num_hidden_layers`` and ``n =
num_nextn_predict_layers``. An FP8 tensor is an E4M3 weight with a scale companion: V3's
``<name>_scale_inv`` (float32) or V4's ``<module>.scale`` (``float8_e8m0fnu``). The rule comes from
``config.json`` ``quantization_config`` (``weight_block_size``; ``scale_fmt: ue8m0``), else from the
scale dtype (float32 → 128×128 ``amax/448``; e8m0 → 32×32 UE8M0).

Example::

    rel = open_release(target_dir)        # None when the drafter has no FP8 tensors
    rel.rule, rel.block, rel.fp8          # 'float32', (128, 128), {weight name: scale name}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from drafter.core.errors import StageError
from drafter.quant.fp8 import ScaleRule

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_BLOCK: dict[str, tuple[int, int]] = {"float32": (128, 128), "ue8m0": (32, 32)}
FP8_DTYPES = ("F8_E4M3",)
SCALE_DTYPES = {"F32": "float32", "F8_E8M0": "ue8m0"}


@dataclass
class TensorInfo:
    dtype: str  # safetensors dtype string (F8_E4M3, F32, BF16, U8, F8_E8M0, …)
    shape: tuple[int, ...]
    file: str


@dataclass
class FP8Release:
    """A release checkpoint's drafter: keys, their dtypes/shapes, FP8 weights and their scales."""

    dir: Path
    config: dict
    index: dict
    drafter_keys: list[str]
    info: dict[str, TensorInfo]
    fp8: dict[str, str]  # E4M3 weight → its scale key
    rule: ScaleRule | None
    block: tuple[int, int] | None
    other_scales: dict[str, str] = field(default_factory=dict)  # non-E4M3 weight (e.g. MXFP4) → its scale

    @property
    def weight_map(self) -> dict[str, str]:
        return self.index["weight_map"]

    def path_of(self, key: str) -> Path:
        return self.dir / self.weight_map[key]


def is_drafter_key(key: str, config: dict) -> bool:
    if key.startswith("mtp.") or "Qwen3DSparkModel" in (config.get("architectures") or []):
        return True  # a standalone DSpark draft: every tensor is the drafter's
    L = int(config.get("num_hidden_layers") or 0)
    n = int(config.get("num_nextn_predict_layers") or 0)
    return any(key.startswith(f"model.layers.{i}.") for i in range(L, L + n))


def scale_key_of(key: str, keys: set[str]) -> str | None:
    """The scale companion of weight ``key`` if the checkpoint has one."""
    cands = [key + "_scale_inv"]
    if key.endswith(".weight"):
        cands.append(key[: -len(".weight")] + ".scale")
    for c in cands:
        if c in keys:
            return c
    return None


def tensor_infos(dir: Path, files: set[str]) -> dict[str, TensorInfo]:
    """dtype/shape of every tensor in ``files`` (headers only, nothing is read)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(files):
        with safe_open(str(dir / f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = TensorInfo(sl.get_dtype(), tuple(sl.get_shape()), f)
    return out


def read_rule(config: dict, scale_dtypes: set[str], where: str) -> tuple[ScaleRule | None, tuple[int, int] | None]:
    """The release's scale rule and block shape (see the module docstring)."""
    qc = config.get("quantization_config") or {}
    rules = {SCALE_DTYPES[d] for d in scale_dtypes if d in SCALE_DTYPES}
    if len(rules) > 1:
        raise StageError(f"{where}: FP8 scales of both dtypes (float32 and e8m0) in one release")
    rule = next(iter(rules), None)
    if qc.get("scale_fmt") == "ue8m0":
        if rule == "float32":
            raise StageError(f"{where}: config.json says scale_fmt ue8m0 but the drafter's scales are float32")
        rule = "ue8m0"
    if rule is None:
        return None, None
    wbs = qc.get("weight_block_size")
    block = tuple(int(b) for b in wbs) if wbs else DEFAULT_BLOCK[rule]
    if len(block) != 2:
        raise StageError(f"{where}: weight_block_size {wbs} is not [rows, cols]")
    return rule, block  # type: ignore[return-value]


def open_release(dir: Path | str) -> FP8Release | None:
    """Describe the drafter of the checkpoint at ``dir``; None when none of its tensors is FP8."""
    dir = Path(dir)
    cfg_path, idx_path = dir / "config.json", dir / INDEX_NAME
    for p in (cfg_path, idx_path):
        if not p.is_file():
            raise StageError(f"{p} is missing: the release must be a checkpoint with config.json and an index")
    config = json.loads(cfg_path.read_text())
    try:
        index = json.loads(idx_path.read_text())
        wm = index["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise StageError(f"{idx_path}: not a safetensors index ({e})") from e
    keys = sorted(k for k in wm if is_drafter_key(k, config))
    if not keys:
        raise StageError(f"{idx_path}: no drafter keys (no mtp.* and no model.layers.{{num_hidden_layers}}.*)")
    missing = sorted({wm[k] for k in keys if not (dir / wm[k]).is_file()})
    if missing:
        raise StageError(f"{idx_path} names shard(s) that do not exist: {missing}")
    infos = tensor_infos(dir, {wm[k] for k in keys})
    absent = [k for k in keys if k not in infos]
    if absent:
        raise StageError(f"{idx_path}: key(s) not in the shard the index names: {absent[:10]}")
    kset = set(keys)
    fp8, other = {}, {}
    for k in keys:
        sk = scale_key_of(k, kset)
        if sk is None:
            continue
        if infos[k].dtype in FP8_DTYPES:
            fp8[k] = sk
        else:
            other[k] = sk
    for k in keys:
        if infos[k].dtype in FP8_DTYPES and k not in fp8:
            raise StageError(f"{dir}: tensor {k} is FP8 E4M3 but has no scale ({k}_scale_inv or .scale)")
    if not fp8:
        return None
    rule, block = read_rule(config, {infos[s].dtype for s in fp8.values()}, str(dir))
    return FP8Release(dir=dir, config=config, index=index, drafter_keys=keys,
                      info={k: infos[k] for k in keys}, fp8=fp8, rule=rule, block=block, other_scales=other)
