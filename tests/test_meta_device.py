"""Every training and evaluation path with every input on the ``meta`` device (DESIGN.md, "Device rule").

CI has no GPU. A tensor created on the CPU inside a training or evaluation step fails on a GPU with
"Expected all tensors to be on the same device"; on ``meta`` it fails the same way ("Tensor on device
cpu is not on the expected device meta!"), so these tests run each path — MTP ``window_loss`` (K = 1..3,
with and without a draft vocabulary, each loss, backward), ``train()`` with its held-out checks, DSpark
``block_loss`` and ``block_acceptance``, the offline evaluation — with the drafter, the head and the
windows on ``meta``. Values do not exist there: :class:`tests.helpers.meta_device.MetaValues` answers
the few data-dependent ops (scalar reads, nonzero, boolean masks, unique, copies to the host) and
forwards everything else to torch, which enforces the devices.
"""
from __future__ import annotations

import pytest
import torch

from drafter.core.config import TrainConfig
from drafter.data.windows import Window
from drafter.evaluation.acceptance import acceptance, block_acceptance, window_block_alphas
from drafter.evaluation.calibration import reliability
from drafter.evaluation.offline import heldout_alphas, measure_block_cost, measure_draft_cost, window_rule_alphas
from drafter.models import EmbeddedGlm4MoeLayout
from drafter.models.dspark import DSparkConfig, DSparkDraft
from drafter.models.target import glm4_moe_mtp_config
from drafter.training import losses as L
from drafter.training.dspark import block_loss
from drafter.training.loop import VocabHead, batch_loss, train, window_loss
from tests.helpers.meta_device import MetaValues

META = torch.device("meta")
V, H, T = 97, 32, 24
CPU_MADE = "Tensor on device cpu is not on the expected device meta"


# --------------------------------------------------------------------------- the harness itself


def test_harness_enforces_devices_and_answers_values():
    with MetaValues() as mv:
        x = torch.randn(5, 3, device=META)
        y = (x @ x.T).softmax(-1).sum()  # a pure meta computation
        assert y.device == META
        with pytest.raises(RuntimeError, match=CPU_MADE):
            x + torch.ones(5, 3)  # a CPU-made tensor mixed in
        mask = x[:, 0] > 0
        assert x[mask].shape == (5, 3) and x.nonzero().shape == (15, 2)  # the mask selects everything
        assert float(y) == 0.5 and int(mask.sum()) == 1 and bool(mask.any()) is True
        u, inv = torch.unique(torch.zeros(4, 2, dtype=torch.long, device=META), return_inverse=True)
        assert u.shape == (8,) and inv.shape == (4, 2)
        z = x.clone()
        z[mask] = 0.0
        assert z.device == META and torch.masked_select(x, mask[:, None]).shape == (15,)
        assert x.cpu().device.type == "cpu" and x.tolist()[0] == [0.5] * 3
    assert {"item", "nonzero", "bool_index", "unique", "to_cpu"} <= set(mv.calls)
    with pytest.raises(RuntimeError):  # without the harness meta has no values
        float(torch.zeros((), device=META))


# --------------------------------------------------------------------------- builders


def mtp_drafter(n_layers: int = 1):
    """A tiny embedded-target MTP drafter (GLM-4-MoE block, 2 routed experts) built on meta."""
    cfg = glm4_moe_mtp_config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=1e4,
                              rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    cfg["num_nextn_predict_layers"] = n_layers
    return EmbeddedGlm4MoeLayout().build(cfg, device=META).to(META)  # .to: the rotary buffer too


def dspark_draft(confidence: bool = True):
    cfg = DSparkConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=V, target_hidden_size=H,
                       target_layer_ids=[0, 1], block_size=3, markov_rank=8, noise_token_id=V - 1,
                       enable_confidence_head=confidence)
    with torch.device(META):
        return DSparkDraft(cfg).to(META)


