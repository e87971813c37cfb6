"""FP8 quantizer (drafter.quant.fp8) against hand-computed bytes and the independent numpy reference;
the release self-check on synthetic V3/V4 releases; tamper detection; the drop-in writer."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafter.quant import fp8 as F
from drafter.quant.dropin import DROPIN_NAME, build_dropin, check_dropin
from tests.helpers.fp8_releases import make_v3_release, make_v4_release
from drafter.quant.reference import quantize_ref
from drafter.quant.release import open_release
from drafter.quant.verify import check_tensor, self_check


def _bytes(q):
    return q.view(torch.uint8)


def _block(fill=0.0):
    return torch.full((32, 32), fill, dtype=torch.float32)


# ---------------------------------------------------------------------- golden bytes


def test_amax_exactly_448_times_power_of_two():
    w = _block()
    w[0, 5] = 448.0 * 2.0 ** -6
    w[3, 3] = -448.0 * 2.0 ** -6
    q, s = F.quantize(w, (32, 32), "ue8m0")
    assert s.dtype == torch.float8_e8m0fnu and _bytes(s).item() == 127 - 6  # scale exactly 2^-6
    assert _bytes(q)[0, 5].item() == 0x7E and _bytes(q)[3, 3].item() == 0xFE
    assert F.dequantize(q, s, (32, 32))[0, 5].item() == 7.0


def test_one_ulp_above_rounds_the_scale_up():
    w = _block()
    w[1, 1] = float(np.nextafter(np.float32(448.0 * 2.0 ** -6), np.float32(np.inf)))
    q, s = F.quantize(w, (32, 32), "ue8m0")
    assert _bytes(s).item() == 127 - 5  # ceil: 2^-5, never the nearest power (2^-6)
    assert _bytes(q)[1, 1].item() == 0x76  # 224 = 1.75·2^7


def test_all_zero_block_uses_the_amax_floor():
    q, s = F.quantize(_block(), (32, 32), "ue8m0")
    assert _bytes(s).item() == 127 - 22  # 2^ceil(log2(1e-4/448)) = 2^-22
    assert (_bytes(q) == 0).all()
    q, s = F.quantize(_block(), (32, 32), "float32")
    assert s.item() == np.float32(np.float32(1e-4) / np.float32(448.0))


def test_subnormals_round_half_to_even():
    w = _block()
    w[0, 0] = 448.0  # scale 1
    vals = {1: 2.0 ** -9, 2: 2.0 ** -10, 3: 1.5 * 2.0 ** -9, 4: 3.5 * 2.0 ** -9, 5: -(2.0 ** -9), 6: 2.0 ** -6}
    for c, v in vals.items():
        w[0, c] = v
    q, s = F.quantize(w, (32, 32), "ue8m0")
    assert _bytes(s).item() == 127
    got = [_bytes(q)[0, c].item() for c in vals]
    assert got == [0x01, 0x00, 0x02, 0x04, 0x81, 0x08]


def test_clamp_at_448():
    # amax values where amax / (amax/448) exceeds 448 in float32: must clamp to 448 (0x7E), never NaN
    a = torch.linspace(1.0, 2.0, 200001, dtype=torch.float32)
    over = a[a / (a / 448.0) > 448.0]
    assert over.numel() > 0
    w = _block()
    w[0, 0], w[0, 1] = over[0], -over[0]
    q, s = F.quantize(w, (32, 32), "float32")
    assert (_bytes(q)[0, 0].item(), _bytes(q)[0, 1].item()) == (0x7E, 0xFE)
    qr, sr = quantize_ref(w.numpy(), (32, 32), "float32")
    assert (qr[0, 0], qr[0, 1]) == (0x7E, 0xFE) and sr[0, 0] == s[0, 0].item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected_with_the_tensor_name(bad):
    w = torch.randn(40, 70)
    w[3, 65] = bad
    with pytest.raises(F.FP8Error, match=r"mtp\.0\.attn\.wq\.weight.*1 NaN/inf"):
        F.quantize(w, (32, 32), "ue8m0", name="mtp.0.attn.wq.weight")


# ---------------------------------------------------------------------- two implementations agree


@pytest.mark.parametrize("rule,block", [("ue8m0", (32, 32)), ("float32", (128, 128)), ("ue8m0", (128, 128))])
@pytest.mark.parametrize("shape", [(64, 64), (300, 200), (33, 257), (1, 5)])
def test_matches_the_reference_byte_for_byte(rule, block, shape):
    g = torch.Generator().manual_seed(hash((rule, shape)) % 1000)
    # magnitudes over 12 decades so blocks hit the floor, subnormals and every exponent
    w = torch.randn(shape, generator=g) * torch.logspace(-9, 3, shape[1])
    q, s = F.quantize(w, block, rule)
    qr, sr = quantize_ref(w.numpy(), block, rule)
    assert np.array_equal(_bytes(q).numpy(), qr)
    assert np.array_equal(_bytes(s).numpy() if rule == "ue8m0" else s.numpy(), sr)
    assert tuple(s.shape) == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def test_padding_is_for_the_amax_only():
    w = torch.randn(40, 40)
    q, s = F.quantize(w, (32, 32), "float32")
    assert q.shape == (40, 40) and s.shape == (2, 2)
    assert s[1, 1].item() == pytest.approx(float(w[32:, 32:].abs().max()) / 448, rel=1e-6)
    d = F.dequantize(q, s, (32, 32))
    assert float((d - w).norm() / w.norm()) < 0.04


# ---------------------------------------------------------------------- self-check on the fixtures


def _expected_blocks(rel):
    return sum(-(-rel.info[k].shape[0] // rel.block[0]) * -(-rel.info[k].shape[1] // rel.block[1]) for k in rel.fp8)


def test_self_check_v3_fixture(tmp_path):
    d, _ = make_v3_release(tmp_path / "v3")
    rel = open_release(d)
    assert (rel.rule, rel.block) == ("float32", (128, 128))
    assert all(s.endswith("_scale_inv") for s in rel.fp8.values()) and len(rel.fp8) == 13
    t = self_check(rel).totals
    assert t["differ"] == 0 and t["identical"] + t["edge"] == t["total"] == _expected_blocks(rel)


def test_self_check_v4_fixture(tmp_path):
    d, _ = make_v4_release(tmp_path / "v4")
    rel = open_release(d)
    assert (rel.rule, rel.block) == ("ue8m0", (32, 32))
    assert {k.split(".")[1] for k in rel.drafter_keys} == {"0", "1", "2"}
    assert all(s.endswith(".scale") for s in rel.fp8.values())
    assert len(rel.other_scales) == 3 * 2 * 3  # MXFP4 experts: kept, not FP8
    r = self_check(rel)
    t = r.totals
    assert t["differ"] == 0 and t["identical"] + t["edge"] == t["total"] == _expected_blocks(rel)
    wq = next(c for c in r.tensors if c.name == "mtp.0.attn.wq.weight")
    assert wq.edge >= 1  # the planted block whose maximum rounds down to 224


def _tamper(rel_dir, name, fn):
    idx = json.loads((rel_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = rel_dir / idx[name]
    ts = load_file(str(shard))
    b = ts[name].view(torch.uint8).clone()
    fn(b)
    ts[name] = b.view(torch.float8_e4m3fn)
    save_file(ts, str(shard))


@pytest.mark.parametrize("how", ["lower-max", "nan"])
def test_tampered_byte_is_detected_and_named(tmp_path, how):
    """A byte no rule-following writer could have produced: the block maximum lowered (V3: the float32
    rule puts every block maximum at exactly 448), or a NaN byte (V4)."""
    if how == "lower-max":
        d, _ = make_v3_release(tmp_path / "v3")
        name, bs, blk_idx = "model.layers.1.mlp.experts.1.down_proj.weight", 128, (1, 1)
    else:
        d, _ = make_v4_release(tmp_path / "v4")
        name, bs, blk_idx = "mtp.1.attn.wo.weight", 32, (1, 2)
    assert not self_check(open_release(d)).failed
    r0, c0 = blk_idx[0] * bs, blk_idx[1] * bs

    def tamper(b):
        blk = b[r0:r0 + bs, c0:c0 + bs]
        if how == "nan":
            blk[3, 5] = 0x7F
        else:
            i = int(blk.bitwise_and(0x7F).flatten().argmax())
            assert int(blk.flatten()[i]) & 0x7F == 0x7E  # the maximum sits at 448
            blk[i // blk.shape[1], i % blk.shape[1]] = (int(blk.flatten()[i]) & 0x80) | 0x70
    _tamper(d, name, tamper)
    bad = self_check(open_release(d)).failed
    assert [c.name for c in bad] == [name]
    assert bad[0].differ == 1 and bad[0].first_differ == blk_idx


def test_wrong_rule_is_detected(tmp_path):
    d, _ = make_v3_release(tmp_path / "v3")
    rel = open_release(d)
    name = sorted(rel.fp8)[0]
    with safe_open(str(rel.path_of(name)), "pt") as f:
        q, s = f.get_tensor(name), f.get_tensor(rel.fp8[name])
    with pytest.raises(F.FP8Error, match="scale dtype"):
        check_tensor(q, s, rel.block, "ue8m0", name)
    # the same bytes read as 64×64 blocks: shape mismatch named
    with pytest.raises(F.FP8Error, match=name):
        check_tensor(q, s, (64, 64), "float32", name)


# ---------------------------------------------------------------------- the drop-in


def _trained_from_release(rel, tmp_path, change):
    """Float weights = the release dequantized; tensors whose name contains one of ``change`` moved."""
    out = {}
    for k in rel.drafter_keys:
        if k in rel.fp8.values() or k in rel.other_scales or k in rel.other_scales.values():
            continue
        with safe_open(str(rel.path_of(k)), "pt") as f:
            t = f.get_tensor(k)
            t = F.dequantize(t, _scale(rel, k), rel.block) if k in rel.fp8 else t.float()
        if any(c in k for c in change):
            t = t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(len(k)))
        out[k] = t.contiguous()
    p = tmp_path / "trained.safetensors"
    save_file(out, str(p))
    return p


def _scale(rel, k):
    with safe_open(str(rel.path_of(rel.fp8[k])), "pt") as f:
        return f.get_tensor(rel.fp8[k])


@pytest.mark.parametrize("maker", [make_v3_release, make_v4_release])
def test_dropin_index_and_bytes(tmp_path, maker):
    d, _ = maker(tmp_path / "rel")
    rel = open_release(d)
    trained = _trained_from_release(rel, tmp_path, change=("attn", "norm", ".e_proj", "hc_"))
    doc = build_dropin(rel, trained, tmp_path / "fp8")
    chk = check_dropin(rel, tmp_path / "fp8")
    assert chk["ok"], chk["problems"]
    idx = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    rwm = rel.weight_map
    assert set(idx) == set(rwm)
    assert {k for k, v in idx.items() if v == DROPIN_NAME} == set(rel.drafter_keys)
    assert all(idx[k] == rwm[k] for k in idx if k not in rel.drafter_keys)
    tensors = doc["tensors"]
    # moved FP8 weights were quantized with the release's rule, with small error; frozen ones kept
    moved_fp8 = [k for k in rel.fp8 if "attn" in k]
    assert moved_fp8 and all(tensors[k]["action"].startswith("fp8") for k in moved_fp8)
    assert all(0 < tensors[k]["fp8_rel_error"] < 0.05 for k in moved_fp8)
    frozen = [k for k in rel.drafter_keys if "experts" in k and k in tensors and not k.startswith("mtp.") or
              ".ffn.experts." in k and k in tensors]
    assert frozen and all(tensors[k]["action"].startswith("kept") for k in frozen)
    assert chk["kept_hash_equal"] == chk["kept"] > 0
    # the drop-in's FP8 tensors pass the self-check against our own rule
    with safe_open(str(tmp_path / "fp8" / DROPIN_NAME), "pt") as f:
        for k in moved_fp8:
            c = check_tensor(f.get_tensor(k), f.get_tensor(rel.fp8[k]), rel.block, rel.rule, k)
            assert c.differ == 0


def test_check_dropin_catches_a_wrong_index_and_changed_kept_bytes(tmp_path):
    d, _ = make_v4_release(tmp_path / "rel")
    rel = open_release(d)
    trained = _trained_from_release(rel, tmp_path, change=("attn",))
    build_dropin(rel, trained, tmp_path / "fp8")
    fp8 = tmp_path / "fp8"
    ip = fp8 / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    idx["weight_map"]["head.weight"] = DROPIN_NAME
    ip.write_text(json.dumps(idx))
    chk = check_dropin(rel, fp8)
    assert not chk["ok"] and any("head.weight" in p for p in chk["problems"])
    # a kept tensor's bytes altered
    shutil.rmtree(fp8)
    build_dropin(rel, trained, fp8)
    ts = load_file(str(fp8 / DROPIN_NAME))
    k = "mtp.0.ffn.experts.0.w1.weight"
    ts[k] = ts[k].clone()
    ts[k][0, 0] ^= 1
    save_file(ts, str(fp8 / DROPIN_NAME))
    chk = check_dropin(rel, fp8)
    assert not chk["ok"] and any(k in p and "byte-identical" in p for p in chk["problems"])


@pytest.mark.parametrize("rule,block", [("ue8m0", (32, 32)), ("float32", (128, 128))])
def test_compiled_path_gives_the_same_bytes_as_eager(monkeypatch, rule, block):
    """Large tensors go through torch.compile: bytes and scales must equal the eager ops' (and the
    reference's), NaN still named."""
    from drafter.quant import fp8 as F
    from drafter.quant.reference import quantize_ref

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 384, generator=g) * torch.logspace(-6, 2, 384)).to(torch.bfloat16)
    q_eager, s_eager = F.quantize(w, block, rule)
    monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", 1)
    q, s = F.quantize(w, block, rule)
    assert not F._compile_broken, F._compile_broken
    assert torch.equal(q.view(torch.uint8), q_eager.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), s_eager.view(torch.uint8))
    q_ref, s_ref = quantize_ref(w.float().numpy(), block, rule)
    assert (q.view(torch.uint8).numpy() == q_ref).all()
    assert torch.equal(F.dequantize(q, s, block), F._dequantize_blocks(q_eager, F.scale_float(s_eager), *block))
    bad = w.clone()
    bad[7, 9] = float("nan")
    with pytest.raises(F.FP8Error, match="big.weight"):
        F.quantize(bad, block, rule, name="big.weight")


