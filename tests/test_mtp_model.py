"""MTP drafter models and release layouts (drafter/models/), on tiny checkpoints.

The reference in ``_vllm_reference_*`` is written from vLLM 0.32's formulas (glm4_moe_mtp.py,
glm4_moe.py, llm_base_proposer.py) with plain torch ops on the on-disk tensors, not the modules.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafter.core.errors import StageError
from drafter.models import (
    DEFAULT_FROZEN,
    DeepSeekV3Layout,
    EmbeddedGlm4MoeLayout,
    MTPDrafter,
    freeze,
    load_drafter,
    save_drafter,
)
from drafter.models.mtp import OnePassMoE
from drafter.models.target import MTP_SHARD

GLM = EmbeddedGlm4MoeLayout()
V3 = DeepSeekV3Layout()


# ---------------------------------------------------------------------- helpers


def _cfg(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _with_mtp_shard(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` (base shard linked) whose MTP shard is ``edit(tensors)`` (index updated)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in (MTP_SHARD, "model.safetensors.index.json"):
            (dst / f.name).symlink_to(f.resolve())
    mtp = edit(load_file(str(src / MTP_SHARD)))
    save_file(mtp, str(dst / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = {k: v for k, v in index["weight_map"].items() if v != MTP_SHARD} | {k: MTP_SHARD for k in mtp}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": index["metadata"], "weight_map": wm}))
    return dst


@pytest.fixture(scope="module")
def random_mtp_target(tiny_target, tmp_path_factory):
    """The tiny target with an MTP layer whose every tensor is random: distinct experts, a non-zero
    router and correction bias, non-identity eh_proj and norms (so every term of the formula matters)."""
    g = torch.Generator().manual_seed(1)

    def edit(t):
        out = {}
        for k, v in t.items():
            if v.ndim == 1:
                out[k] = (1.0 + 0.2 * torch.randn(v.shape, generator=g)).to(v.dtype)
            else:
                out[k] = (torch.randn(v.shape, generator=g) * v.shape[-1] ** -0.5 * (3.0 if ".gate." in k else 1.0)).to(v.dtype)
            if k.endswith("e_score_correction_bias"):
                out[k] = 0.3 * torch.randn(v.shape, generator=g)
        return out

    return _with_mtp_shard(tiny_target, tmp_path_factory.mktemp("rand") / "model", edit)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Neox-style (rotate-half) RoPE, full rotary, as vLLM's get_rope for GLM-4-MoE. x: [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _VllmGlm4MoeMTP:
    """GLM-4-MoE MTP layer from vLLM's formulas, plain torch on the on-disk tensors (one sequence)."""

    def __init__(self, model_dir: Path):
        self.c = _cfg(model_dir)
        wm = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        L = self.c["num_hidden_layers"]
        self.p = f"model.layers.{L}."
        self.w = {}
        for k, f in wm.items():
            if k.startswith(self.p) or k == "model.embed_tokens.weight":
                with safe_open(str(model_dir / f), framework="pt") as fh:
                    self.w[k] = fh.get_tensor(k).float()

    def W(self, name):
        return self.w[self.p + name]

    def kv(self, x, pos):
        """Block input x [T, H] → (residual, normed, q, k, v) with RoPE applied."""
        c, eps = self.c, self.c["rms_norm_eps"]
        d, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        a = _rms(x, self.W("input_layernorm.weight"), eps)
        q = (a @ self.W("self_attn.q_proj.weight").T).view(-1, nh, d)
        k = (a @ self.W("self_attn.k_proj.weight").T).view(-1, nkv, d)
        v = (a @ self.W("self_attn.v_proj.weight").T).view(-1, nkv, d)
        th = c["rope_parameters"]["rope_theta"]
        return _rope(q, pos, th), _rope(k, pos, th), v

    def block_input(self, tok, h, pos):
        eps = self.c["rms_norm_eps"]
        e = self.w["model.embed_tokens.weight"][tok]
        e = torch.where(pos[:, None] == 0, torch.zeros_like(e), e)  # masked at position 0
        cat = torch.cat([_rms(e, self.W("enorm.weight"), eps), _rms(h, self.W("hnorm.weight"), eps)], -1)
        return cat @ self.W("eh_proj.weight").T

    def finish(self, x, attn):
        """residual adds, MoE MLP (sigmoid routing, top-k, renormalize, scaling, shared expert)."""
        c, eps = self.c, self.c["rms_norm_eps"]
        x = x + attn @ self.W("self_attn.o_proj.weight").T
        m = _rms(x, self.W("post_attention_layernorm.weight"), eps)
        scores = (m @ self.W("mlp.gate.weight").T).sigmoid()
        choice = scores + self.W("mlp.gate.e_score_correction_bias")
        top = choice.topk(c["num_experts_per_tok"], dim=-1).indices
        wts = scores.gather(1, top)
        wts = wts / wts.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        out = torch.zeros_like(m)
        silu = torch.nn.functional.silu
        for e in range(c["n_routed_experts"]):
            y = (silu(m @ self.W(f"mlp.experts.{e}.gate_proj.weight").T) * (m @ self.W(f"mlp.experts.{e}.up_proj.weight").T)) \
                @ self.W(f"mlp.experts.{e}.down_proj.weight").T
            out += y * (wts * (top == e)).sum(-1, keepdim=True)
        out += (silu(m @ self.W("mlp.shared_experts.gate_proj.weight").T) * (m @ self.W("mlp.shared_experts.up_proj.weight").T)) \
            @ self.W("mlp.shared_experts.down_proj.weight").T
        return x + out  # vLLM: hidden = residual + mlp(...)

    def attend(self, q, ks, vs, allowed):
        """q [Tq, nh, d], keys [Tk, nkv, d], allowed [Tq, Tk] → [Tq, nh*d]."""
        rep = q.shape[1] // ks.shape[1]
        k, v = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", s, v).reshape(q.shape[0], -1)

    def logits(self, out):
        return _rms(out, self.W("shared_head.norm.weight"), self.c["rms_norm_eps"]) @ self.W("shared_head.head.weight").T

    def first_pass(self, tok, h, pos):
        """vLLM's first pass: causal attention over the sequence. Returns (out, keys, values)."""
        x = self.block_input(tok, h, pos)
        q, k, v = self.kv(x, pos)
        T = x.shape[0]
        allowed = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        return self.finish(x, self.attend(q, k, v, allowed)), k, v

    def draft_step(self, tok, h, pos, ks, vs):
        """One later draft step for one request: a single query at ``pos`` over the KV cache + itself."""
        x = self.block_input(tok.view(1), h.view(1, -1), pos.view(1))
        q, k, v = self.kv(x, pos.view(1))
        ks, vs = torch.cat([ks, k]), torch.cat([vs, v])
        return self.finish(x, self.attend(q, ks, vs, torch.ones(1, ks.shape[0], dtype=torch.bool)))[0], ks, vs


