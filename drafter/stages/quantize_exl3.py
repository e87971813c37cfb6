"""`quantize_exl3` stage: the EXL3 form of the fine-tuned drafter, made by exllamav3's converter.

Inputs: the target (config, tokenizer, shared embedding) and the fine-tuned drafter
(``train``'s ``mtp-trained.safetensors``).
Computes: first, in the configured CUDA Python (``quantize_exl3.python``, this one by default), a
probe; without CUDA, the CUDA toolkit or exllamav3 the stage ends **skipped** with the probe's
finding (``needs CUDA: …``) and writes nothing. Otherwise it presents the MTP layer to exllamav3 as a
one-layer model of the target's architecture (decoder block → layer 0, ``shared_head`` → final norm
and ``lm_head``, the shared embedding; see :mod:`drafter.quant.exl3`), runs the converter with
``bits``, ``head_bits`` and the per-tensor ``overrides`` (an exllamav3 recipe), validates its output
and dequantizes every EXL3 tensor with exllamav3 to measure its relative error. ``enorm``, ``hnorm``
and ``eh_proj`` have no slot in that model: they are not converted (kept BF16, said so per tensor).
A DSpark draft (``dspark/``) or an EAGLE-3 head (``eagle3/``) in the train output: skipped, with the reason —
exllamav3 has neither architecture.
Writes: ``exl3/model/`` (exllamav3's output: ``config.json`` with ``quantization_config``,
``quantization_config.json``, ``model.safetensors``, tokenizer), ``exl3/mtp-input-layer.safetensors``
(the unconverted tensors, release names), ``exl3/names.json`` (EXL3 name ↔ release name),
``exl3/exl3-error.json`` (per-tensor bits and relative error), ``exl3/convert.log``.
Reports: achieved bits, head bits, tensors converted / not converted, mean and max relative error,
size, converter seconds.
"""
from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError, StageSkipped
from drafter.models import TRAINED_NAME, layout_for, load_drafter
from drafter.models.dspark import DSPARK_DIR
from drafter.models.eagle3 import EAGLE3_DIR
from drafter.quant import exl3
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir

OUT_DIR = "exl3"
ERROR_JSON = "exl3-error.json"


