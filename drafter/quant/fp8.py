"""Block FP8 (E4M3) with per-block scales, as DeepSeek releases store it.

Two scale rules:

* ``"float32"`` (DeepSeek-V3, 128×128 blocks): ``weight_scale_inv = amax / 448`` in float32;
* ``"ue8m0"`` (DeepSeek-V3.1+/V4, 32×32 blocks for V4.1 dense matmuls): ``s = 2^ceil(log2(amax/448))``
  with the ceil taken on the float32 bits of ``amax/448`` (biased exponent, +1 when the mantissa is
  non-zero). That biased exponent *is* the ``float8_e8m0fnu`` byte (both have bias 127), so the scale
  is written from the bits — never by casting a non-power-of-two float to e8m0, which rounds to
  nearest instead of up.

Both: ``amax`` per block floored at 1e-4; shapes that are not a multiple of the block are padded with
zeros for the amax only; ``w / s`` clamped to ±448 and rounded to nearest-even into E4M3. NaN/inf in
the input is an error naming the tensor. Everything is vectorized torch over whole tensors (the
blocks are a view, no Python loop over blocks); large tensors use a compiled (fused) version.

Example::

    q, s = quantize(w, block=(32, 32), scale="ue8m0")   # q: float8_e4m3fn, s: float8_e8m0fnu
    w2 = dequantize(q, s, block=(32, 32))               # float32
"""
from __future__ import annotations

from typing import Literal

import torch

Tensor = torch.Tensor
ScaleRule = Literal["ue8m0", "float32"]

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_DTYPES: dict[str, torch.dtype] = {"ue8m0": torch.float8_e8m0fnu, "float32": torch.float32}


class FP8Error(ValueError):
    """A tensor cannot be quantized / dequantized (NaN/inf, wrong shape or dtype); names the tensor."""


