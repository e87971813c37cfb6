"""End to end on a tiny target: prepare_target (path) → generate (transformers backend) → scrub →
capture; a second run recomputes nothing; stage keys follow the target and the user files. (A run
killed mid-stage and resumed: tests/test_lifecycle.py on vLLM, tests/test_deployments.py through a
worker on the transformers backend.)"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from drafter.core.config import load_config
from drafter.core.pipeline import plan, run_all

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, tiny_target: Path, store: Path, **extra) -> Path:
    data = {
        "name": "tiny-e2e",
        "store": {"root": str(store)},
        "prepare_target": {"source": "path", "path": str(tiny_target)},
        "serving": {"backend": "transformers", "dtype": "float32"},
        "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 4, "concurrency": 2},
        "capture": {"shard_tokens": 256, "batch_tokens": 256, "layers": [0]},
        # a few steps of fine-tuning the MTP layer shipped in the (path) target: the bootstrap is skipped
        "train": {"k_steps": 2, "window": 32, "micro_batch": 1, "max_steps": 3, "warmup_steps": 1, "eval_windows": 2},
        "eval_offline": {"k_max": 3, "window": 32, "bootstrap_samples": 50, "cost_repeats": 1},
        # no vLLM here (transformers backend): ab_live is skipped, so the gate has no live evidence
        "gate": {"force": True},
    }
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    p = tmp_path / f"{store.name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def manifest_files(store_root: Path, stage: str) -> dict:
    (d,) = [p for p in (store_root / stage).iterdir() if not p.name.startswith(".")]
    return json.loads((d / "manifest.json").read_text())["files"]


def test_release_twice_recomputes_nothing(tmp_path, tiny_target):
    cfg = load_config(write_config(tmp_path, tiny_target, tmp_path / "store"))
    s1 = run_all(cfg, echo=lambda *_: None)
    status = {s["stage"]: s["status"] for s in s1["stages"]}
    assert status == {"prepare_target": "computed", "generate": "computed", "scrub": "computed", "capture": "computed",
                      "bootstrap_drafter": "skipped", "train": "computed", "eval_offline": "computed",
                      # the tiny target's drafter is not FP8: no FP8 form; EXL3 needs CUDA; A/B needs vLLM
                      "quantize_fp8": "skipped", "verify_fp8": "skipped", "quantize_exl3": "skipped",
                      "ab_live": "skipped", "gate": "computed", "publish": "computed"}
    gen, cap = s1["stages"][1]["metrics"], s1["stages"][3]["metrics"]
    assert gen["rows"] == 24 and gen["failed"] == 0 and gen["tokens_generated"] > 0
    assert cap["tokens"] > 0 and cap["sequences"] == 24
    assert "ships its own released drafter" in s1["stages"][4]["reason"]
    trained = Path(s1["stages"][5]["path"])
    assert (trained / "mtp-trained.safetensors").is_file() and (trained / "curves.png").is_file()
    assert "tau_t0_after" in s1["stages"][5]["metrics"]
    ev = s1["stages"][6]["metrics"]
    assert ev["tau_t0_k1_candidate"] >= 1.0 and 1 <= ev["recommended_k_candidate"] <= 3
    assert "needs CUDA" in s1["stages"][9]["reason"] and "vLLM" in s1["stages"][10]["reason"]
    assert s1["stages"][11]["metrics"]["gate"] == "forced"
    # the release folder of a dry run, its card saying what was not measured and why
    assert s1["stages"][12]["metrics"]["status"] == "dry_run"
    card = (Path(s1["stages"][12]["path"]) / "release" / "README.md").read_text()
    assert "Release gate did not pass" in card or "forced" in card.lower()
    assert "not measured: ab_live was skipped" in card and "quantize_exl3 was skipped (needs CUDA" in card
    s2 = run_all(cfg, echo=lambda *_: None)
    assert [s["status"] for s in s2["stages"]] == ["reused"] * 13 and s2["computed"] == []


def test_path_target_changes_change_the_key(tmp_path, tiny_target):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target, copy)
    cfg = load_config(write_config(tmp_path, copy, tmp_path / "store"))
    k1 = {p.stage.name: p.key for p in plan(cfg)}
    (copy / "generation_config.json").write_text((copy / "generation_config.json").read_text() + "\n")
    k2 = {p.stage.name: p.key for p in plan(cfg)}
    assert all(k1[n] != k2[n] for n in k1)


def test_user_file_contents_change_the_generate_key(tmp_path, tiny_target):
    f = tmp_path / "traffic.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}) + "\n")
    cfg = load_config(write_config(tmp_path, tiny_target, tmp_path / "store", generate={"user_files": [str(f)]}))
    k1 = {p.stage.name: p.key for p in plan(cfg)}
    f.write_text(f.read_text().replace("hi", "hello"))
    k2 = {p.stage.name: p.key for p in plan(cfg)}
    assert k1["prepare_target"] == k2["prepare_target"] and k1["generate"] != k2["generate"]
