"""EAGLE-3 heads (drafter/models/eagle3.py): config and checkpoint layouts vLLM loads, the training-time
test unroll, and parity with vLLM 0.32's own ``Eagle3LlamaForCausalLM`` on CPU."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.models.eagle3 import (Eagle3Config, Eagle3Draft, checkpoint_tensors, default_aux_layer_ids, load_eagle3,
                                   save_eagle3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.targets import make_tiny_llama_target

    return make_tiny_llama_target(tmp_path_factory.mktemp("llama") / "target")


def _target_config(layers=8):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def _head(cfg: Eagle3Config, seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    head = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return head


def test_config_defaults_follow_vllm_and_both_layouts_round_trip():
    tc = _target_config()
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=40)
    assert cfg.aux_layer_ids == [2, 4, 5] == default_aux_layer_ids(8)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.target_hidden_size) == (64, 1, 32, 64)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    spec = cfg.to_speculators(verifier="org/target", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    assert spec["speculators_model_type"] == "eagle3" and spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    back, layout = Eagle3Config.from_hf(spec)
    assert layout == "speculators" and back == cfg
    eagle = cfg.to_eagle()
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"]
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    back, layout = Eagle3Config.from_hf(eagle)
    assert layout == "eagle" and back == cfg


def test_bad_configs_name_what_is_wrong():
    tc = _target_config()
    with pytest.raises(ValueError, match="draft_vocab_size 97 exceeds vocab_size 96"):
        Eagle3Config.for_target(tc, draft_vocab_size=97)
    with pytest.raises(ValueError, match=r"aux_layer_ids must be .* got \[4, 2\]"):
        Eagle3Config.for_target(tc, aux_layer_ids=[4, 2])
    with pytest.raises(ValueError, match=r"x\.json: neither a speculators EAGLE-3 config"):
        Eagle3Config.from_hf({"architectures": ["LlamaForCausalLM"]}, source="x.json")
    spec = Eagle3Config.for_target(tc).to_speculators(verifier="t", verifier_architectures=["LlamaForCausalLM"],
                                                      speculative_tokens=2)
    with pytest.raises(ValueError, match="norm_before_fc is set"):
        Eagle3Config.from_hf(spec | {"norm_before_fc": True})
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_hf({k: v for k, v in spec.items() if k != "eagle_aux_hidden_state_layer_ids"})
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        Eagle3Config.from_hf(spec | {"transformer_layer_config": {"vocab_size": 96}})


def test_unrolled_steps_are_the_served_steps_and_train_only_the_head():
    """Step k of the unroll at index t equals running the layer for one query at position t+k−1 that reads
    the step-1 keys of 0..t and its own earlier steps' keys; gradients reach fc / layer / lm_head, not the
    frozen embedding; logits live on the draft vocabulary and scatter to the target's ids."""
    cfg = Eagle3Config.for_target(_target_config(), draft_vocab_size=40)
    head = _head(cfg)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(list(range(0, 80, 2)))
    feats = torch.randn(2, 10, 3 * 64, generator=torch.Generator().manual_seed(2))
    out = head.unroll(ids, feats, k_steps=3)
    assert [tuple(x.shape) for x in out.logits] == [(2, 10, 40)] * 3
    assert out.valid[2][0].tolist() == [t + 4 < 10 for t in range(10)]
    with torch.no_grad():  # served by hand at index t = 4: a cache of step-1 keys 0..t, then one query per step
        t, T = 4, 10
        from drafter.models.mtp import _StepCache, causal_mask

        cache = _StepCache()
        h = head.step(ids[:, 1:], head.combine(feats)[:, :-1], torch.arange(T - 1).expand(2, -1),
                      causal_mask(T - 1, torch.float32), cache)
        cache.k, cache.v = cache.k[:, :, : t + 1], cache.v[:, :, : t + 1]
        h = h[:, t : t + 1]
        for k in (2, 3):
            open_mask = torch.zeros(1, 1, 1, t + k)
            h = head.step(ids[:, t + k : t + k + 1], h, torch.full((2, 1), t + k - 1), open_mask, cache)
        torch.testing.assert_close(h[:, 0], out.hidden[2][:, t], atol=1e-5, rtol=1e-5)
        full = head.target_logits(out.logits[0])
        assert full.shape == (2, 10, 96) and torch.isinf(full[..., 1:80:2]).all() and torch.isinf(full[..., 80:]).all()
        torch.testing.assert_close(full[..., 0:80:2], out.logits[0])
    sum(x.float().logsumexp(-1).mean() for x in out.logits).backward()
    grads = {n for n, p in head.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert "embed_tokens.weight" not in grads
    assert {"fc.weight", "lm_head.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "layers.0.mlp.down_proj.weight"} <= grads


def test_a_batch_of_windows_trains_as_the_mean_of_their_losses():
    """train()'s micro batch as one [B, T] batch for an EAGLE-3 head (its own draft-vocabulary rows, the
    captured features as input): loss and gradients are the mean of window_loss over the windows."""
    from drafter.core.config import TrainConfig
    from drafter.data.windows import Window
    from drafter.training import losses as L
    from drafter.training.loop import VocabHead, batch_loss, window_loss

    cfg = Eagle3Config.for_target(_target_config(), draft_vocab_size=40)
    head = _head(cfg)
    vocab_ids = list(range(0, 80, 2))
    head.set_draft_vocab(vocab_ids)
    g = torch.Generator().manual_seed(3)
    target_head = torch.randn(96, 64, generator=g)
    wins = []
    for i in range(3):
        mask = torch.rand(16, generator=g) > 0.3
        wins.append(Window(f"w{i}", 4 * i, torch.randint(0, 80, (16,), generator=g), mask, torch.randn(16, 64, generator=g),
                           torch.randn(16, 3 * 64, generator=g)))
    tc = TrainConfig(loss="lk_hybrid", k_steps=3, window=16)
    weights, vocab = L.position_weights(3, tc.gamma), VocabHead.of(vocab_ids, target_head)
    got, _ = batch_loss(head, target_head, wins, tc, weights, vocab=vocab)
    got.backward()
    g_got = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    want = sum(window_loss(head, target_head, w, tc, weights, vocab=vocab)[0] for w in wins) / 3
    want.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=0)
    assert g_got.keys() == {n for n, p in head.named_parameters() if p.grad is not None} and "fc.weight" in g_got
    for n, gr in g_got.items():
        torch.testing.assert_close(gr, head.get_parameter(n).grad, rtol=1e-4, atol=1e-7)


def test_unroll_runs_on_the_meta_device():
    cfg = Eagle3Config.for_target(_target_config(), draft_vocab_size=40)
    head = Eagle3Draft(cfg, device="meta")
    head.rotary_emb.to("meta")
    ids = torch.zeros(1, 6, dtype=torch.long, device="meta")
    out = head.unroll(ids, torch.empty(1, 6, 192, device="meta"), k_steps=2)
    assert out.logits[1].device.type == "meta" and out.logits[1].shape == (1, 6, 40)


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_checkpoints_round_trip_in_both_layouts(tmp_path, layout):
    cfg = Eagle3Config.for_target(_target_config(), draft_vocab_size=40)
    head = _head(cfg)
    head.set_draft_vocab(list(range(56)[16:]))
    save_eagle3(head, tmp_path / "h", layout=layout, verifier="t", speculative_tokens=2)
    names = set(load_file(str(tmp_path / "h" / "model.safetensors")))
    prefix = "midlayer." if layout == "eagle" else "layers.0."
    assert prefix + "self_attn.q_proj.weight" in names and "embed_tokens.weight" not in names
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    with pytest.raises(ValueError, match="no embed_tokens in the checkpoint"):
        load_eagle3(tmp_path / "h")
    back, got_layout = load_eagle3(tmp_path / "h", embed_tokens=head.embed_tokens.weight)
    assert got_layout == layout and back.draft_ids().tolist() == list(range(16, 56))
    ids, feats = torch.randint(0, 96, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        torch.testing.assert_close(back.unroll(ids, feats, 2).logits[1], head.unroll(ids, feats, 2).logits[1])


def test_a_whole_vocabulary_head_has_no_vocabulary_maps(tmp_path):
    """vLLM 0.32 builds ``draft_id_to_target_id`` only for a smaller draft vocabulary (and refuses a ``d2t`` otherwise)."""
    head = _head(Eagle3Config.for_target(_target_config()))
    save_eagle3(head, tmp_path / "h", verifier="t")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "h" / "model.safetensors")))
    back, _ = load_eagle3(tmp_path / "h", embed_tokens=head.embed_tokens.weight)
    assert back.draft_ids().tolist() == list(range(96)) and bool(back.t2d.all())