# ---------------------------------------------------------------------- loading and the forward pass


def test_load_embedded_target_mtp_layer_and_forward(tiny_target):
    drafter = load_drafter(tiny_target, GLM)
    c = _cfg(tiny_target)
    assert isinstance(drafter, MTPDrafter) and drafter.n_layers == 1 and drafter.mtp_start == c["num_hidden_layers"]
    assert type(drafter.layers[0].mtp_block).__name__ == "Glm4MoeDecoderLayer"
    mlp = drafter.layers[0].mtp_block.mlp  # the served MoE block, with its exact shortcuts
    assert isinstance(mlp, OnePassMoE) and mlp.general_cls.__name__ == "Glm4MoeMoE"
    assert not drafter.recycle_normed
    ids = torch.randint(0, c["vocab_size"], (2, 7))
    hidden, logits = drafter.forward_step(0, ids, torch.randn(2, 7, c["hidden_size"]))
    assert hidden.shape == (2, 7, c["hidden_size"]) and logits.shape == (2, 7, c["vocab_size"])
    assert torch.isfinite(logits).all()


def test_untrained_layer_block_input_is_hnorm_of_h(tiny_target):
    """make_tiny_target's MTP layer: eh_proj = [0 | I], enorm = hnorm = 1 → the block sees rms(h) exactly,
    and (the block being the target's last layer) changing the tokens changes nothing."""
    drafter = load_drafter(tiny_target, GLM)
    c = _cfg(tiny_target)
    seen = []
    drafter.layers[0].mtp_block.register_forward_pre_hook(lambda m, args, kw: seen.append(args[0] if args else kw["hidden_states"]), with_kwargs=True)
    h = torch.randn(1, 6, c["hidden_size"]) * 3
    ids = torch.randint(0, c["vocab_size"], (1, 6))
    _, logits_a = drafter.forward_step(0, ids, h)
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"])
    assert (seen[0] - expected).abs().max() < 1e-5
    _, logits_b = drafter.forward_step(0, torch.randint(0, c["vocab_size"], (1, 6)), h)
    assert torch.equal(logits_a, logits_b)


