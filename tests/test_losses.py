"""Losses against direct formulas (double precision, explicit loops), gradient signs, limits."""
import math

import pytest
import torch

from drafter.training import losses as L
def direct(pl, ql):
    """Direct per-row formulas in float64 with Python loops over the vocabulary."""
    out = []
    for a, b in zip(pl.double(), ql.double()):
        p = [math.exp(x) for x in a.tolist()]
        zp = sum(p)
        p = [x / zp for x in p]
        q = [math.exp(x) for x in b.tolist()]
        zq = sum(q)
        q = [x / zq for x in q]
        kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
        tv = 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))
        alpha = sum(min(pi, qi) for pi, qi in zip(p, q))
        out.append({"kl": kl, "tv": tv, "alpha": alpha, "l1": 2 * tv, "logq": [math.log(x) for x in q]})
    return out


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)  # independent of test order
    p = torch.randn(6, 11, generator=g) * 2
    q = torch.randn(6, 11, generator=g) * 2
    mask = torch.tensor([1, 1, 0, 1, 1, 0])
    tok = torch.randint(0, 11, (6,), generator=g)
    return p, q, mask, tok


def mmean(vals, mask):
    m = mask.tolist()
    return sum(v * w for v, w in zip(vals, m)) / sum(m)


def test_kl_tv_alpha_match_direct(batch):
    p, q, mask, _ = batch
    d = direct(p, q)
    assert L.kl(q, p, mask)[0].item() == pytest.approx(mmean([r["kl"] for r in d], mask), rel=1e-5)
    assert L.tv(q, p, mask)[0].item() == pytest.approx(mmean([r["tv"] for r in d], mask), rel=1e-5)
    assert L.lk_alpha(q, p, mask)[0].item() == pytest.approx(mmean([-math.log(r["alpha"]) for r in d], mask), rel=1e-5)
    assert L.acceptance(q, p).tolist() == pytest.approx([r["alpha"] for r in d], rel=1e-5)
    for r in d:
        assert r["alpha"] == pytest.approx(1 - r["tv"], abs=1e-12)


def test_hybrid_matches_direct(batch):
    p, q, mask, _ = batch
    d = direct(p, q)
    eta = 3.0
    want = [math.exp(-eta * r["alpha"]) * r["kl"] + (1 - math.exp(-eta * r["alpha"])) * r["tv"] for r in d]
    loss, stats = L.lk_hybrid(q, p, mask, eta=eta)
    assert loss.item() == pytest.approx(mmean(want, mask), rel=1e-5)
    assert stats["lambda"] == pytest.approx(mmean([math.exp(-eta * r["alpha"]) for r in d], mask), rel=1e-5)


def test_hybrid_limits(batch):
    p, q, mask, _ = batch
    assert L.lk_hybrid(q, p, mask, eta=0.0)[0].item() == pytest.approx(L.kl(q, p, mask)[0].item(), rel=1e-6)
    alpha_min = float(L.acceptance(q, p)[mask.bool()].min())
    eta = 30.0 / alpha_min  # λ = exp(−η·α) ≤ e^-30 on every row
    assert L.lk_hybrid(q, p, mask, eta=eta)[0].item() == pytest.approx(L.tv(q, p, mask)[0].item(), rel=1e-6)


def test_ce_and_ce_l1_match_direct(batch):
    p, q, mask, tok = batch
    d = direct(p, q)
    ce_want = mmean([-r["logq"][t] for r, t in zip(d, tok.tolist())], mask)
    assert L.ce(q, tok, mask)[0].item() == pytest.approx(ce_want, rel=1e-5)
    l1_want = mmean([r["l1"] for r in d], mask)
    got = L.ce_l1(q, p, tok, mask, ce_w=0.1, l1_w=0.9)[0].item()
    assert got == pytest.approx(0.1 * ce_want + 0.9 * l1_want, rel=1e-5)


@pytest.mark.parametrize("name", ["kl", "tv", "lk_alpha", "lk_hybrid"])
def test_gradient_step_raises_acceptance(batch, name):
    """One small step against the gradient lowers the loss and raises α; no gradient to the target."""
    p, q, mask, _ = batch
    q = q.clone().requires_grad_(True)
    pt = p.clone().requires_grad_(True)
    loss, _ = L.LOSSES[name](q, pt, mask)
    loss.backward()
    assert pt.grad is None or torch.count_nonzero(pt.grad) == 0
    assert q.grad[mask == 0].abs().max() == 0  # masked rows get no gradient
    with torch.no_grad():
        q2 = q - 0.05 * q.grad / q.grad.norm()
        a0 = (L.acceptance(q, p) * mask).sum()
        a1 = (L.acceptance(q2, p) * mask).sum()
        assert L.LOSSES[name](q2, p, mask)[0] < loss
    assert a1 > a0


