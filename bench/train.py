"""Training throughput of the demo drafters: tokens/s, peak memory, and the share of step time spent
in the LM head (the part worth fusing or chunking) — the MTP step and the DSpark block step.

    .venv/bin/python bench/train.py [--steps 6] [--window 256] [--k 4] [--capture DIR] [--target DIR]
                                    [--threads N] [--kinds mtp,dspark,experts,compile] [--draft-vocab 8192]
                                    [--block 5] [--anchors 64] [--markov-rank 64]
                                    [--device cpu] [--bf16] [--experts-e 64] [--experts-top-k 8] [--experts-hidden 256]

Uses the demo store's target and captured features when present (run `make demo` first),
otherwise the tiny test target with random windows. Measures, in one run, a full MTP training step
(K-step unroll + loss + backward + AdamW) twice on the same windows from the same weights: the
reference (transformers' own MoE forward: every routed expert and the shared expert computed; lk_hybrid by
autograd, ``fused=False``) and the step as training runs it (the exact shortcuts of
``drafter.models.mtp.OnePassMoE``, the fused ``drafter.training.losses.LKHybridRows``); it prints both
tokens/s, their ratio and both paths' loss of every window (equal within float tolerance); a third path runs
the new step under bfloat16 autocast (`train.dtype: bfloat16`), whose losses differ at bf16 precision; two more run
it over a draft vocabulary (``--draft-vocab``, `train.draft_vocab_size`: the restricted distributions' loss, in
float32 and bf16 — the demo's step). Then the
same step's LM-head work alone (the draft head forward/backward and the target head forward on the
same shapes) and its share of the step. Then a DSpark step on the same windows
(configs/demo-dspark.yaml's draft: one decoder layer over three target layers, blocks of ``--block``,
``--anchors`` per window, Markov and confidence heads; random context features when the capture has
no such layers: their values do not change the step's cost). Each kind runs in its own process, so
each peak memory (max RSS) is that step's own (the MTP one holds three drafters and three optimizers).
Last (``experts``, on ``--device``) the routed experts computed by transformers' loop (``train.experts: eager``)
against one grouped matmul (``grouped_mm``, drafter/models/experts.py) on the general MoE path: the demo's layer
and a DeepSeek-V3-shaped layer scaled to the CPU (``--experts-e`` experts, top ``--experts-top-k``).
``compile`` (not in the default ``--kinds``): ``train()``'s step as the demo runs it (the micro batch as one batch,
over the ``--draft-vocab`` draft tokens, in the dtype ``train.dtype: auto`` picks on ``--device``) eager against the
same step with the drafter's layers compiled (``train.compile``), from the same weights on the same windows: tokens/s,
the first step's seconds (the compile) and the losses.
"""
from __future__ import annotations

import argparse
import copy
import glob
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter.training import losses as L  # noqa: E402
from drafter.core.config import TrainConfig  # noqa: E402
from drafter.models import freeze, layout_for, load_drafter  # noqa: E402
from drafter.models.target import read_tensor  # noqa: E402
from drafter.training.loop import VocabHead, batch_loss, window_loss  # noqa: E402
from drafter.serving.draft_vocab import build_draft_vocab  # noqa: E402
from drafter.data.windows import Window, load_windows  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def find_demo() -> tuple[Path | None, Path | None]:
    targets = sorted(glob.glob(str(ROOT / "store/prepare_target/*/model")))
    captures = sorted(glob.glob(str(ROOT / "store/capture/*/features")))
    return (Path(targets[-1]) if targets else None, Path(captures[-1]).parent if captures else None)