def n_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a ``[R, C]`` weight: ``(ceil(R/b0), ceil(C/b1))``."""
    R, C = shape
    return -(-R // block[0]), -(-C // block[1])


def rule_of_scale(scale: Tensor) -> ScaleRule:
    """The rule a stored scale tensor was written with, from its dtype."""
    if scale.dtype == torch.float8_e8m0fnu:
        return "ue8m0"
    if scale.dtype == torch.float32:
        return "float32"
    raise FP8Error(f"scale dtype {scale.dtype} is neither float8_e8m0fnu (ue8m0) nor float32")


def _blocks(x: Tensor, block: tuple[int, int]) -> Tensor:
    """``x`` ``[R, C]`` → ``[nR, b0, nC, b1]`` (zero-padded copy only when the shape is not a multiple)."""
    R, C = x.shape
    b0, b1 = block
    nR, nC = n_blocks((R, C), block)
    if (R, C) != (nR * b0, nC * b1):
        x = torch.nn.functional.pad(x, (0, nC * b1 - C, 0, nR * b0 - R))
    return x.view(nR, b0, nC, b1)


def block_amax(w: Tensor, block: tuple[int, int]) -> Tensor:
    """Per-block max |w| (float32, ``[nR, nC]``), padding with zeros for the amax only."""
    a = w.abs()
    if a.dtype != torch.float32:
        a = a.float()
    return _blocks(a, block).amax(dim=(1, 3))


def ue8m0_exponent(amax: Tensor) -> Tensor:
    """The e8m0 byte (biased exponent, int32) of ``2^ceil(log2(amax/448))``, from the float32 bits.

    ``amax`` is float32 and already floored; ``amax/448`` is a normal float32, so its biased
    exponent is bits 23..30, and the ceil adds one when any mantissa bit is set.
    """
    bits = (amax / E4M3_MAX).view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def scales(amax: Tensor, scale: ScaleRule) -> tuple[Tensor, Tensor]:
    """``(stored_scale, s_float32)`` for per-block ``amax`` (float32, floored inside)."""
    amax = amax.clamp_min(AMAX_FLOOR)
    if scale == "float32":
        s = amax / E4M3_MAX
        return s, s
    if scale == "ue8m0":
        e = ue8m0_exponent(amax)
        stored = e.to(torch.uint8).view(torch.float8_e8m0fnu)
        s = (e << 23).view(torch.float32)  # 2^(e-127); e ≥ 1 since amax/448 ≥ 1e-4/448
        return stored, s
    raise FP8Error(f"unknown scale rule {scale!r}; use 'ue8m0' or 'float32'")


def _check_finite(w: Tensor, name: str) -> None:
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise FP8Error(f"tensor {name}: {bad} NaN/inf value(s); refusing to quantize")


# Large tensors go through a torch.compile'd (inductor: fused, vectorized C++) version of the same ops —
# on 2 CPU cores a 7168×7168 BF16 quantize+dequantize takes 0.11 s instead of 0.45 s. Below this size
# the one-off compile (seconds) outweighs the gain; shapes not a multiple of the block use eager ops.
# Without a working compiler the eager path is used (with a warning), with identical bytes.
COMPILE_MIN_NUMEL = 1 << 23
_compiled: dict = {}
_compile_broken: list[str] = []


def _quantize_blocks(w: Tensor, b0: int, b1: int, scale: ScaleRule) -> tuple[Tensor, Tensor, Tensor]:
    """Divisible shapes: ``(q, stored_scale, amax)``; the ops of :func:`quantize`, written to fuse."""
    R, C = w.shape
    x = w.float().view(R // b0, b0, C // b1, b1)
    amax = x.abs().amax(dim=(1, 3))
    floored = amax.clamp_min(AMAX_FLOOR)
    if scale == "float32":
        s = stored = floored / E4M3_MAX
    else:  # the e8m0 byte as uint8 (inductor has no e8m0 dtype; the caller views it)
        e = ue8m0_exponent(floored)
        s, stored = (e << 23).view(torch.float32), e.to(torch.uint8)
    y = (x / s.view(R // b0, 1, C // b1, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(R, C), stored, amax


def _dequantize_blocks(q: Tensor, sf: Tensor, b0: int, b1: int) -> Tensor:
    R, C = q.shape
    return (q.view(R // b0, b0, C // b1, b1).float() * sf.view(R // b0, 1, C // b1, 1)).view(R, C)


def _fast(fn, numel: int):
    """The compiled ``fn`` for tensors of ``numel`` elements, or None (small tensor, or no compiler)."""
    if numel < COMPILE_MIN_NUMEL or _compile_broken:
        return None
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)  # static: fully fused code per shape (after 8 shapes: eager)
    return _compiled[fn]


def _call_fast(fn, numel: int, *args):
    compiled = _fast(fn, numel)
    if compiled is None:
        return fn(*args)
    try:
        return compiled(*args)
    except Exception as e:  # noqa: BLE001 — no C++ compiler, unsupported op: same math, eager
        import warnings

        _compile_broken.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"torch.compile unavailable for FP8 ({type(e).__name__}); using eager torch ops", stacklevel=3)
        return fn(*args)


def quantize(w: Tensor, block: tuple[int, int] = (32, 32), scale: ScaleRule = "ue8m0", *,
             name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """Block-quantize a 2-D weight to E4M3. Returns ``(q, s)``: ``q`` float8_e4m3fn ``[R, C]``,
    ``s`` ``[ceil(R/b0), ceil(C/b1)]`` (float8_e8m0fnu for ``ue8m0``, float32 for ``float32``)."""
    if w.ndim != 2:
        raise FP8Error(f"tensor {name}: block FP8 needs a 2-D weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise FP8Error(f"tensor {name}: dtype {w.dtype} is not floating point")
    if scale not in SCALE_DTYPES:
        raise FP8Error(f"unknown scale rule {scale!r}; use 'ue8m0' or 'float32'")
    block = (int(block[0]), int(block[1]))
    R, C = w.shape
    b0, b1 = block
    if R % b0 == 0 and C % b1 == 0:
        q, stored, amax = _call_fast(_quantize_blocks, w.numel(), w, b0, b1, scale)
        if scale == "ue8m0":
            stored = stored.view(torch.float8_e8m0fnu)
        if not torch.isfinite(amax).all():  # NaN/inf anywhere gives a NaN/inf block max
            _check_finite(w.float(), name)
        return q, stored
    x = w if w.dtype == torch.float32 else w.float()
    amax = block_amax(x, block)
    if not torch.isfinite(amax).all():
        _check_finite(x, name)
    stored, s = scales(amax, scale)
    y = x / s.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
    y.clamp_(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn), stored


def scale_float(s: Tensor) -> Tensor:
    """Stored scales → float32 (exact for both rules)."""
    if s.dtype == torch.float8_e8m0fnu:
        return s.float()
    if s.dtype == torch.float32:
        return s
    raise FP8Error(f"scale dtype {s.dtype} is neither float8_e8m0fnu nor float32")


def dequantize(q: Tensor, s: Tensor, block: tuple[int, int] = (32, 32), *, name: str = "<tensor>") -> Tensor:
    """``q`` (E4M3 ``[R, C]``) times its per-block scale ``s`` → float32 ``[R, C]``."""
    if q.ndim != 2:
        raise FP8Error(f"tensor {name}: block FP8 needs a 2-D weight, got shape {tuple(q.shape)}")
    block = (int(block[0]), int(block[1]))
    R, C = q.shape
    want = n_blocks((R, C), block)
    if tuple(s.shape) != want:
        raise FP8Error(f"tensor {name}: scale shape {tuple(s.shape)} does not match weight {(R, C)} "
                       f"in {block[0]}×{block[1]} blocks {want}")
    sf = scale_float(s)
    b0, b1 = block
    if R % b0 == 0 and C % b1 == 0:
        return _call_fast(_dequantize_blocks, q.numel(), q, sf, b0, b1)
    return q.float() * sf.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
