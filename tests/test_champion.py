"""Champion / challenger (drafter/release/champion.py): the decision rules on measured numbers, and
reading the champion from the store (its release folder) and from a Hub (tests/hub_server.py, the real
huggingface_hub client) — sha256-checked, None before the first release."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError
from drafter.core.store import Store
from drafter.release.champion import (KEPT, REPLACED, baseline_for, challenge, champion_from_hub,
                                      champion_from_store, decision_markdown)
from tests.hub_server import HubState, hub_client_settings, running_hub

TOKEN = "hf_champion_test_token"


def ev(champ: list[float], cand: list[float]) -> dict:
    return {"drafters": {w: {r: {"tau_by_k": taus} for r in ("t0", "t1_greedy", "t1_prob")}
                         for w, taus in (("baseline", champ), ("candidate", cand))}}


def ab(champ_tau: float, cand_tau: float, champ_tok: float = 10.0, cand_tok: float = 10.0, k: int = 2,
       none_tok: float = 9.0) -> dict:
    return {"num_speculative_tokens": k, "temperature": 0.0,
            "lossless": {"prompts": 2, "identical": 2, "ok": True, "mismatches": []},
            "summary": {"none/none/c1": {"tau": None, "tok_s": none_tok},
                        "baseline/greedy/c1": {"tau": champ_tau, "tok_s": champ_tok},
                        "candidate/greedy/c1": {"tau": cand_tau, "tok_s": cand_tok}}}


def cfg(**sections) -> ReleaseConfig:
    return ReleaseConfig.model_validate({"ab_live": {"num_speculative_tokens": 2}, **sections})


def test_a_candidate_that_beats_the_champion_offline_and_passes_the_gate_wins():
    d = challenge(ab(1.20, 1.26), ev([1.0, 1.20, 1.3], [1.0, 1.25, 1.4]), cfg(), "champ1")
    assert d["winner"] == "candidate" and d["decision"] == REPLACED
    assert d["champion"] == {"release_id": "champ1", "tau_offline": 1.20, "tau_live": 1.20, "tok_s_c1": 10.0}
    assert d["candidate"]["tau_offline"] == 1.25 and d["candidate"]["tau_live"] == 1.26
    assert d["gate"]["verdict"] == "pass" and any("1.2500 > champion 1.2000" in r for r in d["reasons"])


def test_the_live_numbers_are_the_lowest_temperatures_greedy_ones():
    """An A/B at T=0 and T=1 (summary keys t<T>/…): the decision reads T=0 greedy, whatever T=1 measured."""
    old = ab(1.20, 1.26)
    new = dict(old, temperatures=[0.0, 1.0], summary={f"t0/{k}": v for k, v in old["summary"].items()} | {
        "t1/none/none/c1": {"tau": None, "tok_s": 7.0}, "t1/baseline/greedy/c1": {"tau": 1.1, "tok_s": 6.0},
        "t1/candidate/greedy/c1": {"tau": 1.0, "tok_s": 5.0}, "t1/candidate/probabilistic/c1": {"tau": 1.4, "tok_s": 8.0},
        "t1/baseline/probabilistic/c1": {"tau": 1.3, "tok_s": 7.5}})
    d = challenge(new, ev([1.0, 1.20, 1.3], [1.0, 1.25, 1.4]), cfg(), "champ1")
    assert d["champion"]["tau_live"] == 1.20 and d["candidate"] == {"tau_offline": 1.25, "tau_live": 1.26, "tok_s_c1": 10.0}
    assert d["winner"] == "candidate" and d["gate"]["verdict"] == "pass"  # the slower T=1 greedy is informational


def test_an_equal_candidate_keeps_the_champion_and_so_does_one_below_min_tau_gain():
    d = challenge(ab(1.2, 1.2), ev([1, 1.2], [1, 1.2]), cfg(), "c")
    assert d["winner"] == "champion" and d["decision"] == KEPT
    assert any("1.2000 ≤ champion 1.2000" in r for r in d["reasons"]), d["reasons"]
    d = challenge(ab(1.2, 1.22), ev([1, 1.2], [1, 1.22]), cfg(retrain={"min_tau_gain": 0.05}), "c")
    assert d["winner"] == "champion" and any("min_tau_gain 0.05" in r for r in d["reasons"])


def test_a_candidate_better_offline_but_slower_live_is_refused_by_the_gate_rules():
    d = challenge(ab(1.2, 1.3, champ_tok=10.0, cand_tok=8.0, none_tok=7.0), ev([1, 1.2], [1, 1.3]), cfg(), "c")
    assert d["winner"] == "champion" and d["gate"]["failed"] == ["tok_s/greedy/c1"]
    assert any(r.startswith("gate check tok_s/greedy/c1 failed: candidate 8.0 tok/s vs baseline 10.0") for r in d["reasons"])
    md = decision_markdown("demo", d, "5 new conversation(s)")
    assert "# Retrain demo: champion kept" in md and "| champion `c` | 1.2000 | 1.200 | 10.00 |" in md
    assert "| candidate | 1.3000 | 1.300 | 8.00 |" in md


def test_gate_force_never_lets_a_worse_candidate_through():
    # force set, and the gate's live checks fail: the forced gate is not a win
    d = challenge(ab(1.2, 1.0), ev([1, 1.2], [1, 1.3]), cfg(gate={"force": True}), "c")
    assert d["winner"] == "champion" and "tau/greedy/c1" in d["gate"]["failed"]
    # no live A/B: without force the gate refuses; with force the offline comparison decides, and says so
    d = challenge(None, ev([1, 1.2], [1, 1.3]), cfg(), "c", "serving.backend is 'transformers'")
    assert d["winner"] == "champion" and d["gate"]["failed"] == ["live"]
    d = challenge(None, ev([1, 1.2], [1, 1.3]), cfg(gate={"force": True}), "c", "serving.backend is 'transformers'")
    assert d["winner"] == "candidate" and "offline comparison alone" in d["reasons"][0]
    d = challenge(None, ev([1, 1.3], [1, 1.2]), cfg(gate={"force": True}), "c", "no vLLM")
    assert d["winner"] == "champion"


# --------------------------------------------------------------------------- the schedules' tokens/s


def _run(drafter: str, c: int, r: int, tok_s: float) -> dict:
    tau = None if drafter == "none" else (1.2 if drafter == "baseline" else 1.26)
    return {"drafter": drafter, "draft_sample_method": None if drafter == "none" else "greedy", "temperature": 0.0,
            "concurrency": c, "round": r, "tok_s": tok_s * (1 + 0.01 * (r - 0.5)), "tau": tau,
            "latency_s": {"p50": 1.0}, "num_drafts": 0 if tau is None else 100,
            "accepted_per_pos": [] if tau is None else [20, 6]}


def sched_ab(tok: dict[int, dict[str, float]], served_k: int = 2) -> dict:
    """An ab_live.json with a concurrency × K sweep and its schedule, served: ``tok`` is c → drafter → tok/s, the
    drafters ``none``, ``baseline`` (the champion at the served K), ``candidate`` (the served K), ``candidate-k<K>``
    (the sweep's other Ks) and ``schedule`` (the schedule server)."""
    from drafter.evaluation.ab_live import schedule_record, summarize, sweep_of

    runs = [_run(d, c, r, t) for c, by_d in tok.items() for d, t in by_d.items() for r in (0, 1)]
    rec = schedule_record(sweep_of(runs, 0.0, "greedy", served_k), 0.02, {"method": "mtp"}, temperature=0.0,
                          method="greedy") | {"served": True}
    return {"num_speculative_tokens": served_k, "temperature": 0.0, "runs": runs, "summary": summarize(runs),
            "lossless": {"prompts": 2, "identical": 2, "ok": True, "mismatches": []}, "schedule": rec}


def champion_release(ranges: list[list[int]] | None) -> dict:
    rel = {"release_id": "champ1", "files": []}
    return rel if ranges is None else rel | {"schedule": {"ranges": ranges, "served": True}}


FAST = {1: {"none": 40.0, "baseline": 50.0, "candidate": 55.0, "candidate-k1": 45.0, "schedule": 54.0},
        4: {"none": 120.0, "baseline": 130.0, "candidate": 140.0, "candidate-k1": 135.0, "schedule": 139.0},
        8: {"none": 200.0, "baseline": 170.0, "candidate": 178.0, "candidate-k1": 230.0, "schedule": 228.0}}
OFFLINE = ev([1.0, 1.20, 1.3], [1.0, 1.25, 1.4])


def test_a_candidate_schedule_faster_than_the_champions_everywhere_wins():
    a = sched_ab(FAST)
    assert a["schedule"]["ranges"] == [[1, 4, 2], [5, 8, 1], [9, 1024, 0]]
    d = challenge(a, OFFLINE, cfg(), "champ1", champion_release=champion_release([[1, 4, 2], [5, 1024, 0]]))
    assert d["gate"]["verdict"] == "pass" and d["winner"] == "candidate", d["reasons"]
    rows = {r["concurrency"]: r for r in d["speed"]}
    assert [(c, r["candidate_tok_s"], r["candidate_k"], r["champion_tok_s"], r["champion_k"], r["ok"])
            for c, r in rows.items()] == [(1, 54.0, 2, 50.0, 2, True), (4, 139.0, 2, 130.0, 2, True),
                                          (8, 228.0, 1, 200.0, 0, True)]
    assert "no speculation's tok/s this run" in rows[8]["note"] and "K=0 for 5–1024 users" in rows[8]["note"]
    assert any(r.startswith("tok/s (tolerance 5%): the candidate's released configuration is not slower") and
               "c8 228.0 vs 200.0 (K=1 vs K=0)" in r for r in d["reasons"]), d["reasons"]
    md = decision_markdown("demo", d, "n")
    assert "| users | candidate tok/s (K) | champion tok/s (K) | not slower | note |" in md
    assert "| 8 | 228.0 (1) | 200.0 (0) | yes |" in md


def test_a_candidate_slower_at_8_users_than_the_champions_schedule_keeps_the_champion():
    """The champion's schedule turns speculation off at 8 users: it is compared with no speculation there."""
    # the sweep has K=1 paying at 8 users (210 vs 200), but the served schedule gives 186 there; it stays the
    # candidate's released configuration (faster than any fixed K over 1, 4, 8 users)
    slow = {1: FAST[1] | {"schedule": 62.0}, 4: FAST[4] | {"schedule": 150.0},
            8: {"none": 200.0, "baseline": 170.0, "candidate": 178.0, "candidate-k1": 210.0, "schedule": 186.0}}
    d = challenge(sched_ab(slow), OFFLINE, cfg(), "champ1",
                  champion_release=champion_release([[1, 4, 2], [5, 1024, 0]]))
    assert d["winner"] == "champion" and d["decision"] == KEPT
    assert [r["concurrency"] for r in d["speed"] if not r["ok"]] == [8]
    why = [r for r in d["reasons"] if r.startswith("tok/s at")]
    assert len(why) == 1 and why[0].startswith("tok/s at c8 (8 users): candidate 186.0 (K=1) vs champion 200.0 (K=0")
    assert "must be ≥ 190.0, tolerance 5%" in why[0]
    assert "| 8 | 186.0 (1) | 200.0 (0) | **no** |" in decision_markdown("demo", d, "n")


def test_a_champion_release_without_a_schedule_is_its_fixed_k():
    d = challenge(sched_ab(FAST), OFFLINE, cfg(), "champ1", champion_release=champion_release(None))
    assert d["winner"] == "candidate"
    assert [(r["champion_k"], r["champion_tok_s"]) for r in d["speed"]] == [(2, 50.0), (2, 130.0), (2, 170.0)]
    assert all("fixed K=2 (its release has no schedule)" == r["note"] for r in d["speed"])
    # no champion_release at all (a caller that does not pass it): the same
    assert challenge(sched_ab(FAST), OFFLINE, cfg(), "champ1")["speed"] == d["speed"]


def test_the_schedule_comparison_alone_can_keep_the_champion():
    """Every gate check passes (each within its tolerance), but the served schedule at 8 users is below the
    champion's fixed K beyond the tolerance: the champion stays."""
    tight = FAST | {8: {"none": 150.0, "baseline": 200.0, "candidate": 191.0, "candidate-k1": 180.0, "schedule": 186.0}}
    d = challenge(sched_ab(tight), OFFLINE, cfg(), "champ1", champion_release=champion_release(None))
    assert d["gate"]["verdict"] == "pass" and d["winner"] == "champion"
    assert any(r.startswith("tok/s at c8 (8 users): candidate 186.0 (K=2) vs champion 200.0 (K=2") for r in d["reasons"])


def test_a_champion_k_not_measured_this_run_is_stood_in_for_by_the_served_k():
    d = challenge(sched_ab(FAST), OFFLINE, cfg(), "champ1", champion_release=champion_release([[1, 1, 2], [2, 1024, 3]]))
    rows = {r["concurrency"]: r for r in d["speed"]}
    assert rows[1]["champion_k"] == 2 and "stands in" not in rows[1]["note"]
    assert rows[4]["champion_k"] == 3 and rows[4]["champion_tok_s"] == 130.0
    assert "K=3 was not measured for the champion this run: its K=2 tok/s stands in" in rows[4]["note"]


def test_without_a_live_ab_the_speed_comparison_is_waived():
    d = challenge(None, OFFLINE, cfg(gate={"force": True}), "c", "no vLLM",
                  champion_release=champion_release([[1, 1024, 2]]))
    assert d["winner"] == "candidate" and d["speed"] == []
    assert "no live A/B (no vLLM): the tok/s comparison with the champion's schedule is waived" in d["reasons"]
    assert "not slower" not in decision_markdown("demo", d, "n")


def _release_folder(root: Path, payload: bytes = b"drafter-bytes") -> tuple[Path, str]:
    folder = root / "release"
    folder.mkdir(parents=True)
    (folder / "mtp-trained.safetensors").write_bytes(payload)
    (folder / "README.md").write_text("card\n")
    sha = hashlib.sha256(payload).hexdigest()
    rid = sha[:16]
    (folder / "release.json").write_text(json.dumps({"release_id": rid, "files": [
        {"path": "README.md", "size": 5, "sha256": hashlib.sha256(b"card\n").hexdigest()},
        {"path": "mtp-trained.safetensors", "size": len(payload), "sha256": sha}]}))
    return folder, rid


def _summary(run_id: str, name: str, status: str, publish_key: str | None) -> dict:
    stages = [{"stage": "train", "key": "k1", "status": "computed", "path": "", "seconds": 1.0, "metrics": {}}]
    if publish_key:
        stages.append({"stage": "publish", "key": publish_key, "status": "computed", "path": "", "seconds": 1.0,
                       "metrics": {}})
    return {"run_id": run_id, "release": name, "store": "x", "status": status, "error": None,
            "started_at": f"2026-12-01T00:00:0{run_id[-1]}", "finished_at": "", "stages": stages,
            "computed": [], "reused": []}


def test_the_store_champion_is_the_newest_completed_run_that_published(tmp_path):
    store = Store(tmp_path / "store", cache_dir=tmp_path / "cache")
    assert champion_from_store(store, "demo", tmp_path / "cache") is None

    def write(part: Path):
        _release_folder(part, b"the champion")
        return {}

    store.produce("publish", "pk1", write, {"stage": "publish", "config": {}, "inputs": {}})
    store.write_run("r1", _summary("r1", "demo", "completed", "pk1"))
    store.write_run("r2", _summary("r2", "demo", "completed", None))  # a challenge run: no publish
    store.write_run("r3", _summary("r3", "demo", "failed", "pk-missing"))
    store.write_run("r4", _summary("r4", "other", "completed", "pk-other"))
    champ = champion_from_store(store, "demo", tmp_path / "cache")
    assert champ is not None and champ.source == "store run r1"
    assert champ.weights.read_bytes() == b"the champion"
    assert champ.weights.parent == tmp_path / "cache" / "champions" / champ.release_id
    b = baseline_for(champ, ReleaseConfig().retrain)
    assert b.weights == str(champ.weights) and b.sha256 == champ.sha256 and b.init is True
    assert champion_from_store(store, "nobody", tmp_path / "cache") is None


def test_the_hub_champion_is_the_branch_head_release_checked_by_sha256(tmp_path):
    from huggingface_hub import HfApi

    from drafter.release.hub import publish_folder

    c = ReleaseConfig.model_validate({"publish": {"repo_id": "org/champ", "dry_run": False, "retries": 0}})
    with hub_client_settings(), running_hub(HubState(token=TOKEN, read_token=None)) as hub:
        c.publish.endpoint = hub.url
        assert champion_from_hub(c, TOKEN, tmp_path / "cache") is None  # no repo yet
        HfApi(endpoint=hub.url, token=TOKEN).create_repo("org/champ", private=True)
        assert champion_from_hub(c, TOKEN, tmp_path / "cache") is None  # a repo without a release

        folder, rid = _release_folder(tmp_path / "a", b"published drafter")
        publish_folder(folder, c.publish, token=TOKEN, message="Release", tag=None, release_id=rid, log=lambda *_: None)
        champ = champion_from_hub(c, TOKEN, tmp_path / "cache")
        assert champ.release_id == rid and champ.source.startswith("hub org/champ@")
        assert champ.weights.read_bytes() == b"published drafter"

        # a release.json whose hash does not match its drafter file is refused, naming both hashes
        bad, _ = _release_folder(tmp_path / "b", b"other bytes")
        doc = json.loads((bad / "release.json").read_text())
        doc["files"][1]["sha256"] = "0" * 64
        doc["release_id"] = "badbadbadbadbad0"
        (bad / "release.json").write_text(json.dumps(doc))
        publish_folder(bad, c.publish, token=TOKEN, message="Tampered", tag=None, release_id="badbadbadbadbad0",
                       log=lambda *_: None)
        with pytest.raises(StageError, match="sha256 .* its release.json says 0000"):
            champion_from_hub(c, TOKEN, tmp_path / "cache")


# --------------------------------------------------------------------------- the retrain flow's branches


def test_the_retrain_flow_keeps_the_champion_publishing_nothing(prefect_harness, tmp_path, monkeypatch):
    """drafter_prefect/retrain.py when the challenge loses (the real flow on real traffic, store and ledger;
    faked: the champion lookup and the stage runs, whose numbers are given): one run of the challenge stages
    with the champion as the baseline, no second run (no gate, no publish), the decision with both sets of
    numbers in the store's record, one `champion-kept` event, the traffic used up. The same flow through a
    worker with real stages and a real Hub, a candidate that wins: tests/test_deployments.py (nightly)."""
    import drafter_prefect.retrain as flow_mod
    from drafter.release.champion import Champion

    weights = tmp_path / "champ" / "mtp-trained.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"champion weights")
    champ = Champion("champ0123456789a", "hub org/x@abc", {"release_id": "champ0123456789a", "files": []}, weights,
                     hashlib.sha256(b"champion weights").hexdigest())
    runs: list[dict] = []
    events: list[tuple] = []

    def fake_release(config, stages=None):
        runs.append({"stages": stages, "baseline": config.baseline.model_dump()})
        return {"run_id": f"run{len(runs)}", "status": "completed", "computed": [], "stages": []}

    monkeypatch.setattr(flow_mod, "find_champion", lambda cfg, store, warn=None: champ)
    monkeypatch.setattr(flow_mod, "release", fake_release)
    # the challenge measured the candidate below the champion offline; no live A/B (transformers serving)
    monkeypatch.setattr(flow_mod, "_challenge_inputs", lambda cfg, store: (
        None, ev([1.0, 1.20, 1.3], [1.0, 1.10, 1.2]), "serving.backend is 'transformers'"))
    monkeypatch.setattr(flow_mod, "emit_release_event", lambda kind, name, payload: events.append((kind, name, payload)))

    (tmp_path / "traffic").mkdir()
    rows = [{"messages": [{"role": "user", "content": f"Day 3: tell me about the number {i}."}]} for i in range(4)]
    (tmp_path / "traffic" / "day3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"name": "demo", "store": {"root": str(tmp_path / "store")}, "ab_live": {"num_speculative_tokens": 2},
              "gate": {"force": True}, "retrain": {"min_new_rows": 3, "start_from": "released"}}
    result = flow_mod.retrain(config=config, traffic=[str(tmp_path / "traffic" / "*.jsonl")])

    assert result["status"] == KEPT and result["decision"] == KEPT and result["new_rows"] == 4
    assert runs == [{"stages": ["eval_offline", "ab_live"], "baseline": runs[0]["baseline"]}], runs  # no publish run
    b = runs[0]["baseline"]
    assert (b["weights"], b["sha256"], b["release_id"], b["init"]) == (str(weights), champ.sha256, champ.release_id,
                                                                      False)  # start_from: released
    (d,) = [json.loads(x) for x in (tmp_path / "store" / "records" / "retrain-decisions.jsonl").read_text().splitlines()]
    assert d["decision"] == KEPT and d["winner"] == "champion" and d["challenge_run"] == "run1" and "release_run" not in d
    assert d["champion"] == {"release_id": champ.release_id, "source": "hub org/x@abc", "tau_offline": 1.2,
                             "tau_live": None, "tok_s_c1": None}
    assert d["candidate"]["tau_offline"] == 1.1 and any("1.1000 ≤ champion 1.2000" in r for r in d["reasons"])
    ((kind, name, payload),) = events
    assert (kind, name) == ("champion-kept", "demo")
    assert payload["champion"] == d["champion"] and payload["candidate"] == d["candidate"]
    assert payload["challenge_run"] == "run1" and payload["reasons"] == d["reasons"]
    assert len((tmp_path / "store" / "records" / "traffic-seen.txt").read_text().split()) == 4