def dspark_step(args, target: Path, wins: list[Window], head: torch.Tensor) -> dict:
    """s/step, tokens/s and the LM-head share of a DSpark block step on ``wins`` (see the module docstring)."""
    from transformers import AutoConfig

    from drafter.models.dspark import DSparkConfig, DSparkDraft
    from drafter.training.dspark import block_loss
    from drafter.training.run import target_embedding

    tcfg = AutoConfig.from_pretrained(str(target))
    L_ = tcfg.num_hidden_layers
    ids = sorted({1, L_ // 2, max(L_ - 3, 0)})
    torch.manual_seed(0)
    draft = DSparkDraft(DSparkConfig.for_target(tcfg, target_layer_ids=ids, block_size=args.block,
                                                markov_rank=args.markov_rank))
    embed = target_embedding(target)
    H = tcfg.hidden_size
    g = torch.Generator().manual_seed(1)
    wins = [Window(w.row_id, w.start, w.input_ids, w.loss_mask, w.hidden, torch.randn(len(w.input_ids), len(ids) * H, generator=g))
            for w in wins]
    cfg = TrainConfig(loss="ce_l1", window=args.window, micro_batch=args.micro_batch)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)

    def step(i: int) -> int:
        toks = 0
        for j in range(args.micro_batch):
            w = wins[(i * args.micro_batch + j) % len(wins)]
            loss, _ = block_loss(draft, embed, head, w, cfg, anchors=args.anchors, confidence_w=0.1)
            (loss / args.micro_batch).backward()
            toks += len(w.input_ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return toks

    step(0)
    t, toks = 0.0, 0
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        toks += step(i)
        t += time.perf_counter() - t0
    return {"s_step": t / args.steps, "tok_s": toks / t, "peak_mb": peak_rss_mb(),
            "what": f"DSpark block {args.block}, {args.anchors} anchors/window, layers {ids}, Markov rank {args.markov_rank}",
            "trainable": sum(p.numel() for p in draft.parameters())}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def v3_shaped_layer(args, dev: torch.device):
    """A DeepSeek-V3-shaped MTP layer at a CPU-sized scale (MLA, grouped sigmoid routing; ``--experts-e`` routed
    experts, top ``--experts-top-k``, hidden ``--experts-hidden``) with random weights, and its LM head."""
    from tests.helpers.deepseek import tiny_deepseek_v3_config
    from drafter.models import DeepSeekV3Layout

    H, E = args.experts_hidden, args.experts_e
    cfg = tiny_deepseek_v3_config(vocab_size=4096, hidden_size=H, n_routed_experts=E)
    cfg |= {"moe_intermediate_size": H // 4, "num_experts_per_tok": args.experts_top_k, "n_group": 8, "topk_group": 4,
            "kv_lora_rank": H // 4, "q_lora_rank": H // 2, "intermediate_size": 2 * H}
    torch.manual_seed(0)
    d = DeepSeekV3Layout().build(cfg, device=None)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return d.to(dev), torch.randn(cfg["vocab_size"], H) * H ** -0.5


def experts_step(args, drafter, head: torch.Tensor, wins: list[Window]) -> dict:
    """The MTP step with transformers' loop over the routed experts (``train.experts: eager``) against one grouped
    matmul (``grouped_mm``), same weights and windows, both on the general MoE path (the one-pass shortcut off): the
    demo's layer and a V3-shaped one (see :func:`v3_shaped_layer`)."""
    from drafter.models.experts import set_experts

    dev = torch.device(args.device)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=args.k, window=args.window, micro_batch=args.micro_batch)
    weights = L.position_weights(cfg.k_steps, cfg.gamma).to(dev)
    out = {}
    v3, v3_head = v3_shaped_layer(args, dev)
    g = torch.Generator().manual_seed(0)
    v3_wins = [Window(f"r{i}", 0, torch.randint(0, v3_head.shape[0], (args.window,), generator=g),
                      torch.ones(args.window, dtype=torch.bool), torch.randn(args.window, v3_head.shape[1], generator=g))
               for i in range(8)]
    for name, base, hd, ws in (("demo layer", drafter.to(dev), head, wins),
                               (f"V3-shaped (E={args.experts_e}, top-{args.experts_top_k}, H={args.experts_hidden})",
                                v3, v3_head, v3_wins)):
        base.set_shortcuts(False)
        freeze(base, cfg.freeze)
        paths = {impl: copy.deepcopy(base) for impl in ("eager", "grouped_mm")}
        for impl, d in paths.items():
            set_experts(d, impl)
        opts = {k: torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4) for k, d in paths.items()}
        hd = hd.to(dev)
        t = {k: 0.0 for k in paths}
        losses = {k: [] for k in paths}
        toks = 0
        for i in range(args.steps + 1):  # step 0 warms up
            for k, d in paths.items():
                _sync(dev)
                t0 = time.perf_counter()
                for j in range(args.micro_batch):
                    w = ws[(i * args.micro_batch + j) % len(ws)].to(dev)
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                        loss, _ = window_loss(d, hd, w, cfg, weights)
                    (loss / args.micro_batch).backward()
                    if i:
                        losses[k].append(float(loss.detach()))
                        toks += len(w.input_ids) if k == "eager" else 0
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
                _sync(dev)
                if i:
                    t[k] += time.perf_counter() - t0
        tok_s = {k: toks / t[k] for k in paths}
        diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["eager"], losses["grouped_mm"]))
        out[name] = {"eager": tok_s["eager"], "grouped_mm": tok_s["grouped_mm"], "loss_diff": diff}
    print(f"\nrouted experts on {dev} ({'bf16 autocast' if args.bf16 else 'float32'}; K={args.k}, window {args.window}, "
          f"micro batch {args.micro_batch}, {args.steps} steps; the general MoE path)")
    print(f"{'layer':<44}{'loop tok/s':>12}{'grouped tok/s':>15}{'grouped / loop':>16}{'loss rel. diff':>16}")
    for name, r in out.items():
        print(f"{name:<44}{r['eager']:>12,.1f}{r['grouped_mm']:>15,.1f}{r['grouped_mm'] / r['eager']:>15.2f}×"
              f"{r['loss_diff']:>16.1e}")
    return {"experts": out}


