"""Typed stage result files: every model reads what its stage writes (written unchanged, read back with the same
values), older documents the readers tolerate, keeps unknown keys, and a missing key is one line naming the file
and the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.core.config import GateConfig, PublishConfig
from drafter.core.errors import StageError
from drafter.core.stage import Artifact
from drafter.evaluation.ab_live import (AB_LIVE_JSON, AbLiveResult, load_ab_live, parse_summary, primary,
                                        save_ab_live, summary_of, temperatures)
from drafter.evaluation.gate import GATE_JSON, GateResult, gate_decision, gate_without_live, load_gate, save_gate
from drafter.evaluation.offline_result import EVAL_OFFLINE_JSON, OfflineResult, load_eval_offline, save_eval_offline
from drafter.quant.layout import FP8_RELEASE_JSON, STANDIN_DIR, FP8ReleaseInfo, release_dir
from drafter.quant.verify import VERIFY_JSON, SelfCheckReport, TensorCheck, VerifyResult, load_verify, save_verify
from drafter.release.folder import RELEASE_JSON, ReleaseRecord, write_release_record
from drafter.release.hub import (PUBLISH_JSON, PUBLISH_PLAN_JSON, PublishPlan, PublishResult, load_publish,
                                 make_plan)
from drafter.training.run import RESULT_JSON, TrainResult, acceptance_table, load_train_result, tau_metrics
from tests.test_gate import ab_live, eval_offline, legacy


def _on_disk(path: Path) -> dict:
    return json.loads(path.read_text())


def test_each_model_owns_its_file_name():
    assert (AbLiveResult.NAME, OfflineResult.NAME, GateResult.NAME, TrainResult.NAME, VerifyResult.NAME) == (
        AB_LIVE_JSON, EVAL_OFFLINE_JSON, GATE_JSON, RESULT_JSON, VERIFY_JSON)
    assert (PublishPlan.NAME, PublishResult.NAME, ReleaseRecord.NAME, FP8ReleaseInfo.NAME) == (
        PUBLISH_PLAN_JSON, PUBLISH_JSON, RELEASE_JSON, FP8_RELEASE_JSON)
    assert AB_LIVE_JSON == "ab_live.json" and EVAL_OFFLINE_JSON == "eval_offline.json" and GATE_JSON == "gate.json"


# --------------------------------------------------------------------------- ab_live.json


def test_ab_live_round_trip(tmp_path):
    doc = ab_live(plan={0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]})
    doc |= {"replay": {"turns": 16, "conversations": 4, "domains": ["agent"], "max_tokens": 128, "notes": [],
                       "heldout": {"source": "builtin", "conversations": 4, "text": "built-in held-out split (4 conversations)"}},
            "server_args": ["--block-size", "32"], "draft_vocab": {"candidate": 32, "baseline": None}, "baseline_at": "all",
            "hardware": None, "seconds": 12.5, "servers": [], "future_key": {"kept": True}}
    assert save_ab_live(tmp_path, doc) is doc
    assert _on_disk(tmp_path / AB_LIVE_JSON) == doc  # written as the stage built it
    ab = load_ab_live(tmp_path)
    assert ab.raw == doc and ab.model_extra == {"future_key": {"kept": True}}  # unknown keys survive
    assert ab.num_speculative_tokens == 4 and ab.method == "mtp" and ab.compiled is False
    assert ab.lossless.ok is True and ab.lossless.identical == 8 and ab.replay.heldout.source == "builtin"
    assert ab.draft_vocab == {"candidate": 32, "baseline": None} and ab.server_args == ["--block-size", "32"]
    assert temperatures(ab) == [0.0, 1.0] and primary(ab) == (0.0, "greedy")
    s = summary_of(ab)
    assert s[(1.0, "candidate", "probabilistic", 8)].tok_s == doc["summary"]["t1/candidate/probabilistic/c8"]["tok_s"]
    assert s[(0.0, "none", "none", 1)].tau is None and s[(0.0, "baseline", "greedy", 1)].rounds == 2
    # a plain document still gives its own entries
    assert parse_summary(doc)[(0.0, "candidate", "greedy", 1)] is doc["summary"]["t0/candidate/greedy/c1"]


def test_an_older_ab_live_json_loads_with_its_fallbacks(tmp_path):
    old = legacy(ab_live())  # one ``temperature``, keys <drafter>/<method>/c<c>, no ``compiled``
    (tmp_path / AB_LIVE_JSON).write_text(json.dumps(old))
    ab = load_ab_live(tmp_path)
    assert ab.temperatures is None and ab.temperature == 0.0 and temperatures(ab) == [0.0]
    assert ab.compiled is None and "compiled" not in ab.model_fields_set and ab.replay is None
    assert summary_of(ab)[(0.0, "candidate", "greedy", 8)].tau == 1.72
    # without server timing (older outputs) the entries read None
    old["summary"] = {k: {"tau": v["tau"], "tok_s": v["tok_s"]} for k, v in old["summary"].items()}
    ab = AbLiveResult.of(old)
    assert summary_of(ab)[(0.0, "none", "none", 1)].decode_tok_s is None


def test_ab_live_missing_or_wrong_keys_are_one_line_naming_file_and_key(tmp_path):
    doc = ab_live()
    del doc["summary"]
    with pytest.raises(StageError, match=r"^ab_live.json: missing key 'summary'$"):
        AbLiveResult.of(doc)
    with pytest.raises(StageError, match=r"^ab_live.json: missing key 'summary'$"):
        parse_summary(doc)
    doc = ab_live()
    del doc["num_speculative_tokens"]
    (tmp_path / AB_LIVE_JSON).write_text(json.dumps(doc))
    with pytest.raises(StageError, match=r"^ab_live.json: missing key 'num_speculative_tokens'$"):
        load_ab_live(tmp_path)
    doc = ab_live()
    doc["summary"]["t0/candidate/greedy/c1"]["tau"] = "fast"
    with pytest.raises(StageError) as e:
        AbLiveResult.of(doc)
    assert "\n" not in str(e.value) and str(e.value).startswith("ab_live.json: summary.t0/candidate/greedy/c1.tau:")
    with pytest.raises(StageError, match="does not exist"):
        load_ab_live(tmp_path / "nothing")
    (tmp_path / AB_LIVE_JSON).write_text("{")
    with pytest.raises(StageError, match="not valid JSON"):
        load_ab_live(tmp_path)
    with pytest.raises(StageError, match="ab_live.json: missing key 'summary'"):
        save_ab_live(tmp_path / "w", {"num_speculative_tokens": 2})  # the writer checks too
    assert not (tmp_path / "w" / AB_LIVE_JSON).exists()


# --------------------------------------------------------------------------- eval_offline.json


def test_eval_offline_round_trip_and_older_documents(tmp_path):
    ev = eval_offline() | {"heldout": {"source": "files", "conversations": 3, "text": "your held-out files (a.jsonl)",
                                       "files": [{"name": "a.jsonl", "size": 10, "sha256": "0" * 64}]},
                           "windows": 12, "device": "cpu", "draft_vocab": {"candidate": None, "baseline": None}}
    save_eval_offline(tmp_path, ev)
    assert _on_disk(tmp_path / EVAL_OFFLINE_JSON) == ev
    r = load_eval_offline(tmp_path)
    assert r.raw == ev and r.k_max == 7 and r.heldout.files[0]["name"] == "a.jsonl"
    cand = r.drafters["candidate"]["t0"]
    assert cand.tau_by_k == ev["drafters"]["candidate"]["t0"]["tau_by_k"] and cand.tau_ci[3] == ev["drafters"]["candidate"]["t0"]["tau_ci"][3]
    assert r.tau("candidate", "t0", 4) == ev["drafters"]["candidate"]["t0"]["tau_by_k"][3]
    assert r.tau("candidate", "t0", 8) is None and r.tau("champion", "t0", 1) is None
    # an older document: no held-out record, no bootstrap unit, no windows, no calibration
    old = {k: v for k, v in eval_offline().items() if k not in ("heldout", "bootstrap_unit", "windows")}
    o = OfflineResult.of(old)
    assert o.heldout is None and o.bootstrap_unit == "conversation" and o.windows is None and o.calibration == {}
    # the champion tests' minimal document: drafters only
    m = OfflineResult.of({"drafters": {"baseline": {"t0": {"tau_by_k": [1.5]}}, "candidate": {"t0": {"tau_by_k": [1.6]}}}})
    assert m.tau("candidate", "t0", 1) == 1.6 and m.drafters["candidate"]["t0"].by_domain == {}


def test_eval_offline_missing_keys_name_the_file_and_key():
    with pytest.raises(StageError, match=r"^eval_offline.json: missing key 'drafters'$"):
        OfflineResult.of({"k_max": 3})
    ev = OfflineResult.of({"drafters": {"baseline": {}}})
    with pytest.raises(StageError, match=r"^eval_offline.json drafters: missing key 'candidate'$"):
        ev.drafter("candidate")
    with pytest.raises(StageError, match=r"^eval_offline.json drafters.baseline: missing key 't0'$"):
        ev.rule("baseline", "t0")
    with pytest.raises(StageError, match=r"^eval_offline.json: missing key 'drafters'$"):
        gate_decision(ab_live(), {"k_max": 3}, GateConfig())


# --------------------------------------------------------------------------- gate.json


def test_gate_json_round_trip(tmp_path):
    res = gate_decision(ab_live(), eval_offline(), GateConfig())
    save_gate(tmp_path, res)
    assert _on_disk(tmp_path / GATE_JSON) == json.loads(json.dumps(res))
    g = load_gate(tmp_path)
    assert g.verdict == "pass" and not g.forced and g.failed == [] and g.checks[0].name == "lossless"
    assert [c.name for c in g.checks] == [c["name"] for c in res["checks"]]
    assert g.key_numbers["tau_live_candidate"] == 1.72 and g.temperature == 0.0 and len(g.live_matrix) == 3
    none = gate_without_live("needs vLLM", GateConfig(force=True))
    save_gate(tmp_path / "forced", none)
    g = load_gate(tmp_path / "forced")
    assert g.verdict == "forced" and g.forced and g.temperature is None and g.checks[0].value is None
    # an older, smaller document (the publish tests write one): verdict and failed only
    g = GateResult.of({"verdict": "refused", "failed": ["live_tau@1"]})
    assert g.checks == [] and g.failed == ["live_tau@1"] and g.tolerances == {}
    with pytest.raises(StageError, match=r"^gate.json: missing key 'verdict'$"):
        GateResult.of({"failed": []})


# --------------------------------------------------------------------------- result.json (training)


def _check(tau: float) -> dict:
    rule = {"tau": tau, "alpha": [0.5, 0.25], "accept_rate": [0.5, 0.5], "positions": 40}
    return {"t0": rule, "t1_greedy": dict(rule, tau=tau - 0.1), "t1_prob": dict(rule, tau=tau - 0.05)}


def train_result(**extra) -> dict:
    """A result.json as :func:`drafter.training.run.run_training` writes it."""
    return {"baseline": _check(1.5), "final": _check(1.8), "trainable": 1000, "frozen": 5000, "seconds": 12.3,
            "tokens": 4096, "tokens_per_s": 333.0, "resumed_from": 0, "world_size": 1, "layout": "glm4_moe_mtp",
            "loss": "lk_hybrid", "k_steps": 2, "train_windows": 10, "eval_windows": 4, "weights_in": None,
            "draft_vocab": None, "fresh_process": True, "device": "cpu", "hardware": {"cpu": "x"}} | extra


def test_train_result_round_trip_and_older_documents(tmp_path):
    doc = train_result()
    TrainResult.write(tmp_path, doc)
    assert _on_disk(tmp_path / RESULT_JSON) == doc
    r = load_train_result(tmp_path)
    assert r.raw == doc and r.final.t0.tau == 1.8 and r.baseline.t1_greedy.tau == 1.4 and r.world_size == 1
    m = tau_metrics(r)
    assert m == tau_metrics(doc) and m["tau_t0_after"] == 1.8 and m["tau_t1_ratio"] == round(1.7 / 1.4, 4)
    assert "ece_after" not in m
    assert acceptance_table([("released", r.baseline), ("fine-tune", r.final)]).splitlines()[2:] == [
        "| released | 1.500 | 1.400 |", "| fine-tune | 1.800 | 1.700 |"]
    # before world_size, device, hardware and draft_vocab were recorded
    old = {k: v for k, v in doc.items() if k not in ("world_size", "device", "hardware", "draft_vocab", "fresh_process")}
    o = TrainResult.of(old)
    assert o.world_size == 1 and o.device is None and o.hardware is None and o.draft_vocab is None
    # a DSpark draft's confidence head: ECE before/after
    ds = train_result(final=_check(1.8) | {"calibration": {"ece": 0.0123, "n": 10}},
                      baseline=_check(1.5) | {"calibration": {"ece": None, "n": 0}})
    m = tau_metrics(ds)
    assert m["ece_after"] == 0.0123 and m["ece_before"] is None
    with pytest.raises(StageError, match=r"^result.json: missing key 'tokens_per_s'$"):
        TrainResult.of({k: v for k, v in doc.items() if k != "tokens_per_s"})
    with pytest.raises(StageError, match=r"^result.json final: missing key 't0'$"):
        TrainResult.of(doc | {"final": {"t1_greedy": {"tau": 1.0}}})


# --------------------------------------------------------------------------- verify.json, release.json (FP8)


def test_verify_json_round_trip_in_its_own_format(tmp_path):
    report = SelfCheckReport("float32", (128, 128), [TensorCheck("w", (256, 128), 2, 2, 0, 0)])
    doc = {"release": {"dir": "/x/release", "rule": "float32", "block": [128, 128]}, "self_check": report.as_dict()}
    save_verify(tmp_path, doc)  # the self-check failed: no drop-in checks yet
    v = load_verify(tmp_path)
    assert v.dropin is None and v.vllm_load is None and v.self_check.totals.identical == 2
    doc |= {"dropin": {"ok": True, "problems": [], "keys": 3, "kept_hash_equal": 1, "kept": 1},
            "vllm_load": "unsupported: needs AMX"}
    save_verify(tmp_path, doc)
    assert (tmp_path / VERIFY_JSON).read_text() == json.dumps(doc, indent=2) + "\n"  # the stage's own format
    v = load_verify(tmp_path)
    assert v.dropin.ok and v.dropin.kept_hash_equal == 1 and v.vllm_load.startswith("unsupported")
    assert v.self_check.tensors["w"]["blocks"] == 2 and v.self_check.totals.total == 2
    with pytest.raises(StageError, match=r"^verify.json self_check: missing key 'totals'$"):
        VerifyResult.of({"release": {}, "self_check": {"rule": "float32"}})


def test_fp8_release_info_and_where_the_release_lives(tmp_path):
    FP8ReleaseInfo.write(tmp_path, {"source": "stand-in", "dir": STANDIN_DIR, "rule": "float32", "block": [128, 128],
                                    "drafter": "mtp"})
    assert (tmp_path / FP8_RELEASE_JSON).read_text().startswith('{\n  "source": "stand-in",\n  "dir"')
    art = Artifact("quantize_fp8", "k", tmp_path)
    assert release_dir(art, tmp_path / "target") == tmp_path / STANDIN_DIR
    (tmp_path / FP8_RELEASE_JSON).write_text(json.dumps({"source": "target", "dir": "/t", "rule": "e8m0",
                                                         "block": [128, 128]}))  # before DSpark: no ``drafter``
    assert FP8ReleaseInfo.load(tmp_path).drafter is None and release_dir(art, tmp_path / "target") == tmp_path / "target"
    FP8ReleaseInfo.write(tmp_path, {"source": "released", "dir": str(tmp_path / "draft"), "drafter": "dspark"})
    assert release_dir(art, tmp_path / "target") == tmp_path / "draft"


# --------------------------------------------------------------------------- publish-plan.json, publish.json, release.json


def test_publish_plan_and_result_round_trip(tmp_path):
    folder = tmp_path / "release"
    (folder / "fp8").mkdir(parents=True)
    (folder / "README.md").write_text("card")
    (folder / "fp8" / "x.safetensors").write_bytes(b"12345")
    plan = make_plan(folder, PublishConfig(repo_id="org/demo", mode="pr"), message="Release demo 0.1.0",
                     tag="v0.1.0", release_id="1a2b")
    PublishPlan.write(tmp_path, plan)
    result = {"status": "dry_run", "release_id": "1a2b", "repo_id": "org/demo", "send": "drafter publish"}
    PublishResult.write(tmp_path, result)
    assert _on_disk(tmp_path / PUBLISH_PLAN_JSON) == plan and _on_disk(tmp_path / PUBLISH_JSON) == result
    p, r = load_publish(tmp_path)
    assert p.tag_at == "merge" and p.tag_command and [f.path for f in p.files] == ["README.md", "fp8/x.safetensors"]
    assert p.total_bytes == 9 and p.files[1].size == 5 and r.status == "dry_run" and r.commit_sha is None
    assert PublishResult.of({"status": "published", "commit_sha": "abc", "pr_num": 3, "tag": None,
                             "tag_pending": "v1"}).pr_num == 3
    with pytest.raises(StageError, match=r"^publish.json: missing key 'status'$"):
        PublishResult.of({"release_id": "1a2b"})


def test_release_record_round_trip(tmp_path):
    doc = {"release_id": "0123456789abcdef", "name": "demo", "kind": "mtp", "repo_id": None, "version": "0.1.0",
           "git_commit": None, "files": [{"path": "mtp-trained.safetensors", "size": 3, "sha256": "a" * 64}],
           "metrics": {"gate": {"verdict": "pass"}}, "config": {}, "config_hash": "f" * 16, "stage_keys": {"train": "k"},
           "target": {"name": "t"}}
    path = write_release_record(tmp_path, doc)
    assert path == tmp_path / RELEASE_JSON and _on_disk(path) == doc
    rec = ReleaseRecord.load(tmp_path)
    assert rec.release_id == doc["release_id"] and rec.files[0].sha256 == "a" * 64 and rec.metrics == doc["metrics"]
    assert ReleaseRecord.from_file(path).raw == doc
    with pytest.raises(StageError, match=r"^release.json: missing key 'release_id'$"):
        ReleaseRecord.of({"files": []})
