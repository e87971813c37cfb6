"""Offline acceptance evaluation: the three rules on hand-computed p/q tables, a drafter equal to the
target accepts everything, cluster-bootstrap intervals, the recommended K, and the `eval_offline`
stage on a tiny target + tiny capture (cross-checked against drafter.evaluation.acceptance)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from drafter.evaluation.acceptance import acceptance, rule_alphas, summarize
from drafter.core.config import config_from_dict
from drafter.core.files import write_jsonl_atomic
from drafter.core.errors import StageError
from drafter.evaluation.offline import (cluster_means, conversation_labels, evaluate, expected_speedup, heldout_alphas,
                                recommend_k, resample_counts, row_mode, rule_summary)
from drafter.models import TRAINED_NAME, EmbeddedGlm4MoeLayout, load_drafter, save_drafter
from drafter.core.stage import Artifact
from drafter.models.target import read_tensor, write_target_json
from drafter.data.windows import Window, load_windows

# --------------------------------------------------------------------------- hand-computed tables

P1, Q1 = [0.5, 0.3, 0.2], [0.2, 0.7, 0.1]  # argmax differ; p(argmax q) = 0.3; Σ min = 0.2+0.3+0.1 = 0.6
P2, Q2 = [0.1, 0.6, 0.3], [0.2, 0.5, 0.3]  # argmax agree; p(argmax q) = 0.6; Σ min = 0.1+0.5+0.3 = 0.9


def test_rule_alphas_on_hand_computed_tables():
    p = torch.tensor([P1, P2])
    a = rule_alphas(p, torch.tensor([Q1, Q2]).log())
    assert a["t0"].tolist() == [0.0, 1.0]
    assert a["t1_greedy"].tolist() == pytest.approx([0.3, 0.6])
    assert a["t1_prob"].tolist() == pytest.approx([0.6, 0.9])
    # logits are normalized inside: a shift changes nothing
    b = rule_alphas(p, torch.tensor([Q1, Q2]).log() + 5.0)
    assert b["t1_prob"].tolist() == pytest.approx([0.6, 0.9])


def hand_alphas() -> dict[str, np.ndarray]:
    """Two positions, K=2: position A drafts (P2,Q2) then (P1,Q1); position B (P1,Q1) then (P2,Q2)."""
    p = torch.tensor([P2, P1, P1, P2])
    a = rule_alphas(p, torch.tensor([Q2, Q1, Q1, Q2]).log())
    return {r: v.reshape(2, 2).double().numpy() for r, v in a.items()}


# τ(K) = 1 + mean Σ_{k≤K} Π_{j≤k} α_j, by hand:
#   t0:        A = [1, 0], B = [0, 1]            → τ(1) = 1.5,  τ(2) = 1 + (1 + 0)/2 = 1.5
#   t1_greedy: A = [.6, .3], B = [.3, .6]        → τ(1) = 1.45, τ(2) = 1 + (.6+.18 + .3+.18)/2 = 1.63
#   t1_prob:   A = [.9, .6], B = [.6, .9]        → τ(1) = 1.75, τ(2) = 1 + (.9+.54 + .6+.54)/2 = 2.29
HAND_TAU = {"t0": [1.5, 1.5], "t1_greedy": [1.45, 1.63], "t1_prob": [1.75, 2.29]}
HAND_ALPHA = {"t0": [0.5, 0.5], "t1_greedy": [0.45, 0.45], "t1_prob": [0.75, 0.75]}
# conditional acceptance at k=2: E[Π_{j≤2}] / E[α_1]
HAND_RATE2 = {"t0": 0.0 / 0.5, "t1_greedy": 0.18 / 0.45, "t1_prob": 0.54 / 0.75}


@pytest.mark.parametrize("rule", ["t0", "t1_greedy", "t1_prob"])
def test_tau_and_per_position_on_hand_computed_case(rule):
    a = hand_alphas()[rule]
    s = rule_summary(a, np.array([0, 1]), resample_counts(2, 50, 0), 0.95)
    assert s["tau_by_k"] == pytest.approx(HAND_TAU[rule])
    assert s["alpha"] == pytest.approx(HAND_ALPHA[rule])
    assert s["accept_rate"][1] == pytest.approx(HAND_RATE2[rule])
    assert s["positions"] == 2 and s["conversations"] == 2
    ref = summarize(torch.from_numpy(a))  # the training quick check's summary agrees at K = k_max
    assert ref["tau"] == pytest.approx(HAND_TAU[rule][-1])


# --------------------------------------------------------------------------- drafter == target


class OracleDrafter(nn.Module):
    """A drafter whose step-k logits at index t are exactly the target's at position t+k (its hidden
    state is the target's h_{t+k}, its head the target's). ``shift`` > 0 misaligns it on purpose."""

    def __init__(self, head: torch.Tensor, shift: int = 0):
        super().__init__()
        self.head, self.shift = head, shift

    def unroll(self, input_ids, target_hidden, k_steps, position_ids=None, *, compute_logits=True):
        from drafter.models import Unrolled

        T = target_hidden.shape[1]
        hidden = []
        for k in range(1, k_steps + 1):
            h = torch.zeros_like(target_hidden)
            s = k + self.shift
            h[:, : T - s] = target_hidden[:, s:]
            hidden.append(h)
        return Unrolled(hidden=hidden, logits=None, valid=[])

    def logits(self, layer_idx, hidden, rows=None):
        return hidden @ (self.head if rows is None else self.head[rows]).T


def random_windows(n: int, T: int, H: int, seed: int, masked: bool = True) -> list[Window]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.ones(T, dtype=torch.bool)
        if masked:
            mask[: 3 + i % 4] = False  # a "prompt" the drafter is not scored on
            mask[T // 2: T // 2 + 2] = False
        out.append(Window(f"conv{i // 2}", 0, torch.randint(0, 50, (T,), generator=g), mask,
                          torch.randn(T, H, generator=g)))
    return out


def test_drafter_equal_to_target_accepts_everything():
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 16, generator=g)
    wins = random_windows(4, 30, 16, seed=1)
    K = 4
    held = heldout_alphas({"oracle": OracleDrafter(head), "shifted": OracleDrafter(head, shift=1)}, head, wins, K)
    # eligible positions: t with mask[t+2..t+K+1] all True
    want = 0
    for w in wins:
        n = len(w.input_ids) - K - 1
        want += sum(bool(w.loss_mask[t + 2:t + K + 2].all()) for t in range(n))
    assert held.positions == want > 0
    assert sorted(set(held.conv.tolist())) == [0, 1] and held.conversations == ["conv0", "conv1"]
    a = held.alphas["oracle"]
    assert np.all(a["t0"] == 1.0)
    assert np.allclose(a["t1_prob"], 1.0, atol=1e-5)
    # greedy drafts at T=1: α = p(argmax q) = max_v p(v) when q = p (not 1 unless p is one-hot)
    p_max = torch.cat([torch.softmax(w.hidden @ head.T, -1).max(-1).values for w in wins])
    assert a["t1_greedy"].min() >= float(p_max.min()) - 1e-6 and a["t1_greedy"].max() <= 1.0
    res = evaluate(held, {}, draft_cost=0.0, draft_cost_measured=False, samples=50)
    assert res["drafters"]["oracle"]["t0"]["tau_by_k"] == pytest.approx([2, 3, 4, 5])
    assert res["drafters"]["oracle"]["t1_prob"]["alpha"] == pytest.approx([1] * K, abs=1e-5)
    # the same construction one position off is no longer accepted (the alignment matters)
    assert held.alphas["shifted"]["t0"].mean() < 0.5


def test_a_draft_vocabulary_mask_limits_what_the_drafter_can_get_accepted():
    """The oracle drafter served over a draft vocabulary: a position is accepted at T=0 exactly when the
    target's token is in the vocabulary; an unmasked twin still accepts everything."""
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 16, generator=g)
    wins = random_windows(4, 30, 16, seed=1)
    K = 2
    masked = OracleDrafter(head)
    masked.draft_vocab_ids = torch.arange(0, 50, 2)
    held = heldout_alphas({"full": OracleDrafter(head), "even": masked}, head, wins, K)
    assert np.all(held.alphas["full"]["t0"] == 1.0)
    want = []  # the target's argmax at t+k for every eligible t
    for w in wins:
        top = (w.hidden @ head.T).argmax(-1)
        for t in range(len(w.input_ids) - K - 1):
            if bool(w.loss_mask[t + 2:t + K + 2].all()):
                want.append([float(top[t + k] % 2 == 0) for k in range(1, K + 1)])
    want = np.array(want)
    assert 0 < want.mean() < 1 and np.array_equal(held.alphas["even"]["t0"], want)
    # T=1 probabilistic: the mass outside the vocabulary can never be drafted
    assert np.all(held.alphas["even"]["t1_prob"] < 1.0 - 1e-6)


