"""K-step unrolled training on a tiny target: loss goes down, acceptance goes up at positions ≥ 2,
and a run killed mid-way resumes to bit-identical weights."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from drafter.evaluation.acceptance import acceptance, summarize, target_logits
from drafter.core.config import TrainConfig
from drafter.core.errors import StageError
from drafter.models import EmbeddedGlm4MoeLayout, freeze, load_drafter
from drafter.models.target import read_tensor
from drafter.training.loop import lr_at, train
from drafter.data.windows import Window, row_part, window_order
from tests.helpers.torch_threads import ONE_THREAD_ENV


@pytest.fixture(scope="module")
def tiny_setup(tiny_target):
    """Windows built from the tiny target's own greedy continuations (like the generate stage's data): 40
    random 8-token prompts, 40 new tokens each, generated as one batch (every prompt has 8 tokens, so no
    padding; a row that ends at EOS is cut there, as a single-row generate stops)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.cat([torch.randint(0, model.config.vocab_size, (1, 8), generator=g) for _ in range(40)])
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with torch.no_grad():
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40, do_sample=False,
                             pad_token_id=0)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # post-final-norm: the LM-head input
    wins = []
    for i in range(len(ids)):
        ends = [j + 1 for j in range(8, ids.shape[1]) if int(ids[i, j]) in eos]
        n = ends[0] if ends else ids.shape[1]  # causal: the first n positions' hidden states are the cut row's
        mask = torch.zeros(n, dtype=torch.bool)
        mask[8:] = True
        wins.append(Window(f"row{i}", 0, ids[i, :n], mask, hidden[i, :n]))
    head = read_tensor(tiny_target, "lm_head.weight", torch.float32)
    return wins[:32], wins[32:], head


def test_target_logits_match_model(tiny_target, tiny_setup):
    from transformers import AutoModelForCausalLM

    train_w, _, head = tiny_setup
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    w = train_w[0]
    with torch.no_grad():
        ref = model(w.input_ids[None]).logits[0]
    assert torch.allclose(target_logits(w.hidden, head), ref, atol=1e-4)


def small_cfg(**kw) -> TrainConfig:
    base = dict(loss="lk_hybrid", k_steps=3, window=64, micro_batch=2, max_steps=40, warmup_steps=4, lr=3e-3,
                eval_every=40, checkpoint_every=10, eval_windows=8, freeze=["embed_tokens.*"])
    return TrainConfig(**(base | kw))


