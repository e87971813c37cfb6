"""`verify_fp8` stage: byte-level verification of the FP8 release rule and of the drop-in.

Inputs: the target and ``quantize_fp8``'s output (its drop-in, and the release it was made against).
Part 1, the release self-check (:mod:`drafter.quant.verify`): every FP8 tensor of the release is
dequantized and quantized again with our rule; blocks are counted byte-identical / rounding-edge /
differ, per tensor and in total. Any ``differ`` means our rule is wrong for this release: the stage
fails naming the tensors and their first differing block.
Part 2, the drop-in (:func:`drafter.quant.dropin.check_dropin`): same key set, dtypes and shapes as
the release; untouched tensors hash-equal to the release; the index valid and pointing exactly the
drafter keys at the drop-in. Then (``verify_fp8.vllm_load``) vLLM serves the target with the drop-in
as its MTP drafter and generates; where the engine has no FP8 kernel for this machine that is
recorded as ``unsupported: <the engine's reason>`` — never as a pass.
Writes: ``verify.json``, ``verify.md`` (and ``vllm.log`` when vLLM ran).
Reports: blocks_identical, blocks_edge, blocks_differ, blocks_total, dropin_keys_ok, vllm_load.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError, StageSkipped
from drafter.core.progress import progress
from drafter.quant.dropin import DROPIN_NAME, check_dropin
from drafter.quant.release import FP8Release, is_drafter_key, open_release
from drafter.quant.layout import FP8_DIR, FP8ReleaseInfo, release_dir
from drafter.quant.verify import save_verify, self_check
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir

# lines of a vLLM log that say the engine cannot run FP8 on this machine (as opposed to a bad checkpoint)
# (the block-shape refusal: the engine's kernels need every partition a multiple of the block, as real releases are)
UNSUPPORTED_PATTERNS = (r"Failed to find a kernel that can implement", r"requires AMX", r"not supported on (the )?CPU",
                        r"FP8 .* not supported", r"does not support .*fp8",
                        r"is not divisible by weight quantization block")


def unsupported_reason(log_text: str) -> str | None:
    """The engine's own words when it cannot run block FP8 here; None when the log says nothing of the kind."""
    lines = [re.sub(r"^.*?\] ", "", ln).strip() for ln in log_text.splitlines()]
    hits = [ln for ln in lines if any(re.search(p, ln) for p in UNSUPPORTED_PATTERNS)]
    if not hits:
        return None
    seen: list[str] = []
    for h in hits:
        h = h.split("ValueError: ", 1)[-1]
        if h not in seen:
            seen.append(h)
    return " ".join(seen)[:500]


def serving_quant_config(release: FP8Release, target: Path) -> dict:
    """The release's ``quantization_config`` with every linear layer that is not FP8 in the drop-in
    listed in ``ignored_layers`` (the target's own layers when only its MTP layer is FP8)."""
    qc = dict(release.config.get("quantization_config") or {})
    tcfg = json.loads((target / "config.json").read_text())
    wm = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    if (tcfg.get("quantization_config") or {}).get("quant_method") == "fp8":
        return qc  # the target itself is FP8: its own config already says what is quantized
    ignored: set[str] = set()
    for k in wm:
        if not k.endswith(".weight") or k in release.fp8 or "norm" in k.split(".")[-2]:
            continue
        mod = k[: -len(".weight")]
        ignored.add(mod)
        m = re.match(r"^(.*\.experts)\.\d+\.", k)
        if m and not any(f.startswith(m.group(1) + ".") for f in release.fp8):
            ignored.add(m.group(1))
    qc["ignored_layers"] = sorted(ignored)
    return qc


def vllm_load(cfg: ReleaseConfig, release: FP8Release, target: Path, fp8_dir: Path, out: Path) -> str:
    """Serve target + drop-in with MTP speculation and generate; ``ok`` / ``unsupported: …``; raises otherwise."""
    import httpx

    from drafter.serving.served_model import drafter_model_dir
    from drafter.serving.server import ServingError, serve

    tcfg = json.loads((target / "config.json").read_text())
    qc = serving_quant_config(release, target)
    served = drafter_model_dir(target, fp8_dir / DROPIN_NAME, out / "served-fp8",
                               config_updates={"quantization_config": qc},
                               allow_new_keys=not any(is_drafter_key(k, tcfg) and k.endswith(("_scale_inv", ".scale"))
                                                      for k in json.loads((target / "model.safetensors.index.json")
                                                                          .read_text())["weight_map"]))
    log = out / "vllm.log"
    serving = cfg.serving
    if serving.dtype == "float32":  # vLLM's fp8 method computes in bfloat16/float16 only
        serving = serving.model_copy(update={"dtype": "bfloat16"})
    try:
        with serve(served, serving, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                   log_path=log) as srv:
            r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": srv.model, "prompt": "The capital of France is",
                           "max_tokens": 8, "temperature": 0}, timeout=cfg.serving.startup_timeout_s)
            r.raise_for_status()
            text = r.json()["choices"][0]["text"]
            if not text:
                raise StageError(f"vLLM served the FP8 drop-in but generated nothing (log {log})")
            return "ok"
    except ServingError as e:
        reason = unsupported_reason(log.read_text(errors="replace")) if log.is_file() else None
        if reason:
            return f"unsupported: {reason}"
        raise StageError(f"vLLM could not load the FP8 drop-in ({e}); log {log}") from e
    finally:
        import shutil

        shutil.rmtree(out / "served-fp8", ignore_errors=True)  # links and rewritten shards: not an output