# --------------------------------------------------------------------------- bootstrap


def clustered(n_conv: int, seed: int, per: int = 20, K: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    level = rng.uniform(0.2, 0.9, n_conv)  # conversations differ: positions within one are correlated
    cl = np.repeat(np.arange(n_conv), per)
    a = np.clip(level[cl][:, None] + rng.normal(0, 0.05, (len(cl), K)), 0, 1)
    return a, cl


def test_vectorized_cluster_bootstrap_matches_a_loop():
    a, cl = clustered(6, seed=3, per=5)
    counts = resample_counts(6, 20, seed=7)
    assert np.all(counts.sum(1) == 6)
    point, boot = cluster_means(a, cl, counts)
    assert point == pytest.approx(a.mean(0))
    for b in range(20):
        rows = np.concatenate([np.flatnonzero(cl == c) for c in range(6) for _ in range(int(counts[b, c]))])
        assert boot[b] == pytest.approx(a[rows].mean(0))


def test_interval_contains_estimate_shrinks_with_data_and_is_seeded():
    small, cl_s = clustered(8, seed=0)
    big, cl_b = clustered(128, seed=0)
    s = rule_summary(small, cl_s, resample_counts(8, 400, 0), 0.95)
    b = rule_summary(big, cl_b, resample_counts(128, 400, 0), 0.95)
    for r in (s, b):
        for t, (lo, hi) in zip(r["tau_by_k"], r["tau_ci"]):
            assert lo < t < hi
        for x, (lo, hi) in zip(r["alpha"], r["alpha_ci"]):
            assert lo < x < hi
    width = lambda r: np.diff(np.array(r["tau_ci"]), axis=1)[:, 0]
    assert np.all(width(b) < 0.5 * width(s))  # 16× the conversations: ≈ 1/4 the width
    again = rule_summary(small, cl_s, resample_counts(8, 400, 0), 0.95)
    assert again["tau_ci"] == s["tau_ci"]
    other = rule_summary(small, cl_s, resample_counts(8, 400, 1), 0.95)
    assert other["tau_ci"] != s["tau_ci"]


def test_intervals_resample_conversations_not_positions():
    # one conversation of 1000 accepted positions and one of 1000 rejected: resampling positions would
    # give a tiny interval around 0.5; resampling the 2 conversations gives [0, 1]
    a = np.concatenate([np.ones((1000, 1)), np.zeros((1000, 1))])
    s = rule_summary(a, np.repeat([0, 1], 1000), resample_counts(2, 400, 0), 0.95)
    assert s["alpha"] == [0.5]
    assert s["alpha_ci"][0] == pytest.approx([0.0, 1.0])


# --------------------------------------------------------------------------- speed, labels


def test_recommended_k_maximizes_expected_speed():
    tau = [1.8, 2.4, 2.8, 3.0, 3.1]
    sp = expected_speedup(tau, 0.1)  # 1.636, 2.0, 2.154, 2.143, 2.067
    assert sp == pytest.approx([1.8 / 1.1, 2.4 / 1.2, 2.8 / 1.3, 3.0 / 1.4, 3.1 / 1.5])
    assert recommend_k(sp) == 3
    assert recommend_k(expected_speedup(tau, 0.0)) == 5  # free drafts: the longest
    assert recommend_k(expected_speedup(tau, 1.0)) == 1  # drafts as dear as the target


def test_labels_domain_and_mode():
    rows = [{"id": "a", "domain": "code", "mode": "thinking", "chat_template_kwargs": {"enable_thinking": True}},
            {"id": "b", "domain": "math", "mode": "non-thinking", "chat_template_kwargs": {"enable_thinking": False}},
            {"id": "c", "domain": "general", "mode": "default", "chat_template_kwargs": {}},
            {"id": "d"}]
    lab = conversation_labels(rows)
    assert lab == {"a": {"domain": "code", "mode": "thinking"}, "b": {"domain": "math", "mode": "non-thinking"},
                   "c": {"domain": "general", "mode": "default"}, "d": {"domain": "unknown", "mode": "unknown"}}
    assert row_mode({"mode": "off"}) == "non-thinking" and row_mode({"mode": "on"}) == "thinking"


def test_evaluate_groups_by_domain_and_mode():
    a, cl = clustered(6, seed=5, per=4, K=2)
    from drafter.evaluation.offline import HeldoutAlphas

    convs = [f"r{i}" for i in range(6)]
    held = HeldoutAlphas(convs, cl, {"baseline": {r: a for r in ("t0", "t1_greedy", "t1_prob")},
                                      "candidate": {r: np.clip(a + 0.05, 0, 1) for r in ("t0", "t1_greedy", "t1_prob")}}, 2)
    labels = {"r0": {"domain": "code", "mode": "thinking"}, "r1": {"domain": "code", "mode": "non-thinking"},
              "r2": {"domain": "math", "mode": "thinking"}}  # r3..r5 unlabeled
    res = evaluate(held, labels, draft_cost=0.2, draft_cost_measured=False, samples=100)
    t0 = res["drafters"]["candidate"]["t0"]
    assert set(t0["by_domain"]) == {"code", "math", "unknown"}
    assert {g: s["positions"] for g, s in t0["by_domain"].items()} == {"code": 8, "math": 4, "unknown": 12}
    assert set(t0["by_mode"]) == {"thinking", "non-thinking", "unknown"}
    code = t0["by_domain"]["code"]["tau_by_k"][0]
    assert code == pytest.approx(1 + np.clip(a + 0.05, 0, 1)[cl < 2, 0].mean())
    d = res["difference"]["t0"]
    assert d["tau_by_k"][0] == pytest.approx(t0["tau_by_k"][0] - res["drafters"]["baseline"]["t0"]["tau_by_k"][0])
    assert d["tau_ci"][0][0] > 0  # paired resamples: a uniform improvement is significant
    assert res["recommended_k"]["candidate"] == recommend_k(expected_speedup(t0["tau_by_k"], 0.2))


# --------------------------------------------------------------------------- the stage


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: explain item {i}."},
            {"role": "assistant", "content": f"Item {i} works like this: " + "first, then next; " * (3 + i % 3)}]