def compile_step(args, drafter, head: torch.Tensor, wins: list[Window]) -> dict:
    """train()'s step eager and with the drafter's layers compiled (see the module docstring)."""
    from drafter.core.hardware import compute_dtype
    from drafter.training.compiled import compile_layers

    dev = torch.device(args.device)
    dtype = compute_dtype("auto", dev)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=args.k, window=args.window, micro_batch=args.micro_batch,
                      dtype=dtype)
    freeze(drafter, cfg.freeze)
    head = head.to(dev)
    V = head.shape[0]
    vocab = None
    if args.draft_vocab:
        vocab = VocabHead.of(build_draft_vocab((w.input_ids.tolist() for w in wins), vocab_size=V,
                                               size=min(args.draft_vocab, V)), head)
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    mb = args.micro_batch
    groups = [[wins[(i * mb + j) % len(wins)].to(dev) for j in range(mb)] for i in range(args.steps + 1)]
    paths = {"eager": copy.deepcopy(drafter).to(dev), "compiled": copy.deepcopy(drafter).to(dev)}
    compile_layers(paths["compiled"])
    opts = {k: torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4) for k, d in paths.items()}

    def step(path: str, group: list[Window]) -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss, _ = batch_loss(paths[path], head, group, cfg, weights, vocab=vocab)
        loss.backward()
        opts[path].step()
        opts[path].zero_grad(set_to_none=True)
        _sync(dev)
        return float(loss.detach())

    first, t, losses = {}, {p: 0.0 for p in paths}, {p: [] for p in paths}
    for path in paths:  # the first step: the compiled path compiles here
        t0 = time.perf_counter()
        losses[path].append(step(path, groups[0]))
        first[path] = time.perf_counter() - t0
    for group in groups[1:]:  # interleaved so that both see the same machine load
        for path in paths:
            t0 = time.perf_counter()
            losses[path].append(step(path, group))
            t[path] += time.perf_counter() - t0
    toks = sum(len(w.input_ids) for g in groups[1:] for w in g)
    tok_s = {p: toks / t[p] for p in paths}
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["eager"], losses["compiled"]))
    print(f"train()'s step on {dev} ({dtype}, micro batch {mb} × window {args.window} as one batch, K={args.k}, "
          f"{len(vocab.ids) if vocab is not None else V} draft tokens, torch threads {torch.get_num_threads()}):")
    print(f"{'':<12}{'first step s':>14}{'s/step':>10}{'tokens/s':>12}")
    for p in paths:
        print(f"{p:<12}{first[p]:>14.1f}{t[p] / args.steps:>10.3f}{tok_s[p]:>12,.1f}")
    print(f"compiled / eager: tokens/s {tok_s['compiled'] / tok_s['eager']:.2f}×; losses of {len(losses['eager'])} steps "
          f"within {diff:.2e} relative; the compile cost {first['compiled'] - first['eager']:.1f} s before the first step")
    return {"compile": tok_s}


def _child(kind: str, argv: list[str], q) -> None:
    sys.argv = [sys.argv[0], *argv]
    q.put(main(kind))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--capture", type=Path)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--kinds", default="mtp,dspark,experts", help="steps to measure, comma-separated")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="also time the step over a draft vocabulary of N tokens (train.draft_vocab_size), fp32 and "
                         "bf16; 0: skip")
    ap.add_argument("--device", default="cpu", help="device of the experts and compile comparisons (cpu, cuda, cuda:N)")
    ap.add_argument("--bf16", action="store_true", help="experts comparison under bf16 autocast")
    ap.add_argument("--experts-e", type=int, default=64, help="routed experts of the V3-shaped layer")
    ap.add_argument("--experts-top-k", type=int, default=8)
    ap.add_argument("--experts-hidden", type=int, default=256)
    return ap.parse_args()


