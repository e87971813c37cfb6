"""EAGLE-3 training runs (drafter/training/eagle3.py) on a tiny Llama target's captured aux hidden states:
a fresh head learns, the written folder is the head vLLM loads, a fine-tune starts where it ended."""

from __future__ import annotations

import pytest
import torch
import yaml

from drafter.core.config import Eagle3Section, TrainConfig, load_config
from drafter.core.errors import StageError
from drafter.models.eagle3 import EAGLE3_DIR, load_eagle3


@pytest.fixture(scope="module")
def llama_capture(tmp_path_factory):
    """A tiny Llama target and the capture stage's output for 24 conversations it answered (transformers),
    with its aux layers 2, 4, 5 (vLLM's default for 8 layers)."""
    from drafter.core.pipeline import run_all
    from tests.helpers.targets import make_tiny_llama_target

    root = tmp_path_factory.mktemp("eagle3-train")
    target = make_tiny_llama_target(root / "target")
    cfg_path = root / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "store": {"root": str(root / "store")},
        "prepare_target": {"source": "path", "path": str(target)},
        "serving": {"backend": "transformers", "dtype": "float32"},
        "generate": {"num_prompts": 24, "max_tokens": 24, "shard_size": 8},
        "capture": {"layers": [2, 4, 5]},
    }))
    capture = run_all(load_config(cfg_path), only=["capture"], echo=lambda *_: None)["stages"][-1]["path"]
    return target, capture


BASE = dict(k_steps=2, window=32, micro_batch=2, max_steps=60, warmup_steps=1, lr=3e-3, eval_every=100, eval_windows=40,
            data_part="all", device="cpu")


def test_a_fresh_head_learns_and_a_fine_tune_starts_where_it_ended(llama_capture, tmp_path):
    from drafter.training.eagle3 import run_eagle3_training

    target, capture = llama_capture
    e = Eagle3Section(enabled=True, draft_vocab_size=300, speculative_tokens=2)
    boot = run_eagle3_training(target, capture, TrainConfig(**BASE, loss="kl"), e, tmp_path / "boot", verifier="tiny")
    assert boot["layout"] == "eagle3" and boot["draft_vocab"]["aux_layer_ids"] == [2, 4, 5]
    assert boot["final"]["t0"]["tau"] > boot["baseline"]["t0"]["tau"] + 0.15, (boot["baseline"], boot["final"])
    head, layout = load_eagle3(tmp_path / "boot" / EAGLE3_DIR, embed_tokens=torch.zeros(49152, 64))
    assert layout == "speculators" and head.cfg.draft_vocab_size == 300 and head.cfg.aux_layer_ids == [2, 4, 5]
    ids = head.draft_ids()
    assert ids.unique().numel() == 300 and bool(head.t2d[ids].all()) and int(head.t2d.sum()) == 300
    ft = run_eagle3_training(target, capture, TrainConfig(**(BASE | {"max_steps": 4}), loss="lk_hybrid"), e, tmp_path / "ft",
                             weights=tmp_path / "boot" / EAGLE3_DIR, verifier="tiny")
    assert ft["weights_in"].endswith(EAGLE3_DIR)
    assert ft["baseline"]["t0"]["tau"] == pytest.approx(boot["final"]["t0"]["tau"], abs=1e-6)
    again = run_eagle3_training(target, capture, TrainConfig(**(BASE | {"max_steps": 4}), loss="lk_hybrid"), e, tmp_path / "ft",
                                weights=tmp_path / "boot" / EAGLE3_DIR)
    assert again == ft  # finished: not trained again


def test_bad_inputs_name_what_is_wrong(llama_capture, tmp_path):
    from drafter.training.eagle3 import run_eagle3_training

    target, capture = llama_capture
    with pytest.raises(StageError, match=r"no hidden_layer_3 tensor"):
        run_eagle3_training(target, capture, TrainConfig(**(BASE | {"max_steps": 1})),
                            Eagle3Section(enabled=True, aux_layer_ids=[2, 3, 5]), tmp_path / "a")
    with pytest.raises(StageError, match=r"aux_layer_ids \[2, 4, 9\]: the target has 8 decoder layers"):
        run_eagle3_training(target, capture, TrainConfig(**(BASE | {"max_steps": 1})),
                            Eagle3Section(enabled=True, aux_layer_ids=[2, 4, 9]), tmp_path / "b")
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(StageError, match=r"the released EAGLE-3 head .*rel.*neither a speculators EAGLE-3 config"):
        run_eagle3_training(target, capture, TrainConfig(**(BASE | {"max_steps": 1})), Eagle3Section(enabled=True),
                            tmp_path / "c", weights=tmp_path / "rel")
    for d in ("a", "b", "c"):
        assert not (tmp_path / d / EAGLE3_DIR).exists()