ROWS = [{"id": f"r{i}", "split": "heldout" if i < 6 else "train", "domain": ("code", "general")[i % 2],
         "mode": "default", "chat_template_kwargs": {}, "messages": conversation(i)} for i in range(8)]


@pytest.fixture(scope="module")
def stage_inputs(tiny_target, tmp_path_factory):
    from drafter.stages import capture as capture_stage

    root = tmp_path_factory.mktemp("eval-inputs")
    pt = root / "prepare_target"
    pt.mkdir()
    write_target_json(pt, str(tiny_target.resolve()), source="path", name="tiny", revision=None)
    sc = root / "scrub"
    write_jsonl_atomic(sc / "shards" / "shard-00000.jsonl", ROWS)
    arts = {"prepare_target": Artifact("prepare_target", "p" * 16, pt), "scrub": Artifact("scrub", "s" * 16, sc)}
    cap = root / "capture"
    cap.mkdir()
    capture_stage.run(config_from_dict({"capture": {"layers": [], "max_seq_len": 96}}), arts, cap)
    arts["capture"] = Artifact("capture", "c" * 16, cap)
    boot = root / "bootstrap"
    boot.mkdir()  # skipped: the released drafter is the MTP layer inside the target
    arts["bootstrap_drafter"] = Artifact("bootstrap_drafter", "b" * 16, boot, {"status": "skipped"})
    tr = root / "train"
    tr.mkdir()
    layout = EmbeddedGlm4MoeLayout()
    cand = load_drafter(tiny_target, layout)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in cand.named_parameters():
            if "eh_proj" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_drafter(cand, tr / TRAINED_NAME, layout, torch.float32)
    arts["train"] = Artifact("train", "t" * 16, tr)
    return arts