def test_ce_gradient_sign(batch):
    _, q, mask, tok = batch
    q = q.clone().requires_grad_(True)
    L.ce(q, tok, mask)[0].backward()
    rows = mask.nonzero().flatten()
    assert (q.grad[rows, tok[rows]] < 0).all()  # raising the data token's logit lowers the loss


def test_identical_is_zero_and_alpha_one(batch):
    p, _, mask, _ = batch
    for name in ("kl", "tv", "lk_alpha", "lk_hybrid"):
        loss, stats = L.LOSSES[name](p.clone(), p, mask)
        assert loss.item() == pytest.approx(0.0, abs=1e-6)
        assert stats["alpha"] == pytest.approx(1.0, abs=1e-6)


def test_stable_in_low_precision_and_extreme_logits():
    p = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.bfloat16)
    q = torch.tensor([[-1e4, 0.0, 1e4]], dtype=torch.bfloat16)
    for name in ("kl", "tv", "lk_alpha", "lk_hybrid"):
        loss, _ = L.LOSSES[name](q, p)
        assert torch.isfinite(loss) and loss.dtype == torch.float32


def test_position_weights_and_errors():
    w = L.position_weights(4, gamma=4.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])
    with pytest.raises(ValueError, match="gamma"):
        L.position_weights(3, gamma=0)
    with pytest.raises(ValueError, match="differ in shape"):
        L.kl(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_hybrid_equals_the_autograd_reference(monkeypatch, temperature):
    """lk_hybrid's fused rows (value and draft-logit gradient worked out in one chunked pass) against the
    reference autograd computation (fused=False): the training step's speed-up keeps the loss and its
    gradient within float32 rounding, across chunk boundaries, masked rows, and a row where q = p."""
    g = torch.Generator().manual_seed(1)
    n, v = 37, 503
    monkeypatch.setattr(L, "CHUNK_ROWS", 8)  # 5 chunks, the last one partial
    p = torch.randn(n, v, generator=g) * 3
    q0 = torch.randn(n, v, generator=g) * 3
    q0[5] = p[5]  # identical rows: sign(q − p) = 0 everywhere
    mask = (torch.rand(n, generator=g) > 0.2).long()
    grads, vals = {}, {}
    for fused in (True, False):
        q = q0.clone().requires_grad_(True)
        loss, st = L.lk_hybrid(q, p, mask, eta=3.0, temperature=temperature, fused=fused)
        (2.5 * loss).backward()
        vals[fused], grads[fused] = (loss.item(), st["alpha"], st["lambda"]), q.grad
    assert vals[True] == pytest.approx(vals[False], rel=2e-6)
    assert torch.allclose(grads[True], grads[False], rtol=1e-4, atol=1e-9)
    assert grads[True][mask == 0].abs().max() == 0
    # under bf16 autocast, as `train.dtype: bfloat16` runs it: bf16 logits in, a bf16 gradient out
    qb = q0.to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lb, _ = L.lk_hybrid(qb, p.to(torch.bfloat16), mask, temperature=temperature)
    lb.backward()
    qr = q0.to(torch.bfloat16).requires_grad_(True)
    lr_, _ = L.lk_hybrid(qr, p.to(torch.bfloat16), mask, temperature=temperature, fused=False)
    lr_.backward()
    assert qb.grad.dtype == torch.bfloat16 and lb.item() == pytest.approx(lr_.item(), rel=1e-5)
    assert torch.allclose(qb.grad.float(), qr.grad.float(), rtol=1e-2, atol=1e-6)


def test_fused_hybrid_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"draft logits \(3, 5\) and target logits \(3, 4\) differ in shape"):
        L.lk_hybrid(torch.zeros(3, 5), torch.zeros(3, 4))


def test_loss_chunks_are_sized_per_device(monkeypatch):
    """8 rows on the CPU (cache-sized); on a GPU (and meta) rows up to 128 MiB per float32 temporary — the
    whole window at a draft vocabulary of 8,192, 259 rows at DeepSeek-V3's 129,280; one chunk or many, the same
    loss and gradient."""
    assert L.chunk_rows("cpu", 49_152) == 8
    assert L.chunk_rows("cuda", 8192) == 4096 and L.chunk_rows("meta", 8192) == 4096
    assert L.chunk_rows("cuda", 129_280) == 259 and L.chunk_rows("cuda", 10 ** 9) == 8
    g = torch.Generator().manual_seed(3)
    p, q0 = torch.randn(37, 503, generator=g) * 3, torch.randn(37, 503, generator=g) * 3
    out = {}
    for rows in (8, 37):
        monkeypatch.setattr(L, "chunk_rows", lambda device_type, vocab, rows=rows: rows)
        q = q0.clone().requires_grad_(True)
        loss, _ = L.lk_hybrid(q, p)
        loss.backward()
        out[rows] = (loss.detach(), q.grad)
    torch.testing.assert_close(out[37][0], out[8][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[37][1], out[8][1], rtol=1e-5, atol=1e-9)
