"""The release gate on realistic ab_live / eval_offline documents: an improvement passes, a regression
(τ, tok/s at any concurrency), a lossless failure and a live-offline gap are refused (the flow stops
with the report), `force` passes and is recorded."""
from __future__ import annotations

import json

import pytest

from drafter.core.config import GateConfig, config_from_dict
from drafter.core.files import write_json_atomic
from drafter.core.errors import StageError
from drafter.evaluation.gate import GateRefused, gate_decision, gate_report, offline_rule
from drafter.core.stage import Artifact
from drafter.evaluation.ab_live import run_key
from drafter.stages import gate as gate_stage


def _run(drafter: str, method: str | None, c: int, r: int, tok_s: float, tau: float | None, t: float = 0.0) -> dict:
    n_out = 2048
    drafts = None if tau is None else round(n_out / tau)
    acc = None if tau is None else n_out - drafts
    return {"drafter": drafter, "draft_sample_method": method, "temperature": t, "concurrency": c, "round": r,
            "requests": 16, "output_tokens": n_out, "seconds": n_out / tok_s, "tok_s": tok_s,
            "latency_s": {"mean": 8.0 / c ** 0.5, "p50": 7.5, "p90": 11.0}, "tau": tau,
            "num_drafts": drafts or 0, "num_draft_tokens": 4 * (drafts or 0), "num_accepted_tokens": acc or 0,
            "accepted_per_pos": [] if tau is None else [int(acc * f) for f in (0.45, 0.27, 0.17, 0.11)]}


def ab_live(tau_base=1.60, tau_cand=1.72, tok={1: (40.0, 52.0, 55.0), 8: (150.0, 170.0, 178.0)},
            lossless_ok=True, plan=None, other=None) -> dict:
    """A realistic ab_live.json (the schema the ab_live stage writes): K=4, T=0, greedy drafts,
    concurrency 1 and 8, 2 interleaved rounds; tok = {c: (none, baseline, candidate)}. ``plan``
    ({temperature: [methods]}) adds other temperatures and methods; ``other`` ({(T, method): (tau_base,
    tau_cand, tok)}) gives their numbers (default: the T=0 greedy ones)."""
    plan = plan or {0.0: ["greedy"]}
    runs, summary = [], {}
    for t, methods in sorted(plan.items()):
        for m in methods:
            tb, tc, tk = (other or {}).get((t, m), (tau_base, tau_cand, tok))
            for c, (t_none, t_base, t_cand) in tk.items():
                drafters = [("baseline", m, t_base, tb), ("candidate", m, t_cand, tc)]
                if m == methods[0]:
                    drafters.insert(0, ("none", None, t_none, None))
                for d, method, ts, tau in drafters:
                    rr = [_run(d, method, c, r, ts * (1 + 0.01 * (r - 0.5)), tau, t) for r in (0, 1)]
                    runs += rr
                    summary[run_key(d, method, c, t)] = {
                        "tau": tau, "tok_s": sum(x["tok_s"] for x in rr) / 2, "latency_p50_s": 7.5,
                        "accept_rate_per_pos": [] if tau is None else [0.6, 0.55, 0.5, 0.45],
                        "ttft_mean_s": 0.3, "decode_tok_s": ts * 1.25, "rounds": 2}
    mism = [] if lossless_ok else [{"prompt": 3, "first_diff_token": 17}]
    return {"num_speculative_tokens": 4, "method": "mtp", "temperatures": sorted(plan), "compiled": False,
            "engine_version": "0.32.0", "runs": runs, "summary": summary,
            "plan": [{"temperature": t, "draft_sample_methods": ms} for t, ms in sorted(plan.items())],
            "lossless": {"prompts": 8, "identical": 8 - len(mism), "ok": lossless_ok, "mismatches": mism},
            "unsupported": {} if any("probabilistic" in ms for ms in plan.values()) else
            {"probabilistic": "vLLM 0.32 MTP proposer samples drafts greedily only"}}


def legacy(ab: dict) -> dict:
    """The same document as an ab_live.json written before temperatures were a list: one ``temperature``,
    summary keys ``<drafter>/<method>/c<c>``."""
    (t,) = ab["temperatures"]
    return {k: v for k, v in ab.items() if k not in ("temperatures", "compiled", "plan")} | {
        "temperature": t, "summary": {k.split("/", 1)[1]: v for k, v in ab["summary"].items()}}


