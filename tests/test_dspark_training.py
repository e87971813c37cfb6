"""DSpark block training and evaluation (drafter/training/dspark.py, evaluation/acceptance.py
block_acceptance, evaluation/calibration.py) on a synthetic target whose next token is a fixed
function of the current one: the draft learns it, τ per block rises towards K + 1, the numbers
follow the metric definitions, and the confidence head's calibration is computed exactly."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from drafter.core.config import TrainConfig
from drafter.data.windows import Window
from drafter.evaluation.acceptance import block_acceptance, block_forward, rule_alphas, summarize
from drafter.evaluation.calibration import plot_reliability, reliability
from drafter.models.dspark import DSparkConfig, DSparkDraft
from drafter.training.dspark import block_loss

V, H, K = 64, 32, 3


def _world(seed=0):
    """A target: embedding, LM head, and windows whose tokens follow x' = (5x + 3) mod V with the
    target's LM-head input pointing at the next token (so p is peaked on the data)."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H)
    head = torch.randn(V, H, generator=g)
    wins = []
    for r in range(10):
        x = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(40):
            x.append((5 * x[-1] + 3) % V)
        ids = torch.tensor(x)
        nxt = torch.tensor(x[1:] + [x[0]])
        hidden = 4.0 * head[nxt] / head[nxt].norm(dim=-1, keepdim=True) + 0.1 * torch.randn(len(x), H, generator=g)
        feats = torch.randn(len(x), 2 * H, generator=g)
        mask = torch.ones(len(x), dtype=torch.bool)
        mask[:3] = False  # a prompt
        wins.append(Window(f"row{r}", 7 * r, ids, mask, hidden, feats))
    return embed, head, wins


def _draft(seed=0):
    torch.manual_seed(seed)
    cfg = DSparkConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=V, target_hidden_size=H,
                       target_layer_ids=[0, 1], block_size=K, markov_rank=16, noise_token_id=V - 1)
    return DSparkDraft(cfg)


def test_block_acceptance_follows_the_metric_definitions():
    embed, head, wins = _world()
    d = _draft()
    res = block_acceptance(d, embed, head, wins[:2], chunk=7)
    # by hand: every anchor p with p+1..p+K assistant tokens inside the window
    alphas = {r: [] for r in ("t0", "t1_greedy", "t1_prob")}
    for w in wins[:2]:
        T = len(w.input_ids)
        anchors = torch.tensor([p for p in range(1, T - K) if bool(w.loss_mask[p + 1:p + 1 + K].all())])
        with torch.no_grad():
            out, p_logits = block_forward(d, embed, head, w, anchors)
        for r in alphas:
            alphas[r].append(torch.stack([rule_alphas(torch.softmax(p_logits[:, j], -1), out.logits[0, :, j])[r]
                                          for j in range(K)], 1))
    for r, a in alphas.items():
        want = summarize(torch.cat(a))
        assert res[r]["positions"] == want["positions"] == 2 * 36  # p = 2..37: p+1 past the prompt, p+K inside the window
        assert res[r]["tau"] == pytest.approx(want["tau"], abs=1e-6)  # float32 logits; chunks of 7 anchors against all at once
        chain = torch.cumprod(torch.cat(a).double(), 1)
        assert want["tau"] == pytest.approx(float(1 + chain.sum(1).mean()), abs=1e-9)
    conf = res["confidence"]
    assert conf["confidence"].shape == conf["accepted"].shape == (2 * 36, K)


def test_training_the_recipe_loss_learns_the_blocks():
    embed, head, wins = _world()
    d = _draft()
    cfg = TrainConfig(loss="ce_l1", gamma=4.0, ce_w=0.1, l1_w=0.9)
    before = block_acceptance(d, embed, head, wins[8:])
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    first = None
    for step in range(120):
        loss, stats = block_loss(d, embed, head, wins[step % 8], cfg, anchors=16, confidence_w=0.1, generator=g)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert len(stats) == K and all("alpha" in s and "confidence_bce" in s for s in stats)
    after = block_acceptance(d, embed, head, wins[8:])  # held-out rows
    print(before["t0"]["tau"], after["t0"]["tau"], first, float(loss))
    assert float(loss) < 0.5 * first
    assert before["t0"]["tau"] < 1.3 and after["t0"]["tau"] > 3.0  # of at most K + 1 = 4
    assert after["t1_prob"]["tau"] > before["t1_prob"]["tau"] + 1.0
    # the confidence head learned that these blocks are accepted
    rel = reliability(after["confidence"]["confidence"], after["confidence"]["accepted"])
    assert rel["mean_confidence"] > 0.6 and rel["ece"] < 0.3


def test_the_ablation_loss_and_a_window_without_features():
    embed, head, wins = _world()
    d = _draft()
    loss, stats = block_loss(d, embed, head, wins[0], TrainConfig(loss="lk_hybrid", eta=3.0), anchors=8,
                             confidence_w=0.0)
    assert loss.requires_grad and all("lambda" in s and "confidence_bce" not in s for s in stats)
    bare = Window("r", 0, wins[0].input_ids, wins[0].loss_mask, wins[0].hidden)
    with pytest.raises(ValueError, match="window r@0 has no features"):
        block_loss(d, embed, head, bare, TrainConfig(), anchors=4, confidence_w=0.1)