def test_bad_checkpoints_name_the_file_and_tensor(tmp_path):
    cfg = Eagle3Config.for_target(_target_config(), draft_vocab_size=40)
    head = _head(cfg)
    save_eagle3(head, tmp_path / "h", verifier="t")
    f = tmp_path / "h" / "model.safetensors"
    good = load_file(str(f))
    emb = head.embed_tokens.weight
    save_file(good | {"layers.0.extra": torch.zeros(2)}, str(f))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.0\.extra' is not an EAGLE-3 head tensor"):
        load_eagle3(tmp_path / "h", embed_tokens=emb)
    save_file(good | {"fc.weight": torch.zeros(64, 100)}, str(f))
    with pytest.raises(ValueError, match=r"tensor 'fc\.weight' has shape \(64, 100\), the config .* implies \(64, 192\)"):
        load_eagle3(tmp_path / "h", embed_tokens=emb)
    save_file({k: v for k, v in good.items() if k != "norm.weight"}, str(f))
    with pytest.raises(ValueError, match="missing EAGLE-3 tensor.*norm.weight"):
        load_eagle3(tmp_path / "h", embed_tokens=emb)
    save_file(good | {"d2t": torch.full((40,), 90)}, str(f))
    with pytest.raises(ValueError, match=r"d2t maps draft ids outside \[0, 96\)"):
        load_eagle3(tmp_path / "h", embed_tokens=emb)