# ---------------------------------------------------------------------- exact division on every device
# CUDA divides by a Python scalar (or a 0-dim CPU tensor) as a multiplication by its float32 reciprocal,
# and Triton's `/` is approximate: a byte-verified rule must divide exactly wherever it runs. These tests
# pin values where `x * (1/d)` and `x / d` round differently, and emulate CUDA's scalar division on the CPU.


class CudaScalarDivision(torch.utils._python_dispatch.TorchDispatchMode):
    """What ``div_true_kernel_cuda`` does with a CPU-scalar divisor (a Python number or a 0-dim CPU
    tensor): ``a * (1/b)``, the reciprocal computed in the op math type (float32 for float32/bf16/fp16)."""

    DIV = (torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar, torch.ops.aten.div_.Tensor, torch.ops.aten.div_.Scalar)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DIV and not kwargs and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            a, b = args[:2]
            if isinstance(b, torch.Tensor) and b.dim() == 0 and b.device.type == "cpu":
                b = b.item()
            if isinstance(b, (int, float)):
                op = np.float64 if a.dtype == torch.float64 else np.float32
                inv = float(op(1.0) / op(b))
                mul = torch.ops.aten.mul_.Tensor if func in self.DIV[2:] else torch.ops.aten.mul.Tensor
                return mul(a, inv)
        return func(*args, **kwargs)


