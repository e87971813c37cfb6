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
blocks are a view, no Python loop over blocks); large tensors on the CPU use a compiled (fused) version.

Same bytes on every device. Both divisions (``amax / 448`` and ``w / s``) are IEEE, correctly
rounded float32 divisions, never a multiplication by a reciprocal:

* a divisor is always a tensor on the dividend's device (``torch.full_like(amax, 448)``, the scale
  grid), never a Python scalar or a 0-dim CPU tensor: CUDA's ``div`` turns a CPU-scalar divisor into
  ``x * (1/d)`` (``div_true_kernel_cuda``), which rounds differently from ``x / d`` for about half of
  all float32 ``amax`` (an H200 gave 509 of 896 V3 scales different before this rule);
* only the CPU path is compiled. Inductor's C++ code divides with IEEE ``/`` (its CPU lowering keeps
  division by a constant a division, and the flags it compiles with exclude ``-freciprocal-math``; we
  pin ``cpp.enable_unsafe_math_opt_flag=False`` so an environment variable cannot turn that on). On
  other backends the compiled code is not exact: Triton's ``/`` is the approximate ``div.full``
  unless ``eager_numerics.division_rounding`` is set, and even then Inductor rewrites a division by a
  constant (such as ``full_like(.., 448)``) into a multiplication by its reciprocal on every device but
  the CPU. So CUDA (and any non-CPU device) runs the eager ops — tensor / tensor, which CUDA divides
  with IEEE ``div.rn`` — and ``meta`` tensors run them too (shapes and dtypes only; the NaN/inf check,
  which needs the values, is skipped there).

The UE8M0 scale would not change even under reciprocal division (checked exhaustively over one
binade of ``amax``, which covers all: the ceil of the rounded quotient is the same), but it uses the
same exact division.

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


def div_e4m3_max(amax: Tensor) -> Tensor:
    """``amax / 448``, correctly rounded on every device: the divisor is a tensor on ``amax``'s device
    (a Python-scalar divisor is a reciprocal multiplication on CUDA). Use it for any ``/ 448`` whose
    bits matter (scales, the UE8M0 exponent, the self-check's power-of-two edge test)."""
    return amax / torch.full_like(amax, E4M3_MAX)


def ue8m0_exponent(amax: Tensor) -> Tensor:
    """The e8m0 byte (biased exponent, int32) of ``2^ceil(log2(amax/448))``, from the float32 bits.

    ``amax`` is float32 and already floored; ``amax/448`` is a normal float32, so its biased
    exponent is bits 23..30, and the ceil adds one when any mantissa bit is set.
    """
    bits = div_e4m3_max(amax).view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def scales(amax: Tensor, scale: ScaleRule) -> tuple[Tensor, Tensor]:
    """``(stored_scale, s_float32)`` for per-block ``amax`` (float32, floored inside)."""
    amax = amax.clamp_min(AMAX_FLOOR)
    if scale == "float32":
        s = div_e4m3_max(amax)
        return s, s
    if scale == "ue8m0":
        e = ue8m0_exponent(amax)
        stored = e.to(torch.uint8).view(torch.float8_e8m0fnu)
        s = (e << 23).view(torch.float32)  # 2^(e-127); e ≥ 1 since amax/448 ≥ 1e-4/448
        return stored, s
    raise FP8Error(f"unknown scale rule {scale!r}; use 'ue8m0' or 'float32'")


def _has_values(t: Tensor) -> bool:
    """False on the ``meta`` device (shapes only): data-dependent checks are skipped there."""
    return t.device.type != "meta"


def _check_finite(w: Tensor, name: str) -> None:
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise FP8Error(f"tensor {name}: {bad} NaN/inf value(s); refusing to quantize")


# Large CPU tensors go through a torch.compile'd (inductor: fused, vectorized C++) version of the same ops —
# on 2 CPU cores a 7168×7168 BF16 quantize+dequantize takes 0.11 s instead of 0.45 s. Below this size
# the one-off compile (seconds) outweighs the gain; shapes not a multiple of the block use eager ops.
# Without a working compiler the eager path is used (with a warning), with identical bytes. Other
# devices always use the eager ops: only inductor's CPU code divides exactly (see the module docstring).
COMPILE_MIN_NUMEL = 1 << 23
COMPILE_DEVICES = ("cpu",)
# never -funsafe-math-optimizations (it implies -freciprocal-math: x / d → x * (1/d))
COMPILE_OPTIONS = {"cpp.enable_unsafe_math_opt_flag": False}
_compiled: dict = {}
_compile_broken: list[str] = []


def _quantize_blocks(w: Tensor, b0: int, b1: int, scale: ScaleRule) -> tuple[Tensor, Tensor, Tensor]:
    """Divisible shapes: ``(q, stored_scale, amax)``; the ops of :func:`quantize`, written to fuse."""
    R, C = w.shape
    x = w.float().view(R // b0, b0, C // b1, b1)
    amax = x.abs().amax(dim=(1, 3))
    floored = amax.clamp_min(AMAX_FLOOR)
    if scale == "float32":
        s = stored = div_e4m3_max(floored)
    else:  # the e8m0 byte as uint8 (inductor has no e8m0 dtype; the caller views it)
        e = ue8m0_exponent(floored)
        s, stored = (e << 23).view(torch.float32), e.to(torch.uint8)
    y = (x / s.view(R // b0, 1, C // b1, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(R, C), stored, amax


def _dequantize_blocks(q: Tensor, sf: Tensor, b0: int, b1: int) -> Tensor:
    R, C = q.shape
    return (q.view(R // b0, b0, C // b1, b1).float() * sf.view(R // b0, 1, C // b1, 1)).view(R, C)


def _fast(fn, t: Tensor):
    """The compiled ``fn`` for input ``t``, or None (small tensor, a device whose compiled division is
    not exact, or no compiler)."""
    if t.device.type not in COMPILE_DEVICES or t.numel() < COMPILE_MIN_NUMEL or _compile_broken:
        return None
    if fn not in _compiled:  # static: fully fused code per shape (after 8 shapes: eager)
        _compiled[fn] = torch.compile(fn, dynamic=False, options=dict(COMPILE_OPTIONS))
    return _compiled[fn]


def _call_fast(fn, t: Tensor, *args):
    compiled = _fast(fn, t)
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
        q, stored, amax = _call_fast(_quantize_blocks, w, w, b0, b1, scale)
        if scale == "ue8m0":
            stored = stored.view(torch.float8_e8m0fnu)
        if _has_values(amax) and not torch.isfinite(amax).all():  # NaN/inf anywhere gives a NaN/inf block max
            _check_finite(w.float(), name)
        return q, stored
    x = w if w.dtype == torch.float32 else w.float()
    amax = block_amax(x, block)
    if _has_values(amax) and not torch.isfinite(amax).all():
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
        return _call_fast(_dequantize_blocks, q, q, sf, b0, b1)
    return q.float() * sf.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
