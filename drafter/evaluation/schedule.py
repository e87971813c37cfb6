"""The batch-size schedule of speculation: which K to serve at how many concurrent requests, from a sweep.

Speculation pays where decoding is memory-bound (few users) and costs where it is compute-bound (many users, and
every CPU); the crossover depends on the hardware, the drafter's acceptance and K, so it is measured per release.
vLLM serves a schedule as ``speculative_config.num_speculative_tokens_per_batch_size``: inclusive, sorted,
non-overlapping ``(batch_from, batch_to, K)`` ranges, the first from 1, K = 0 turning speculation off there
(``vllm/v1/spec_decode/dynamic/utils.py``, whose validator the tests run on what this module writes).

From a sweep — tokens/s per round at each measured concurrency, for no speculation (K = 0) and each K:

* at each measured concurrency, the K with the most tokens/s among those that beat no speculation beyond noise
  (mean above no speculation's by more than ``tolerance`` *and* every round above every no-speculation round);
  where that K's rounds overlap a smaller winning K's, the smaller K (as fast within noise, cheaper); none: K = 0;
* between two measured concurrencies, the smaller K of the two (conservative); below the first measured one, the
  first one's K; above the last, K = 0 (not measured: never assumed to pay).

Example::

    sweep = {1: {0: [50.0, 51.0], 2: [70.0, 71.5]}, 8: {0: [270.0, 268.0], 2: [180.0, 185.0]}}
    s = derive_schedule(sweep)
    s.ranges            # [(1, 1, 2), (2, 1024, 0)]: K=2 for one user; 2..7 unmeasured → the smaller neighbour, 0
    s.speculative_config({"method": "mtp"})
    # {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 1024, 0]]}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean

from drafter.core.errors import StageError

MAX_BATCH = 1024  # the last range's end: above every serving max_num_seqs the demo and the seed configs use

Sweep = dict[int, dict[int, list[float]]]  # concurrency → K (0: no speculation) → tokens/s of each round


@dataclass(frozen=True)
class Choice:
    """The K chosen at one measured concurrency, and why."""

    concurrency: int
    k: int
    tok_s: float  # mean tokens/s of the chosen K (of no speculation when k = 0)
    no_spec_tok_s: float
    why: str

    @property
    def speedup(self) -> float:
        return self.tok_s / self.no_spec_tok_s if self.no_spec_tok_s else float("nan")


@dataclass(frozen=True)
class Schedule:
    """The chosen K per measured concurrency and the ranges vLLM serves."""

    choices: list[Choice]
    ranges: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def max_k(self) -> int:
        return max((k for _, _, k in self.ranges), default=0)

    @property
    def pays_up_to(self) -> int:
        """The largest measured concurrency where speculation is served (0: nowhere)."""
        return max((c.concurrency for c in self.choices if c.k > 0), default=0)

    def speculative_config(self, base: dict) -> dict | None:
        """``base`` (method, model, …) with the schedule; None when no K beats no speculation anywhere (serve
        without speculation). A schedule with one K everywhere it is on stays a schedule: K = 0 ranges need it."""
        if self.max_k == 0:
            return None
        return {**base, "num_speculative_tokens": self.max_k,
                "num_speculative_tokens_per_batch_size": [list(r) for r in self.ranges]}


def _interval(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def beats(k_rounds: list[float], base_rounds: list[float], tolerance: float) -> bool:
    """Faster than the base beyond noise: the mean by more than ``tolerance`` and every round above every base
    round (with one round each, the means alone)."""
    lo, _ = _interval(k_rounds)
    _, base_hi = _interval(base_rounds)
    return fmean(k_rounds) > fmean(base_rounds) * (1 + tolerance) and lo > base_hi


def _choose(concurrency: int, by_k: dict[int, list[float]], tolerance: float) -> Choice:
    if 0 not in by_k or not by_k[0]:
        raise StageError(f"the sweep at concurrency {concurrency} has no no-speculation measurement (K = 0)")
    base = by_k[0]
    winners = sorted(k for k, v in by_k.items() if k > 0 and v and beats(v, base, tolerance))
    if not winners:
        best = max((k for k in by_k if k > 0 and by_k[k]), key=lambda k: fmean(by_k[k]), default=None)
        why = ("no K measured" if best is None else
               f"no K beats no speculation beyond noise (best K={best}: {fmean(by_k[best]) / fmean(base):.2f}×)")
        return Choice(concurrency, 0, fmean(base), fmean(base), why)
    best = max(winners, key=lambda k: fmean(by_k[k]))
    best_lo, _ = _interval(by_k[best])
    # the smallest winning K whose rounds reach the best K's: as fast within noise, and cheaper
    k = next(w for w in winners if w == best or _interval(by_k[w])[1] >= best_lo)
    why = (f"K={k}: {fmean(by_k[k]) / fmean(base):.2f}× no speculation"
           + (f" (K={best} {fmean(by_k[best]) / fmean(base):.2f}× is within noise of it)" if k != best else ""))
    return Choice(concurrency, k, fmean(by_k[k]), fmean(base), why)


def _merge(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for lo, hi, k in ranges:
        if out and out[-1][2] == k and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
    return out


def derive_schedule(sweep: Sweep, tolerance: float = 0.02, max_batch: int = MAX_BATCH) -> Schedule:
    """The schedule of a sweep (see the module docstring). Raises :class:`StageError` on an empty sweep or a
    concurrency without a no-speculation measurement."""
    if not sweep:
        raise StageError("an empty sweep: no concurrency was measured")
    if any(c < 1 for c in sweep):
        raise StageError(f"concurrencies must be >= 1, got {sorted(sweep)}")
    choices = [_choose(c, sweep[c], tolerance) for c in sorted(sweep)]
    last = choices[-1].concurrency
    if max_batch < last:
        raise StageError(f"max_batch {max_batch} is below the largest measured concurrency {last}")
    ranges = [(1, choices[0].concurrency, choices[0].k)] if choices[0].concurrency > 1 else []
    for i, ch in enumerate(choices):
        if not ranges or ranges[-1][1] < ch.concurrency:  # the first point is covered from 1 already
            ranges.append((ch.concurrency, ch.concurrency, ch.k))
        nxt = choices[i + 1] if i + 1 < len(choices) else None
        if nxt is not None and nxt.concurrency > ch.concurrency + 1:
            ranges.append((ch.concurrency + 1, nxt.concurrency - 1, min(ch.k, nxt.k)))
    if last < max_batch:
        ranges.append((last + 1, max_batch, 0))
    return Schedule(choices, _merge(ranges))
