"""The batch-size schedule of speculation from a concurrency × K sweep (drafter/evaluation/schedule.py), and its
JSON checked by vLLM's own validator and dense lookup (vllm/v1/spec_decode/dynamic/utils.py, serving env)."""
from __future__ import annotations

import json
import subprocess

import pytest

from drafter.core.errors import StageError
from drafter.evaluation.schedule import MAX_BATCH, derive_schedule


def _k_at(ranges, c):
    return next(k for lo, hi, k in ranges if lo <= c <= hi)


def test_monotone_sweep_speculates_where_it_pays_and_turns_off_where_it_costs():
    """Memory-bound at few users (K pays, the larger K more), compute-bound at many (every K loses)."""
    sweep = {1: {0: [50, 51], 1: [62, 63], 2: [70, 72], 3: [66, 67]},
             2: {0: [95, 96], 1: [110, 111], 2: [118, 120], 3: [112, 113]},
             4: {0: [170, 172], 1: [180, 182], 2: [176, 178], 3: [160, 162]},
             8: {0: [270, 268], 1: [240, 242], 2: [185, 180], 3: [150, 152]}}
    s = derive_schedule(sweep)
    assert [c.k for c in s.choices] == [2, 2, 1, 0]
    assert s.ranges == [(1, 2, 2), (3, 4, 1), (5, MAX_BATCH, 0)]  # 3 between K=2 and K=1 → 1; 5..7 → min(1, 0)
    assert s.pays_up_to == 4 and s.max_k == 2
    assert s.choices[0].speedup == pytest.approx(71 / 50.5)
    cfg = s.speculative_config({"method": "mtp", "model": "m"})
    assert cfg == {"method": "mtp", "model": "m", "num_speculative_tokens": 2,
                   "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 4, 1], [5, MAX_BATCH, 0]]}


def test_crossing_sweep_the_best_k_changes_with_concurrency():
    sweep = {1: {0: [40], 1: [50], 3: [60]}, 16: {0: [300], 1: [330], 3: [310]}}
    s = derive_schedule(sweep)
    assert [(c.concurrency, c.k) for c in s.choices] == [(1, 3), (16, 1)]
    assert s.ranges == [(1, 1, 3), (2, 16, 1), (17, MAX_BATCH, 0)]


def test_noise_prefers_no_speculation_and_the_smaller_k():
    # K=1's mean is 3 % higher but its rounds overlap no speculation's: not beyond noise → off
    assert derive_schedule({1: {0: [100, 104], 1: [103, 107]}}).choices[0].k == 0
    # within the tolerance (2 %), every round above: still off
    assert derive_schedule({1: {0: [100, 100.5], 1: [101.5, 102]}}).choices[0].k == 0
    # K=2 and K=3 both beat it; K=3's mean is higher but its rounds reach K=2's: the smaller K
    ch = derive_schedule({1: {0: [100, 101], 2: [120, 126], 3: [124, 128]}}).choices[0]
    assert ch.k == 2 and "K=3" in ch.why
    # K=3 clearly above K=2: the larger K
    assert derive_schedule({1: {0: [100, 101], 2: [120, 121], 3: [130, 131]}}).choices[0].k == 3


def test_all_losing_turns_speculation_off_everywhere():
    sweep = {c: {0: [100.0 * c, 101.0 * c], 1: [90.0 * c, 91.0 * c], 2: [80.0 * c, 82.0 * c]} for c in (1, 2, 4, 8)}
    s = derive_schedule(sweep)
    assert [c.k for c in s.choices] == [0, 0, 0, 0] and s.ranges == [(1, MAX_BATCH, 0)]
    assert s.pays_up_to == 0 and s.speculative_config({"method": "mtp"}) is None
    assert "best K=1: 0.90×" in s.choices[0].why


def test_a_sweep_that_starts_above_one_user_covers_from_one():
    s = derive_schedule({4: {0: [100, 101], 2: [130, 131]}, 8: {0: [200, 201], 2: [230, 231]}})
    assert s.ranges == [(1, 8, 2), (9, MAX_BATCH, 0)]


@pytest.mark.parametrize("sweep, match", [({}, "empty sweep"), ({1: {2: [10.0]}}, "no no-speculation"),
                                          ({0: {0: [1.0]}}, ">= 1")])
def test_bad_sweeps_are_refused_naming_what_is_wrong(sweep, match):
    with pytest.raises(StageError, match=match):
        derive_schedule(sweep)


def test_vllms_own_validator_accepts_the_schedules_and_serves_the_chosen_k_at_each_measured_concurrency():
    from drafter.serving.server import serving_python

    sweeps = [
        {1: {0: [50, 51], 2: [70, 72]}, 2: {0: [95, 96], 2: [118, 120]}, 4: {0: [170, 172], 1: [180, 182]},
         8: {0: [270, 268], 1: [240, 242]}},
        {1: {0: [40], 1: [50], 3: [60]}, 16: {0: [300], 1: [330], 3: [310]}},
        {4: {0: [100, 101], 2: [130, 131]}, 8: {0: [200, 201], 2: [230, 231]}},
    ]
    cases = []
    for sw in sweeps:
        s = derive_schedule(sw)
        cfg = s.speculative_config({"method": "mtp"})
        cases.append({"cfg": cfg, "want": {c.concurrency: c.k for c in s.choices}})
    code = (
        "import json, sys\n"
        "from vllm.v1.spec_decode.dynamic.utils import (build_dynamic_sd_schedule_lookup,\n"
        "    validate_and_normalize_dynamic_sd_schedule)\n"
        "out = []\n"
        "for case in json.load(sys.stdin):\n"
        "    cfg = case['cfg']\n"
        "    sched = cfg['num_speculative_tokens_per_batch_size']\n"
        "    validate_and_normalize_dynamic_sd_schedule(sched)\n"
        f"    dense = build_dynamic_sd_schedule_lookup(sched, {MAX_BATCH}, cfg['num_speculative_tokens'])\n"
        "    out.append({c: dense[int(c)] for c in case['want']})\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([str(serving_python()), "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    served = json.loads(r.stdout.strip().splitlines()[-1])
    assert served == [{str(c): k for c, k in case["want"].items()} for case in cases]
    # and the validator does refuse what it should (the check can fail): a schedule not starting at 1
    bad = subprocess.run([str(serving_python()), "-c", code], input=json.dumps(
        [{"cfg": {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 2]]}, "want": {}}]),
        capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "must start at 1" in bad.stderr