def eval_offline(tau_base_k4=1.70, tau_cand_k4=1.85, k_max=7) -> dict:
    """A realistic eval_offline.json: τ(K) rising and flattening, per rule and drafter."""
    def rule(t4: float, scale: float) -> dict:
        inc = [(t4 - 1) * f for f in (0.45, 0.27, 0.17, 0.11, 0.06, 0.03, 0.02)][:k_max]
        by_k, acc = [], 1.0
        for x in inc:
            acc += x * scale
            by_k.append(acc)
        return {"tau_by_k": by_k, "tau_ci": [[t - 0.05, t + 0.05] for t in by_k], "alpha": inc,
                "alpha_ci": [[a - 0.02, a + 0.02] for a in inc], "by_domain": {}, "by_mode": {}, "positions": 4200}

    drafters = {d: {"t0": rule(t, 1.0), "t1_greedy": rule(t, 0.9), "t1_prob": rule(t, 1.1)}
                for d, t in (("baseline", tau_base_k4), ("candidate", tau_cand_k4))}
    return {"k_max": k_max, "draft_cost": 0.08, "draft_cost_measured": True, "drafters": drafters,
            "recommended_k": {"baseline": 3, "candidate": 4}, "expected_speedup": {"baseline": [], "candidate": []}}


def run_gate(tmp_path, ab: dict, ev: dict, **gate):
    for name, doc in (("ab_live", ab), ("eval_offline", ev)):
        write_json_atomic(tmp_path / name / f"{name}.json", doc)
    inputs = {n: Artifact(n, n[0] * 16, tmp_path / n) for n in ("ab_live", "eval_offline")}
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return gate_stage.run(config_from_dict({"gate": gate}), inputs, out), out


def test_improvement_passes(tmp_path):
    m, out = run_gate(tmp_path, ab_live(), eval_offline())
    res = json.loads((out / "gate.json").read_text())
    assert res["verdict"] == "pass" and res["forced"] is False and res["failed"] == []
    names = [c["name"] for c in res["checks"]]
    assert names == ["lossless", "tau/greedy/c1", "tok_s/greedy/c1", "live_vs_offline/greedy/c1",
                     "tau/greedy/c8", "tok_s/greedy/c8", "live_vs_offline/greedy/c8", "no_spec/c1", "no_spec/c8"]
    tau1 = res["checks"][1]
    assert (tau1["value"], tau1["reference"]) == (1.72, 1.60) and tau1["threshold"] == pytest.approx(1.60 * 0.98)
    lvo = res["checks"][3]  # live 1.72 / offline t0 τ(K=4) 1.85
    assert lvo["value"] == pytest.approx(1.72 / 1.85) and lvo["reference"] == pytest.approx(1.85)
    assert m["gate"] == "pass" and m["failed_checks"] == 0 and m["tau_live_candidate"] == 1.72
    assert m["tau_offline_candidate"] == pytest.approx(1.85) and m["tok_s_c1_none"] == pytest.approx(40.0)
    assert "PASS" in (out / "gate.md").read_text()
    assert "probabilistic" in (out / "gate.md").read_text()  # unsupported methods are reported


def test_tau_regression_is_refused_with_the_report(tmp_path):
    with pytest.raises(GateRefused) as e:
        run_gate(tmp_path, ab_live(tau_cand=1.50), eval_offline())
    msg = str(e.value)
    assert "REFUSED" in msg and "**tau/greedy/c1**" in msg and "**tau/greedy/c8**" in msg
    assert "candidate live τ 1.500 vs baseline 1.600 (must be ≥ 1.568" in msg
    assert "tok_s/greedy/c1**" not in msg  # only the failed checks are listed as reasons
    assert "gate.force" in msg
    assert not (tmp_path / "out" / "gate.json").exists()  # nothing to publish
    assert isinstance(e.value, StageError)