@pytest.mark.parametrize("loss", ["lk_hybrid", "kl", "ce"])
def test_training_lowers_loss_and_raises_acceptance(tiny_target, tiny_setup, tmp_path, loss):
    train_w, eval_w, head = tiny_setup
    drafter = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    res = train(drafter, head, train_w, eval_w, small_cfg(loss=loss), tmp_path, log=lambda *_: None)
    h = res["history"]
    first, last = sum(x["loss"] for x in h[:5]) / 5, sum(x["loss"] for x in h[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    before, after = res["baseline"]["t1_prob"]["alpha"], res["final"]["t1_prob"]["alpha"]
    assert all(a > b for a, b in zip(after[1:], before[1:])), (before, after)  # positions ≥ 2
    # (a random tiny target's greedy tokens are too arbitrary for T=0 gains in 40 steps; the demo
    # measures T=0 on the real model)
    assert res["final"]["t1_prob"]["tau"] > res["baseline"]["t1_prob"]["tau"]


@pytest.mark.parametrize("frozen", [["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"], ["embed_tokens.*"]],
                         ids=["default-freeze", "experts-trained"])
def test_exact_shortcuts_train_as_the_reference(tiny_target, tiny_setup, frozen):
    """Steps of window_loss + AdamW with the MoE shortcuts (drafter/models/mtp.py OnePassMoE) and with
    transformers' own MoE forward, from the same weights on the same windows: the same losses and
    weights within float tolerance, routed experts frozen or trained."""
    from drafter.training import losses as L
    from drafter.training.loop import window_loss

    train_w, _, head = tiny_setup
    cfg = small_cfg(freeze=frozen)
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    runs = {}
    for shortcuts in (False, True):
        d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
        freeze(d, cfg.freeze)
        d.set_shortcuts(shortcuts)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=cfg.lr)
        losses = []
        for step in range(4):
            for w in train_w[2 * step:2 * step + 2]:
                loss, _ = window_loss(d, head, w, cfg, weights)
                (loss / 2).backward()
                losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[shortcuts] = losses, d.state_dict()
    (ref, ref_sd), (new, new_sd) = runs[False], runs[True]
    assert new == pytest.approx(ref, rel=1e-5)
    assert all(torch.allclose(ref_sd[k], new_sd[k], rtol=1e-4, atol=1e-6) for k in ref_sd)
    ex = new_sd["layers.0.mtp_block.mlp.experts.down_proj"]
    assert torch.equal(ex[0], ex[1])  # still identical: the shortcut stayed exact throughout


@pytest.mark.parametrize("loss", ["lk_hybrid", "kl", "ce"])
def test_window_loss_over_a_draft_vocabulary_is_the_loss_of_the_restricted_distributions(tiny_target, tiny_setup, loss):
    """With a draft vocabulary V' the loss (value and gradients) is the one computed, by the plain loss
    functions, on both logits restricted to V' (the target's distribution renormalised over V'); CE
    counts only labels inside V' — and the whole-vocabulary loss is a different number."""
    from drafter.training import losses as L
    from drafter.training.loop import VocabHead, window_loss

    train_w, _, head = tiny_setup
    cfg = small_cfg(loss=loss)
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    w = train_w[0]
    counts = Counter(w.input_ids[w.loss_mask].tolist())  # assistant tokens: the labels
    ids = sorted({t for t, _ in counts.most_common(6)} | {head.shape[0] - 1})  # some labels fall outside
    vocab = VocabHead.of(ids, head)
    d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    freeze(d, cfg.freeze)
    got, _ = window_loss(d, head, w, cfg, weights, vocab=vocab)
    got.backward()
    g_got = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    assert "layers.0.shared_head.head.weight" in g_got  # trainable here: its rows V' get the gradient
    d.zero_grad(set_to_none=True)

    # by hand: the whole-vocabulary logits, then their columns V'
    T, cols = len(w.input_ids), torch.tensor(ids)
    un = d.unroll(w.input_ids[None], w.hidden[None], cfg.k_steps, w.positions[None])
    total, wsum = 0.0, 0.0
    for k in range(1, cfg.k_steps + 1):
        n = T - k - 1
        t = torch.nonzero(w.loss_mask[k + 1:k + 1 + n]).flatten()
        labels = w.input_ids[k + 1 + t]
        if loss == "ce":
            inside = torch.isin(labels, cols)
            t, labels = t[inside], torch.searchsorted(cols, labels[inside])
        if len(t) == 0:
            continue
        q = un.logits[k - 1][0, t][:, cols]
        p = (w.hidden[t + k] @ head.T)[:, cols]
        lk, _ = L.ce(q, labels) if loss == "ce" else L.position_loss(cfg, q, p, labels, fused=False)
        total, wsum = total + float(weights[k - 1]) * lk, wsum + float(weights[k - 1])
    want = total / wsum
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert g_got.keys() == {n for n, p in d.named_parameters() if p.grad is not None}
    for name, g in g_got.items():
        ref = d.get_parameter(name).grad
        assert (g - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-7, (name, float((g - ref).abs().max()), float(ref.abs().max()))
    whole, _ = window_loss(d, head, w, cfg, weights)
    assert abs(float(whole) - float(got)) > 1e-3
    assert vocab.mask().sum() == len(ids) and vocab.mask()[ids].all()
    with pytest.raises(ValueError, match="distinct token ids"):
        VocabHead.of([1, 1], head)
    with pytest.raises(ValueError, match="distinct token ids"):
        VocabHead.of([head.shape[0]], head)


@pytest.mark.parametrize("loss,draft_vocab", [("lk_hybrid", False), ("lk_hybrid", True), ("ce", True), ("ce_l1", False)])
def test_a_batch_of_windows_is_the_mean_of_their_losses(tiny_target, tiny_setup, loss, draft_vocab):
    """batch_loss runs windows of one length as one [B, T] batch: its loss and every gradient are the mean of
    window_loss over them — with windows at other positions, one without an assistant token (loss 0) and one
    whose only assistant token leaves rows at the first draft step alone (its own Σ w_k)."""
    from drafter.training import losses as L
    from drafter.training.loop import VocabHead, batch_loss, micro_batches, window_loss

    train_w, _, head = tiny_setup
    cfg = small_cfg(loss=loss)
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    T = len(train_w[0].input_ids)
    early = torch.zeros(T, dtype=torch.bool)
    early[2] = True  # x_2 is predicted at k = 1 only
    w1, w2 = train_w[1], train_w[2]
    wins = [train_w[0], Window("later", 7, w1.input_ids, w1.loss_mask, w1.hidden),
            Window("none", 0, w2.input_ids, torch.zeros(T, dtype=torch.bool), w2.hidden),
            Window("early", 3, w2.input_ids, early, w2.hidden)]
    vocab = VocabHead.of(sorted(set(train_w[0].input_ids.tolist()) | {0, 1, 2}), head) if draft_vocab else None
    d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    freeze(d, cfg.freeze)
    got, stats = batch_loss(d, head, wins, cfg, weights, vocab=vocab)
    got.backward()
    g_got = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad(set_to_none=True)
    want = sum(window_loss(d, head, w, cfg, weights, vocab=vocab)[0] for w in wins) / len(wins)
    want.backward()
    assert len(stats) == cfg.k_steps and float(got.detach()) > 0
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert g_got.keys() == {n for n, p in d.named_parameters() if p.grad is not None}
    for name, g in g_got.items():
        ref = d.get_parameter(name).grad
        assert (g - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-7, name
    with pytest.raises(ValueError, match=r"one length only; got \[40, 48\]"):
        batch_loss(d, head, [wins[0], Window("short", 0, w1.input_ids[:40], w1.loss_mask[:40], w1.hidden[:40])],
                   cfg, weights)
    by_len = [Window(str(i), 0, w1.input_ids[:n], w1.loss_mask[:n], w1.hidden[:n])
              for i, n in enumerate([48, 40, 48, 48, 40, 40, 48, 48, 30])]
    groups = [[w.row_id for w in g] for g in micro_batches(by_len, 4)]
    assert groups == [["0", "2", "3"], ["1"], ["4", "5"], ["6", "7"], ["8"]]
    assert [len(g) for g in micro_batches(by_len, 4, batched=False)] == [1] * 9


def test_micro_batch_trains_as_accumulated_windows(tiny_target, tiny_setup, tmp_path):
    """micro_batch 4 (each micro batch's windows of one length as one batch) and micro_batch 1 × grad_accum 4
    see the same windows per step and give the same losses and α per position (within 1e-4; measured 6e-8);
    shorter windows run in their own group."""
    train_w, eval_w, head = tiny_setup
    mixed = [w if i % 3 else Window(w.row_id, 0, w.input_ids[:36], w.loss_mask[:36], w.hidden[:36])
             for i, w in enumerate(train_w)]
    res = {}
    for mb, acc in ((4, 1), (1, 4)):
        d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
        cfg = small_cfg(micro_batch=mb, grad_accum=acc, max_steps=4, eval_every=4)
        # one held-out window: the held-out checks (before and after) are not what this test compares
        res[mb] = train(d, head, mixed, eval_w[:1], cfg, tmp_path / str(mb), log=lambda *_: None)
    a, b = res[4], res[1]
    assert a["tokens"] == b["tokens"] == sum(len(mixed[window_order(len(mixed), cfg.seed, i)].input_ids) for i in range(16))
    for x, y in zip(a["history"], b["history"], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
        assert x["alpha_1"] == pytest.approx(y["alpha_1"], abs=1e-4)


def test_kill_and_resume_gives_identical_weights(tiny_target, tiny_setup, tmp_path):
    """train() stopped after step 3 resumes from its checkpoint at step 2 to the weights and history of a run
    never stopped (the process-level kill of a real release: test_lifecycle's train-SIGKILL case)."""
    train_w, eval_w, head = tiny_setup
    cfg = small_cfg(max_steps=6, checkpoint_every=2, eval_every=100)
    eval_w = eval_w[:2]  # the held-out checks are not what this test compares
    ref = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    ref_res = train(ref, head, train_w, eval_w, cfg, tmp_path / "ref", log=lambda *_: None)

    d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    with pytest.raises(KeyboardInterrupt):
        train(d, head, train_w, eval_w, cfg, tmp_path / "run", log=lambda *_: None, stop_after=3)  # ckpt at 2
    d2 = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())  # a fresh process: weights from the release
    logs = []
    res = train(d2, head, train_w, eval_w, cfg, tmp_path / "run", log=logs.append)
    assert res["resumed_from"] == 2 and any("resumed from checkpoint at step 2" in m for m in logs)
    a, b = ref.state_dict(), d2.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [x["step"] for x in res["history"]] == list(range(1, 7))
    assert [x["loss"] for x in res["history"]] == [x["loss"] for x in ref_res["history"]]


def test_acceptance_rules_on_hand_made_case():
    """τ from α tables computed by hand."""
    a = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.5]])
    s = summarize(a)
    # rows: 1+1+1+0 = 3; 1+1+0+0 = 2; 1+.5+.25+.125 = 1.875 → mean 2.291666
    assert s["tau"] == pytest.approx((3 + 2 + 1.875) / 3)
    assert s["alpha"] == pytest.approx([2.5 / 3, 1.5 / 3, 1.5 / 3])
    assert s["accept_rate"][0] == pytest.approx(2.5 / 3)
    assert s["accept_rate"][1] == pytest.approx((1 + 0 + 0.25) / 2.5)