def test_one_step_matches_independent_vllm_formula(random_mtp_target):
    drafter = load_drafter(random_mtp_target, GLM)
    ref = _VllmGlm4MoeMTP(random_mtp_target)
    c = _cfg(random_mtp_target)
    g = torch.Generator().manual_seed(2)
    T = 9
    ids = torch.randint(0, c["vocab_size"], (1, T), generator=g)
    h = torch.randn(1, T, c["hidden_size"], generator=g)
    pos = torch.arange(T)
    with torch.no_grad():
        out, logits = drafter.forward_step(0, ids, h)
    ref_out, _, _ = ref.first_pass(ids[0], h[0], pos)
    d = (logits[0] - ref.logits(ref_out)).abs().max().item()
    print(f"max |Δlogit| step 1 vs vLLM formula: {d:.2e}")
    assert d < 1e-4
    assert (out[0] - ref_out).abs().max() < 1e-4  # GLM-4-MoE recycles the pre-norm hidden state
    # the position-0 mask is real: without it the reference differs at t=0 only
    x_nomask = ref.block_input(ids[0], h[0], pos + 1)
    assert not torch.allclose(x_nomask[0], ref.block_input(ids[0], h[0], pos)[0])


def test_unroll_matches_vllm_reused_layer_decoding(random_mtp_target):
    """K=3 unrolled steps == vLLM's proposer run per request: first pass over x_0..x_{t}, then single-token
    steps at positions t+1, t+2 that read the KV cache (context from step 1 + their own earlier steps)."""
    drafter = load_drafter(random_mtp_target, GLM)
    ref = _VllmGlm4MoeMTP(random_mtp_target)
    c = _cfg(random_mtp_target)
    g = torch.Generator().manual_seed(3)
    T, K = 8, 3
    x = torch.randint(0, c["vocab_size"], (T,), generator=g)
    h = torch.randn(T, c["hidden_size"], generator=g)
    with torch.no_grad():
        un = drafter.unroll(x[None], h[None], K)
    worst = [0.0] * K
    for t in range(T - K - 1):  # every chain with a target for all K steps
        # first pass over the prompt up to t: position i gets token x_{i+1} and h_i
        out, ks, vs = ref.first_pass(x[1: t + 2], h[: t + 1], torch.arange(t + 1))
        hid = out[t]
        worst[0] = max(worst[0], (un.logits[0][0, t] - ref.logits(hid)).abs().max().item())
        for k in range(2, K + 1):
            hid, ks, vs = ref.draft_step(x[t + k], hid, torch.tensor(t + k - 1), ks, vs)
            worst[k - 1] = max(worst[k - 1], (un.logits[k - 1][0, t] - ref.logits(hid)).abs().max().item())
    print("max |Δlogit| per step vs vLLM reused-layer decoding:", [f"{w:.2e}" for w in worst])
    assert max(worst) < 1e-4


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_unroll_shapes_and_valid_masks(tiny_target, K):
    drafter = load_drafter(tiny_target, GLM)
    c = _cfg(tiny_target)
    B, T = 2, 7
    un = drafter.unroll(torch.randint(0, c["vocab_size"], (B, T)), torch.randn(B, T, c["hidden_size"]), K)
    assert len(un.logits) == len(un.valid) == len(un.hidden) == K
    for k in range(1, K + 1):
        assert un.logits[k - 1].shape == (B, T, c["vocab_size"])
        assert un.hidden[k - 1].shape == (B, T, c["hidden_size"])
        assert un.valid[k - 1].dtype == torch.bool and un.valid[k - 1].shape == (B, T)
        # step k at t predicts x_{t+k+1}: valid for t ≤ T-k-2
        assert un.valid[k - 1][0].tolist() == [t + k + 1 <= T - 1 for t in range(T)]
    assert drafter.unroll(torch.zeros(1, T, dtype=torch.long), torch.randn(1, T, c["hidden_size"]), K,
                          compute_logits=False).logits is None