def test_tok_s_regression_at_higher_concurrency_is_refused(tmp_path):
    ab = ab_live(tok={1: (40.0, 52.0, 53.0), 8: (150.0, 170.0, 150.0)})  # c8: −11.8 % > 5 %
    with pytest.raises(GateRefused, match=r"\*\*tok_s/greedy/c8\*\*: candidate 150.0 tok/s vs baseline 170.0"):
        run_gate(tmp_path, ab, eval_offline())
    # within the tolerance it passes
    m, _ = run_gate(tmp_path, ab, eval_offline(), tok_s_tolerance=0.15)
    assert m["gate"] == "pass"


def test_lossless_failure_is_refused(tmp_path):
    with pytest.raises(GateRefused, match=r"(?s)\*\*lossless\*\*: 7/8 prompts identical.*prompt 3 at token 17"):
        run_gate(tmp_path, ab_live(lossless_ok=False), eval_offline())
    ab = ab_live()
    ab["lossless"] = {"prompts": 0, "identical": 0, "ok": True, "mismatches": []}
    with pytest.raises(GateRefused, match="ran on no prompts"):
        run_gate(tmp_path, ab, eval_offline())
    ab["lossless"] = None  # what ab_live writes with lossless_prompts = 0
    with pytest.raises(GateRefused, match="ran on no prompts"):
        run_gate(tmp_path, ab, eval_offline())


def test_live_offline_gap_is_refused(tmp_path):
    # the offline prediction (3.0) is far above what vLLM measured (1.72): 0.57 < 0.7
    with pytest.raises(GateRefused, match=r"live τ 1.720 / offline τ 3.000 \(t0, K=4\) = 0.573"):
        run_gate(tmp_path, ab_live(), eval_offline(tau_cand_k4=3.0))
    m, _ = run_gate(tmp_path, ab_live(), eval_offline(tau_cand_k4=3.0), min_live_offline_ratio=0.5)
    assert m["gate"] == "pass"


def test_live_k_beyond_offline_k_max_fails_its_check():
    res = gate_decision(ab_live(), eval_offline(k_max=3), GateConfig())
    assert res["verdict"] == "refused"
    assert res["failed"] == ["live_vs_offline/greedy/c1", "live_vs_offline/greedy/c8"]
    assert "raise eval_offline.k_max to ≥ 4" in gate_report(res)


def test_force_passes_and_is_recorded(tmp_path):
    m, out = run_gate(tmp_path, ab_live(tau_cand=1.50, lossless_ok=False), eval_offline(), force=True)
    res = json.loads((out / "gate.json").read_text())
    assert res["verdict"] == "forced" and res["forced"] is True and res["force"] is True
    assert res["failed"] == ["lossless", "tau/greedy/c1", "tau/greedy/c8"]  # live/offline 1.50/1.85 = 0.81 is fine
    assert m["gate"] == "forced" and m["forced"] is True and m["failed_checks"] == 3
    assert m["failed"] == "lossless, tau/greedy/c1, tau/greedy/c8"
    assert "FORCED" in (out / "gate.md").read_text()
    # force on a passing release: still a plain pass, not recorded as forced
    m, out = run_gate(tmp_path, ab_live(), eval_offline(), force=True)
    assert m["gate"] == "pass" and json.loads((out / "gate.json").read_text())["forced"] is False


def test_rule_follows_temperature_and_draft_method():
    assert offline_rule(0.0, "greedy") == "t0" and offline_rule(0.0, "probabilistic") == "t0"
    assert offline_rule(1.0, "greedy") == "t1_greedy" and offline_rule(0.7, "probabilistic") == "t1_prob"
    tok = {1: (40.0, 52.0, 55.0), 8: (150.0, 170.0, 178.0)}
    ab = ab_live(plan={1.0: ["greedy", "probabilistic"]}, other={(1.0, "probabilistic"): (1.65, 1.80, tok)})
    ev = eval_offline()
    res = gate_decision(ab, ev, GateConfig())
    by = {c["name"]: c for c in res["checks"]}
    assert by["live_vs_offline/greedy/c1"]["reference"] == ev["drafters"]["candidate"]["t1_greedy"]["tau_by_k"][3]
    assert by["live_vs_offline/probabilistic/c1"]["reference"] == ev["drafters"]["candidate"]["t1_prob"]["tau_by_k"][3]
    assert by["live_vs_offline/probabilistic/c1"]["value"] == pytest.approx(1.80 / ev["drafters"]["candidate"]["t1_prob"]["tau_by_k"][3])


