"""The GPU check (issue 32): the project's training, evaluation and FP8 paths on CUDA against the CPU, one table.

    bash bench/gpu_check.sh             # on a GPU machine (installs the wheels of bench/gpu_wheels first)
    python bench/gpu_check.py --dry-run # the same script with the CPU standing in for the GPU, small sizes

What it runs, each on the CPU (the reference) and on the GPU, from the same seeded weights and windows:

* ``mtp``       the MTP step (``window_loss``, lk_hybrid, K = 1..3, whole vocabulary and a draft vocabulary) in
                float32: the loss difference, and the bf16-autocast training step's tokens/s and peak memory
                (``train()``'s: a micro batch of 4 windows of 256 as one batch; one window at a time beside it);
* ``compile``   that training step with the drafter's layers compiled (``train.compile``) against it eager, on the
                GPU only: tokens/s, the first step's seconds (the compile), the first loss;
* ``train``     ``train()`` itself for a few steps including its held-out checks: the loss history and τ;
* ``dspark``    the DSpark block step (``block_loss`` with the confidence head) and ``block_acceptance``;
* ``fp8``       block FP8 of one 7168×2048 bf16 tensor under both scale rules: differing scale and E4M3 bytes;
* ``v3``        the DeepSeek-V3-size MTP layer (real dimensions, random bf16 weights built on the GPU) trained
                with the project's step: tokens/s and peak memory against ``drafter plan``'s estimate;
* ``torchrun``  two processes under torchrun: the backend follows the device (gloo for CPU ranks, NCCL for
                GPU ranks when there are two GPUs), gradients averaged equal the one-process average.

Without a CUDA device (and without ``--dry-run``) it stops at once with the reason and exit code 3: the
boundary. With ``--out DIR`` (default ``$OUT`` when set) it writes ``gpu_check.json``, ``gpu_check.md`` and
``profile-*.txt`` (one more step under torch.profiler of the demo size, eager and compiled, and of the V3 size:
kernels by GPU time, launch count). Criteria (issue 32): losses within 1e-4 in float32, FP8 bytes identical, the
V3 step's peak within 15 % of the plan; on a GPU also issue 36's bars: the demo-size step ≥ 10,000 tokens/s (its
eager and its compiled row), the V3-size step ≥ 10,000 tokens/s at window 2048 with peak ≤ 40 GiB. A check that
cannot run says why in its row; the exit code is 1 when any criterion fails.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSS_TOL = 1e-4
PEAK_TOL = 0.15
BOUNDARY_EXIT = 3
# issue 36's bars on a GPU: the demo-size step and the DeepSeek-V3-size step (window 2048) in tokens/s, its peak
DEMO_STEP_BAR = 10_000
V3_STEP_BAR, V3_PEAK_BAR_GIB = 10_000, 40.0
PROFILE_DIR: Path | None = None  # where profile_step writes its tables (main sets it: --out, or $OUT)

# the demo target's shape (SmolLM2-135M re-expressed as GLM-4-MoE with one MTP layer): no weights needed
DEMO = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
            bos_token_id=1, eos_token_id=2)
DRY = dict(DEMO, vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=64)


class Check:
    """One row of the table: what ran, on the CPU and the GPU, the comparison and whether it passed."""

    def __init__(self, name: str):
        self.name, self.cpu, self.gpu, self.compare, self.ok, self.note = name, "", "", "", None, ""

    def row(self) -> dict:
        return {"check": self.name, "cpu": self.cpu, "gpu": self.gpu, "compare": self.compare,
                "result": {True: "pass", False: "FAIL", None: "—"}[self.ok], "note": self.note}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def exact_float32(device: torch.device) -> None:
    """No TF32 anywhere: the float32 comparison is IEEE float32 on both sides."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


# ------------------------------------------------------------------------------------------- builders


def mtp_drafter(shape: dict, seed: int = 0):
    """An MTP drafter of the demo's layout at ``shape``, seeded random weights (CPU)."""
    from drafter.models.layouts import EmbeddedGlm4MoeLayout
    from drafter.models.target import glm4_moe_mtp_config

    torch.manual_seed(seed)
    drafter = EmbeddedGlm4MoeLayout().build(glm4_moe_mtp_config(**shape))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return drafter