def windows(n: int = 2, device=META, features: bool = False) -> list[Window]:
    """Windows from CPU data (a prompt of 3 tokens), moved to ``device``."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        mask = torch.ones(T, dtype=torch.bool)
        mask[:3] = False
        feats = torch.randn(T, 2 * H, generator=g) if features else None
        ids, hidden = torch.randint(0, V, (T,), generator=g), torch.randn(T, H, generator=g)
        out.append(Window(f"row{i}", 5 * i, ids.to(device), mask.to(device), hidden.to(device),
                          None if feats is None else feats.to(device)))
    return out


def meta_head() -> torch.Tensor:
    return torch.empty(V, H, device=META)


def meta_embed() -> torch.nn.Embedding:
    return torch.nn.Embedding(V, H, device=META).requires_grad_(False)


def cfg_for(loss: str, k: int = 2, **kw) -> TrainConfig:
    base = dict(loss=loss, k_steps=k, window=T, micro_batch=1, max_steps=2, warmup_steps=1, lr=1e-3, eval_every=1,
                checkpoint_every=100, eval_windows=2, freeze=["embed_tokens.*"])
    return TrainConfig(**(base | kw))


def assert_meta_grads(model) -> None:
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and any(g is not None for g in grads)
    assert all(g.device == META for g in grads if g is not None)


# --------------------------------------------------------------------------- MTP training


LOSSES = [("lk_hybrid", True), ("lk_hybrid", False), ("kl", True), ("ce", True)]


@pytest.mark.parametrize("vocab", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("loss,fused", LOSSES, ids=["lk_hybrid-fused", "lk_hybrid-unfused", "kl", "ce"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_window_loss_and_backward_on_meta(k, loss, fused, vocab):
    drafter, head = mtp_drafter(), meta_head()
    cfg = cfg_for(loss, k)
    vh = VocabHead.of(list(range(0, V, 3)), head) if vocab else None
    weights = L.position_weights(k, cfg.gamma)
    with MetaValues():
        out, stats = window_loss(drafter, head, windows(1)[0], cfg, weights, fused=fused, vocab=vh)
        assert out.device == META and out.requires_grad and len(stats) == k
        out.backward()
    assert_meta_grads(drafter)


@pytest.mark.parametrize("loss", ["lk_hybrid", "ce_l1"])
def test_batch_loss_on_meta(loss):
    """A micro batch of three windows as one [3, T] batch: the row weights, the per-window counts and the
    target rows are made on the model's device."""
    drafter, head = mtp_drafter(), meta_head()
    cfg = cfg_for(loss, 2)
    with MetaValues():
        out, stats = batch_loss(drafter, head, windows(3), cfg, L.position_weights(2, cfg.gamma),
                                vocab=VocabHead.of(list(range(0, V, 2)), head))
        assert out.device == META and out.requires_grad and len(stats) == 2
        out.backward()
    assert_meta_grads(drafter)


@pytest.mark.parametrize("where", ["meta", "cpu"], ids=["windows-on-meta", "windows-on-cpu"])
def test_train_micro_batch_on_meta(tmp_path, where):
    """train() with micro_batch 2: each micro batch's two windows run as one batch on the model's device."""
    drafter, head = mtp_drafter(), meta_head()
    wins = windows(5, device=torch.device(where))
    with MetaValues():
        res = train(drafter, head, wins[:4], wins[4:], cfg_for("lk_hybrid", 2, micro_batch=2, grad_accum=2), tmp_path,
                    log=lambda *_: None)
    assert [h["step"] for h in res["history"]] == [1, 2] and res["tokens"] == 2 * 4 * T
    assert all(p.device == META for p in drafter.parameters())


def test_window_loss_chained_layers_on_meta():
    drafter, head = mtp_drafter(n_layers=2), meta_head()
    with MetaValues():
        out, stats = window_loss(drafter, head, windows(1)[0], cfg_for("lk_hybrid", 3), L.position_weights(3))
        out.backward()
    assert len(stats) == 3
    assert_meta_grads(drafter)


@pytest.mark.parametrize("where", ["meta", "cpu"], ids=["windows-on-meta", "windows-on-cpu"])
@pytest.mark.parametrize("vocab", [None, list(range(0, V, 2))], ids=["full-vocab", "draft-vocab"])
def test_train_step_and_heldout_check_on_meta(tmp_path, where, vocab):
    """train(): the held-out check before, two bf16-autocast steps with an eval after each, a checkpoint;
    windows loaded on the CPU are moved to the model's device by train() and the evaluation."""
    drafter, head = mtp_drafter(), meta_head()
    wins = windows(3, device=torch.device(where))
    with MetaValues() as mv:
        res = train(drafter, head, wins[:2], wins[2:], cfg_for("lk_hybrid", 2, dtype="bfloat16"), tmp_path,
                    log=lambda *_: None, draft_vocab=vocab)
    assert len(res["history"]) == 2 and "eval" in res["history"][-1]
    assert set(res["final"]) == {"t0", "t1_greedy", "t1_prob"} and res["final"]["t0"]["positions"] > 0
    assert all(p.device == META for p in drafter.parameters())
    assert mv.calls["nonzero"] > 0


