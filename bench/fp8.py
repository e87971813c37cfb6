"""Benchmark: block-FP8 quantize + dequantize throughput against a plain copy of the same bytes, and
the release self-check's blocks/s — measured side by side, interleaved, in one run.

    .venv/bin/python bench/fp8.py [--rows 7168] [--cols 7168] [--reps 3]

Rows (a BF16 ``rows×cols`` matrix, GB/s = BF16 input bytes / seconds):

* ``copy``                        — ``w.clone()`` of the BF16 matrix (the reference);
* ``quantize+dequantize float32`` — :func:`drafter.quant.fp8.quantize` (128×128, amax/448) then ``dequantize``;
* ``quantize+dequantize ue8m0``   — the same with 32×32 UE8M0 scales;
* ``self-check ue8m0``            — :func:`drafter.quant.verify.check_tensor` on the quantized matrix (blocks/s).

The ratio reported is copy seconds ÷ quantize+dequantize seconds, from the best of the interleaved
repetitions (goal ≥ 0.25 on CPU); medians are printed too.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from drafter.quant import fp8 as F  # noqa: E402
from drafter.quant.verify import check_tensor  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=7168)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    w = (torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    q8, s8 = F.quantize(w, (32, 32), "ue8m0")
    cases = {
        "copy": lambda: w.clone(),
        "quantize+dequantize float32": lambda: F.dequantize(*F.quantize(w, (128, 128), "float32"), (128, 128)),
        "quantize+dequantize ue8m0": lambda: F.dequantize(*F.quantize(w, (32, 32), "ue8m0"), (32, 32)),
        "self-check ue8m0": lambda: check_tensor(q8, s8, (32, 32), "ue8m0", "bench"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.reps):  # interleaved: every case once per round
        for k, fn in cases.items():
            times[k].append(timed(fn))
    blocks = F.n_blocks(tuple(w.shape), (32, 32))
    nblocks = blocks[0] * blocks[1]
    print(f"BF16 {a.rows}×{a.cols} ({nbytes / 1e6:.0f} MB), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"best/median of {a.reps}")
    print(f"{'case':32s} {'best s':>8s} {'median s':>9s} {'GB/s':>7s} {'blocks/s':>12s}")
    for k, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        extra = f"{nblocks / best:12.0f}" if k.startswith("self-check") else f"{'':12s}"
        print(f"{k:32s} {best:8.3f} {med:9.3f} {nbytes / best / 1e9:7.2f} {extra}")
    copy = min(times["copy"])
    for k in ("quantize+dequantize float32", "quantize+dequantize ue8m0"):
        print(f"ratio {k} / copy bandwidth: {copy / min(times[k]):.3f} (goal ≥ 0.25)")


if __name__ == "__main__":
    main()