def test_live_checks_use_the_lowest_temperature_and_the_others_are_listed(tmp_path):
    """T=0 and T=1 × greedy/probabilistic: the checks are those of T=0 greedy; a fine-tuned drafter slower than
    the released one at T=1 is in the gate document's table but does not refuse."""
    slower = {1: (30.0, 36.0, 33.0), 8: (120.0, 132.0, 126.0)}  # candidate below baseline at T=1
    ab = ab_live(plan={0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]},
                 other={(1.0, "greedy"): (1.50, 1.40, slower), (1.0, "probabilistic"): (1.55, 1.45, slower)})
    m, out = run_gate(tmp_path, ab, eval_offline())
    res = json.loads((out / "gate.json").read_text())
    assert res["verdict"] == "pass" and res["temperature"] == 0.0 and res["temperatures"] == [0.0, 1.0]
    assert [c["name"] for c in res["checks"]] == [c["name"] for c in gate_decision(ab_live(), eval_offline(),
                                                                                    GateConfig())["checks"]]
    assert m["tau_live_candidate"] == 1.72 and m["tok_s_c1_none"] == pytest.approx(40.0)  # T=0 greedy
    rows = {(r["temperature"], r["draft_sample_method"], r["drafter"]): r for r in res["live_matrix"]}
    assert len(rows) == 8 and rows[(1.0, None, "none")]["tau"] is None
    cand = rows[(1.0, "probabilistic", "candidate")]
    assert cand["tau"] == 1.45 and [e["concurrency"] for e in cand["by_concurrency"]] == [1, 8]
    assert cand["by_concurrency"][0]["tok_s"] == pytest.approx(33.0) and cand["by_concurrency"][0]["speedup"] == 1.1
    md = (out / "gate.md").read_text()
    assert "informational: the live checks above use T=0" in md and "Temperatures 0, 1; servers eager" in md
    assert "| 1 | probabilistic | candidate | 1.450 | 33.0 | 126.0 | 1.10× | 1.05× |" in md
    # with only T>0 the lowest temperature is checked, every method measured there, under the T=1 rules
    ab = ab_live(plan={0.7: ["greedy", "probabilistic"], 1.0: ["greedy", "probabilistic"]},
                 other={(1.0, "greedy"): (1.50, 1.40, slower), (1.0, "probabilistic"): (1.55, 1.45, slower)})
    res = gate_decision(ab, eval_offline(), GateConfig())
    assert res["verdict"] == "pass" and res["temperature"] == 0.7
    assert {c["name"].split("/", 1)[1] for c in res["checks"][1:] if not c["name"].startswith("no_spec/")} == {"greedy/c1", "greedy/c8",
                                                                         "probabilistic/c1", "probabilistic/c8"}
    assert "(t1_prob, K=4)" in {c["name"]: c for c in res["checks"]}["live_vs_offline/probabilistic/c1"]["detail"]
    # the same slower drafter at the lowest temperature is refused
    ab = ab_live(plan={1.0: ["greedy"]}, other={(1.0, "greedy"): (1.50, 1.40, slower)})
    assert gate_decision(ab, eval_offline(), GateConfig())["failed"][:2] == ["tau/greedy/c1", "tok_s/greedy/c1"]


def test_an_older_ab_live_json_gives_the_same_verdict(tmp_path):
    """ab_live.json written before temperatures were a list: one ``temperature``, keys <drafter>/<method>/c<c>."""
    for ab in (ab_live(), ab_live(tau_cand=1.50)):
        new, old = gate_decision(ab, eval_offline(), GateConfig()), gate_decision(legacy(ab), eval_offline(), GateConfig())
        assert old["checks"] == new["checks"] and old["key_numbers"] == new["key_numbers"]
        assert old["live_matrix"] == new["live_matrix"] and old["compiled"] is None


