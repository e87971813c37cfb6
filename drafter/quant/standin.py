"""The demo's stand-in FP8 release of the embedded target's drafter, written by the reference
implementation (:mod:`drafter.quant.reference`) in DeepSeek-V3's layout: the decoder block's linear
weights in FP8 E4M3 blocks, norms/router/``eh_proj``/head in BF16/F32, a copy of the target's index
with the drafter keys pointed at the stand-in shard.

Example::

    write_standin_release(target_dir, released_tensors, out / "standin-release", rule="ue8m0")
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from drafter.quant.reference import quantize_ref


def fp8_tensors(name: str, w: np.ndarray, block, rule: str, v4: bool) -> dict[str, torch.Tensor]:
    q, s = quantize_ref(w, block, rule)
    qt = torch.from_numpy(q).view(torch.float8_e4m3fn)  # a view of the reference's bytes, no cast
    if rule == "ue8m0":
        st = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    else:
        st = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32))
    sname = name[: -len(".weight")] + ".scale" if v4 else name + "_scale_inv"
    return {name: qt, sname: st}


def write_release(out_dir: Path, config: dict, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    from drafter.core.files import save_safetensors

    out_dir.mkdir(parents=True, exist_ok=True)
    wm, total = {}, 0
    for fname, tensors in shards.items():
        save_safetensors({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            wm[k] = fname
            total += v.numel() * v.element_size()
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


STANDIN_SHARD = "model-mtp-fp8.safetensors"


def is_standin_fp8(name: str, shape: tuple) -> bool:
    """Which drafter tensors the stand-in release stores as FP8 (DeepSeek-V3's choice: the decoder
    block's linear weights; norms, router, ``eh_proj`` and the head stay BF16/F32)."""
    return len(shape) == 2 and any(s in name for s in (".self_attn.", ".mlp.experts.", ".mlp.shared_experts."))


def write_standin_release(target_dir: Path, released: Path, out_dir: Path, rule: str,
                          block: tuple[int, int] | None = None) -> Path:
    """The demo's stand-in FP8 release: the released drafter tensors (``released``, float) written by the
    reference implementation into ``out_dir/model-mtp-fp8.safetensors``, with a copy of the target's
    index (drafter keys pointed at that shard) and its config.json plus a ``quantization_config``."""
    from safetensors import safe_open

    from drafter.quant.release import DEFAULT_BLOCK, is_drafter_key

    block = tuple(block or DEFAULT_BLOCK[rule])
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    config = json.loads((target_dir / "config.json").read_text())
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    keys = sorted(k for k in index["weight_map"] if is_drafter_key(k, config))
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(released), framework="pt") as f:
        have = set(f.keys())
        missing = [k for k in keys if k not in have]
        if missing:
            from drafter.core.errors import StageError

            raise StageError(f"{released}: the released drafter lacks {len(missing)} drafter key(s) of the target: {missing[:10]}")
        for k in keys:
            w = f.get_tensor(k).float()
            if is_standin_fp8(k, tuple(w.shape)):
                tensors |= fp8_tensors(k, w.numpy(), block, rule, v4=False)
            elif k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias"):
                tensors[k] = w
            else:
                tensors[k] = w.to(torch.bfloat16)
    from drafter.core.files import save_safetensors

    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / STANDIN_SHARD), metadata={"format": "pt"})
    wm = dict(index["weight_map"])
    for k in tensors:
        wm[k] = STANDIN_SHARD
    index["weight_map"] = dict(sorted(wm.items()))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if rule == "ue8m0":
        qc["scale_fmt"] = "ue8m0"
    (out_dir / "config.json").write_text(json.dumps(config | {"quantization_config": qc}, indent=2) + "\n")
    return out_dir


def is_dspark_fp8(name: str, shape: tuple) -> bool:
    """Which tensors of a standalone DSpark draft the stand-in stores as FP8: the decoder layers'
    linear weights (as the MTP stand-in); ``fc``, norms, the Markov and confidence heads stay float."""
    return len(shape) == 2 and name.startswith("layers.") and (".self_attn." in name or ".mlp." in name) \
        and name.endswith("_proj.weight")


def write_standin_dspark_release(released: Path, out_dir: Path, rule: str, block: tuple[int, int] | None = None) -> Path:
    """The demo's stand-in FP8 release of a DSpark draft folder (``released``: config.json +
    *.safetensors): the decoder layers' linear weights by the reference implementation, the other
    tensors as they are, in ``out_dir/model.safetensors`` with an index and the config plus a
    ``quantization_config``."""
    from safetensors import safe_open

    from drafter.quant.release import DEFAULT_BLOCK

    block = tuple(block or DEFAULT_BLOCK[rule])
    released, out_dir = Path(released), Path(out_dir)
    config = json.loads((released / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(released.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                w = h.get_tensor(k)
                tensors |= fp8_tensors(k, w.float().numpy(), block, rule, v4=False) if is_dspark_fp8(k, tuple(w.shape)) \
                    else {k: w}
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if rule == "ue8m0":
        qc["scale_fmt"] = "ue8m0"
    write_release(out_dir, config | {"quantization_config": qc}, {"model.safetensors": tensors})
    return out_dir
