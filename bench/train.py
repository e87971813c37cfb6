"""Training throughput of the demo drafters: tokens/s, peak memory, and the share of step time spent
in the LM head (the part worth fusing or chunking) — the MTP step and the DSpark block step.

    .venv/bin/python bench/train.py [--steps 6] [--window 256] [--k 4] [--capture DIR] [--target DIR]
                                    [--block 5] [--anchors 64] [--markov-rank 64]

Uses the demo store's target and captured features when present (run `make demo` first),
otherwise the tiny test target with random windows. Measures, in one run, a full MTP training step
(K-step unroll + loss + backward + AdamW) and the same step's LM-head work alone (the draft head
forward/backward and the target head forward on the same shapes), and prints the ratio; then a
DSpark step on the same windows (configs/demo-dspark.yaml's draft: one decoder layer over three
target layers, blocks of ``--block``, ``--anchors`` per window, Markov and confidence heads; random
context features when the capture has no such layers: their values do not change the step's cost).
Each kind runs in its own process, so each peak memory (max RSS) is that step's own.
"""
from __future__ import annotations

import argparse
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
from drafter.training.loop import window_loss  # noqa: E402
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


def _child(kind: str, argv: list[str], q) -> None:
    sys.argv = [sys.argv[0], *argv]
    q.put(main(kind))


def main(kind: str | None = None) -> dict | None:
    if kind is None:  # the parent: each kind in its own process, then the table
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        res = {}
        for k in ("mtp", "dspark"):
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(k, sys.argv[1:], q))
            p.start()
            res[k] = q.get()
            p.join()
        m, d = res["mtp"], res["dspark"]
        print(f"\n{'step':<34}{'s/step':>9}{'tokens/s':>10}{'peak RSS MiB':>14}")
        print(f"{'MTP (K-step unroll, lk_hybrid)':<34}{m['s_step']:>9.3f}{m['tok_s']:>10,.0f}{m['peak_mb']:>14,.0f}")
        print(f"{'DSpark (block loss, ce_l1)':<34}{d['s_step']:>9.3f}{d['tok_s']:>10,.0f}{d['peak_mb']:>14,.0f}")
        print(f"\nDSpark / MTP: tokens/s {d['tok_s'] / m['tok_s']:.2f}×, peak memory {d['peak_mb'] / m['peak_mb']:.2f}× "
              f"({d['what']}; {d['trainable']:,} parameters)")
        return None
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
    args = ap.parse_args()

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
    cfg = TrainConfig(loss="lk_hybrid", k_steps=args.k, window=args.window, micro_batch=args.micro_batch)
    n_train, n_frozen = freeze(drafter, cfg.freeze)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    weights = L.position_weights(cfg.k_steps, cfg.gamma)
    print(f"target {target} (H={H}, V={V}); {source}; K={args.k}, window {args.window}, micro batch {args.micro_batch}; "
          f"{n_train:,} trainable parameters; torch threads {torch.get_num_threads()}")

    def full_step(i: int) -> int:
        toks = 0
        for j in range(args.micro_batch):
            w = wins[(i * args.micro_batch + j) % len(wins)]
            loss, _ = window_loss(drafter, head, w, cfg, weights)
            (loss / args.micro_batch).backward()
            toks += len(w.input_ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return toks

    def head_only(i: int) -> None:
        """The LM-head work of one step: per window, the target head forward once, and per draft
        position the draft head forward + backward (input gradient) and the loss on [T, V]."""
        shead = drafter.layers[0].shared_head
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

    full_step(0)  # warm-up
    head_only(0)
    rows = []
    t_full, t_head, toks = 0.0, 0.0, 0
    for i in range(1, args.steps + 1):  # interleaved so both see the same machine load
        t0 = time.perf_counter()
        toks += full_step(i)
        t_full += time.perf_counter() - t0
        t0 = time.perf_counter()
        head_only(i)
        t_head += time.perf_counter() - t0
    tok_s = toks / t_full
    rows.append(("full training step", f"{t_full / args.steps:.3f}", f"{tok_s:,.0f}", "1.00"))
    rows.append(("LM head + loss only", f"{t_head / args.steps:.3f}", "", f"{t_head / t_full:.2f}"))
    print(f"\n{'part':<22}{'s/step':>10}{'tokens/s':>12}{'share':>8}")
    for r in rows:
        print(f"{r[0]:<22}{r[1]:>10}{r[2]:>12}{r[3]:>8}")
    print(f"\npeak RSS: {peak_rss_mb():,.0f} MiB")
    print(f"LM-head share of step time: {t_head / t_full:.2f} (the rest: unrolled MTP block, eh_proj, optimizer)")
    return {"s_step": t_full / args.steps, "tok_s": tok_s, "peak_mb": peak_rss_mb()}


if __name__ == "__main__":
    main()
