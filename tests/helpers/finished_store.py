"""A finished store for card and publish tests: every stage up to ``gate`` on a tiny target, with
vLLM serving so that ``ab_live`` has real numbers (see ``finished_store`` in tests/conftest.py)."""
from __future__ import annotations

import time
from pathlib import Path

import yaml


def finished_store_config(tiny_target: Path, root: Path) -> Path:
    """The tiny settings (as cheap as the stages allow): bootstrap forced on so that quantize_fp8 has a
    stand-in FP8 release to match; verify_fp8 without its vLLM load; ab_live 1 round, K=2, 1 and 2 users;
    ``gate.force`` because a 3-step drafter may be refused."""
    data = {
        "name": "tiny-card",
        "store": {"root": str(root / "store")},
        "prepare_target": {"source": "path", "path": str(tiny_target)},
        "serving": {"backend": "vllm", "dtype": "float32", "max_model_len": 1024, "startup_timeout_s": 300},
        "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 8, "concurrency": 4},
        "capture": {"shard_tokens": 512, "batch_tokens": 512},
        "bootstrap_drafter": {"enabled": "on", "window": 32, "micro_batch": 1, "max_steps": 2, "warmup_steps": 1,
                              "eval_windows": 2, "eval_every": 2},
        "train": {"k_steps": 2, "window": 32, "micro_batch": 1, "max_steps": 3, "warmup_steps": 1, "eval_windows": 2,
                  "eval_every": 3, "draft_vocab_size": 64},
        "eval_offline": {"k_max": 3, "window": 32, "bootstrap_samples": 50, "cost_repeats": 1},
        "verify_fp8": {"vllm_load": False},
        "ab_live": {"num_speculative_tokens": 2, "concurrency": [1, 2], "num_turns": 2, "rounds": 1, "max_tokens": 8,
                    "lossless_prompts": 2, "server_args": ["--block-size", "32"],
                    # the served K alone and no schedule server: the sweep and the served schedule have their own
                    # tests (test_ab_live.py); here the number of servers stays fixed
                    "k_sweep": [2], "schedule": False},
        "gate": {"force": True},
        "publish": {"tags": ["tiny-test"], "datasets": []},
        "stages": ["gate", "verify_fp8", "quantize_exl3"],  # every stage up to the gate (publish excluded)
    }
    p = root / "finished.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def build_finished_store(tiny_target: Path, root: Path) -> dict:
    """Run every stage up to gate; return {"cfg", "store", "inputs", "summary", "seconds"}."""
    from drafter.core.config import load_config
    from drafter.core.pipeline import open_store, plan, run_all

    cfg = load_config(finished_store_config(tiny_target, root))
    t0 = time.monotonic()
    summary = run_all(cfg, echo=lambda *_: None)
    seconds = time.monotonic() - t0
    store = open_store(cfg)
    inputs = {p.stage.name: store.find(p.stage.name, p.key) for p in plan(cfg)}
    return {"cfg": cfg, "store": store, "inputs": inputs, "summary": summary, "seconds": seconds}