def test_acceptance_on_meta_with_a_vocab_mask():
    drafter, head = mtp_drafter(), meta_head()
    mask = VocabHead.of([1, 5, 7], head).mask()
    with MetaValues():
        res = acceptance(drafter, head, windows(2), 3, vocab_mask=mask)
    assert res["t1_prob"]["positions"] > 0 and len(res["t0"]["alpha"]) == 3


# --------------------------------------------------------------------------- DSpark


@pytest.mark.parametrize("loss", ["ce_l1", "lk_hybrid"])
def test_block_loss_with_confidence_head_and_backward_on_meta(loss):
    draft, head, embed = dspark_draft(), meta_head(), meta_embed()
    win = windows(1, features=True)[0]
    with MetaValues():
        out, stats = block_loss(draft, embed, head, win, TrainConfig(loss=loss), anchors=6, confidence_w=0.1)
        assert out.device == META
        out.backward()
    assert len(stats) == 3 and all("confidence_bce" in s for s in stats)
    assert_meta_grads(draft)
    assert draft.confidence_head.proj.weight.grad is not None


def test_block_acceptance_and_calibration_on_meta():
    draft, head, embed = dspark_draft(), meta_head(), meta_embed()
    with MetaValues():
        res = block_acceptance(draft, embed, head, windows(2, features=True), chunk=5)
        rel = reliability(res["confidence"]["confidence"], res["confidence"]["accepted"])
    assert res["t0"]["positions"] > 0 and len(res["t1_prob"]["alpha"]) == 3
    assert res["confidence"]["confidence"].device == META and rel["n"] == res["t0"]["positions"] * 3


def test_dspark_train_step_on_meta(tmp_path):
    """train() with a DSpark block loss and block acceptance (what run_dspark_training passes)."""
    draft, head, embed = dspark_draft(), meta_head(), meta_embed()
    wins = windows(3, device=torch.device("cpu"), features=True)
    cfg = cfg_for("ce_l1", 2)

    def evaluate():  # drafter.training.run.dspark_evaluate
        res = block_acceptance(draft, embed, head, wins[2:])
        conf = res.pop("confidence")
        return res | {"calibration": reliability(conf["confidence"], conf["accepted"])}

    with MetaValues():
        res = train(draft, head, wins[:2], wins[2:], cfg, tmp_path, log=lambda *_: None,
                    loss_fn=lambda w: block_loss(draft, embed, head, w, cfg, anchors=4, confidence_w=0.1),
                    evaluate=evaluate)
    assert len(res["history"]) == 2 and res["final"]["t0"]["positions"] > 0
    assert "ece" in res["history"][-1]["eval"]["calibration"]


# --------------------------------------------------------------------------- offline evaluation


def test_offline_mtp_alphas_on_meta_with_a_draft_vocabulary():
    base, cand, head = mtp_drafter(), mtp_drafter(), meta_head()
    cand.draft_vocab_ids = torch.arange(0, V, 2, device=META)
    wins = windows(2)
    with MetaValues():
        one = window_rule_alphas({"baseline": base, "candidate": cand}, head, wins[0], 3)
        held = heldout_alphas({"baseline": base, "candidate": cand}, head, wins, 3)
    assert one["candidate"]["t0"].device == META and one["candidate"]["t0"].shape[1] == 3
    assert held.positions > 0 and held.alphas["candidate"]["t1_prob"].shape == (held.positions, 3)