def main(kind: str | None = None) -> dict | None:
    if kind is None:  # the parent: each kind in its own process, then the table
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        res = {}
        for k in parse_args().kinds.split(","):
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(k, sys.argv[1:], q))
            p.start()
            res[k] = q.get()
            p.join()
        if not {"mtp", "dspark"} <= set(res):
            return None
        m, d = res["mtp"], res["dspark"]
        print(f"\n{'step':<34}{'s/step':>9}{'tokens/s':>10}{'peak RSS MiB':>14}")
        print(f"{'MTP (K-step unroll, lk_hybrid)':<34}{m['s_step']:>9.3f}{m['tok_s']:>10,.0f}{m['peak_mb']:>14,.0f}")
        print(f"{'DSpark (block loss, ce_l1)':<34}{d['s_step']:>9.3f}{d['tok_s']:>10,.0f}{d['peak_mb']:>14,.0f}")
        print(f"\nDSpark / MTP: tokens/s {d['tok_s'] / m['tok_s']:.2f}×, peak memory {d['peak_mb'] / m['peak_mb']:.2f}× "
              f"({d['what']}; {d['trainable']:,} parameters)")
        return None
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, capture = find_demo()
    target, capture = args.target or target, args.capture or capture
    if target is None:
        from tests.helpers.targets import make_tiny_target

        target = make_tiny_target(Path("/tmp/drafter-bench-tiny/model"))
        capture = None
    drafter = load_drafter(target, layout_for(target))
    head = read_tensor(target, "lm_head.weight", torch.float32)
    H, V = head.shape[1], head.shape[0]
    if capture is not None:
        wins = [w for w in load_windows(capture, "train", "all", args.window) if len(w.input_ids) == args.window]
        source = f"captured features {capture}"
    else:
        g = torch.Generator().manual_seed(0)
        wins = [Window(f"r{i}", 0, torch.randint(0, V, (args.window,), generator=g), torch.ones(args.window, dtype=torch.bool),
                       torch.randn(args.window, H, generator=g)) for i in range(16)]
        source = "random windows (no captured features in the store: their values do not change a step's cost)"
    if kind == "dspark":
        return dspark_step(args, target, wins, head)
    if kind == "experts":
        return experts_step(args, drafter, head, wins)
    if kind == "compile":
        return compile_step(args, drafter, head, wins)
    cfg = TrainConfig(loss="lk_hybrid", k_steps=args.k, window=args.window, micro_batch=args.micro_batch)
    n_train, n_frozen = freeze(drafter, cfg.freeze)
    fast = copy.deepcopy(drafter)  # same weights; the exact shortcuts on (the default)
    bf16 = copy.deepcopy(drafter)  # the exact shortcuts under `train.dtype: bfloat16` (autocast): not exact
    paths = {"reference": drafter, "new": fast, "bf16": bf16}
    vocab = None
    if args.draft_vocab:  # the step over a draft vocabulary: a different loss by definition (restricted distributions)
        ids = build_draft_vocab((w.input_ids.tolist() for w in wins), vocab_size=V, size=min(args.draft_vocab, V))
        vocab = VocabHead.of(ids, head)
        paths |= {"vocab": copy.deepcopy(drafter), "vocab_bf16": copy.deepcopy(drafter),
                  "batched": copy.deepcopy(drafter)}
    drafter.set_shortcuts(False)  # the reference: transformers' own MoE forward (and the autograd loss)
    opts = {k: torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4) for k, d in paths.items()}
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    print(f"target {target} (H={H}, V={V}); {source}; K={args.k}, window {args.window}, micro batch {args.micro_batch}; "
          f"{n_train:,} trainable parameters; torch threads {torch.get_num_threads()}")

    def full_step(path: str, i: int) -> tuple[int, list[float]]:
        d, opt, toks, losses = paths[path], opts[path], 0, []
        if path == "batched":  # the demo's step as train() runs it: the micro batch's windows as one batch
            group = [wins[(i * args.micro_batch + j) % len(wins)] for j in range(args.micro_batch)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = batch_loss(d, head, group, cfg, weights, vocab=vocab)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return sum(len(w.input_ids) for w in group), [float(loss.detach())]
        for j in range(args.micro_batch):
            w = wins[(i * args.micro_batch + j) % len(wins)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=path in ("bf16", "vocab_bf16")):
                loss, _ = window_loss(d, head, w, cfg, weights, fused=path != "reference",
                                      vocab=vocab if path.startswith("vocab") else None)
            (loss / args.micro_batch).backward()
            toks += len(w.input_ids)
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return toks, losses

    def head_only(i: int) -> None:
        """The LM-head work of one step: per window, the target head forward once, and per draft
        position the draft head forward + backward (input gradient) and the loss on [T, V]."""
        shead = fast.layers[0].shared_head
        for j in range(args.micro_batch):
            w = wins[(i * args.micro_batch + j) % len(wins)]
            T = len(w.input_ids)
            need = torch.nonzero(w.loss_mask[2:T]).flatten() + 1  # as window_loss: assistant targets only
            with torch.no_grad():
                p = w.hidden[need] @ head.T
            for k in range(1, args.k + 1):
                n = T - k - 1
                sel = torch.nonzero(w.loss_mask[k + 1:k + 1 + n]).flatten()
                h = w.hidden[sel].clone().requires_grad_(True)
                q = shead(h)
                loss, _ = L.lk_hybrid(q, p[: len(sel)])
                loss.backward()

    for path in paths:  # warm-up, on windows the timed steps do not use
        full_step(path, args.steps + 1)
    head_only(0)
    t = {path: 0.0 for path in paths}
    losses = {path: [] for path in paths}
    t_head, toks = 0.0, 0
    for i in range(args.steps):  # interleaved so that all see the same machine load
        for path in paths:
            t0 = time.perf_counter()
            n, ls = full_step(path, i)
            t[path] += time.perf_counter() - t0
            losses[path] += ls
        toks += n
        t0 = time.perf_counter()
        head_only(i)
        t_head += time.perf_counter() - t0
    tok_s = {path: toks / t[path] for path in paths}
    print(f"\n{'MTP step':<40}{'s/step':>10}{'tokens/s':>12}{'ratio':>8}")
    for path, name in (("reference", "reference (all experts, autograd loss)"), ("new", "new (exact shortcuts, fused loss)"),
                       ("bf16", "new, bf16 autocast (not exact)"),
                       ("vocab", f"new, over {args.draft_vocab} draft tokens"),
                       ("vocab_bf16", f"new, {args.draft_vocab} draft tokens, bf16"),
                       ("batched", f"  the same, micro batch as one batch")):
        if path not in paths:
            continue
        print(f"{name:<40}{t[path] / args.steps:>10.3f}{tok_s[path]:>12,.1f}{tok_s[path] / tok_s['reference']:>8.2f}")
    print(f"{'LM head + loss only':<40}{t_head / args.steps:>10.3f}{'':>12}{'':>8}"
          f"  share of the new step {t_head / t['new']:.2f}, of the reference {t_head / t['reference']:.2f}")
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["reference"], losses["new"]))
    print(f"\nloss per window ({len(losses['new'])} windows, {args.steps} optimizer steps on each path):")
    print("  reference " + " ".join(f"{x:.6f}" for x in losses["reference"]))
    print("  new       " + " ".join(f"{x:.6f}" for x in losses["new"]))
    print(f"  largest relative difference {diff:.2e}")
    d16 = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["reference"], losses["bf16"]))
    print("  bf16      " + " ".join(f"{x:.6f}" for x in losses["bf16"]))
    print(f"  bf16 autocast (`train.dtype: bfloat16`, an option, not the default): largest relative difference {d16:.2e}")
    print(f"\nnew / reference: tokens/s {tok_s['new'] / tok_s['reference']:.2f}× (exact); bf16 autocast / reference "
          f"{tok_s['bf16'] / tok_s['reference']:.2f}× (not exact); peak RSS {peak_rss_mb():,.0f} MiB (all drafters)")
    if vocab is not None:
        print(f"over a draft vocabulary of {len(vocab.ids)} tokens (train.draft_vocab_size: the loss of the restricted "
              f"distributions, another number by definition): tokens/s {tok_s['vocab'] / tok_s['new']:.2f}× the new step, "
              f"{tok_s['vocab'] / tok_s['reference']:.2f}× the reference; with bf16 autocast (the demo's step) "
              f"{tok_s['vocab_bf16'] / tok_s['reference']:.2f}× the reference")
        mb = args.micro_batch
        per_window = [sum(losses["vocab_bf16"][i:i + mb]) / mb for i in range(0, len(losses["vocab_bf16"]), mb)]
        db = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(per_window, losses["batched"]))
        print(f"the micro batch of {mb} windows as one batch (train()'s step): tokens/s {tok_s['batched'] / tok_s['vocab_bf16']:.2f}× "
              f"one window at a time; micro-batch losses within {db:.2e} relative (bf16 autocast)")
    return {"s_step": t["new"] / args.steps, "tok_s": tok_s["new"], "peak_mb": peak_rss_mb()}


if __name__ == "__main__":
    main()