def render_md(doc: dict) -> str:
    t = doc["self_check"]["totals"]
    lines = [f"# FP8 verification ({doc['release']['rule']}, {doc['release']['block'][0]}×{doc['release']['block'][1]} blocks)",
             "", "## Part 1: release self-check", "",
             f"Blocks: {t['total']} — byte-identical {t['identical']}, rounding-edge {t['edge']}, differ {t['differ']}.",
             "", "| tensor | blocks | identical | edge | differ |", "|---|---|---|---|---|"]
    for name, c in doc["self_check"]["tensors"].items():
        lines.append(f"| `{name}` | {c['blocks']} | {c['identical']} | {c['edge']} | {c['differ']} |")
    d = doc["dropin"]
    lines += ["", "## Part 2: the drop-in", "",
              f"- key set, dtypes, shapes, index: {'ok' if d['ok'] else 'FAILED'} ({d['keys']} keys)",
              f"- untouched tensors byte-identical to the release: {d['kept_hash_equal']}/{d['kept']}",
              f"- vLLM load: {doc['vllm_load']}"]
    if d["problems"]:
        lines += [f"  - {p}" for p in d["problems"]]
    return "\n".join(lines) + "\n"


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    tdir = target_dir(inputs["prepare_target"])
    qa = inputs["quantize_fp8"]
    if qa.status == "skipped":
        raise StageSkipped(f"no FP8 drop-in to verify: quantize_fp8 was skipped ({qa.manifest.get('reason')})")
    rdir = release_dir(qa, tdir)
    release = open_release(rdir)
    if release is None:
        raise StageError(f"{rdir}: the release has no FP8 drafter tensors to verify")
    with progress("verify_fp8 self-check", total=len(release.fp8), unit="tensors") as bar:
        report = self_check(release, progress=lambda _n: bar.advance(1))
    doc = {"release": {"dir": str(rdir), "rule": release.rule, "block": list(release.block)},
           "self_check": report.as_dict()}
    save_verify(out, doc)
    if report.failed:
        where = "; ".join(f"{c.name}: {c.differ}/{c.blocks} blocks differ, first at block {c.first_differ}"
                          for c in report.failed[:10])
        raise StageError(f"FP8 self-check of {rdir}: our {release.rule} {release.block[0]}×{release.block[1]} rule does not "
                         f"reproduce the release ({where})")
    fp8_dir = Path(qa.path) / FP8_DIR
    doc["dropin"] = check_dropin(release, fp8_dir)
    if not doc["dropin"]["ok"]:
        save_verify(out, doc)
        raise StageError(f"FP8 drop-in {fp8_dir} failed its checks: " + "; ".join(doc["dropin"]["problems"][:10]))
    dspark = FP8ReleaseInfo.load(qa.path).drafter == "dspark"
    if not cfg.verify_fp8.vllm_load:
        doc["vllm_load"] = "skipped (verify_fp8.vllm_load: false)"
    elif dspark:  # the FP8 draft folder is served as method dspark, which vLLM 0.32 runs on GPUs only
        doc["vllm_load"] = "not run: a DSpark draft is served as vLLM's method dspark (GPUs only; bench/dspark_gpu.sh)"
    else:
        doc["vllm_load"] = vllm_load(cfg, release, tdir, fp8_dir, out)
    save_verify(out, doc)
    (out / "verify.md").write_text(render_md(doc))
    t = report.totals
    return {"rule": f"{release.rule} {release.block[0]}x{release.block[1]}", "blocks_identical": t["identical"], "blocks_edge": t["edge"], "blocks_differ": t["differ"],
            "blocks_total": t["total"], "fp8_tensors": len(report.tensors), "dropin_keys_ok": doc["dropin"]["ok"],
            "vllm_load": doc["vllm_load"]}


STAGE = Stage(
    name="verify_fp8",
    version="1",
    inputs=("prepare_target", "quantize_fp8"),
    sections=("verify_fp8", "serving"),
    run=run,
    description="Byte-level FP8 verification: release self-check, drop-in checks, vLLM load",
)