def test_unroll_gradients_reach_the_drafter_not_the_embedding(tiny_target):
    drafter = load_drafter(tiny_target, GLM)
    c = _cfg(tiny_target)
    un = drafter.unroll(torch.randint(0, c["vocab_size"], (1, 6)), torch.randn(1, 6, c["hidden_size"]), 3)
    sum(l[m].logsumexp(-1).sum() for l, m in zip(un.logits, un.valid)).backward()
    assert drafter.embed_tokens.weight.grad is None
    assert drafter.layers[0].eh_proj.weight.grad is not None and drafter.layers[0].eh_proj.weight.grad.abs().sum() > 0


def _two_layer_drafter(model_dir: Path, same: bool) -> MTPDrafter:
    """A 2-MTP-layer drafter on the tiny target: layer 1 = layer 0 (``same``) or layer 0 perturbed."""
    one = load_drafter(model_dir, GLM)
    two = GLM.build(_cfg(model_dir) | {"num_nextn_predict_layers": 2})
    sd = one.state_dict()
    sd |= {k.replace("layers.0.", "layers.1.", 1): v.clone() for k, v in sd.items() if k.startswith("layers.0.")}
    if not same:
        sd["layers.1.eh_proj.weight"] = sd["layers.1.eh_proj.weight"] + 0.05 * torch.randn_like(sd["layers.1.eh_proj.weight"])
    two.load_state_dict(sd)
    return two


def test_several_layers_chain_and_one_layer_is_reused(random_mtp_target):
    c = _cfg(random_mtp_target)
    T = 7
    ids = torch.randint(0, c["vocab_size"], (1, T))
    h = torch.randn(1, T, c["hidden_size"])
    # chaining: step k runs layer (k-1) % n over the window at the same positions, fed step k-1's hidden
    two = _two_layer_drafter(random_mtp_target, same=False)
    calls = {0: 0, 1: 0}
    for i in (0, 1):
        two.layers[i].register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
    with torch.no_grad():
        un = two.unroll(ids, h, 3)
        h1, l1 = two.forward_step(0, ids[:, 1:], h[:, :-1])
        h2, l2 = two.forward_step(1, ids[:, 2:], h1[:, :-1])
        _, l3 = two.forward_step(0, ids[:, 3:], h2[:, :-1])
    assert calls == {0: 2 + 2, 1: 1 + 1}  # unroll: layers 0,1,0; then the manual chain: 0,1,0
    for k, ref in ((1, l1), (2, l2), (3, l3)):
        n = T - k
        assert (un.logits[k - 1][:, :n] - ref).abs().max() < 1e-4, f"step {k}"
    # a single layer is reused for every step: one module, called K times, and its later steps are
    # not the chained computation (different positions and KV: vLLM's reused-layer decoding)
    one = load_drafter(random_mtp_target, GLM)
    n_calls = []
    one.layers[0].register_forward_hook(lambda m, a, o: n_calls.append(1))
    with torch.no_grad():
        un1 = one.unroll(ids, h, 3)
    assert len(n_calls) == 3
    assert torch.allclose(un1.logits[0], un.logits[0], atol=1e-5)  # step 1: same layer-0 weights
    same = _two_layer_drafter(random_mtp_target, same=True)
    with torch.no_grad():
        chained = same.unroll(ids, h, 2)
    assert not torch.allclose(un1.logits[1][:, : T - 3], chained.logits[1][:, : T - 3], atol=1e-3)


def test_deepseek_v3_recycles_the_post_norm_hidden(tmp_path):
    from tests.helpers.deepseek import make_tiny_deepseek_v3_mtp

    model_dir, _ = make_tiny_deepseek_v3_mtp(tmp_path / "v3")
    drafter = load_drafter(model_dir, V3)
    assert drafter.recycle_normed and type(drafter.layers[0].mtp_block).__name__ == "DeepseekV3DecoderLayer"
    ids = torch.randint(0, 500, (1, 5))
    with torch.no_grad():
        hidden, logits = drafter.forward_step(0, ids, torch.randn(1, 5, 192))
    # post-norm recycled: logits = head(hidden) with no second norm
    assert (drafter.layers[0].shared_head.head(hidden) - logits).abs().max() < 1e-4


# ---------------------------------------------------------------------- layouts: save / load