def test_reliability_and_ece_by_hand(tmp_path):
    conf = torch.tensor([0.05, 0.15, 0.12, 0.95, 0.91, 0.99, 0.55])
    hit = torch.tensor([0, 1, 0, 1, 1, 0, 1])
    rel = reliability(conf, hit, bins=10)
    b = rel["bins"]
    assert [r["count"] for r in b] == [1, 2, 0, 0, 0, 1, 0, 0, 0, 3]
    assert b[1]["confidence"] == pytest.approx(0.135) and b[1]["frequency"] == pytest.approx(0.5)
    want = (1 * 0.05 + 2 * abs(0.5 - 0.135) + 1 * abs(1 - 0.55) + 3 * abs(2 / 3 - (0.95 + 0.91 + 0.99) / 3)) / 7
    assert rel["ece"] == pytest.approx(want, abs=1e-7)  # float32 confidences
    png = plot_reliability(rel, tmp_path / "rel.png", "test")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="must lie in"):
        reliability(torch.tensor([1.5]), torch.tensor([1]))


def test_block_training_killed_and_resumed_reaches_the_same_weights(tmp_path):
    """The loop with the block loss: stopped after 3 of 6 steps, resumed from its checkpoint, it ends
    with the weights of an uninterrupted run (anchors come from torch's generator, kept in checkpoints)."""
    from drafter.training.loop import train

    embed, head, wins = _world()
    cfg = TrainConfig(loss="ce_l1", max_steps=6, warmup_steps=1, lr=1e-2, micro_batch=1, eval_every=100,
                      checkpoint_every=1, freeze=[])

    def run(workdir, stop_after=None):
        d = _draft()
        loss_fn = lambda w: block_loss(d, embed, head, w, cfg, anchors=8, confidence_w=0.1)  # noqa: E731
        evaluate = lambda: {r: {"tau": 1.0, "alpha": []} for r in ("t0", "t1_greedy")}  # noqa: E731
        try:
            train(d, head, wins[:8], wins[8:], cfg, workdir, log=lambda *_: None, stop_after=stop_after,
                  loss_fn=loss_fn, evaluate=evaluate)
        except KeyboardInterrupt:
            return None
        return d.state_dict()

    whole = run(tmp_path / "whole")
    assert run(tmp_path / "cut", stop_after=3) is None
    resumed = run(tmp_path / "cut")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert not torch.equal(whole["fc.weight"], _draft().state_dict()["fc.weight"])  # it trained


def test_block_loss_equals_the_direct_formula():
    """block_loss = Σ_j w_j·L_j / Σ_j w_j, w_j = exp(−j/γ), L_j = mean over the valid anchors of
    0.1·CE + 0.9·‖p − q‖₁ + 0.1·BCE(confidence, argmax q = argmax p), written out by hand in float64."""
    import math

    from drafter.models.dspark import sample_anchors

    embed, head, wins = _world()
    d = _draft()
    w = wins[0]
    cfg = TrainConfig(loss="ce_l1", gamma=4.0, ce_w=0.1, l1_w=0.9)
    loss, _ = block_loss(d, embed, head, w, cfg, anchors=6, confidence_w=0.1, generator=torch.Generator().manual_seed(5))
    a, ok = sample_anchors(torch.tensor([len(w.input_ids)]), w.loss_mask[None], 6, torch.Generator().manual_seed(5))
    with torch.no_grad():
        out, p_logits = block_forward(d, embed, head, w, a[0], ok[0])
    num = den = 0.0
    for j in range(K):
        terms = []
        for m in range(a.shape[1]):
            if not bool(out.valid[0, m, j]):
                continue
            q = out.logits[0, m, j].double()
            p = p_logits[m, j].double()
            y = int(out.labels[0, m, j])
            assert y == int(w.input_ids[int(a[0, m]) + 1 + j])  # position j of anchor p predicts x[p+1+j]
            lq, lp = torch.log_softmax(q, -1), torch.log_softmax(p, -1)
            ce = -float(lq[y])
            l1 = float((lp.exp() - lq.exp()).abs().sum())
            hit = float(q.argmax() == p.argmax())
            c = float(out.confidence_logits[0, m, j])
            bce = -(hit * math.log(1 / (1 + math.exp(-c))) + (1 - hit) * math.log(1 - 1 / (1 + math.exp(-c))))
            terms.append((0.1 * ce + 0.9 * l1, bce))
        if terms:
            wj = math.exp(-j / 4.0)
            num += wj * (sum(t[0] for t in terms) / len(terms) + 0.1 * sum(t[1] for t in terms) / len(terms))
            den += wj
    assert float(loss) == pytest.approx(num / den, rel=1e-5)  # float32 logits against float64 arithmetic