def _f32_div(a, b):
    """The correctly rounded float32 quotient: float64 division of two float32 values, rounded once."""
    return (torch.as_tensor(a, dtype=torch.float32).double() / torch.as_tensor(b, dtype=torch.float32).double()).float()


def _amax_where_reciprocal_differs(n=64):
    """float32 ``amax`` in (1, 1.0625] where ``amax * fl(1/448) != fl(amax/448)`` (about 40 % of them)."""
    a = 1.0 + torch.arange(1, 4097, dtype=torch.float32) * 2.0 ** -16
    inv = torch.tensor(1.0) / torch.tensor(448.0)
    hit = a[_f32_div(a, 448.0) != a * inv]
    assert hit.numel() >= n
    return hit[:n]


# E4M3 (fn) rounding midpoints between adjacent normal values, below 448
_E4M3_MIDPOINTS = torch.tensor([(17 + 2 * j) / 16 * 2.0 ** e for e in range(-6, 8) for j in range(8)], dtype=torch.float32)
_E4M3_MIDPOINTS = _E4M3_MIDPOINTS[_E4M3_MIDPOINTS < 448]


def _e4m3_cases(n=32):
    """``(amax, x, byte)``: ``x ≤ amax`` where, with ``s = fl(amax/448)``, ``fl(x/s)`` and ``fl(x·fl(1/s))``
    straddle or sit on an E4M3 rounding midpoint, so the exact quotient and the reciprocal product give
    different E4M3 bytes; ``byte`` is the exact quotient's (the independent numpy encoder). Both kinds:
    the exact quotient exactly on the midpoint (ties to even) and the reciprocal product exactly on it."""
    from drafter.quant.reference import e4m3_encode

    on_exact, on_recip = [], []
    for am in _amax_where_reciprocal_differs(16):
        s = _f32_div(am, 448.0)
        sinv = torch.tensor(1.0) / s
        x0 = (_E4M3_MIDPOINTS.double() * s.double()).float()
        xs = (x0.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)).flatten().view(torch.float32)
        xs = xs[xs <= am]
        exact, recip = _f32_div(xs, s), xs * sinv
        be, br = e4m3_encode(exact.numpy()), e4m3_encode(recip.numpy())
        for i in np.nonzero(be != br)[0]:
            case = (float(am), float(xs[i]), int(be[i]))
            if bool(torch.isin(exact[i:i + 1], _E4M3_MIDPOINTS)):
                on_exact.append(case)
            elif bool(torch.isin(recip[i:i + 1], _E4M3_MIDPOINTS)):
                on_recip.append(case)
    assert len(on_exact) >= n // 2 and len(on_recip) >= n // 2
    return on_exact[: n // 2] + on_recip[: n // 2]


def _one_block_each(values):
    """A ``32×(32·n)`` float32 weight, block ``j`` holding ``values[j]`` = ``(amax, x)`` (x, −x at two spots)."""
    w = torch.zeros(32, 32 * len(values))
    for j, (am, x) in enumerate(values):
        w[0, 32 * j] = am
        if x is not None:
            w[5, 32 * j + 7], w[9, 32 * j + 30] = x, -x
    return w


def _quantize_on(path, monkeypatch, w, block, rule):
    if path == "compiled":
        monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", 1)
        out = F.quantize(w, block, rule)
        assert not F._compile_broken, F._compile_broken
        assert F._quantize_blocks in F._compiled
        return out
    if path == "cuda-emulated":
        with CudaScalarDivision():
            return F.quantize(w, block, rule)
    return F.quantize(w, block, rule)


PATHS = ["eager", "compiled", "cuda-emulated"]


@pytest.mark.parametrize("path", PATHS)
def test_float32_scale_is_the_correctly_rounded_quotient(monkeypatch, path):
    amax = _amax_where_reciprocal_differs(64)
    w = _one_block_each([(float(a), None) for a in amax])
    _, s = _quantize_on(path, monkeypatch, w, (32, 32), "float32")
    want = _f32_div(amax, 448.0)
    assert torch.equal(s[0].view(torch.int32), want.view(torch.int32))
    assert (want != amax * (torch.tensor(1.0) / torch.tensor(448.0))).all()  # every one discriminates


@pytest.mark.parametrize("path", PATHS)
def test_e4m3_byte_is_the_exact_quotients_on_a_rounding_midpoint(monkeypatch, path):
    cases = _e4m3_cases(32)
    w = _one_block_each([(am, x) for am, x, _ in cases])
    q, s = _quantize_on(path, monkeypatch, w, (32, 32), "float32")
    qb = _bytes(q)
    assert torch.equal(s[0], _f32_div(torch.tensor([c[0] for c in cases]), 448.0))
    for j, (_, _, byte) in enumerate(cases):
        assert (qb[5, 32 * j + 7].item(), qb[9, 32 * j + 30].item()) == (byte, byte | 0x80), j


def _bf16_weight():
    g = torch.Generator().manual_seed(11)
    return (torch.randn(256, 384, generator=g) * torch.logspace(-6, 2, 384)).to(torch.bfloat16)


@pytest.mark.parametrize("rule,block", [("float32", (128, 128)), ("float32", (32, 32)), ("ue8m0", (32, 32)),
                                        ("ue8m0", (128, 128))])
def test_cuda_scalar_division_gives_the_same_bytes(monkeypatch, rule, block):
    """Under CUDA's scalar division (emulated) quantize writes the same bytes; the old formulation
    (``amax / 448`` with a Python scalar) would not for the float32 rule, so the emulation bites."""
    cases = _e4m3_cases(32)
    weights = [_bf16_weight(), _one_block_each([(am, x) for am, x, _ in cases])]

    def both(w):
        q, s = F.quantize(w, block, rule)
        with CudaScalarDivision():
            q2, s2 = F.quantize(w, block, rule)
        return (_bytes(q), _bytes(q2)), (s.view(torch.uint8), s2.view(torch.uint8))

    for w in weights:
        (q, q2), (s, s2) = both(w)
        assert torch.equal(q, q2) and torch.equal(s, s2)
    monkeypatch.setattr(F, "div_e4m3_max", lambda a: a / F.E4M3_MAX)  # the old formulation
    (q, q2), (s, s2) = both(weights[1])
    if rule == "float32":
        assert not torch.equal(s, s2)
    else:  # the UE8M0 ceil does not move under a reciprocal (see the next test): same bytes even so
        assert torch.equal(q, q2) and torch.equal(s, s2)


def test_ue8m0_exponent_is_the_same_under_reciprocal_division():
    """Every float32 amax of [256, 512) (the binade holding 448; others are it times 2^k, exactly):
    the ceil exponent of ``fl(amax/448)`` equals that of ``fl(amax·fl(1/448))`` though ~55 % of the
    quotients differ (e.g. 447.99997: 1 − 2^-24 exactly, 1.0 by the reciprocal; both ceil to 2^0)."""
    a = torch.arange(0x43800000, 0x44000000, dtype=torch.int32).view(torch.float32)
    recip = a * (torch.tensor(1.0) / torch.tensor(448.0))
    bits = recip.view(torch.int32)
    e_recip = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    assert torch.equal(F.ue8m0_exponent(a), e_recip)
    assert (recip != _f32_div(a, 448.0)).sum() > a.numel() // 2


# ---------------------------------------------------------------------- meta tensors (no CPU tensor inside)


@pytest.mark.parametrize("rule", ["ue8m0", "float32"])
@pytest.mark.parametrize("shape", [(64, 96), (33, 70), (1, 5)])
@pytest.mark.parametrize("compile_min", [None, 1])
def test_quantize_and_dequantize_on_meta(monkeypatch, rule, shape, compile_min):
    if compile_min is not None:  # even at compile size, meta (like CUDA) runs the exact eager ops
        monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", compile_min)
    w = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    q, s = F.quantize(w, (32, 32), rule, name="meta.weight")
    assert (q.device.type, q.dtype, tuple(q.shape)) == ("meta", torch.float8_e4m3fn, shape)
    assert (s.device.type, s.dtype, tuple(s.shape)) == ("meta", F.SCALE_DTYPES[rule], F.n_blocks(shape, (32, 32)))
    d = F.dequantize(q, s, (32, 32), name="meta.weight")
    assert (d.device.type, d.dtype, tuple(d.shape)) == ("meta", torch.float32, shape)
    assert F._fast(F._quantize_blocks, w) is None


def test_only_the_cpu_is_compiled(monkeypatch):
    monkeypatch.setattr(F, "COMPILE_MIN_NUMEL", 1)
    assert F.COMPILE_DEVICES == ("cpu",)
    assert F._fast(F._dequantize_blocks, torch.empty(32, 32, device="meta")) is None
    assert F.COMPILE_OPTIONS["cpp.enable_unsafe_math_opt_flag"] is False


@pytest.mark.parametrize("rule", ["ue8m0", "float32"])
@pytest.mark.parametrize("shape", [(64, 96), (33, 70)])
def test_verify_check_tensor_on_meta(rule, shape):
    """The byte verification (drafter/quant/verify.py: dequantize, re-quantize, compare per block) with its
    inputs on `meta`: no tensor made on the CPU inside (its counts are read through the value stand-ins)."""
    from drafter.quant.verify import check_tensor
    from tests.helpers.meta_device import MetaValues

    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(F.n_blocks(shape, (32, 32)), dtype=F.SCALE_DTYPES[rule], device="meta")
    with MetaValues():
        res = check_tensor(q, s, (32, 32), rule, name="meta.weight")
    assert res.blocks == F.n_blocks(shape, (32, 32))[0] * F.n_blocks(shape, (32, 32))[1]


def test_verify_check_tensor_made_on_the_cpu_fails_on_meta(monkeypatch):
    """The meta check can fail: a scale made on the CPU inside check_tensor is refused on meta."""
    from drafter.quant import verify
    from tests.helpers.meta_device import MetaValues

    monkeypatch.setattr(verify, "_per_block_any", lambda mask, block: F._blocks(mask.cpu().to(torch.uint8), block).amax(dim=(1, 3)).bool())
    q = torch.empty(64, 64, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(2, 2, dtype=torch.float32, device="meta")
    with MetaValues(), pytest.raises((RuntimeError, NotImplementedError), match="meta|device"):
        verify.check_tensor(q, s, (32, 32), "float32", name="meta.weight")