def test_bad_inputs_name_the_file_and_key(tmp_path):
    ab = ab_live()
    del ab["summary"]["t0/baseline/greedy/c8"]
    with pytest.raises(StageError, match="summary has t0/candidate/greedy/c8 but no t0/baseline/greedy/c8"):
        run_gate(tmp_path, ab, eval_offline())
    ab = ab_live()
    del ab["lossless"]
    with pytest.raises(StageError, match="ab_live.json: missing key 'lossless'"):
        run_gate(tmp_path, ab, eval_offline())
    ab = ab_live()
    ab["summary"] = {k: v for k, v in ab["summary"].items() if "/candidate/" not in k}
    with pytest.raises(StageError, match="summary has no candidate entry at temperature 0"):
        run_gate(tmp_path, ab, eval_offline())
    ab = ab_live()
    ab["summary"]["t0.5/candidate/greedy"] = ab["summary"]["t0/candidate/greedy/c1"]
    with pytest.raises(StageError, match=r"summary key 't0.5/candidate/greedy' is not t<temperature>/<drafter>/<method>/c<concurrency>"):
        run_gate(tmp_path, ab, eval_offline())
    ab = ab_live()
    ab["summary"]["t0/candidate/greedy/c1"] = dict(ab["summary"]["t0/candidate/greedy/c1"], tau=None)
    res = gate_decision(ab, eval_offline(), GateConfig())
    assert "tau/greedy/c1" in res["failed"] and "live_vs_offline/greedy/c1" in res["failed"]
    inputs = {"ab_live": Artifact("ab_live", "a" * 16, tmp_path / "nothing"),
              "eval_offline": Artifact("eval_offline", "e" * 16, tmp_path / "eval_offline")}
    with pytest.raises(StageError, match=r"nothing/ab_live.json does not exist"):
        gate_stage.run(config_from_dict({}), inputs, tmp_path / "o")


def test_skipped_live_ab_refuses_unless_forced(tmp_path):
    """No vLLM (ab_live skipped): no live evidence, so the gate refuses — or, forced, records why."""
    write_json_atomic(tmp_path / "eval_offline" / "eval_offline.json", eval_offline())
    inputs = {"eval_offline": Artifact("eval_offline", "e" * 16, tmp_path / "eval_offline"),
              "ab_live": Artifact("ab_live", "a" * 16, tmp_path / "ab_live",
                                  {"status": "skipped", "reason": "serving.backend is 'transformers'"})}
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GateRefused, match="ab_live was skipped.*transformers"):
        gate_stage.run(config_from_dict({}), inputs, out)
    assert not (out / "gate.json").exists()
    m = gate_stage.run(config_from_dict({"gate": {"force": True}}), inputs, out)
    assert m["gate"] == "forced" and m["failed"] == "live"
    doc = json.loads((out / "gate.json").read_text())
    assert doc["forced"] is True and "transformers" in doc["checks"][0]["detail"]


# --------------------------------------------------------------------------- never slower than no speculation


def with_schedule(ab: dict, sweep_tok: dict[int, dict[int, float]], served: dict[int, float] | None,
                  refusal: str | None = None) -> dict:
    """``ab`` with a sweep of the fine-tuned drafter (``sweep_tok``: c → K → tok/s; K=4 is the served one, K=0 no
    speculation: both already in ``ab``'s runs) and its schedule, served (``served``: c → the schedule server's tok/s)
    or refused."""
    from drafter.evaluation.ab_live import SCHEDULE, schedule_record, sweep_name, sweep_of, summarize

    runs = list(ab["runs"])
    for c, by_k in sweep_tok.items():
        for k, tok in by_k.items():
            if k not in (0, 4):
                runs += [_run(sweep_name(k, 4), "greedy", c, r, tok * (1 + 0.01 * (r - 0.5)), 1.5) for r in (0, 1)]
    rec = schedule_record(sweep_of(runs, 0.0, "greedy", 4), 0.02, {"method": "mtp"}, temperature=0.0, method="greedy")
    if served is not None:
        runs += [_run(SCHEDULE, "greedy", c, r, tok, 1.6) for c, tok in served.items() for r in (0, 1)]
        rec["served"] = True
    else:
        rec["refusal"] = refusal
    summary = dict(ab["summary"])
    for key, entry in summarize(runs).items():
        summary.setdefault(key, entry)
    return ab | {"runs": runs, "summary": summary, "schedule": rec}