def random_windows(n: int, T: int, vocab: int, hidden: int, seed: int, features: int = 0):
    from drafter.data.windows import Window

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.bool)
        mask[: T // 8] = False  # a user turn first, as in chat windows
        h = torch.randn(T, hidden, generator=g)
        f = torch.randn(T, features, generator=g) if features else None
        out.append(Window(f"w{i}", 0, ids, mask, h, f))
    return out


def train_cfg(**kw):
    from drafter.core.config import TrainConfig

    base = dict(loss="lk_hybrid", k_steps=2, window=256, micro_batch=1, max_steps=4, warmup_steps=1, lr=1e-3,
                eval_every=2, eval_windows=2, freeze=["embed_tokens.*", "*.shared_head.head.*"], data_part="all",
                device="cpu")
    return TrainConfig(**(base | kw))


def profile_step(name: str, step_fn, params, device: torch.device) -> None:
    """One more training step under torch.profiler: its kernels by GPU time and the launch count, written to
    ``PROFILE_DIR/profile-{name}.txt`` — what a failing speed bar is spent on."""
    from torch.profiler import ProfilerActivity, profile

    opt = torch.optim.AdamW(params, lr=1e-6)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        one_step(step_fn, opt, device)
    events = prof.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    (PROFILE_DIR / f"profile-{name}.txt").write_text(
        f"{name}: one step, {kernels} GPU kernels\n\n" + events.table(sort_by=sort, row_limit=30, max_name_column_width=70))


def timed_steps(step_fn, params, device: torch.device, steps: int, lr: float) -> float:
    """Median seconds of ``steps`` training steps (after one warm-up): ``step_fn()`` → loss under bf16
    autocast on ``device``, backward, AdamW; the peak memory counts from here."""
    opt = torch.optim.AdamW(params, lr=lr)
    reset_peak(device)
    times = []
    for _ in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        one_step(step_fn, opt, device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def one_step(step_fn, opt, device: torch.device) -> None:
    """``step_fn()`` → loss under bf16 autocast on ``device``, backward, ``opt`` step; waits for the device."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = step_fn()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)


# ------------------------------------------------------------------------------------------- checks


def check_mtp(gpu: torch.device, shape: dict, steps: int) -> list[Check]:
    from drafter.training import losses as L
    from drafter.training.loop import VocabHead, batch_loss, window_loss

    rows = []
    cpu = torch.device("cpu")
    base = mtp_drafter(shape)
    H, V = shape["hidden_size"], shape["vocab_size"]
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.05
    win = random_windows(1, 256 if shape is DEMO else 64, V, H, seed=1)[0]
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[: V // 6].sort().values
    for k in (1, 2, 3):
        for vocab_ids in (None, ids):
            c = Check(f"mtp window_loss K={k}{' draft vocab' if vocab_ids is not None else ''} (fp32)")
            cfg = train_cfg(k_steps=k)
            weights = L.position_weights(k, cfg.gamma)
            vals = []
            for dev in (cpu, gpu):
                d = copy.deepcopy(base).to(dev)
                hw = head.to(dev)
                vh = None if vocab_ids is None else VocabHead.of(vocab_ids.to(dev), hw)
                loss, _ = window_loss(d, hw, win.to(dev), cfg, weights.to(dev), vocab=vh)
                loss.backward()
                g = next(p.grad for n, p in d.named_parameters() if n.endswith("eh_proj.weight"))
                vals.append((float(loss.detach()), g.detach().double().cpu()))
            (lc, gc), (lg, gg) = vals
            c.cpu, c.gpu = f"{lc:.6f}", f"{lg:.6f}"
            gdiff = float((gc - gg).abs().max() / gc.abs().max().clamp_min(1e-30))
            c.compare = f"|Δloss| {abs(lc - lg):.2e}, eh_proj grad rel {gdiff:.2e}"
            c.ok = abs(lc - lg) <= LOSS_TOL and gdiff <= 1e-3
            rows.append(c)
    # the training step's speed: bf16 autocast, AdamW, as train() runs it (a micro batch of 4 windows as one batch)
    mb, T = 4, len(win.input_ids)
    wins = random_windows(mb, T, V, H, seed=11)
    c = Check(f"mtp step bf16 K=2 draft vocab, micro batch {mb} × window {T}")
    res = []
    for n_dev, dev in enumerate((cpu, gpu)):
        d = copy.deepcopy(base).to(dev)
        hw = head.to(dev)
        vh = VocabHead.of(ids.to(dev), hw)
        cfg = train_cfg(k_steps=2, micro_batch=mb)
        weights = L.position_weights(2, cfg.gamma)  # on the host, as train() keeps them: read as floats
        params = [p for n, p in d.named_parameters() if not n.startswith("embed_tokens")]
        ws = [w.to(dev) for w in wins]
        one = timed_steps(lambda: window_loss(d, hw, ws[0], cfg, weights, vocab=vh)[0], params, dev, steps, lr=1e-4)
        step = timed_steps(lambda: batch_loss(d, hw, ws, cfg, weights, vocab=vh)[0], params, dev, steps, lr=1e-4)
        res.append((T / one, mb * T / step, peak_gib(dev)))
        if n_dev == 1 and PROFILE_DIR:  # the GPU's step (the dry run's second CPU pass)
            profile_step(f"demo-step-micro-batch-{mb}", lambda: batch_loss(d, hw, ws, cfg, weights, vocab=vh)[0],
                         params, dev)
    c.cpu = f"{res[0][1]:,.0f} tok/s (one window at a time {res[0][0]:,.0f})"
    _, tps, peak = res[1]
    c.gpu = f"{tps:,.0f} tok/s (one window at a time {res[1][0]:,.0f})" + (f", peak {peak:.2f} GiB" if peak is not None else "")
    c.compare = f"{tps / res[0][1]:.1f}× the CPU"
    if gpu.type == "cuda":  # issue 36's bar for the demo-size step
        c.compare += f"; bar ≥ {DEMO_STEP_BAR:,} tok/s"
        c.ok = tps >= DEMO_STEP_BAR
    rows.append(c)
    return rows


def check_compile(gpu: torch.device, shape: dict, steps: int) -> list[Check]:
    """``train.compile``: the demo-size step of :func:`check_mtp` (bf16 autocast, a micro batch of 4 as one batch,
    K = 2, a draft vocabulary) on the GPU with the drafter's layers compiled, against the same step eager from the
    same weights: tokens/s, the first step's seconds (the compile), the first loss (bf16: within 1e-2). The dry
    run compiles with the aot_eager backend (Inductor itself: tests/test_compiled.py)."""
    from drafter.training import losses as L
    from drafter.training.compiled import compile_layers
    from drafter.training.loop import VocabHead, batch_loss

    base = mtp_drafter(shape)
    H, V = shape["hidden_size"], shape["vocab_size"]
    hw = (torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.05).to(gpu)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[: V // 6].sort().values
    vh = VocabHead.of(ids.to(gpu), hw)
    mb, T = 4, 256 if shape is DEMO else 64
    ws = [w.to(gpu) for w in random_windows(mb, T, V, H, seed=11)]
    cfg = train_cfg(k_steps=2, micro_batch=mb)
    weights = L.position_weights(2, cfg.gamma)
    c = Check(f"mtp step bf16 compiled (train.compile), micro batch {mb} × window {T}"
              + ("" if gpu.type == "cuda" else " (dry-run: aot_eager backend)"))
    out = {}
    for name in ("eager", "compiled"):
        d = copy.deepcopy(base).to(gpu)
        if name == "compiled":  # the dry run traces with dynamo but skips Inductor's CPU code generation (~1 min)
            compile_layers(d, **({} if gpu.type == "cuda" else {"backend": "aot_eager"}))
        params = [p for n, p in d.named_parameters() if not n.startswith("embed_tokens")]
        fn = lambda d=d: batch_loss(d, hw, ws, cfg, weights, vocab=vh)[0]  # noqa: E731
        sync(gpu)
        t0 = time.perf_counter()
        with torch.autocast(gpu.type, dtype=torch.bfloat16):
            first = fn()
        first.backward()  # the compile of the forward and the backward happens here
        sync(gpu)
        out[name] = {"first_s": time.perf_counter() - t0, "loss": float(first.detach())}
        d.zero_grad(set_to_none=True)
        out[name]["tok_s"] = mb * T / timed_steps(fn, params, gpu, steps, lr=1e-4)
        out[name]["peak"] = peak_gib(gpu)
        if name == "compiled" and PROFILE_DIR:
            profile_step("demo-step-compiled", fn, params, gpu)
    e, k = out["eager"], out["compiled"]
    rel = abs(k["loss"] - e["loss"]) / max(abs(e["loss"]), 1e-12)
    c.cpu = "—"
    c.gpu = (f"{k['tok_s']:,.0f} tok/s compiled, {e['tok_s']:,.0f} eager; first step {k['first_s']:.1f} s "
             f"(eager {e['first_s']:.1f} s)" + (f", peak {k['peak']:.2f} GiB" if k["peak"] is not None else ""))
    c.compare = f"{k['tok_s'] / e['tok_s']:.2f}× eager; first loss rel. diff {rel:.1e}"
    c.ok = rel <= 1e-2
    if gpu.type == "cuda":  # issue 36's bar for the demo-size step, compiled
        c.compare += f"; bar ≥ {DEMO_STEP_BAR:,} tok/s"
        c.ok = c.ok and k["tok_s"] >= DEMO_STEP_BAR
    return [c]


def check_train(gpu: torch.device, shape: dict) -> list[Check]:
    """``train()`` end to end (its held-out checks included) on the CPU and the GPU: the same history."""
    from drafter.training.loop import train

    c = Check("train() 4 steps + held-out checks (fp32)")
    H, V = shape["hidden_size"], shape["vocab_size"]
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.05
    tr = random_windows(4, 64, V, H, seed=3)
    ev = random_windows(2, 64, V, H, seed=4)
    out = []
    for dev in (torch.device("cpu"), gpu):
        d = mtp_drafter(shape).to(dev)
        with tempfile.TemporaryDirectory() as work:
            out.append(train(d, head.to(dev), tr, ev, train_cfg(device=str(dev)), Path(work), log=lambda *_: None))
    a, b = out
    la, lb = [h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]]
    dl = max(abs(x - y) for x, y in zip(la, lb))
    dt = abs(a["final"]["t0"]["tau"] - b["final"]["t0"]["tau"])
    c.cpu = f"loss {la[-1]:.6f}, τ {a['final']['t0']['tau']:.4f}"
    c.gpu = f"loss {lb[-1]:.6f}, τ {b['final']['t0']['tau']:.4f}"
    c.compare = f"max |Δloss| over {len(la)} steps {dl:.2e}, |Δτ| {dt:.2e}"
    c.ok = dl <= LOSS_TOL * 10 and len(la) == len(lb)  # 4 AdamW steps compound 1e-7 differences
    c.note = "loss tolerance 1e-3 after 4 optimizer steps" if c.ok else ""
    return [c]


def check_dspark(gpu: torch.device, shape: dict) -> list[Check]:
    from drafter.evaluation.acceptance import block_acceptance
    from drafter.models.dspark import DSparkConfig, DSparkDraft
    from drafter.training.dspark import block_loss

    H, V = shape["hidden_size"], shape["vocab_size"]
    layers = [1, 2, 3] if shape is DEMO else [1, 2]
    torch.manual_seed(0)
    cfg = DSparkConfig(hidden_size=H, intermediate_size=shape["intermediate_size"], num_hidden_layers=1,
                       num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                       head_dim=shape["head_dim"], vocab_size=V, target_hidden_size=H, target_layer_ids=layers,
                       block_size=5, markov_rank=64, noise_token_id=V - 1)
    base = DSparkDraft(cfg)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.05
    emb = torch.nn.Embedding(V, H)
    torch.nn.init.normal_(emb.weight, std=0.5)
    wins = random_windows(2, 128, V, H, seed=6, features=len(layers) * H)
    tc = train_cfg(loss="ce_l1")
    vals = []
    for dev in (torch.device("cpu"), gpu):
        d = copy.deepcopy(base).to(dev)
        e = copy.deepcopy(emb).to(dev)
        hw = head.to(dev)
        w = wins[0].to(dev)
        loss, _ = block_loss(d, e, hw, w, tc, anchors=32, confidence_w=0.1, generator=torch.Generator().manual_seed(7))
        loss.backward()
        acc = block_acceptance(d, e, hw, [x.to(dev) for x in wins])
        vals.append((float(loss.detach()), acc["t0"]["tau"], acc["t1_prob"]["tau"]))
    a, b = vals
    c1 = Check("dspark block_loss (ce_l1 + confidence, fp32)")
    c1.cpu, c1.gpu = f"{a[0]:.6f}", f"{b[0]:.6f}"
    c1.compare = f"|Δloss| {abs(a[0] - b[0]):.2e}"
    c1.ok = abs(a[0] - b[0]) <= LOSS_TOL
    c2 = Check("dspark block_acceptance (τ T=0 / T=1 prob)")
    c2.cpu, c2.gpu = f"{a[1]:.4f} / {a[2]:.4f}", f"{b[1]:.4f} / {b[2]:.4f}"
    c2.compare = f"|Δτ| {abs(a[1] - b[1]):.2e} / {abs(a[2] - b[2]):.2e}"
    c2.ok = abs(a[2] - b[2]) <= LOSS_TOL
    return [c1, c2]


def check_fp8(gpu: torch.device, big: bool) -> list[Check]:
    from drafter.quant.fp8 import dequantize, quantize

    shape = (7168, 2048) if big else (512, 384)
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(8)) * 0.02).to(torch.bfloat16)
    rows = []
    for rule, block in (("float32", (128, 128)), ("ue8m0", (32, 32))):
        c = Check(f"fp8 {rule} {block[0]}×{block[1]} of {shape[0]}×{shape[1]} bf16")
        q0, s0 = quantize(w, block, rule, name="w")
        t0 = time.perf_counter()
        q1, s1 = quantize(w.to(gpu), block, rule, name="w")
        sync(gpu)
        dt = time.perf_counter() - t0
        q1, s1 = q1.cpu(), s1.cpu()
        dq = int((q0.view(torch.uint8) != q1.view(torch.uint8)).sum())
        ds = int((s0.view(torch.uint8 if rule == "ue8m0" else torch.int32) != s1.view(torch.uint8 if rule == "ue8m0" else torch.int32)).sum())
        back = dequantize(q1.to(gpu), s1.to(gpu), block, name="w").cpu()
        same_back = bool(torch.equal(back, dequantize(q0, s0, block, name="w")))
        c.cpu = f"{s0.numel()} scales, {q0.numel():,} bytes"
        c.gpu = f"{dt * 1e3:.0f} ms"
        c.compare = f"{ds} scales, {dq} bytes differ; dequantized {'equal' if same_back else 'DIFFERENT'}"
        c.ok = dq == 0 and ds == 0 and same_back
        rows.append(c)
    return rows


def v3_config(dry: bool) -> dict:
    cfg = json.loads((ROOT / "configs/targets/deepseek-v3-0324.config.json").read_text())
    if dry:  # the same architecture, small: hidden 256, 16 experts top-4, vocab 4096
        cfg |= dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                    num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4, q_lora_rank=96,
                    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=4096)
    return cfg


def materialize(module: torch.nn.Module, device: torch.device, generator: torch.Generator) -> None:
    """A model built on the meta device, materialized on ``device`` as the memory plan holds it: frozen
    parameters in bfloat16, trainable ones in float32 (AdamW's master copy), random values (norms at 1)."""
    with torch.no_grad():
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                t = torch.empty(p.shape, dtype=torch.float32 if p.requires_grad else torch.bfloat16, device=device)
                t.fill_(1.0) if p.ndim == 1 else t.normal_(0.0, 0.02, generator=generator)
                mod._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            for name, b in list(mod._buffers.items()):  # the rotary inv_freq is built real (CPU): moved as it is
                if b is not None:
                    mod._buffers[name] = (torch.zeros(b.shape, dtype=b.dtype, device=device) if b.is_meta
                                          else b.to(device))


def check_v3(gpu: torch.device, dry: bool, window: int, steps: int) -> list[Check]:
    """The DeepSeek-V3 MTP layer at its real size: built on the meta device, materialized on the GPU with random
    weights (frozen bf16, trainable float32; routed experts by one grouped matmul, train.experts auto), trained
    with the project's step (lk_hybrid, K=2, bf16 autocast, AdamW) on a window of assistant tokens; the peak against ``drafter plan``'s estimate for the same settings."""
    from drafter.core.config import TrainConfig
    from drafter.models.experts import set_experts
    from drafter.models.layouts import DeepSeekV3Layout
    from drafter.models.mtp import freeze
    from drafter.training import losses as L
    from drafter.training.loop import window_loss
    from drafter.training.memory import mtp_shape, plan_memory

    c = Check(f"v3-size MTP step, window {window}, K=2 bf16{' (dry-run: small dims)' if dry else ''}")
    config = v3_config(dry)
    cfg = train_cfg(k_steps=2, window=window, dtype="bfloat16", freeze=TrainConfig().freeze)
    d = DeepSeekV3Layout().build(config, device="meta")
    n_all = sum(p.numel() for p in d.parameters())
    n_train, _ = freeze(d, cfg.freeze)
    g = torch.Generator(device=gpu).manual_seed(0)
    materialize(d, gpu, g)
    experts = set_experts(d, "auto")  # bf16 frozen experts: one grouped matmul where the kernel takes them
    plan = plan_memory(mtp_shape(config, cfg.freeze), cfg, dims_source="configs/targets/deepseek-v3-0324.config.json",
                       frozen_dtype="bfloat16", gpu_memory=141 * 2**30)
    H, V = config["hidden_size"], config["vocab_size"]
    head = torch.randn(V, H, generator=g, device=gpu) * 0.02  # float32, as run.py reads the target's head
    w = random_windows(1, window, V, H, seed=9)[0].to(gpu)
    w.loss_mask[:] = True  # every position an assistant token, as the plan assumes
    weights = L.position_weights(2, cfg.gamma)
    step = timed_steps(lambda: window_loss(d, head, w, cfg, weights)[0], [p for p in d.parameters() if p.requires_grad],
                       gpu, steps, lr=1e-5)
    peak = peak_gib(gpu)
    planned = plan.total / 2**30
    c.cpu = f"{n_all / 1e9:.2f} B params, {n_train / 1e6:.1f} M trainable, experts {experts}; plan {planned:.2f} GiB"
    c.gpu = f"{window / step:,.0f} tok/s" + (f", peak {peak:.1f} GiB" if peak is not None else "")
    if peak is not None:
        tps = window / step
        c.compare = (f"measured/plan {peak / planned:.2f}; bars (issue 36, window 2048): ≥ {V3_STEP_BAR:,} tok/s, "
                     f"peak ≤ {V3_PEAK_BAR_GIB:.0f} GiB")
        c.ok = abs(peak / planned - 1) <= PEAK_TOL and tps >= V3_STEP_BAR and peak <= V3_PEAK_BAR_GIB
    else:
        c.compare = "no GPU peak on the CPU"
    if PROFILE_DIR:
        profile_step(f"v3-step-window-{window}", lambda: window_loss(d, head, w, cfg, weights)[0],
                     [p for p in d.parameters() if p.requires_grad], gpu)
    return [c]


def check_torchrun(gpu: torch.device) -> list[Check]:
    """Two ranks under torchrun: on two GPUs NCCL with each rank on its LOCAL_RANK GPU; with fewer, CPU ranks
    on gloo (the fix: the backend follows where the gradients are, not whether CUDA exists)."""
    c = Check("torchrun 2 processes, gradients averaged")
    on_gpus = gpu.type == "cuda" and torch.cuda.device_count() >= 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(__file__).resolve()), "--torchrun-worker", str(out), "--worker-device", "auto" if on_gpus else "cpu"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if p.returncode != 0:  # once more: torchrun's standalone rendezvous picks its port racily (seen 1 in ~10)
            first = p
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            c.note = f"second launch (the first exited {first.returncode})"
        if p.returncode != 0 or not out.is_file():
            lines = (p.stderr + p.stdout).splitlines()
            errors = [ln.strip() for ln in lines if "Error" in ln or "error:" in ln] or lines[-3:]
            c.compare, c.ok = f"exit {p.returncode}: {' / '.join(errors[-3:])[:400]}", False
            return [c]
        r = json.loads(out.read_text())
    c.cpu = f"backend {r['backend']}, devices {r['devices']}"
    c.gpu = "2 GPUs" if on_gpus else f"{torch.cuda.device_count() if gpu.type == 'cuda' else 0} GPU(s): CPU ranks"
    c.compare = f"max rel |Δgrad| vs one process {r['grad_rel_diff']:.2e}"
    c.ok = r["grad_rel_diff"] <= 1e-5 and r["backend"] == ("nccl" if on_gpus else "gloo")
    return [c]


def torchrun_worker(out: Path, spec: str) -> None:
    import torch.distributed as dist

    from drafter.core.hardware import resolve_device
    from drafter.training import losses as L
    from drafter.training.loop import _all_reduce_grads, window_loss
    from drafter.training.run import process_group_backend

    device = resolve_device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    exact_float32(device)
    d = mtp_drafter(DRY).to(device)
    head = (torch.randn(DRY["vocab_size"], DRY["hidden_size"], generator=torch.Generator().manual_seed(5)) * 0.05).to(device)
    wins = random_windows(world, 64, DRY["vocab_size"], DRY["hidden_size"], seed=10)
    cfg = train_cfg(k_steps=2)
    weights = L.position_weights(2, cfg.gamma).to(device)
    params = [p for p in d.parameters() if p.requires_grad]
    loss, _ = window_loss(d, head, wins[rank].to(device), cfg, weights)
    loss.backward()
    _all_reduce_grads(params, world)
    devices = [None] * world
    dist.all_gather_object(devices, str(device))
    if rank == 0:  # the same average in one process
        ref = mtp_drafter(DRY).to(device)
        rparams = [p for p in ref.parameters() if p.requires_grad]
        for w in wins:
            lw, _ = window_loss(ref, head, w.to(device), cfg, weights)
            (lw / world).backward()
        diff = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
                   for a, b in zip(params, rparams) if b.grad is not None)
        out.write_text(json.dumps({"backend": backend, "devices": devices, "grad_rel_diff": diff}))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- main


def render(rows: list[dict], header: str) -> str:
    lines = [header, "", "| check | CPU | GPU | comparison | result |", "|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"| {r['check']} | {r['cpu']} | {r['gpu']} | {r['compare']}{note} | {r['result']} |")
    return "\n".join(lines) + "\n"


def boundary() -> str | None:
    """Why this machine cannot run the GPU check, or None."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        return (f"no CUDA device: torch {torch.__version__} ({build}) sees none (torch.cuda.is_available() is False); "
                "the GPU check needs one NVIDIA GPU (run it on the device machine, or --dry-run here)")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the CPU stands in for the GPU; small sizes")
    ap.add_argument("--only", default="mtp,compile,train,dspark,fp8,v3,torchrun", help="checks to run (comma-separated)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per speed measurement (after one warm-up)")
    ap.add_argument("--v3-window", type=int, default=2048, help="window of the V3-size step")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    ap.add_argument("--torchrun-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker-device", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torchrun_worker:
        torchrun_worker(args.torchrun_worker, args.worker_device)
        return 0
    why = boundary()
    if why and not args.dry_run:
        print(f"gpu_check: stopping at the boundary: {why}", file=sys.stderr)
        return BOUNDARY_EXIT
    global PROFILE_DIR
    PROFILE_DIR = args.out
    gpu = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    exact_float32(gpu)
    shape = DRY if args.dry_run else DEMO
    checks = {"mtp": lambda: check_mtp(gpu, shape, args.steps), "compile": lambda: check_compile(gpu, shape, args.steps),
              "train": lambda: check_train(gpu, shape),
              "dspark": lambda: check_dspark(gpu, shape), "fp8": lambda: check_fp8(gpu, big=not args.dry_run),
              "v3": lambda: check_v3(gpu, args.dry_run, 128 if args.dry_run else args.v3_window, args.steps),
              "torchrun": lambda: check_torchrun(gpu)}
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    for name in names:  # refused before any check runs: a typo costs no measurement
        if name not in checks:
            print(f"gpu_check: unknown check {name!r}; known: {', '.join(checks)}", file=sys.stderr)
            return 2
    import transformers

    header = (f"GPU check {time.strftime('%Y-%m-%d %H:%M')}: torch {torch.__version__}, transformers "
              f"{transformers.__version__}, " + (f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
                                                 if gpu.type == "cuda" else "dry run: the CPU stands in for the GPU"))
    print(header, flush=True)
    rows: list[dict] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            got = [c.row() for c in checks[name]()]
        except Exception as e:  # noqa: BLE001 — one failing check is a FAIL row, the others still run
            traceback.print_exc()
            c = Check(name)
            c.compare, c.ok = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", False
            got = [c.row()]
        rows += got
        for r in got:
            print(f"  {r['result']:4} {r['check']}: {r['cpu']} | {r['gpu']} | {r['compare']}", flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    table = render(rows, header)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
        (args.out / "gpu_check.md").write_text(table)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