def test_embedded_layout_save_load_round_trip(tiny_target, tmp_path):
    drafter = load_drafter(tiny_target, GLM)
    with torch.no_grad():
        drafter.layers[0].eh_proj.weight.add_(0.01)
    on_disk = dict(load_file(str(tiny_target / MTP_SHARD)))
    for dtype in (torch.float32, torch.bfloat16):
        path = save_drafter(drafter, tmp_path / f"mtp-{dtype}.safetensors", GLM, dtype)
        saved = load_file(str(path))
        assert set(saved) == set(on_disk)  # the release's own names; the shared embedding is not the layer's
        for k, v in saved.items():
            assert v.shape == on_disk[k].shape, k
            keep32 = k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias")
            assert v.dtype == (torch.float32 if keep32 else dtype), k
    back = load_drafter(tiny_target, GLM, weights=tmp_path / f"mtp-{torch.float32}.safetensors")
    a, b = drafter.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # experts were split per expert on save and fused again on load
    assert torch.equal(saved["model.layers.2.mlp.experts.1.up_proj.weight"].float(),
                       drafter.layers[0].mtp_block.mlp.experts.gate_up_proj[1, 128:].bfloat16().float())


def test_only_trainable_leaves_out_frozen_tensors(tiny_target, tmp_path):
    drafter = load_drafter(tiny_target, GLM)
    freeze(drafter)
    saved = load_file(str(save_drafter(drafter, tmp_path / "t.safetensors", GLM, torch.float32, only_trainable=True)))
    assert not any(".mlp.experts." in k for k in saved) and "model.layers.2.eh_proj.weight" in saved


def test_deepseek_v3_fp8_load_dequantizes_and_round_trips(tmp_path):
    from tests.helpers.deepseek import make_tiny_deepseek_v3_mtp

    model_dir, reference = make_tiny_deepseek_v3_mtp(tmp_path / "v3")
    idx = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    fp8_names = [k[: -len("_scale_inv")] for k in idx if k.endswith("_scale_inv")]
    assert any(".mlp.experts." in k for k in fp8_names) and any(".self_attn." in k for k in fp8_names)
    drafter = load_drafter(model_dir, V3)
    release = V3.to_release(drafter)
    n_checked = 0
    for name in fp8_names:
        got, ref = release[name].float(), reference[name]
        with safe_open(str(model_dir / idx[name]), framework="pt") as f:
            assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        # E4M3 round-to-nearest: relative error ≤ 2^-4 (normals), absolute ≤ s·2^-10 (subnormals)
        tol = 2 ** -4 * ref.abs() + ref.abs().max() / 448 * 2 ** -10 + 1e-7
        assert ((got - ref).abs() <= tol).all(), name
        assert (got - ref).abs().max() > 0  # really went through FP8
        n_checked += 1
    assert n_checked >= 10
    # naive dequantization without the block scales would be far off: the scales were applied
    with safe_open(str(model_dir / idx[fp8_names[0]]), framework="pt") as f:
        raw = f.get_tensor(fp8_names[0]).float()
    assert (raw - reference[fp8_names[0]]).abs().max() > 1.0
    # BF16 tensors load as written
    assert torch.equal(release["model.layers.2.enorm.weight"], reference["model.layers.2.enorm.weight"].bfloat16().float())

    path = save_drafter(drafter, tmp_path / "mtp-trained.safetensors", V3, torch.bfloat16)
    saved = load_file(str(path))
    expected = {k for k in idx if k.startswith("model.layers.2.") and not k.endswith("_scale_inv")} - {"model.layers.2.embed_tokens.weight"}
    assert set(saved) == expected
    for k, v in saved.items():
        assert v.shape == release[k].shape
        assert v.dtype == (torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16), k
    back = load_drafter(model_dir, V3, weights=path)
    for k, v in V3.to_release(back).items():
        assert torch.equal(v, saved[k].float() if k in saved else release[k]), k


# ---------------------------------------------------------------------- bad checkpoints