def test_platt_scaling_recovers_a_known_miscalibration():
    """Outcomes drawn with P(accepted) = σ(0.5·z − 0.4) for a confidence σ(z) (overconfident, like a head
    trained over several passes of its data): the fit finds a ≈ 0.5, b ≈ −0.4 and the ECE falls."""
    from drafter.evaluation.calibration import fit_platt

    g = torch.Generator().manual_seed(0)
    z = 2.0 * torch.randn(20000, generator=g, dtype=torch.float64)
    y = (torch.rand(20000, generator=g, dtype=torch.float64) < torch.sigmoid(0.5 * z - 0.4)).double()
    conf = torch.sigmoid(z)
    a, b = fit_platt(conf, y)
    assert a == pytest.approx(0.5, abs=0.05) and b == pytest.approx(-0.4, abs=0.08)  # ~4 standard errors
    before, after = reliability(conf, y)["ece"], reliability(torch.sigmoid(a * z + b), y)["ece"]
    assert before > 0.1 and after < 0.02
    with pytest.raises(ValueError, match="needs both outcomes: 0 of 3"):
        fit_platt(torch.tensor([0.2, 0.5, 0.9]), torch.zeros(3))
    with pytest.raises(ValueError, match="differ in size"):
        fit_platt(torch.tensor([0.2, 0.5]), torch.ones(3))


def test_recalibration_folds_into_the_served_head_exactly(tmp_path):
    """ConfidenceHead.recalibrate(a, b): the confidence becomes σ(a·logit(c) + b) at every block position,
    and it survives the save/load vLLM's loader reads (confidence head in float32)."""
    from drafter.models.dspark import load_dspark, save_dspark

    embed, head, wins = _world()
    d = _draft()
    c0 = block_acceptance(d, embed, head, wins)["confidence"]["confidence"].double()
    d.confidence_head.recalibrate(0.7, -0.3)
    c1 = block_acceptance(d, embed, head, wins)["confidence"]["confidence"].double()
    assert torch.allclose(c1, torch.sigmoid(0.7 * torch.logit(c0) - 0.3), atol=1e-5)
    save_dspark(d, tmp_path / "d", dtype=torch.bfloat16)
    c2 = block_acceptance(load_dspark(tmp_path / "d"), embed, head, wins)["confidence"]["confidence"].double()
    assert torch.allclose(c2, c1, atol=2e-2)  # the backbone went through bfloat16; the head itself stayed float32
    assert load_dspark(tmp_path / "d").confidence_head.proj.weight.dtype == torch.float32


def test_recalibrate_confidence_never_worsens_the_slices_likelihood():
    """training.run.recalibrate_confidence on unseen windows: the fitted (a, b) are folded into the head,
    the slice's binary cross-entropy is at most the head's own (the identity a=1, b=0 is a candidate), and
    a slice with a single outcome is skipped with the reason, the head untouched."""
    import torch.nn.functional as F

    from drafter.training.run import recalibrate_confidence

    embed, head, wins = _world()
    d = _draft()
    with torch.no_grad():  # an overconfident head: its bias pushed up
        d.confidence_head.proj.bias.add_(3.0)

    def bce():
        c = block_acceptance(d, embed, head, wins)["confidence"]
        return F.binary_cross_entropy(c["confidence"].double().clamp(1e-6, 1 - 1e-6), c["accepted"].double())

    acc = block_acceptance(d, embed, head, wins)["confidence"]["accepted"]
    assert 0 < float(acc.sum()) < acc.numel()  # both outcomes in the slice
    before = bce()
    w0 = d.confidence_head.proj.weight.clone()
    r = recalibrate_confidence(d, embed, head, wins, 0.5)
    assert r["windows"] == len(wins) and r["positions"] == acc.numel() and "skipped" not in r
    assert torch.allclose(d.confidence_head.proj.weight, w0 * r["a"])
    assert bce() <= before + 1e-9 and r["ece_after"] < r["ece_before"]
    one = [w for w in wins[:1]]
    never = Window(one[0].row_id, one[0].start, one[0].input_ids, torch.zeros_like(one[0].loss_mask),
                   one[0].hidden, one[0].features)  # no assistant token: no eligible position
    w1 = d.confidence_head.proj.weight.clone()
    r = recalibrate_confidence(d, embed, head, [never], 0.5)
    assert "needs both outcomes: 0 of 0" in r["skipped"] and torch.equal(d.confidence_head.proj.weight, w1)


def test_calibration_slice_is_stable_and_cuts_across_both_halves():
    from drafter.data.windows import in_calibration_slice, row_part

    ids = [f"general-s0-{i:05d}" for i in range(4000)]
    picked = [i for i in ids if in_calibration_slice(i, 1 / 16)]
    assert 250 - 60 <= len(picked) <= 250 + 60  # binomial(4000, 1/16): sd 15
    assert picked == [i for i in ids if in_calibration_slice(i, 1 / 16)]  # by the row id alone
    halves = [row_part(i) for i in picked]
    assert halves.count("finetune") > 80 and halves.count("bootstrap") > 80
    assert not any(in_calibration_slice(i, 0.0) for i in ids)
    assert set(picked) <= {i for i in ids if in_calibration_slice(i, 1 / 8)}  # nested slices
    with pytest.raises(ValueError, match="must lie in"):
        in_calibration_slice("x", 1.0)
