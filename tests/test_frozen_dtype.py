"""Frozen weights held in bfloat16 under bfloat16 training (``train.frozen_dtype``, issue 36).

Under autocast every float32 matmul weight is rounded to bfloat16 anyway, so holding the frozen ones in bfloat16
computes the same loss and gradients to the bit, with half their memory; the written drafter keeps the loaded
values (:func:`restore_frozen`)."""
from __future__ import annotations

import pytest
import torch

from drafter.core.config import TrainConfig
from drafter.models import freeze
from drafter.training import losses as L
from drafter.training.frozen import frozen_dtype_of, hold_frozen, restore_frozen
from drafter.training.loop import train, window_loss
from tests.test_grouped_experts import T, v3_drafter, window

FROZEN = ["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"]


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**({"loss": "lk_hybrid", "k_steps": 2, "window": T, "micro_batch": 1, "dtype": "bfloat16",
                           "experts": "eager", "freeze": FROZEN} | kw))


def test_what_is_held_in_bfloat16():
    d = v3_drafter()
    freeze(d, FROZEN)
    with torch.no_grad():  # an embedding table of bf16-exact values (a bf16 release's)
        d.embed_tokens.weight.copy_(d.embed_tokens.weight.to(torch.bfloat16).float())
    info = hold_frozen(d, "bfloat16")
    dtypes = {n: p.dtype for n, p in d.named_parameters()}
    assert dtypes["embed_tokens.weight"] == torch.bfloat16
    assert dtypes["layers.0.mtp_block.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dtypes["layers.0.mtp_block.mlp.experts.down_proj"] == torch.bfloat16
    assert dtypes["layers.0.shared_head.head.weight"] == torch.bfloat16
    assert dtypes["layers.0.mtp_block.mlp.gate.weight"] == torch.float32  # the router stays float32
    assert dtypes["layers.0.eh_proj.weight"] == torch.float32  # trainable: the AdamW master copy
    assert all(dt == torch.float32 for n, dt in dtypes.items() if "norm" in n)
    n_bf16 = sum(p.numel() for p in d.parameters() if p.dtype == torch.bfloat16)
    assert info["tensors"] == 4 and info["elements"] == n_bf16 and info["bytes_saved"] == 2 * n_bf16
    e = v3_drafter()  # random float32 embedding values: a lookup is not autocast, so the table stays float32
    freeze(e, FROZEN)
    hold_frozen(e, "bfloat16")
    assert e.embed_tokens.weight.dtype == torch.float32 and e.layers[0].shared_head.head.weight.dtype == torch.bfloat16
    assert hold_frozen(v3_drafter(), "float32")["tensors"] == 0


def _step(hold: bool):
    d = v3_drafter()
    freeze(d, FROZEN)
    if hold:
        hold_frozen(d, "bfloat16")
    g = torch.Generator().manual_seed(2)
    head = torch.randn(d.config.vocab_size, d.config.hidden_size, generator=g) * 0.125
    cfg = _cfg()
    with L.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = window_loss(d, head, window(d), cfg, L.position_weights(2, cfg.gamma))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in d.named_parameters() if p.requires_grad}


def test_bfloat16_frozen_weights_compute_the_same_bits_under_autocast():
    loss32, g32 = _step(False)
    loss16, g16 = _step(True)
    assert torch.equal(loss16, loss32)
    assert g16.keys() == g32.keys() and g32
    for n in g32:
        assert torch.equal(g16[n], g32[n]), n


def test_restore_gives_back_the_loaded_values():
    d, original = v3_drafter(), v3_drafter()
    freeze(d, FROZEN)
    hold_frozen(d, "bfloat16")
    assert d.layers[0].mtp_block.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert restore_frozen(d, original) == 3  # the experts (2 tensors) and the head; a random table stays float32
    for (n, p), (_, q) in zip(d.named_parameters(), original.named_parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), n


def test_training_holds_them_and_records_it(tmp_path):
    d = v3_drafter()
    g = torch.Generator().manual_seed(2)
    head = torch.randn(d.config.vocab_size, d.config.hidden_size, generator=g) * 0.125
    wins = [window(d, s) for s in (1, 2, 3)]
    cfg = _cfg(max_steps=2, warmup_steps=1, eval_every=2, checkpoint_every=100, eval_windows=2)
    res = train(d, head, wins, wins[:2], cfg, tmp_path / "work", log=lambda *_: None)
    assert res["frozen_dtype"] == "bfloat16" and res["final"]["t0"]["tau"] >= 1.0
    assert d.layers[0].mtp_block.mlp.experts.down_proj.dtype == torch.bfloat16
    res32 = train(v3_drafter(), head, wins, wins[:2], _cfg(max_steps=2, warmup_steps=1, eval_every=2, checkpoint_every=100,
                                                              eval_windows=2, frozen_dtype="float32"),
                  tmp_path / "work32", log=lambda *_: None)
    assert res32["frozen_dtype"] == "float32"
    # the same training to the bit: the first step's loss (before any update) and the held-out check's τ
    assert res["history"][0]["loss"] == res32["history"][0]["loss"]


def test_frozen_dtype_resolution_and_config():
    assert frozen_dtype_of(TrainConfig(dtype="bfloat16")) == "bfloat16"
    assert frozen_dtype_of(TrainConfig(dtype="float32")) == "float32"
    assert frozen_dtype_of(TrainConfig(dtype="bfloat16"), "meta") == "float32"  # no autocast on meta
    assert frozen_dtype_of(TrainConfig(dtype="bfloat16", frozen_dtype="float32")) == "float32"
    with pytest.raises(ValueError, match="frozen_dtype: bfloat16 needs dtype: bfloat16"):
        TrainConfig(dtype="float32", frozen_dtype="bfloat16")


def test_the_written_drafter_keeps_the_frozen_values(tiny_target, tmp_path):
    """The train stage's own run (a fresh process, bf16 autocast): frozen tensors held in bfloat16 while training,
    written with their loaded float32 values; the trained ones changed."""
    from safetensors.torch import load_file

    from drafter.models import EmbeddedGlm4MoeLayout, load_drafter
    from drafter.training.run import run_training
    from tests.test_train import tiny_capture

    capture = tiny_capture(tmp_path, tiny_target, num_prompts=12)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=2, window=32, max_steps=3, warmup_steps=1, lr=1e-2, eval_every=100,
                      eval_windows=4, data_part="all", dtype="bfloat16", device="cpu")
    res = run_training(tiny_target, capture, cfg, tmp_path / "out")
    assert res["frozen_dtype"] == "bfloat16"
    layout = EmbeddedGlm4MoeLayout()
    written = load_file(tmp_path / "out/mtp-trained.safetensors")
    init = layout.to_release(load_drafter(tiny_target, layout))
    frozen = [k for k in written if ".mlp.experts." in k or k.endswith("shared_head.head.weight")]
    trained = [k for k in written if k.endswith("eh_proj.weight")]
    assert frozen and trained
    for k in frozen:
        assert written[k].dtype == torch.float32 and torch.equal(written[k], init[k]), k
    assert all(not torch.equal(written[k], init[k]) for k in trained)
