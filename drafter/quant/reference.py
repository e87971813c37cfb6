"""An independent reference implementation of DeepSeek block FP8, in numpy integer arithmetic.

It exists so the release self-check compares *two* implementations: the synthetic release fixtures
and the demo's stand-in FP8 release are written with this module, and :mod:`drafter.quant.fp8`
(vectorized torch, torch float8 casts) must reproduce their bytes. Written differently on purpose:

* E4M3 encoding from the float32 bit pattern (sign / exponent / mantissa fields, round-to-nearest-
  even done on the integer mantissa; subnormals by ``rint`` of the exactly scaled value), no torch
  and no float8 casts;
* the UE8M0 exponent from ``numpy.frexp`` (``t = m·2^e``, ``m ∈ [0.5, 1)``: ``ceil(log2 t)`` is
  ``e - 1`` when ``m == 0.5``, else ``e``) rather than from the raw bits;
* blocks by a per-block-row loop over an explicitly padded array.

Returned arrays are raw bytes (``uint8``) for E4M3 and e8m0, ``float32`` for V3 scales, so the
fixtures can be written with any safetensors writer.

Example::

    q_bytes, s = quantize_ref(w.numpy(), (128, 128), "float32")
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 values already in [-448, 448] → E4M3 (fn) bytes, round-to-nearest-even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("e4m3_encode: NaN/inf input")
    if (np.abs(x) > E4M3_MAX).any():
        raise ValueError("e4m3_encode: |x| > 448 (clamp first)")
    bits = x.view(np.uint32)
    sign = ((bits >> 31) & 1).astype(np.uint8) << 7
    exp32 = ((bits >> 23) & 0xFF).astype(np.int64)
    man32 = (bits & 0x7FFFFF).astype(np.int64)
    out = np.zeros(x.shape, dtype=np.uint8)

    normal = exp32 >= 127 - 6  # |x| >= 2^-6, the smallest E4M3 normal
    # normal range: keep 3 of the 23 mantissa bits, round half to even on the 20 dropped bits
    keep = man32 >> 20
    rest = man32 & ((1 << 20) - 1)
    half = 1 << 19
    up = (rest > half) | ((rest == half) & ((keep & 1) == 1))
    m = keep + up
    e = exp32 - 127 + 7 + (m >> 3)  # a mantissa carry bumps the exponent
    m = m & 7
    code_normal = ((e << 3) | m).astype(np.int64)
    # subnormal range: value = k · 2^-9, k = rint(|x| · 2^9) (exact scaling in float64, rint = half-even)
    k = np.rint(np.abs(x.astype(np.float64)) * 512.0).astype(np.int64)  # k == 8 is the smallest normal, code 0x08
    code = np.where(normal, code_normal, k)
    if (code > 0x7E).any():
        raise AssertionError("e4m3_encode: code above 448 after clamping")
    out[...] = code.astype(np.uint8)
    return out | sign


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bytes → float32 (0x7F/0xFF decode as NaN)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where((b & 0x7F) == 0x7F, np.nan, val)
    return (sign * val).astype(np.float32)


def ue8m0_byte(t: np.ndarray) -> np.ndarray:
    """e8m0 byte of ``2^ceil(log2 t)`` for positive normal float32 ``t`` (via frexp)."""
    m, e = np.frexp(t.astype(np.float32))
    exp = np.where(m == 0.5, e - 1, e)
    return (exp + 127).astype(np.uint8)


def _pad(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    R, C = w.shape
    b0, b1 = block
    nR, nC = -(-R // b0), -(-C // b1)
    p = np.zeros((nR * b0, nC * b1), dtype=np.float32)
    p[:R, :C] = w
    return p


def quantize_ref(w: np.ndarray, block: tuple[int, int], scale: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference block quantizer: ``(q_bytes uint8 [R, C], s)``; ``s`` is e8m0 bytes (``uint8``) for
    ``ue8m0`` or ``float32`` scale_inv for ``float32``; both ``[ceil(R/b0), ceil(C/b1)]``."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise ValueError("quantize_ref: need a finite 2-D array")
    R, C = w.shape
    b0, b1 = block
    p = _pad(np.abs(w), block)
    nR, nC = p.shape[0] // b0, p.shape[1] // b1
    amax = np.empty((nR, nC), dtype=np.float32)
    for i in range(nR):  # one block row at a time
        amax[i] = p[i * b0:(i + 1) * b0].reshape(b0, nC, b1).max(axis=(0, 2))
    amax = np.maximum(amax, AMAX_FLOOR)
    t = (amax / E4M3_MAX).astype(np.float32)
    if scale == "float32":
        s_stored, s_f = t, t
    elif scale == "ue8m0":
        s_stored = ue8m0_byte(t)
        s_f = np.ldexp(np.float32(1.0), s_stored.astype(np.int64) - 127).astype(np.float32)
    else:
        raise ValueError(f"unknown scale rule {scale!r}")
    s_full = np.repeat(np.repeat(s_f, b0, axis=0), b1, axis=1)[:R, :C]
    y = np.clip((w / s_full).astype(np.float32), -E4M3_MAX, E4M3_MAX)
    return e4m3_encode(y), s_stored


def dequantize_ref(q_bytes: np.ndarray, s: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Inverse of :func:`quantize_ref` (``s`` uint8 = e8m0 bytes, else float32 scale_inv)."""
    R, C = q_bytes.shape
    b0, b1 = block
    sf = np.ldexp(np.float32(1.0), s.astype(np.int64) - 127).astype(np.float32) if s.dtype == np.uint8 else s
    s_full = np.repeat(np.repeat(sf, b0, axis=0), b1, axis=1)[:R, :C]
    return (e4m3_decode(q_bytes) * s_full).astype(np.float32)