def drafter_presentation(model_dir: Path):
    """The layout of the target's drafter and its one-layer presentation (names and shapes only)."""
    layout = layout_for(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    drafter = layout.build(config, device="meta")
    shapes = {k: tuple(v.shape) for k, v in layout.to_release(drafter).items()}
    return layout, exl3.plan_presentation(config, shapes)


@functools.lru_cache(maxsize=8)
def probe(python: str) -> exl3.Probe:
    """The CUDA probe of ``python``, once per process."""
    return exl3.probe_python(python)


def environment(cfg: ReleaseConfig) -> dict | None:
    """Part of the key: whether the configured Python can convert (and with which exllamav3), so a
    result skipped on a CPU machine is not reused by a CUDA machine sharing the store."""
    c = cfg.quantize_exl3
    if not c.enabled:
        return None
    p = probe(c.python or sys.executable)
    return {"exl3_ready": p.ok, "exllamav3": p.info.get("exllamav3")}


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.quantize_exl3
    if not c.enabled:
        raise StageSkipped("disabled: quantize_exl3.enabled is false")
    model_dir = target_dir(inputs["prepare_target"])
    weights = inputs["train"].path / TRAINED_NAME
    if not weights.is_file() and (inputs["train"].path / DSPARK_DIR / "config.json").is_file():
        raise StageSkipped("the drafter is a DSpark block draft: exllamav3 has no DSpark architecture to quantize "
                           "(vLLM serves the draft from its BF16/F32 tensors or the FP8 form)")
    if not weights.is_file() and (inputs["train"].path / EAGLE3_DIR / "config.json").is_file():
        raise StageSkipped("the drafter is an EAGLE-3 head: exllamav3 has no EAGLE-3 head architecture to quantize "
                           "(vLLM serves the head from its BF16/F32 tensors)")
    if not weights.is_file():
        raise StageError(f"{weights}: the fine-tuned drafter is missing from the train output")
    layout, pres = drafter_presentation(model_dir)
    plan = exl3.plan_bits(pres, c.bits, c.head_bits, c.overrides, c.codebook)  # bad overrides fail on any machine

    found = probe(c.python or sys.executable)
    if not found.ok:
        raise StageSkipped(found.missing)

    dest, in_dir, work = out / OUT_DIR, out / "input", out / "work"
    model_out, log = dest / "model", dest / "convert.log"
    dest.mkdir(parents=True, exist_ok=True)
    resume = (work / "args.json").is_file() and (work / "ckpt" / "job.json").is_file()
    tensors = layout.to_release(load_drafter(model_dir, layout, weights=weights))
    exl3.write_input_dir(pres, tensors, model_dir, in_dir)
    recipe = None
    if plan.recipe is not None:
        import yaml

        recipe = out / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(plan.recipe, sort_keys=False))
    if not resume and model_out.exists():
        shutil.rmtree(model_out)
    cmd = exl3.converter_command(found.python, in_dir, model_out, work, bits=plan.bits, head_bits=plan.head_bits,
                                 recipe=recipe, codebook=c.codebook, cal_rows=c.cal_rows, cal_cols=c.cal_cols,
                                 resume=resume, extra_args=c.extra_args)
    t0 = time.monotonic()
    lines = exl3.run_converter(cmd, log, total=len(pres.quantized) + 1, timeout_s=c.timeout_s)
    convert_s = time.monotonic() - t0

    checked = exl3.validate_output(model_out, pres, plan, codebook=c.codebook)
    keys = sorted(checked["per_tensor_bits"])
    dequant, why_not = exl3.measure_errors(found.python, in_dir, model_out, keys, out / "dequant.json", log,
                                           timeout_s=c.timeout_s)
    meta = {"exllamav3": found.info.get("exllamav3"), "torch": found.info.get("torch"),
            "devices": found.info.get("devices"), "architecture": pres.arch, "codebook": c.codebook,
            "requested_bits": c.bits, "recipe": plan.recipe, "convert_seconds": round(convert_s, 1)}
    report = exl3.error_report(pres, plan, checked, dequant, why_not, exl3.parse_converter_log(lines), meta)

    from drafter.core.files import save_safetensors

    save_safetensors({rel: tensors[rel].detach().to("cpu").bfloat16().contiguous() for rel in pres.not_converted},
              str(dest / "mtp-input-layer.safetensors"), metadata={"format": "pt", "layout": layout.name})
    (dest / "names.json").write_text(json.dumps(pres.to_json(), indent=2))
    (dest / ERROR_JSON).write_text(json.dumps(report, indent=2))
    for tmp in (in_dir, work, out / "dequant.json", out / "recipe.yaml"):
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
    return {
        "bits": round(checked["bits"], 3), "head_bits": checked["head_bits"], "converted": len(checked["per_tensor_bits"]),
        "not_converted": len(pres.not_converted),
        "overrides_not_applied": sum(len(o["not_applied"]) for o in plan.overrides.values()),
        "mean_rel_error": report["mean_rel_error"], "max_rel_error": report["max_rel_error"],
        "size_mb": round(checked["size_bytes"] / 2**20, 2), "convert_seconds": round(convert_s, 1),
        "exllamav3": found.info.get("exllamav3"),
    }


STAGE = Stage(
    name="quantize_exl3",
    version="1",
    inputs=("prepare_target", "train"),
    sections=("quantize_exl3",),
    run=run,
    fingerprint=environment,
    description="EXL3 form of the fine-tuned drafter with exllamav3 (CUDA only; skipped with the reason elsewhere): "
                "decoder block and head converted, enorm/hnorm/eh_proj kept BF16, per-tensor relative error",
)
