"""Generation throughput: vLLM (OpenAI API, concurrent requests) vs the in-process transformers backend.

Both backends regenerate the same built-in prompts (all assistant turns, multi-turn included) with
the same sampling settings, through the same code path as the `generate` stage
(:func:`drafter.data.generate.generate_dataset`). Reported tok/s counts generated tokens over the
generation wall time (engine start-up excluded, shown separately). Both run in float32 (vLLM's
``dtype: auto`` would downcast to bfloat16 on CPU), so greedy outputs are also compared.

Run::

    .venv/bin/python bench/generate.py                 # the embedded target (SmolLM2-135M, re-expressed)
    .venv/bin/python bench/generate.py --tiny          # the tiny random target (seconds to build)
    .venv/bin/python bench/generate.py --target DIR --num-prompts 32 --max-tokens 128 --concurrency 8
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.core.config import GenerateConfig, ServingConfig  # noqa: E402
from drafter.core.files import iter_rows  # noqa: E402
from drafter.data.generate import OpenAIChatBackend, TransformersBackend, generate_dataset  # noqa: E402
from drafter.data.prompts import builtin_prompts  # noqa: E402


def embedded_target(cache: Path) -> Path:
    """The embedded SmolLM2-135M-Instruct re-expressed as GLM-4-MoE + MTP (built once, cached)."""
    from drafter.models.target import load_original, reexpress_as_glm4_moe_mtp

    model_dir = cache / "embedded-target"
    if not (model_dir / "config.json").is_file():
        print(f"building the embedded target in {model_dir} ...", file=sys.stderr)
        model, tok = load_original()
        tmp = Path(tempfile.mkdtemp(prefix="embedded-target.tmp-", dir=cache))
        reexpress_as_glm4_moe_mtp(model, tok, tmp / "m")
        (tmp / "m").rename(model_dir)
        tmp.rmdir()
    return model_dir


def tiny_target(cache: Path) -> Path:
    from tests.helpers.targets import make_tiny_target

    model_dir = cache / "tiny-target"
    if not (model_dir / "config.json").is_file():
        make_tiny_target(model_dir)
    return model_dir


def run_backend(name: str, model_dir: Path, convs, cfg: GenerateConfig, work: Path, serving: ServingConfig) -> dict:
    out = work / name
    startup = None
    t0 = time.monotonic()
    if name == "transformers":
        backend = TransformersBackend(model_dir, dtype="float32")
        startup = time.monotonic() - t0
        summary = generate_dataset(convs, backend, out, cfg, target={"name": str(model_dir)})
    else:
        from drafter.serving.server import serve

        with serve(model_dir, serving, log_path=work / "vllm.log") as srv:
            startup = time.monotonic() - t0
            backend = OpenAIChatBackend(srv.base_url, srv.model, engine="vllm", engine_version=srv.engine_version or "",
                                        timeout_s=cfg.request_timeout_s, max_connections=cfg.concurrency)
            summary = generate_dataset(convs, backend, out, cfg, target={"name": str(model_dir)})
    summary["startup_s"] = startup
    summary["rows_by_id"] = {r["id"]: r for r in iter_rows(out / "shards")}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tiny", action="store_true", help="use the tiny random target instead of the embedded one")
    src.add_argument("--target", type=Path, help="an HF checkpoint directory vLLM can serve")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight to vLLM (transformers runs one at a time)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/drafter-release/bench").expanduser())
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    args.cache.mkdir(parents=True, exist_ok=True)
    model_dir = args.target or (tiny_target(args.cache) if args.tiny else embedded_target(args.cache))
    cfg = GenerateConfig(num_prompts=args.num_prompts, max_tokens=args.max_tokens, concurrency=args.concurrency,
                         temperature=args.temperature, shard_size=max(args.num_prompts, 1), max_failed_fraction=0.0)
    serving = ServingConfig(dtype="float32")
    convs = builtin_prompts(args.num_prompts, seed=cfg.seed)
    turns = sum(c.num_assistant_turns for c in convs)

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as work:
        for name in ("transformers", "vllm"):
            results[name] = run_backend(name, model_dir, convs, cfg, Path(work), serving)

    hf, vl = results["transformers"], results["vllm"]
    same = sum(
        [t["token_ids"] for t in vl["rows_by_id"][i]["turns"]] == [t["token_ids"] for t in hf["rows_by_id"][i]["turns"]]
        for i in hf["rows_by_id"] if i in vl["rows_by_id"])

    print(f"\ngeneration throughput — target {model_dir.name}, {len(convs)} prompts ({turns} assistant turns), "
          f"max_tokens {cfg.max_tokens}, temperature {cfg.temperature:g}, float32\n")
    print(f"| backend      | version  | in flight | tokens | gen s  | tok/s   | start-up s |")
    print(f"|--------------|----------|-----------|--------|--------|---------|------------|")
    for name, r, conc in (("transformers", hf, 1), ("vllm", vl, cfg.concurrency)):
        print(f"| {name:<12} | {r['engine_version']:<8} | {conc:>9} | {r['tokens_generated']:>6} | "
              f"{r['generation_seconds']:>6.1f} | {r['tok_per_s']:>7.1f} | {r['startup_s']:>10.1f} |")
    ratio = vl["tok_per_s"] / hf["tok_per_s"] if hf["tok_per_s"] else float("nan")
    print(f"\nratio vLLM / transformers: {ratio:.2f}x")
    print(f"greedy agreement: {same}/{len(hf['rows_by_id'])} conversations with identical token ids"
          if cfg.temperature == 0 else "")
    if args.json:
        keep = ("tokens_generated", "generation_seconds", "tok_per_s", "startup_s", "engine_version", "requests", "failed")
        args.json.write_text(json.dumps({
            "target": str(model_dir), "prompts": len(convs), "turns": turns, "max_tokens": cfg.max_tokens,
            "concurrency": cfg.concurrency, "ratio": ratio, "greedy_identical_rows": same,
            **{n: {k: r[k] for k in keep} for n, r in results.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