def test_stage_writes_evaluation_plots_and_metrics(tiny_target, stage_inputs, tmp_path):
    from drafter.stages import eval_offline

    K = 3
    cfg = config_from_dict({"eval_offline": {"k_max": K, "window": 48, "bootstrap_samples": 60, "cost_repeats": 2}})
    out = tmp_path / "out"
    out.mkdir()
    m = eval_offline.run(cfg, stage_inputs, out)
    res = json.loads((out / "eval_offline.json").read_text())
    for f in ("tau_vs_k.png", "acceptance_per_position.png"):
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "eval_offline.md").read_text()
    assert "| K |" in md and "recommended K" in md

    assert res["k_max"] == K and res["draft_cost_measured"] is True and 0 < res["draft_cost"] < 10
    timing = res["draft_cost_timing"]
    assert timing["target_s"] > 0 and timing["draft_s"] > 0 and timing["tokens"] > K
    assert res["draft_cost"] == pytest.approx(timing["draft_s"] / timing["target_s"])
    assert m["draft_cost"] == pytest.approx(res["draft_cost"], abs=1e-4)
    assert set(res["drafters"]) == {"baseline", "candidate"}
    assert res["conversations"] == 6  # the held-out rows only
    for name in ("baseline", "candidate"):
        for rule in ("t0", "t1_greedy", "t1_prob"):
            s = res["drafters"][name][rule]
            assert len(s["tau_by_k"]) == len(s["tau_ci"]) == len(s["alpha"]) == K
            assert all(b >= a - 1e-12 for a, b in zip(s["tau_by_k"], s["tau_by_k"][1:]))
            assert all(lo - 1e-9 <= t <= hi + 1e-9 for t, (lo, hi) in zip(s["tau_by_k"], s["tau_ci"]))
            assert set(s["by_domain"]) == {"code", "general"} and set(s["by_mode"]) == {"default"}
            assert sum(g["positions"] for g in s["by_domain"].values()) == s["positions"] > 0
            assert m[f"tau_{rule}_k{K}_{name}"] == pytest.approx(s["tau_by_k"][-1], abs=1e-4)
        k = res["recommended_k"][name]
        sp = res["expected_speedup"][name]
        assert sp[k - 1] == max(sp) and m[f"recommended_k_{name}"] == k
    assert res["drafters"]["candidate"]["t1_prob"]["tau_by_k"] != res["drafters"]["baseline"]["t1_prob"]["tau_by_k"]

    # cross-check against the training quick check's independent implementation, same windows
    wins = load_windows(stage_inputs["capture"], "heldout", "all", 48, min_tokens=K + 2)
    head = read_tensor(tiny_target, "lm_head.weight", torch.float32)
    ref = acceptance(load_drafter(tiny_target, EmbeddedGlm4MoeLayout()), head, wins, K)
    for rule in ("t0", "t1_greedy", "t1_prob"):
        s = res["drafters"]["baseline"][rule]
        assert s["tau_by_k"][-1] == pytest.approx(ref[rule]["tau"], abs=1e-9)
        assert s["alpha"] == pytest.approx(ref[rule]["alpha"], abs=1e-9)
        assert s["positions"] == ref[rule]["positions"]


def test_stage_with_configured_cost_and_missing_candidate(stage_inputs, tmp_path):
    from drafter.stages import eval_offline

    cfg = config_from_dict({"eval_offline": {"k_max": 2, "window": 48, "bootstrap_samples": 20, "draft_cost": 0.25}})
    out = tmp_path / "out"
    out.mkdir()
    m = eval_offline.run(cfg, stage_inputs, out)
    res = json.loads((out / "eval_offline.json").read_text())
    assert res["draft_cost"] == 0.25 and res["draft_cost_measured"] is False and m["draft_cost_measured"] is False
    t = res["drafters"]["candidate"]["t0"]["tau_by_k"]
    assert res["expected_speedup"]["candidate"] == pytest.approx([t[0] / 1.25, t[1] / 1.5])

    bad = dict(stage_inputs, train=Artifact("train", "x" * 16, tmp_path / "empty-train"))
    with pytest.raises(StageError, match="has no mtp-trained.safetensors"):
        eval_offline.run(cfg, bad, tmp_path / "out2")
