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


def ab(champ_tau: float, cand_tau: float, champ_tok: float = 10.0, cand_tok: float = 10.0, k: int = 2) -> dict:
    return {"num_speculative_tokens": k, "temperature": 0.0,
            "lossless": {"prompts": 2, "identical": 2, "ok": True, "mismatches": []},
            "summary": {"none/none/c1": {"tau": None, "tok_s": 9.0},
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
    d = challenge(ab(1.2, 1.3, champ_tok=10.0, cand_tok=8.0), ev([1, 1.2], [1, 1.3]), cfg(), "c")
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