def test_identical_drafter_has_alpha_one(tiny_target, tiny_setup):
    """A 'drafter' whose draft distribution is the target's own: α = 1 under every rule."""
    _, eval_w, head = tiny_setup

    class Oracle:
        training = False

        def eval(self):
            return self

        def train(self, mode=True):
            return self

        def unroll(self, ids, hidden, k, pos):
            T = ids.shape[1]
            logits = []
            for step in range(1, k + 1):
                lg = torch.zeros(1, T, head.shape[0])
                lg[0, : T - step] = target_logits(hidden[0, step:], head)
                logits.append(lg)
            return type("U", (), {"logits": logits})

    acc = acceptance(Oracle(), head, eval_w, 3)
    for rule in ("t0", "t1_prob"):
        assert acc[rule]["alpha"] == pytest.approx([1.0] * 3, abs=1e-5)
        assert acc[rule]["tau"] == pytest.approx(4.0, abs=1e-4)


def test_schedule_order_and_parts():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55) and lr_at(110, cfg) == pytest.approx(0.1)
    order = [window_order(10, 3, i) for i in range(20)]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10)) and order[:10] != order[10:]
    parts = [row_part(f"id-{i}") for i in range(1000)]
    assert 400 < parts.count("bootstrap") < 600 and set(parts) == {"bootstrap", "finetune"}