def _edit_case(case: str, L: int):
    p = f"model.layers.{L}."

    def edit(t):
        t = dict(t)
        if case == "missing":
            del t[p + "enorm.weight"]
        elif case == "unexpected":
            t[p + "mystery_proj.weight"] = torch.zeros(4, 4)
        elif case == "shape":
            t[p + "eh_proj.weight"] = torch.zeros(64, 64)
        elif case == "nan":
            t[p + "hnorm.weight"] = t[p + "hnorm.weight"].clone()
            t[p + "hnorm.weight"][3] = float("nan")
        elif case == "inf_expert":
            t[p + "mlp.experts.1.down_proj.weight"] = t[p + "mlp.experts.1.down_proj.weight"].clone()
            t[p + "mlp.experts.1.down_proj.weight"][0, 0] = float("inf")
        return t

    return edit


@pytest.mark.parametrize("case,needle", [
    ("missing", "enorm.weight"),
    ("unexpected", "mystery_proj.weight"),
    ("shape", "eh_proj.weight"),
    ("nan", "hnorm.weight"),
    ("inf_expert", "mlp.experts.1.down_proj.weight"),
])
def test_bad_checkpoint_fails_naming_the_tensor(tiny_target, tmp_path, case, needle):
    L = _cfg(tiny_target)["num_hidden_layers"]
    bad = _with_mtp_shard(tiny_target, tmp_path / case, _edit_case(case, L))
    with pytest.raises(StageError) as e:
        load_drafter(bad, GLM)
    assert f"model.layers.{L}.{needle}" in str(e.value)
    if case in ("missing", "unexpected"):
        assert ("missing" if case == "missing" else "unknown") in str(e.value)
    if case == "shape":
        assert "(64, 64)" in str(e.value) and "(64, 128)" in str(e.value)


