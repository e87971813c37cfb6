"""Draft vocabularies (drafter/serving/draft_vocab.py), the plugin's draft-vocabulary logits
(drafter/serving/vllm_fixes.py), and where the pipeline writes, serves, measures and releases them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from drafter.core.errors import StageError
from drafter.serving import vllm_fixes
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, build_draft_vocab, load_draft_vocab, save_draft_vocab


def test_build_takes_the_most_frequent_seen_tokens_then_the_lowest_unseen_ids():
    lists = [[7, 7, 7, 9, 9, 3], [9, 5]]
    assert build_draft_vocab(lists, vocab_size=12, size=2) == [7, 9]        # 7 ×3, 9 ×3 beat 3 and 5 (×1)
    assert build_draft_vocab(lists, vocab_size=12, size=4) == [3, 5, 7, 9]  # all seen
    assert build_draft_vocab(lists, vocab_size=12, size=7) == [0, 1, 2, 3, 5, 7, 9]  # + the lowest unseen ids
    assert build_draft_vocab([], vocab_size=12, size=12) == list(range(12))
    with pytest.raises(StageError, match=r"size 13 must be in 1\.\.12"):
        build_draft_vocab(lists, vocab_size=12, size=13)
    with pytest.raises(StageError, match=r"token id\(s\) \[12\] outside the target's vocabulary of 12"):
        build_draft_vocab([[1, 12]], vocab_size=12, size=4)


def test_save_and_load_round_trip_and_load_names_what_is_wrong(tmp_path):
    from safetensors.torch import save_file

    p = save_draft_vocab([9, 2, 4], tmp_path / DRAFT_VOCAB_FILE)
    ids = load_draft_vocab(p, vocab_size=10)
    assert ids.tolist() == [2, 4, 9] and ids.dtype == torch.int64
    with pytest.raises(StageError, match=r"ids outside \[0, 9\)"):
        load_draft_vocab(p, vocab_size=9)
    bad = tmp_path / "bad.safetensors"
    for tensors, msg in (({"ids": torch.tensor([1])}, "no tensor 'token_ids'"),
                         ({"token_ids": torch.tensor([3, 1])}, "sorted and unique"),
                         ({"token_ids": torch.tensor([1, 1])}, "sorted and unique"),
                         ({"token_ids": torch.tensor([1.0, 2.0])}, "1-D int64"),
                         ({"token_ids": torch.tensor([-1, 2])}, "outside")):
        save_file(tensors, str(bad))
        with pytest.raises(StageError, match=msg):
            load_draft_vocab(bad, vocab_size=5)


class _Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


class _SharedHead(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.norm = torch.nn.LayerNorm(weight.shape[1], elementwise_affine=False)
        self.head = _Head(weight)

    def forward(self, h):
        return self.norm(h)


class _Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.shared_head = _SharedHead(weight)


class _Predictor(torch.nn.Module):
    """The attributes of vLLM's MTP predictors (Glm4MoeMultiTokenPredictor) that the plugin's logits use."""

    def __init__(self, weight, soft_cap=None, scale=1.0):
        super().__init__()
        self.mtp_start_layer_idx, self.num_mtp_layers = 30, 1
        self.layers = torch.nn.ModuleDict({"30": _Layer(weight)})
        self.logits_processor = type("LP", (), {"soft_cap": soft_cap, "scale": scale, "head_dtype": None,
                                                "org_vocab_size": weight.shape[0]})()

    def full_logits(self, hidden):
        lp = self.logits_processor
        logits = self.layers["30"].shared_head(hidden) @ self.layers["30"].shared_head.head.weight.T
        if lp.soft_cap is not None:
            logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
        return logits * lp.scale


@pytest.mark.parametrize("soft_cap,scale", [(None, 1.0), (5.0, 0.5)])
def test_plugin_logits_are_the_full_logits_on_the_draft_vocabulary_and_minus_inf_elsewhere(soft_cap, scale):
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 16, generator=g), torch.randn(4, 16, generator=g)
    pred = _Predictor(weight, soft_cap, scale)
    full = pred.full_logits(hidden)
    pred._drafter_vocab = torch.arange(50)  # the whole vocabulary: the same logits
    torch.testing.assert_close(vllm_fixes.draft_vocab_compute_logits(pred, hidden), full, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([1, 4, 8, 20, 33])
    pred._drafter_vocab = ids
    got = vllm_fixes.draft_vocab_compute_logits(pred, hidden)
    assert got.shape == (4, 50)
    torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(50, dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.isneginf(got[:, outside]).all()
    assert got.argmax(-1).tolist() == ids[full[:, ids].argmax(-1)].tolist()  # greedy drafts: the best in the set
    assert torch.softmax(got, -1)[:, outside].sum() == 0  # probabilistic drafts never leave the set


def test_plugin_logits_follow_a_replaced_head():
    """vLLM replaces the MTP layer's head with the target's lm_head after loading: rows gathered before
    that must not be reused."""
    g = torch.Generator().manual_seed(1)
    pred = _Predictor(torch.randn(30, 8, generator=g))
    pred._drafter_vocab = torch.tensor([0, 5, 7])
    hidden = torch.randn(2, 8, generator=g)
    vllm_fixes.draft_vocab_compute_logits(pred, hidden)
    pred.layers["30"].shared_head.head = _Head(torch.randn(30, 8, generator=g))  # the target's head, shared
    got = vllm_fixes.draft_vocab_compute_logits(pred, hidden)
    torch.testing.assert_close(got[:, [0, 5, 7]], pred.full_logits(hidden)[:, [0, 5, 7]], rtol=1e-5, atol=1e-5)


def test_plugin_logits_refuse_a_sharded_or_quantized_head():
    """Under tensor parallelism each rank holds a slice of the head, and a quantized head needs its scales:
    the plugin then returns None (vLLM's own logits are used) rather than gather wrong rows."""
    g = torch.Generator().manual_seed(2)
    pred = _Predictor(torch.randn(30, 8, generator=g))
    pred._drafter_vocab = torch.tensor([0, 5, 7])
    hidden = torch.randn(2, 8, generator=g)
    assert vllm_fixes.draft_vocab_compute_logits(pred, hidden) is not None
    pred.logits_processor.org_vocab_size = 60  # a rank's shard of a 60-token head
    assert vllm_fixes.draft_vocab_compute_logits(pred, hidden) is None
    assert "sharded" in vllm_fixes.head_unsupported(pred.layers["30"].shared_head.head, 60)
    assert "float8" in vllm_fixes.head_unsupported(_Head(torch.zeros(30, 8).to(torch.float8_e4m3fn)), 30)
    head = _Head(torch.zeros(30, 8))
    head.quant_method = type("Fp8LinearMethod", (), {})()
    assert "quantized (Fp8LinearMethod)" in vllm_fixes.head_unsupported(head, 30)
    head.quant_method = type("UnquantizedEmbeddingMethod", (), {})()
    assert vllm_fixes.head_unsupported(head, 30) is None


def test_served_model_dir_links_the_draft_vocabulary(tmp_path):
    from tests.helpers.targets import make_tiny_target

    from drafter.models.target import MTP_SHARD
    from drafter.serving.served_model import drafter_model_dir

    target = make_tiny_target(tmp_path / "target")
    vocab = save_draft_vocab([0, 3], tmp_path / "v.safetensors")
    out = drafter_model_dir(target, target / MTP_SHARD, tmp_path / "served", draft_vocab=vocab, allow_new_keys=True)
    assert (out / DRAFT_VOCAB_FILE).resolve() == vocab.resolve()
    out = drafter_model_dir(target, target / MTP_SHARD, tmp_path / "served", allow_new_keys=True)  # rebuilt without
    assert not (out / DRAFT_VOCAB_FILE).exists()
    with pytest.raises(StageError, match="draft vocabulary .*nope.safetensors does not exist"):
        drafter_model_dir(target, target / MTP_SHARD, tmp_path / "served", draft_vocab=tmp_path / "nope.safetensors",
                          allow_new_keys=True)


def test_hook_is_installed_on_vllms_mtp_predictors_once():
    """In the serving env: register() wraps the MTP predictors' __init__ and compute_logits, idempotently."""
    from tests.test_vllm_fixes import _serving_python

    code = ("from drafter.serving import vllm_fixes as f\n"
            "from vllm.model_executor.models.glm4_moe_mtp import Glm4MoeMultiTokenPredictor as C\n"
            "from vllm.model_executor.models.deepseek_mtp import DeepSeekMultiTokenPredictor as D\n"
            "orig = C.compute_logits\n"
            "f.register(); first = (C.__init__, C.compute_logits)\n"
            "f.register()\n"
            "assert (C.__init__, C.compute_logits) == first and C.compute_logits is not orig\n"
            "assert getattr(C.__init__, f.FIXED_MARK) and getattr(D.__init__, f.FIXED_MARK)\n"
            "print('ok')\n")
    r = subprocess.run([str(_serving_python()), "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