def test_the_fresh_process_gets_a_bootstrap_config_as_the_train_config_it_reads(tmp_path):
    """The bootstrap's config (a TrainConfig subclass with more fields) reaches the training process as
    the TrainConfig it validates: the same values, without the fields TrainConfig refuses."""
    from drafter.core.config import BootstrapConfig
    from drafter.training.run import _child_args

    boot = BootstrapConfig(enabled="on", max_steps=7, lr=2e-3)
    args = _child_args(tmp_path / "model", tmp_path / "capture", boot, tmp_path / "out", None, "bootstrap")
    got = TrainConfig.model_validate_json(args[args.index("--config-json") + 1])
    assert got.model_dump() == {k: v for k, v in boot.model_dump().items() if k != "enabled"}
    assert (got.max_steps, got.lr, got.loss, got.k_steps) == (7, 2e-3, "ce", 1)


@pytest.mark.slow
def tiny_capture(tmp_path, tiny_target, num_prompts: int):
    """The capture stage's output for ``num_prompts`` conversations generated by the tiny target (transformers)."""
    import yaml

    from drafter.core.config import load_config
    from drafter.core.pipeline import run_all

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "store": {"root": str(tmp_path / "store")},
        "prepare_target": {"source": "path", "path": str(tiny_target)},
        "serving": {"backend": "transformers", "dtype": "float32"},
        "generate": {"num_prompts": num_prompts, "max_tokens": 24, "shard_size": 8},
    }))
    return run_all(load_config(cfg_path), only=["capture"], echo=lambda *_: None)["stages"][-1]["path"]