def test_offline_dspark_alphas_on_meta():
    """The α function eval_offline passes for DSpark drafts (window_block_alphas per draft)."""
    drafts = {"baseline": dspark_draft(confidence=False), "candidate": dspark_draft()}
    head, embed = meta_head(), meta_embed()

    def alphas_fn(win):
        return {name: window_block_alphas(d, embed, head, win)[0] for name, d in drafts.items()}

    with MetaValues():
        held = heldout_alphas(drafts, head, windows(2, features=True), 3, alphas_fn=alphas_fn)
        alphas, conf = window_block_alphas(drafts["candidate"], embed, head, windows(1, features=True)[0])
    assert held.positions > 0 and held.alphas["candidate"]["t0"].shape == (held.positions, 3)
    assert conf.device == META and conf.shape == alphas["t0"].shape


def test_draft_cost_timing_on_meta():
    """measure_draft_cost / measure_block_cost: the windows follow the drafters to their device."""
    seen = []

    def target(input_ids, position_ids):
        seen.append((input_ids.device, position_ids.device))

    win = windows(1, device=torch.device("cpu"), features=True)[0]
    with MetaValues():
        mtp = measure_draft_cost(target, mtp_drafter(), win, repeats=1, warmup=0)
        blk = measure_block_cost(target, dspark_draft(), meta_embed(), meta_head(), win, repeats=1, warmup=0)
    assert mtp["tokens"] == blk["tokens"] == T
    assert seen == [(META, META)] * 2


# --------------------------------------------------------------------------- EAGLE-3 heads


def eagle3_head(draft_vocab: int = 40):
    """A tiny EAGLE-3 head on meta reading 2 aux layers (the windows' 2·H features), its own draft vocabulary."""
    from transformers import LlamaConfig

    from drafter.models.eagle3 import Eagle3Config, Eagle3Draft

    tc = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16)
    return Eagle3Draft(Eagle3Config.for_target(tc, aux_layer_ids=[1, 3], draft_vocab_size=draft_vocab),
                       device=META).to(META)


@pytest.mark.parametrize("where", ["meta", "cpu"], ids=["windows-on-meta", "windows-on-cpu"])
def test_eagle3_train_step_and_heldout_check_on_meta(tmp_path, where):
    """train() on an EAGLE-3 head as run_eagle3_training calls it: the aux features in, the loss over its own
    draft vocabulary (the target's distribution over those ids), three-step training-time test, bf16 autocast."""
    head = eagle3_head()
    wins = windows(3, device=torch.device(where), features=True)
    with MetaValues():
        res = train(head, meta_head(), wins[:2], wins[2:], cfg_for("lk_hybrid", 3, dtype="bfloat16"), tmp_path,
                    log=lambda *_: None, draft_vocab=list(range(0, 80, 2)))
    assert len(res["history"]) == 2 and res["final"]["t0"]["positions"] > 0
    assert all(p.device == META for p in head.parameters())
    cfg = cfg_for("kl", 3)
    with MetaValues():
        out, stats = window_loss(head, meta_head(), windows(1, features=True)[0], cfg, L.position_weights(3),
                                 vocab=VocabHead.of(list(range(0, 80, 2)), meta_head()))
        out.backward()
    assert len(stats) == 3
    assert_meta_grads(head)


def test_eagle3_offline_alphas_and_draft_cost_on_meta():
    heads = {"baseline": eagle3_head(), "candidate": eagle3_head(draft_vocab=V)}
    seen = []
    with MetaValues():
        held = heldout_alphas(heads, meta_head(), windows(2, features=True), 3)
        cost = measure_draft_cost(lambda input_ids, position_ids: seen.append(input_ids.device), heads["baseline"],
                                  windows(1, device=torch.device("cpu"), features=True)[0], repeats=1, warmup=0)
    assert held.positions > 0 and held.alphas["baseline"]["t1_prob"].shape == (held.positions, 3)
    assert cost["tokens"] == T and seen == [META]


# --------------------------------------------------------------------------- Window.to


def test_window_to_moves_every_tensor_and_is_a_no_op_when_there():
    win = windows(1, device=torch.device("cpu"), features=True)[0]
    assert win.to("cpu") is win and win.positions.device.type == "cpu"
    moved = win.to(META)
    assert moved is not win and moved.to(META) is moved
    assert all(t.device == META for t in (moved.input_ids, moved.loss_mask, moved.hidden, moved.features))
    assert moved.positions.device == META and (moved.row_id, moved.start) == (win.row_id, win.start)