def test_bad_weights_file_and_fp8_without_scale(tiny_target, tmp_path):
    from tests.helpers.deepseek import make_tiny_deepseek_v3_mtp

    save_file({"model.layers.2.not_a_tensor.weight": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(StageError, match="not_a_tensor"):
        load_drafter(tiny_target, GLM, weights=tmp_path / "w.safetensors")
    model_dir, _ = make_tiny_deepseek_v3_mtp(tmp_path / "v3")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = "model.layers.2.self_attn.q_a_proj.weight"
    del index["weight_map"][victim + "_scale_inv"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(StageError, match=victim.replace(".", r"\.") + ".*_scale_inv"):
        load_drafter(model_dir, V3)


# ---------------------------------------------------------------------- freezing


def test_freeze_defaults_and_patterns(tiny_target):
    drafter = load_drafter(tiny_target, GLM)
    c = _cfg(tiny_target)
    H, V, I, E = c["hidden_size"], c["vocab_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    total = sum(p.numel() for p in drafter.parameters())
    n_train, n_frozen = freeze(drafter)
    assert n_frozen == V * H + E * (2 * I * H + H * I)  # embedding + routed experts
    assert n_train + n_frozen == total
    assert not drafter.embed_tokens.weight.requires_grad
    assert not drafter.layers[0].mtp_block.mlp.experts.gate_up_proj.requires_grad
    assert drafter.layers[0].mtp_block.mlp.shared_experts.up_proj.weight.requires_grad
    assert DEFAULT_FROZEN == ("embed_tokens.*", "*.mlp.experts.*")
    n_train, n_frozen = freeze(drafter, ["re:.*\\.eh_proj\\..*", "*.shared_head.head.*"])
    assert n_frozen == 2 * H * H + V * H
    assert drafter.embed_tokens.weight.requires_grad  # patterns replace the defaults
    assert freeze(drafter, []) == (total, 0)


# ---------------------------------------------------------------------- exact shortcuts of the MoE MLP


def _mlp_passes(drafter) -> dict:
    """Counts of the routed-experts and shared-expert module calls (forward hooks on layer 0's MoE)."""
    mlp, n = drafter.layers[0].mtp_block.mlp, {"routed": 0, "shared": 0}
    mlp.experts.register_forward_hook(lambda *_: n.__setitem__("routed", n["routed"] + 1))
    mlp.shared_experts.register_forward_hook(lambda *_: n.__setitem__("shared", n["shared"] + 1))
    return n


def _unroll_loss(drafter, shortcuts: bool, seed: int = 0, K: int = 3):
    """A K-step unroll's loss and the gradient of every trainable parameter (None → zeros), with the
    MoE shortcuts on or off; same inputs for the same seed."""
    c = drafter.config
    g = torch.Generator().manual_seed(seed)
    ids, h = torch.randint(0, c.vocab_size, (1, 9), generator=g), torch.randn(1, 9, c.hidden_size, generator=g)
    drafter.set_shortcuts(shortcuts)
    drafter.zero_grad(set_to_none=True)
    un = drafter.unroll(ids, h, K)
    loss = sum(torch.log_softmax(l[m], -1)[:, :100].mean() for l, m in zip(un.logits, un.valid))
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for n, p in drafter.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_same(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.allclose(a[1][k], b[1][k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_one_pass_moe_gives_the_general_paths_loss_and_gradients(tiny_target, scale):
    """The embedded target's block (2 identical experts, top-2, zero shared expert): one routed pass,
    no shared pass, and the same loss and gradients as transformers' own MoE forward (also with a
    routed scaling factor, where the routing weights sum to it rather than to 1)."""
    drafter = load_drafter(tiny_target, GLM)
    freeze(drafter)
    drafter.layers[0].mtp_block.mlp.gate.routed_scaling_factor = scale
    passes = _mlp_passes(drafter)
    ref = _unroll_loss(drafter, shortcuts=False)
    assert passes == {"routed": 3, "shared": 3}
    shared = [k for k in ref[1] if ".shared_experts." in k]
    assert shared and all(not ref[1][k].any() for k in shared)  # zero in the general path: skipping it is exact
    new = _unroll_loss(drafter, shortcuts=True)
    assert passes == {"routed": 3, "shared": 3}  # neither module ran
    _assert_same(ref, new)
    assert ref[1]["layers.0.mtp_block.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("case", ["experts differ", "shared expert non-zero", "top-1 routing"])
def test_one_pass_moe_falls_back_when_a_condition_fails(tiny_target, case):
    drafter = load_drafter(tiny_target, GLM)
    freeze(drafter)
    mlp = drafter.layers[0].mtp_block.mlp
    with torch.no_grad():
        if case == "experts differ":
            mlp.experts.down_proj[1, 0, 0] += 1e-3
        elif case == "shared expert non-zero":
            for p in mlp.shared_experts.parameters():
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    if case == "top-1 routing":
        mlp.gate.top_k = 1
    passes = _mlp_passes(drafter)
    new = _unroll_loss(drafter, shortcuts=True)
    assert passes == {"routed": 3 if case != "shared expert non-zero" else 0,
                      "shared": 3 if case == "shared expert non-zero" else 0}
    _assert_same(_unroll_loss(drafter, shortcuts=False), new)


def test_one_pass_moe_keeps_trainable_experts_identical_only_while_routing_is_even(tiny_target):
    """Trainable experts: in the general path expert e's gradient is Jᵀ(w_e·g), so the experts stay
    identical exactly while every token weighs them equally (zero router). The one pass then gives each
    expert the same gradient as the general path; a router that weighs them unequally falls back."""
    drafter = load_drafter(tiny_target, GLM)
    freeze(drafter, ["embed_tokens.*", "*.shared_head.head.*"])  # routed experts trainable
    mlp = drafter.layers[0].mtp_block.mlp
    passes = _mlp_passes(drafter)
    ref = _unroll_loss(drafter, shortcuts=False)
    new = _unroll_loss(drafter, shortcuts=True)
    assert passes["routed"] == 3  # the reference's; the one pass did not call the experts module
    _assert_same(ref, new)
    for g in (ref[1], new[1]):  # both experts get the same gradient on both paths
        for w in ("gate_up_proj", "down_proj"):
            gw = g[f"layers.0.mtp_block.mlp.experts.{w}"]
            assert gw[0].abs().sum() > 0 and torch.equal(gw[0], gw[1])
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    opt.step()  # with the one pass's gradients
    assert torch.equal(mlp.experts.gate_up_proj[0], mlp.experts.gate_up_proj[1])
    assert torch.equal(mlp.experts.down_proj[0], mlp.experts.down_proj[1])

    with torch.no_grad():  # a trained router: uneven weights, the experts' gradients differ
        mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=torch.Generator().manual_seed(4)))
    ref = _unroll_loss(drafter, shortcuts=False)
    n = passes["routed"]
    new = _unroll_loss(drafter, shortcuts=True)
    assert passes["routed"] == n + 3  # fell back
    _assert_same(ref, new)
    gw = new[1]["layers.0.mtp_block.mlp.experts.down_proj"]
    assert not torch.allclose(gw[0], gw[1])