@pytest.fixture(scope="module")
def vllm_runs(tiny_llama, tmp_path_factory):
    """Per layout: our head (saved in that layout for the tiny Llama target), its inputs, our outputs, and what
    vLLM 0.32's Eagle3LlamaForCausalLM computed from the folder (one serving-env process for both layouts)."""
    from transformers import AutoConfig

    from drafter.serving.server import ServingError, serving_python
    from tests.helpers import vllm_eagle3_model

    try:
        py = serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    root = tmp_path_factory.mktemp("vllm-eagle3")
    tc = AutoConfig.from_pretrained(tiny_llama)
    head = _head(Eagle3Config.for_target(tc, draft_vocab_size=512), seed=3)
    tw = load_file(str(tiny_llama / "model.safetensors"))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(tw["model.embed_tokens.weight"])
        head.lm_head.weight.mul_(4)  # clear margins
    head.set_draft_vocab(sorted(torch.randperm(tc.vocab_size, generator=torch.Generator().manual_seed(4))[:512].tolist()))
    T, p = 12, 7
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, tc.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, 3 * tc.hidden_size, generator=g)
    with torch.no_grad():
        out = head.unroll(ids, feats, k_steps=2)
    shifted = torch.cat([ids[0, 1:], torch.zeros(1, dtype=ids.dtype)])
    step2 = torch.cat([ids[0, 2:], torch.zeros(2, dtype=ids.dtype)])
    torch.save({"features": feats[0], "ids": shifted, "positions": torch.arange(T), "step2_ids": step2, "end": p},
               root / "in.pt")
    args = []
    for layout in ("speculators", "eagle"):
        save_eagle3(head, root / layout, layout=layout, verifier=str(tiny_llama), speculative_tokens=2)
        args += [str(root / layout), str(root / "in.pt"), str(root / f"{layout}.pt")]
    r = subprocess.run([py, vllm_eagle3_model.__file__, str(tiny_llama), *args], capture_output=True, text=True,
                       timeout=600, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return {layout: torch.load(root / f"{layout}.pt") for layout in ("speculators", "eagle")} | {
        "head": head, "features": feats, "out": out, "T": T, "p": p}


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_vllm_loads_the_head_and_computes_what_we_compute(vllm_runs, layout):
    """vLLM 0.32's Eagle3LlamaForCausalLM (serving env, CPU) built for the tiny Llama target and loaded from
    our folder in either layout: the same fc output, first-pass logits over the target vocabulary (−inf
    outside the draft vocabulary), fed-back hidden state, and the step-2 logits with the proposer's KV
    cache; every tensor we save is one it loads."""
    head, out, T, p, theirs = vllm_runs["head"], vllm_runs["out"], vllm_runs["T"], vllm_runs["p"], vllm_runs[layout]
    with torch.no_grad():
        ours1, ours2 = head.target_logits(out.logits[0][0]), head.target_logits(out.logits[1][0])
    assert theirs["has_own_embed_tokens"] is False
    loaded = {n.removeprefix("model.") for n in theirs["params"]}
    fused = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
             "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj", "mlp.up_proj": "mlp.gate_up_proj",
             "midlayer.": "layers.0.", "d2t": "draft_id_to_target_id"}
    for name in checkpoint_tensors(head, layout):
        for a, b in fused.items():
            name = name.replace(a, b)
        assert name in loaded or name == "t2d", name
    with torch.no_grad():
        torch.testing.assert_close(head.combine(vllm_runs["features"])[0], theirs["combined"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden[0][0, : T - 1], theirs["prenorm1"][: T - 1], atol=1e-4, rtol=1e-4)
        assert torch.equal(torch.isinf(ours1), torch.isinf(theirs["logits1"]))
        keep = ~torch.isinf(ours1)
        torch.testing.assert_close(ours1[keep], theirs["logits1"][keep], atol=1e-4, rtol=1e-4)
        keep2 = ~torch.isinf(ours2[p])
        torch.testing.assert_close(ours2[p][keep2], theirs["logits2"][keep2], atol=1e-4, rtol=1e-4)
        assert ours2[p].argmax() == theirs["logits2"].argmax()