def test_a_release_slower_than_no_speculation_is_refused_naming_the_concurrency(tmp_path):
    ab = ab_live(tok={1: (40.0, 52.0, 55.0), 8: (200.0, 170.0, 178.0)})  # fixed K at 8 users: 0.89× no speculation
    with pytest.raises(GateRefused) as e:
        run_gate(tmp_path, ab, eval_offline())
    msg = str(e.value)
    assert "**no_spec/c8**" in msg and "**no_spec/c1**" not in msg
    assert "fixed K=4): 178.0 tok/s vs no speculation 200.0 (0.89×; must be ≥ 190.0, tolerance 5%) at 8 concurrent users" in msg


def test_a_served_schedule_that_turns_speculation_off_passes(tmp_path):
    ab = ab_live(tok={1: (40.0, 52.0, 55.0), 8: (200.0, 170.0, 178.0)})
    ab = with_schedule(ab, {1: {0: 40.0, 2: 50.0, 4: 55.0}, 8: {0: 200.0, 2: 185.0, 4: 178.0}}, {1: 54.0, 8: 198.0})
    assert ab["schedule"]["ranges"] == [[1, 1, 4], [2, 1024, 0]]
    m, out = run_gate(tmp_path, ab, eval_offline())
    res = json.loads((out / "gate.json").read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert m["gate"] == "pass", res["failed"]
    assert checks["no_spec/c8"]["value"] == pytest.approx(198.0) and checks["no_spec/c8"]["reference"] == pytest.approx(200.0)
    assert checks["schedule/c1"]["reference"] == pytest.approx(55.0)  # the best fixed choice at 1 user: K=4
    assert "schedule (served), K=0 here" in checks["no_spec/c8"]["detail"]
    assert res["schedule"]["served"] is True


def test_a_served_schedule_below_the_best_fixed_choice_is_refused(tmp_path):
    """The schedule stays the released configuration (as fast as the best fixed K overall, within tolerance) but is
    slower than the best fixed choice at 1 user beyond tolerance: refused there."""
    ab = ab_live(tok={1: (40.0, 52.0, 55.0), 8: (200.0, 170.0, 178.0)})
    ab = with_schedule(ab, {1: {0: 40.0, 2: 54.0, 4: 55.0}, 8: {0: 200.0, 2: 215.0, 4: 178.0}}, {1: 52.0, 8: 216.0})
    assert ab["schedule"]["ranges"] == [[1, 1, 4], [2, 8, 2], [9, 1024, 0]]
    with pytest.raises(GateRefused, match=r"\*\*schedule/c1\*\*: the served schedule 52.0 tok/s vs the best fixed "
                       r"choice \(K=4\) 55.0") as e:
        run_gate(tmp_path, ab, eval_offline())
    assert "Released configuration: the schedule (served): 1.18× no speculation" in str(e.value)
    assert "**schedule/c8**" not in str(e.value) and "**no_spec/c8**" not in str(e.value)


def test_a_fixed_k_faster_than_the_served_schedule_is_released_in_its_place(tmp_path):
    """The EAGLE-3 demo's case (2026-12-05): vLLM served the schedule ~10 % below the fixed K it schedules. The fixed
    K (up to the users where it beats no speculation) is released; the schedule's per-concurrency checks go."""
    ab = ab_live(tok={1: (40.0, 52.0, 55.0), 8: (200.0, 170.0, 178.0)})
    ab = with_schedule(ab, {1: {0: 40.0, 2: 50.0, 4: 55.0}, 8: {0: 200.0, 2: 185.0, 4: 178.0}}, {1: 47.0, 8: 199.0})
    m, out = run_gate(tmp_path, ab, eval_offline())
    res = json.loads((out / "gate.json").read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert m["gate"] == "pass", res["failed"]
    assert not [n for n in checks if n.startswith("schedule/")]
    assert checks["no_spec/c1"]["value"] == pytest.approx(55.0) and "fixed K=4" in checks["no_spec/c1"]["detail"]
    assert checks["no_spec/c8"]["value"] == pytest.approx(200.0)  # no drafter above 1 user
    rel = res["released"]
    assert (rel["kind"], rel["k"], rel["serve_limit"], rel["pays_up_to"]) == ("fixed", 4, 1, 1)
    assert rel["ranges"] == [[1, 1, 4], [2, 1024, 0]]
    assert rel["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 4}
    assert rel["why"].startswith("fixed K=4 up to 1 user: 1.17× no speculation (geometric mean over 1, 8 users), "
                                 "faster than the schedule (served) at 1.08×")
    assert "Released configuration: fixed K=4 up to 1 user" in (out / "gate.md").read_text()


def test_a_schedule_the_engine_refused_is_checked_on_the_fixed_k_servers(tmp_path):
    ab = ab_live(tok={1: (40.0, 52.0, 55.0), 8: (200.0, 170.0, 178.0)})
    ab = with_schedule(ab, {1: {0: 40.0, 4: 55.0}, 8: {0: 200.0, 4: 178.0}}, None, refusal="unknown field")
    m, out = run_gate(tmp_path, ab, eval_offline())
    checks = {c["name"]: c for c in json.loads((out / "gate.json").read_text())["checks"]}
    assert m["gate"] == "pass"
    assert checks["no_spec/c8"]["value"] == pytest.approx(200.0)  # K=0 at 8 users: no speculation's own rounds
    assert checks["no_spec/c1"]["value"] == pytest.approx(55.0) and "schedule/c1" not in checks
    assert "not served" in checks["no_spec/c1"]["detail"]


def test_where_a_served_schedule_turned_off_is_slower_the_release_serves_without_the_drafter(tmp_path):
    """vLLM runs the drafter's first pass even where the schedule says K=0: the measured demo case (2026-12-05) —
    K=1 pays at 1 user, the served schedule is 0.81×/0.77×/0.80× at 2/4/8 users. Above the 1 user where speculation
    pays the release is served without the drafter; the gate checks that, and the served schedule at 1 user."""
    from drafter.evaluation.ab_live import AbLiveResult, serve_limit

    ab = ab_live(tok={1: (75.6, 58.0, 70.7), 2: (131.1, 98.6, 108.2), 4: (208.4, 151.7, 158.9),
                      8: (342.5, 200.2, 214.7)}, tau_base=1.463, tau_cand=1.779)
    ab = with_schedule(ab, {1: {1: 80.6}, 2: {1: 124.8}, 4: {1: 200.6}, 8: {1: 271.6}},
                       {1: 79.9, 2: 106.1, 4: 161.1, 8: 272.4})
    assert ab["schedule"]["ranges"] == [[1, 1, 1], [2, 1024, 0]] and ab["schedule"]["pays_up_to"] == 1
    assert serve_limit(AbLiveResult.of(ab)) == 1
    res = gate_decision(ab, eval_offline(tau_base_k4=1.5, tau_cand_k4=1.9), GateConfig())
    checks = {c["name"]: c for c in res["checks"]}
    assert checks["no_spec/c1"]["passed"] and checks["no_spec/c1"]["value"] == pytest.approx(79.9)
    assert checks["schedule/c1"]["passed"] and checks["schedule/c1"]["reference"] == pytest.approx(80.6)
    c8 = checks["no_spec/c8"]
    assert c8["passed"] and c8["value"] == c8["reference"] == pytest.approx(342.5) and "schedule/c8" not in checks
    assert "the drafter is not loaded above 1 user; the served schedule, with speculation off here, was 0.80×" in c8["detail"]
    # the served schedule slower than no speculation where speculation is to pay: fixed K=1 is released instead
    slow = with_schedule(ab_live(tok={1: (75.6, 58.0, 70.7), 8: (342.5, 200.2, 214.7)}),
                         {1: {1: 80.6}, 8: {1: 271.6}}, {1: 70.0, 8: 340.0})
    res = gate_decision(slow, eval_offline(), GateConfig())
    assert res["verdict"] == "pass" and res["released"]["kind"] == "fixed" and res["released"]["serve_limit"] == 1
    # ... unless the schedule is faster overall (here at 8 users): then it stays released and is refused at 1 user
    slow = with_schedule(ab_live(tok={1: (75.6, 58.0, 70.7), 8: (342.5, 200.2, 214.7)}),
                         {1: {1: 80.6}, 8: {1: 400.0}}, {1: 70.0, 8: 500.0})
    res = gate_decision(slow, eval_offline(), GateConfig())
    assert res["verdict"] == "refused" and "no_spec/c1" in res["failed"] and "no_spec/c8" not in res["failed"]
    assert res["released"]["kind"] == "schedule" and serve_limit(AbLiveResult.of(slow)) is None
