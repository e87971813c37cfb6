"""``train.compile`` (drafter/training/compiled.py): the drafter's layers compiled by torch.compile (Inductor, the
real backend: about a minute of compiling on 2 cores) give the eager step's loss and gradients within float
rounding; train() compiles when asked (there with the ``aot_eager`` backend: Dynamo's graphs, guards and
recompiles for a second window length and the held-out checks, without Inductor's minutes of code generation),
records it, and writes checkpoints under the eager names."""
from __future__ import annotations

import copy

import pytest
import torch

from drafter.core.config import TrainConfig
from drafter.data.windows import Window
from drafter.models import EmbeddedGlm4MoeLayout, freeze, load_drafter
from drafter.models.target import read_tensor
from drafter.training import losses as L
from drafter.training.compiled import compile_layers
from drafter.training.loop import batch_loss, train


def windows(n: int, T: int, vocab: int, hidden: int, seed: int) -> list[Window]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 4:] = True  # the first quarter is the prompt
        out.append(Window(f"r{seed}-{i}", 0, torch.randint(0, vocab, (T,), generator=g), mask, torch.randn(T, hidden, generator=g)))
    return out


def cfg(**kw) -> TrainConfig:
    base = dict(loss="lk_hybrid", k_steps=2, window=48, micro_batch=2, max_steps=3, warmup_steps=1, lr=1e-3,
                eval_every=3, checkpoint_every=3, eval_windows=2, freeze=["embed_tokens.*"])
    return TrainConfig(**(base | kw))


@pytest.mark.slow
def test_compiled_layers_give_the_eager_loss_and_gradients(tiny_target):
    eager = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    freeze(eager, cfg().freeze)
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled) == 1
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # in place: no `_orig_mod.` names
    head = read_tensor(tiny_target, "lm_head.weight", torch.float32)
    V, H = head.shape
    weights = L.position_weights(2, cfg().gamma)
    wins = windows(2, 48, V, H, seed=1)
    got = {}
    for name, d in (("eager", eager), ("compiled", compiled)):
        loss, stats = batch_loss(d, head, wins, cfg(), weights)
        loss.backward()
        got[name] = (float(loss.detach()), [s["alpha"] for s in stats],
                     {n: p.grad for n, p in d.named_parameters() if p.grad is not None})
    (le, ae, ge), (lc, ac, gc) = got["eager"], got["compiled"]
    assert lc == pytest.approx(le, rel=1e-5) and ac == pytest.approx(ae, abs=1e-5)
    assert ge.keys() == gc.keys() and len(ge) > 5
    for n in ge:  # float32: fused element-wise work reorders a few roundings, nothing more
        scale = ge[n].abs().max().clamp_min(1e-12)
        assert float((ge[n] - gc[n]).abs().max() / scale) < 1e-4, n


@pytest.mark.slow
def test_train_compiles_when_asked(tiny_target, tmp_path, monkeypatch):
    import drafter.training.loop as loop

    monkeypatch.setattr(loop, "compile_layers", lambda d: compile_layers(d, backend="aot_eager"))
    head = read_tensor(tiny_target, "lm_head.weight", torch.float32)
    V, H = head.shape
    tr = windows(6, 48, V, H, seed=3)
    tr[-1] = Window("short", 0, tr[-1].input_ids[:40], tr[-1].loss_mask[:40], tr[-1].hidden[:40])
    ev = windows(2, 48, V, H, seed=4)
    res, logs = {}, []
    for on in (False, True):
        d = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
        res[on] = train(d, head, tr, ev, cfg(compile=on), tmp_path / str(on), log=logs.append)
    a, b = res[False], res[True]
    assert (a["compiled"], b["compiled"]) == (0, 1)
    assert any("1 layer(s) compiled" in m for m in logs)
    for x, y in zip(a["history"], b["history"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
    assert b["final"]["t0"]["tau"] == pytest.approx(a["final"]["t0"]["tau"], abs=1e-3)
    ck = torch.load(tmp_path / "True" / "ckpt" / "latest.pt", weights_only=True)
    assert set(ck["model"]) == set(torch.load(tmp_path / "False" / "ckpt" / "latest.pt", weights_only=True)["model"])


def test_a_drafter_without_layers_is_refused():
    with pytest.raises(ValueError, match="train.compile: Linear has no `layers` list"):
        compile_layers(torch.nn.Linear(2, 2))
