"""Routed experts computed by one grouped matmul equal transformers' loop over the experts (issue 36).

A DeepSeek-V3-format MTP layer with 8 distinct routed experts, top-2 grouped routing (so the exact one-pass
shortcut of ``OnePassMoE`` does not apply and the experts module runs), trained through the project's own
``window_loss``: loss, the gradient reaching the captured hidden states, and every parameter's gradient agree
between ``eager`` and ``grouped_mm``, with the experts frozen (the default freeze) and trained.
"""
from __future__ import annotations

import pytest
import torch

from drafter.core.config import EvalOfflineConfig, TrainConfig
from drafter.data.windows import Window
from drafter.models import DeepSeekV3Layout, freeze
from drafter.models.experts import resolve_experts, set_experts
from drafter.training import losses as L
from drafter.training.loop import train, window_loss
from tests.helpers.deepseek import tiny_deepseek_v3_config

T = 40


def v3_drafter(seed: int = 0):
    """The tiny V3 MTP layer with random weights: 8 routed experts in 4 groups, top-2 from 2 groups."""
    cfg = tiny_deepseek_v3_config(vocab_size=256, hidden_size=64, n_routed_experts=8)
    cfg |= {"moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
            "kv_lora_rank": 32, "q_lora_rank": 48}
    torch.manual_seed(seed)
    d = DeepSeekV3Layout().build(cfg, device=None)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return d


def window(d, seed: int = 1) -> Window:
    g = torch.Generator().manual_seed(seed)
    V, H = d.config.vocab_size, d.config.hidden_size
    mask = torch.ones(T, dtype=torch.bool)
    mask[:4] = False
    return Window("row0", 0, torch.randint(0, V, (T,), generator=g), mask, torch.randn(T, H, generator=g))


def step(impl: str, frozen: list[str]):
    """One loss + backward with ``impl``: (loss, d loss / d hidden, {name: grad})."""
    d = v3_drafter()
    freeze(d, frozen)
    assert set_experts(d, impl) == impl
    g = torch.Generator().manual_seed(2)
    head = torch.randn(d.config.vocab_size, d.config.hidden_size, generator=g) * 0.125
    win = window(d)
    win.hidden.requires_grad_(True)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=2, window=T, micro_batch=1, freeze=frozen)
    loss, _ = window_loss(d, head, win, cfg, L.position_weights(2, cfg.gamma))
    loss.backward()
    return loss.detach(), win.hidden.grad, {n: p.grad for n, p in d.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("frozen", [["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"], ["embed_tokens.*"]],
                         ids=["experts-frozen", "experts-trained"])
def test_grouped_experts_equal_the_loop_forward_and_backward(frozen):
    loss_e, dh_e, grads_e = step("eager", frozen)
    loss_g, dh_g, grads_g = step("grouped_mm", frozen)
    torch.testing.assert_close(loss_g, loss_e, rtol=1e-5, atol=1e-6)
    assert dh_e.abs().max() > 0  # the hidden states do receive a gradient through the experts
    torch.testing.assert_close(dh_g, dh_e, rtol=1e-4, atol=1e-6)
    assert grads_g.keys() == grads_e.keys()
    trained_experts = [n for n in grads_e if ".mlp.experts." in n]
    assert bool(trained_experts) == (frozen == ["embed_tokens.*"])
    for n in grads_e:
        assert grads_e[n] is not None and grads_g[n] is not None, n
        torch.testing.assert_close(grads_g[n], grads_e[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_the_experts_module_really_runs_grouped(monkeypatch):
    """The grouped path is what runs (not the loop under another name): torch's grouped matmul is called."""
    calls = []
    real = torch.nn.functional.grouped_mm

    def counting(*a, **kw):
        calls.append(a[1].shape)
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counting)
    step("grouped_mm", ["embed_tokens.*"])
    assert calls and all(s[0] == 8 for s in calls)  # one call per projection over all 8 experts
    calls.clear()
    step("eager", ["embed_tokens.*"])
    assert calls == []


def test_auto_resolves_per_device_and_dtype():
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    assert resolve_experts("auto", cpu, torch.float32) == "grouped_mm"
    assert resolve_experts("auto", cuda, torch.float32) == "eager"  # CUDA's kernel takes bfloat16 only
    assert resolve_experts("auto", cuda, torch.bfloat16) == "grouped_mm"
    assert resolve_experts("eager", cpu, torch.float32) == "eager"
    with pytest.raises(ValueError, match="does not take torch.float32 experts on meta"):
        resolve_experts("grouped_mm", meta, torch.float32)
    with pytest.raises(ValueError, match="expected one of auto, eager, grouped_mm"):
        resolve_experts("loop", cpu, torch.float32)
    assert TrainConfig().experts == "auto" and EvalOfflineConfig().experts == "auto"
    with pytest.raises(ValueError):
        TrainConfig(experts="loop")


def test_grouped_experts_on_meta_in_bfloat16():
    """On ``meta`` (CUDA's checks) the grouped path runs forward and backward with bfloat16 experts."""
    from tests.helpers.meta_device import MetaValues

    d = v3_drafter().to(torch.bfloat16).to("meta")
    freeze(d, ["embed_tokens.*"])
    assert set_experts(d, "auto") == "grouped_mm"
    win = window(v3_drafter())
    head = torch.empty(d.config.vocab_size, d.config.hidden_size, device="meta", dtype=torch.bfloat16)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=2, window=T, micro_batch=1, freeze=["embed_tokens.*"])
    meta_win = Window(win.row_id, win.start, win.input_ids.to("meta"), win.loss_mask.to("meta"),
                      win.hidden.to(torch.bfloat16).to("meta"))
    with MetaValues(), L.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        loss, _ = window_loss(d, head, meta_win, cfg, L.position_weights(2, cfg.gamma).to("meta"))
        loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters() if ".mlp.experts." in n}
    assert grads and all(g is not None and g.device.type == "meta" for g in grads.values())


def test_training_records_the_experts_path(tmp_path):
    d = v3_drafter()
    g = torch.Generator().manual_seed(2)
    head = torch.randn(d.config.vocab_size, d.config.hidden_size, generator=g) * 0.125
    wins = [window(d, s) for s in (1, 2, 3)]
    cfg = TrainConfig(loss="lk_hybrid", k_steps=2, window=T, micro_batch=1, max_steps=2, warmup_steps=1,
                      eval_every=2, checkpoint_every=100, eval_windows=2, experts="grouped_mm")
    res = train(d, head, wins, wins[:2], cfg, tmp_path / "work", log=lambda *_: None)
    assert res["experts"] == "grouped_mm"
    assert {m.config._experts_implementation for m in d.modules() if hasattr(m, "gate_up_proj")} == {"grouped_mm"}
