"""The FP8 drop-in: the fine-tuned drafter in the release's own format, and an index pointing at it.

For every drafter key of the release (see :mod:`drafter.quant.release`):

* an FP8 weight that training changed → quantized with the release's rule (:func:`drafter.quant.fp8.quantize`)
  under the release's names (``<name>`` + its ``_scale_inv`` / ``.scale``);
* a tensor training did not change (bit-identical to the weights training started from, e.g. the
  frozen routed experts), one absent from the trained weights, or one in a format this quantizer does
  not write (MXFP4-packed experts and their scales) → the release's exact bytes;
* everything else → the trained tensor cast to the release's dtype.

Written as one safetensors file, streamed tensor by tensor (header first, from the release's dtypes
and shapes, so peak memory stays near one tensor), plus a copy of the release index with every
drafter key pointed at it. Per tensor: relative FP8 error against the trained weights, and the
relative distance moved from the release.

Example::

    report = build_dropin(open_release(tdir), train_out / "mtp-trained.safetensors", out / "fp8")
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from drafter.core.errors import StageError
from drafter.quant import fp8 as F
from drafter.quant.release import INDEX_NAME, FP8Release, TensorInfo

DROPIN_NAME = "mtp-ft.safetensors"
ERROR_NAME = "fp8-error.json"
ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def write_safetensors_streaming(path: Path, infos: dict[str, TensorInfo],
                                tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict | None = None) -> None:
    """Write a safetensors file whose header (dtypes, shapes) is known up front, one tensor at a time.

    ``tensors`` must yield every key of ``infos`` once, in sorted order, each with the declared
    dtype and shape. Written to a temp file and renamed into place.
    """
    names = sorted(infos)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for k in names:
        inf = infos[k]
        n = ST_DTYPES[inf.dtype].itemsize
        for d in inf.shape:
            n *= d
        header[k] = {"dtype": inf.dtype, "shape": list(inf.shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        it = iter(tensors)
        for k in names:
            name, t = next(it)
            inf = infos[k]
            if name != k or ST_DTYPES[inf.dtype] != t.dtype or tuple(t.shape) != inf.shape:
                raise StageError(f"{path}: tensor {name} {t.dtype} {tuple(t.shape)} does not match the header's "
                                 f"{k} {inf.dtype} {inf.shape}")
            f.write(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")  # any device
    os.replace(tmp, path)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    n = float(ref.double().norm())
    return float((a.double() - ref.double()).norm()) / n if n > 0 else float((a.double()).norm())


def _read(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()  # any device


def _release_float(release: FP8Release, name: str) -> torch.Tensor | None:
    """The release's tensor ``name`` as float (an FP8 weight dequantized with its scale); None for a
    tensor with no float meaning (integer, packed, an e8m0 scale)."""
    t = _read(release.path_of(name), name)
    if name in release.fp8:
        return F.dequantize(t, _read(release.path_of(release.fp8[name]), release.fp8[name]), release.block, name=name)
    return t.float() if t.is_floating_point() and t.dtype not in (torch.float8_e8m0fnu,) else None


@dataclass
class _DropinTensors:
    """The drop-in's tensors, made one at a time in the header's (sorted) order, and the report of what
    was done to each. ``tkeys``: the keys of the ``trained`` file; ``start``: see :func:`build_dropin`."""

    release: FP8Release
    trained: Path
    tkeys: set[str]
    infos: dict[str, TensorInfo]
    start: Callable[[str], torch.Tensor | None]
    report: dict[str, dict] = field(default_factory=dict)
    quantized: set[str] = field(default_factory=set)  # FP8 weights we write (their scales come with them)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # scales made with their weight, not yet written

    def produce(self, progress=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) for every key of ``infos``, sorted; a scale comes from its weight's quantization."""
        release = self.release
        owner = {s: w for w, s in (release.fp8 | release.other_scales).items()}
        done: set[str] = set()
        for k in sorted(self.infos):
            if k in owner and k not in self.pending and owner[k] not in done:  # scale sorts before its weight (V4)
                w = owner[k]
                self.pending[w] = self.tensor_for(w)
                done.add(w)
            if k in self.pending:
                t = self.pending.pop(k)
            elif k in owner:
                t = _read(release.path_of(k), k)  # its weight was kept: the release's bytes
            else:
                done.add(k)
                t = self.tensor_for(k)
            if progress is not None:
                progress(k)
            yield k, t

    def tensor_for(self, k: str) -> torch.Tensor:
        """The drop-in's tensor ``k`` (a weight; its FP8 scale goes to ``pending``), reported."""
        release, trained, inf = self.release, self.trained, self.infos[k]
        rel_t = _read(release.path_of(k), k)
        entry: dict = {"dtype": inf.dtype, "shape": list(inf.shape)}
        if k not in self.tkeys:
            self.report[k] = entry | {"action": "kept (not in the trained weights)", "fp8_rel_error": None,
                                      "moved_rel": 0.0}
            return rel_t
        w = _read(trained, k).float()
        if tuple(w.shape) != inf.shape:
            raise StageError(f"{trained}: tensor {k} has shape {tuple(w.shape)}, the release's is {inf.shape}")
        if not torch.isfinite(w).all():
            raise StageError(f"{trained}: tensor {k} has NaN/inf values")
        ref = _release_float(release, k)
        moved = _rel(w, ref) if ref is not None else None
        st = self.start(k)
        untouched = st is not None and st.shape == w.shape and torch.equal(st.float().view(torch.int32), w.view(torch.int32))
        if k in release.other_scales or inf.dtype not in FLOAT_DTYPES + ("F8_E4M3",):
            if st is None:  # packed (MXFP4 experts, …): no float to compare with, so a change would be lost
                raise StageError(f"{trained}: tensor {k} is in the trained weights but the release stores it as "
                                 f"{inf.dtype}, a packed format this quantizer neither reads nor writes: leave it out "
                                 "of the trained weights (freeze it; the release's bytes are kept)")
            if not untouched:
                raise StageError(f"{trained}: tensor {k} changed in training but the release stores it as {inf.dtype}, "
                                 "a format this quantizer does not write (freeze it, or leave it out of the trained weights)")
            self.report[k] = entry | {"action": "kept (format not written here)", "fp8_rel_error": None, "moved_rel": moved}
            return rel_t
        if untouched:
            self.report[k] = entry | {"action": "kept (unchanged by training)",
                                      "fp8_rel_error": _rel(ref, w) if ref is not None else None, "moved_rel": moved}
            return rel_t
        if k in release.fp8:
            block, rule = release.block, release.rule
            q, s = F.quantize(w, block, rule, name=k)
            self.pending[release.fp8[k]] = s
            self.quantized.add(k)
            self.report[k] = entry | {"action": f"fp8 {rule} {block[0]}x{block[1]}",
                                      "fp8_rel_error": _rel(F.dequantize(q, s, block, name=k), w), "moved_rel": moved}
            return q
        t = w.to(ST_DTYPES[inf.dtype])
        self.report[k] = entry | {"action": f"cast {inf.dtype}", "fp8_rel_error": _rel(t.float(), w), "moved_rel": moved}
        return t