def test_torchrun_two_processes_match_one(tiny_target, tmp_path, monkeypatch):
    """The same loop under torchrun (2 CPU processes, gloo): gradients averaged across ranks, so
    2 ranks × micro batch 2 reach the weights of 1 process × micro batch 4 (up to summation order)."""
    from safetensors.torch import load_file

    from drafter.training.run import run_training

    for k, v in ONE_THREAD_ENV.items():  # the training child and torchrun's ranks: one torch thread each
        monkeypatch.setenv(k, v)

    capture = tiny_capture(tmp_path, tiny_target, num_prompts=24)
    base = dict(loss="lk_hybrid", k_steps=2, window=32, max_steps=6, warmup_steps=1, lr=1e-3, eval_every=100,
                eval_windows=4, freeze=["embed_tokens.*"], data_part="all", draft_vocab_size=20,
                device="cpu")  # gloo on CPUs, also on a GPU machine (two ranks on one GPU is not NCCL's)
    logs = []
    one = run_training(tiny_target, capture, TrainConfig(**base, micro_batch=4), tmp_path / "one", log=logs.append)
    two = run_training(tiny_target, capture, TrainConfig(**base, micro_batch=2, nproc_per_node=2), tmp_path / "two")
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["tokens"] == one["tokens"]
    assert one["device"] == two["device"] == "cpu"  # recorded in result.json (and the card)
    # one process: trained in a fresh child process, whose lines (progress, held-out checks) reach `log`
    assert one["fresh_process"] is True and two["fresh_process"] is False
    assert any(line.startswith("train: ") and "held-out τ before" in line for line in logs), logs
    assert any(line.startswith("[train] 6/6 steps") for line in logs), logs
    with pytest.raises(StageError, match=r"(?s)failed with exit code 1.*no-such-capture"):
        run_training(tiny_target, tmp_path / "no-such-capture", TrainConfig(**base, micro_batch=4), tmp_path / "bad")
    assert not (tmp_path / "bad" / "result.json").exists()
    h1, h2 = ([json.loads(line) for line in (tmp_path / d / "history.jsonl").read_text().splitlines()] for d in ("one", "two"))
    print("grad norms", [(r["grad_norm"], q["grad_norm"]) for r, q in zip(h1, h2)])
    # The gradient norm is taken after the ranks' gradients are averaged, so it is the whole batch's
    # in both runs. Step 1 sees the same weights and windows: the norms differ only by float32
    # summation order (rank-averaged vs one batch), a relative 1e-6. (The logged loss is rank 0's
    # half batch under torchrun: not comparable.)
    assert h1[0]["grad_norm"] == pytest.approx(h2[0]["grad_norm"], rel=1e-5)
    # Later steps: Adam's first updates are ±lr on every element whatever the gradient's size, so a
    # near-zero gradient whose sign differs by summation order moves that element the other way.
    # That changes a few elements, not the run: the gradient norms stay within 1e-3 and the weight
    # updates point the same way (cosine of the two runs' updates, per tensor).
    assert len(h1) == len(h2) == 6
    for r, q in zip(h1, h2):
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-3), r["step"]
    a, b = load_file(tmp_path / "one/mtp-trained.safetensors"), load_file(tmp_path / "two/mtp-trained.safetensors")
    assert a.keys() == b.keys()
    init = EmbeddedGlm4MoeLayout().to_release(load_drafter(tiny_target, EmbeddedGlm4MoeLayout()))
    cos = {}
    for k in a:
        da, db = (a[k] - init[k]).flatten().double(), (b[k] - init[k]).flatten().double()
        if da.norm() > 0:
            cos[k] = float(da @ db / (da.norm() * db.norm()))
    print("update cosines", {k: round(v, 4) for k, v in cos.items()})
    assert cos and min(cos.values()) > 0.95, cos
    eh = next(k for k in a if k.endswith("eh_proj.weight"))
    assert (a[eh] - init[eh]).abs().max() > 1e-3  # training moved the weights: the match is not trivial
    # train.draft_vocab_size: rank 0 writes the draft vocabulary from the windows it trained on (the same in both runs)
    from collections import Counter

    from drafter.data.windows import load_windows
    from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab

    ids = load_draft_vocab(tmp_path / "one" / DRAFT_VOCAB_FILE)
    assert ids.tolist() == load_draft_vocab(tmp_path / "two" / DRAFT_VOCAB_FILE).tolist() and len(ids) == 20
    train_w = load_windows(capture, "train", "all", 32, min_tokens=4)
    counts = Counter(t for w in train_w for t in w.input_ids.tolist())
    assert {t for t, _ in counts.most_common(5)} <= set(ids.tolist())
    held = torch.cat([w.input_ids[w.loss_mask] for w in load_windows(capture, "heldout", "all", 32, min_tokens=1)])
    coverage = torch.isin(held, ids).float().mean().item()
    assert one["draft_vocab"] == {"size": 20, "vocab_size": read_tensor(tiny_target, "lm_head.weight").shape[0],
                                  "file": DRAFT_VOCAB_FILE, "heldout_coverage": round(coverage, 4),
                                  "heldout_tokens": len(held), "trained_over": True}
    assert 0 < coverage < 1


def test_curves_plot_accuracy_for_ce_and_alpha_for_distribution_losses(tmp_path):
    """The middle panel shows what the loss logs: α per position (distribution losses) or top-1
    accuracy (CE, as the bootstrap trains) — never an empty panel."""
    import warnings

    from drafter.training.loop import plot_curves

    ce_hist = [{"step": s, "loss": 3.0 / s, "accuracy_1": 0.1 * s} for s in range(1, 6)]
    ce_hist[-1]["eval"] = {"t0": {"tau": 1.4}, "t1_greedy": {"tau": 1.3}}
    lk_hist = [{"step": s, "loss": 2.0 / s, "alpha_1": 0.1 * s, "alpha_2": 0.05 * s} for s in range(1, 6)]
    lk_hist[-1]["eval"] = {"t0": {"tau": 1.6}, "t1_greedy": {"tau": 1.5}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "No artists with labels found"
        for name, hist in (("ce.png", ce_hist), ("lk.png", lk_hist)):
            path = plot_curves(hist, tmp_path / name, name)
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ce.png", "lk.png"]  # no temporary left behind