def build_dropin(release: FP8Release, trained: Path, out_dir: Path, *,
                 start: Callable[[str], torch.Tensor | None] | None = None, progress=None) -> dict:
    """Write ``out_dir/mtp-ft.safetensors``, ``out_dir/model.safetensors.index.json``, ``out_dir/fp8-error.json``.

    ``trained``: the fine-tuned drafter (release names, float). ``start(name)``: the float weights
    training started from (default: the release itself, dequantized); a trained tensor bit-identical
    to it is kept as the release's exact bytes. Returns the error report (also written as JSON).
    """
    from safetensors import safe_open

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with safe_open(str(trained), framework="pt") as f:
        tkeys = set(f.keys())
    foreign = sorted(tkeys - set(release.drafter_keys))
    if foreign:
        raise StageError(f"{trained}: {len(foreign)} tensor(s) that are not drafter keys of the release {release.dir}: "
                         f"{foreign[:10]}")
    infos = {k: release.info[k] for k in release.drafter_keys}
    made = _DropinTensors(release, trained, tkeys, infos, start or (lambda name: _release_float(release, name)))
    write_safetensors_streaming(out_dir / DROPIN_NAME, infos, made.produce(progress),
                                metadata={"format": "pt", "source": "quantize_fp8"})

    index = json.loads(json.dumps(release.index))
    for k in release.drafter_keys:
        index["weight_map"][k] = DROPIN_NAME
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    doc = {"summary": _summary(made.report, made.quantized, len(infos), release), "tensors": made.report}
    (out_dir / ERROR_NAME).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _summary(report: dict[str, dict], quantized: set[str], n_tensors: int, release: FP8Release) -> dict:
    """The ``summary`` of ``fp8-error.json``: counts per action, the worst FP8 error and the largest move."""
    fp8_errs = {k: v["fp8_rel_error"] for k, v in report.items() if v["fp8_rel_error"] is not None and k in quantized}
    worst = max(fp8_errs, key=fp8_errs.get) if fp8_errs else None
    return {"tensors": n_tensors, "fp8_tensors": len(quantized),
            "kept_tensors": sum(1 for v in report.values() if v["action"].startswith("kept")),
            "cast_tensors": sum(1 for v in report.values() if v["action"].startswith("cast")),
            "max_fp8_rel_error": fp8_errs[worst] if worst else None, "max_fp8_rel_error_tensor": worst,
            "max_moved_rel": max((v["moved_rel"] for v in report.values() if v["moved_rel"] is not None), default=None),
            "rule": release.rule, "block": list(release.block)}


def check_dropin(release: FP8Release, fp8_dir: Path) -> dict:
    """Part 2 checks: same key set, dtypes and shapes as the release; kept tensors hash-equal to the
    release; the index = the release's with exactly the drafter keys pointed at the drop-in.
    Returns ``{"ok": bool, "problems": [...], "hash_equal": n, …}``."""
    fp8_dir = Path(fp8_dir)
    problems: list[str] = []
    from drafter.quant.release import tensor_infos

    dropin = fp8_dir / DROPIN_NAME
    infos = tensor_infos(fp8_dir, {DROPIN_NAME}) if dropin.is_file() else {}
    if not infos:
        problems.append(f"{dropin} is missing or empty")
    want = set(release.drafter_keys)
    if set(infos) != want:
        problems.append(f"key set differs: missing {sorted(want - set(infos))[:10]}, extra {sorted(set(infos) - want)[:10]}")
    for k in sorted(want & set(infos)):
        a, b = infos[k], release.info[k]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            problems.append(f"{k}: {a.dtype} {a.shape} in the drop-in, {b.dtype} {b.shape} in the release")
    errs = json.loads((fp8_dir / ERROR_NAME).read_text())["tensors"] if (fp8_dir / ERROR_NAME).is_file() else {}
    kept = [k for k, v in errs.items() if v["action"].startswith("kept")]
    kept += [release.fp8[k] for k in kept if k in release.fp8] + [release.other_scales[k] for k in kept if k in release.other_scales]
    hash_equal = 0
    for k in sorted(set(kept) & set(infos)):
        if sha256_of(_read(dropin, k)) == sha256_of(_read(release.path_of(k), k)):
            hash_equal += 1
        else:
            problems.append(f"{k}: kept tensor is not byte-identical to the release")
    idx_path = fp8_dir / INDEX_NAME
    try:
        idx = json.loads(idx_path.read_text())
        wm = idx["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        problems.append(f"{idx_path}: not a valid index ({e})")
        wm = {}
    if wm:
        rwm = release.weight_map
        if set(wm) != set(rwm):
            problems.append(f"index key set differs from the release's: {sorted(set(wm) ^ set(rwm))[:10]}")
        wrong = sorted(k for k in wm if (wm[k] == DROPIN_NAME) != (k in want))
        if wrong:
            problems.append(f"index: {len(wrong)} key(s) pointed wrongly: {wrong[:10]}")
        moved = sorted(k for k in wm if k not in want and wm[k] != rwm.get(k))
        if moved:
            problems.append(f"index: non-drafter key(s) changed: {moved[:10]}")
        if idx.get("metadata") != release.index.get("metadata"):
            problems.append("index metadata differs from the release's")
    return {"ok": not problems, "problems": problems, "keys": len(infos), "kept_hash_equal": hash_equal,
            "kept": len(set(kept))}
