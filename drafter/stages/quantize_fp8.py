"""`quantize_fp8` stage: the FP8 drop-in of the fine-tuned drafter, in the release's own format.

Inputs: the target, the bootstrap (demo) and the fine-tuned drafter (``train``'s
``mtp-trained.safetensors``, release names, float).
The release: the target checkpoint's own FP8 MTP tensors when its drafter is FP8 (e.g. DeepSeek-V3;
rule and block from config.json ``quantization_config`` or the scale dtype). The demo's embedded
target is float32 with no FP8 release: then the stand-in release is the bootstrap's (released)
drafter written by the independent reference implementation (:mod:`drafter.quant.reference`) with
rule ``quantize_fp8.demo_release_scale``, as ``release/`` here.
A target whose drafter is not FP8 (and no bootstrap): skipped — there is no FP8 form to match.
Computes: every drafter tensor in the release's format (:mod:`drafter.quant.dropin`): changed FP8
weights quantized by the release's rule, unchanged ones (frozen routed experts) as the release's
exact bytes, the rest cast to the release's dtype.
DSpark (``dspark.enabled``): the same against the released draft folder's FP8 form, or on the demo a
stand-in of the bootstrap's draft (its decoder layers' linear weights in FP8); ``fp8/`` then also holds
the release's ``config.json``, so it is a whole draft folder vLLM loads.
EAGLE-3 (``eagle3.enabled``): an FP8 drop-in would match a released head in FP8; when the released head
(``train.init`` or the bootstrap's stand-in) has no FP8 tensors — the demo's and ordinary speculators heads are
float/bf16 — the stage is skipped saying so (the fine-tuned head ships in the release's own dtype). An FP8
released head is skipped too: an FP8 drop-in of an EAGLE-3 head is not implemented.
Writes: ``fp8/mtp-ft.safetensors``, ``fp8/model.safetensors.index.json`` (the release's index with
every drafter key pointed at the new file), ``fp8/fp8-error.json``, ``release.json``.
Reports: tensors, FP8 tensors, kept and cast tensors, the largest relative FP8 error and its tensor.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError, StageSkipped
from drafter.models import TRAINED_NAME
from drafter.core.progress import progress
from drafter.quant.dropin import build_dropin
from drafter.models.dspark import DSPARK_DIR
from drafter.quant.layout import FP8_DIR, STANDIN_DIR, FP8ReleaseInfo
from drafter.quant.release import FP8_DTYPES, open_release, tensor_infos
from drafter.quant.standin import write_standin_dspark_release, write_standin_release
from drafter.release.baselines import released_draft, released_head, released_weights
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir

def _float_reader(path: Path):
    from safetensors import safe_open

    def read(name: str):
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name).float() if name in f.keys() else None
    return read


def _dspark_release(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path):
    """(release, source, start reader, trained file) for a DSpark draft: the released folder's own FP8
    form when it has one, else — the demo's bootstrap — a stand-in written by the reference code."""
    c = cfg.quantize_fp8
    trained = Path(inputs["train"].path) / DSPARK_DIR / "model.safetensors"
    if not trained.is_file():
        raise StageError(f"{trained} is missing: the train stage's output has no fine-tuned DSpark draft")
    released = released_draft(cfg, inputs)
    if (released / "model.safetensors.index.json").is_file() and open_release(released) is not None:
        return open_release(released), "released", None, trained
    if cfg.dspark.released:
        raise StageSkipped(f"the released DSpark draft {released} is not FP8: there is no FP8 release to match; "
                           "the fine-tuned tensors ship in the release's own dtype")
    rule = c.demo_release_scale if c.scale == "auto" else c.scale
    write_standin_dspark_release(released, out / STANDIN_DIR, rule, tuple(c.block) if c.block else None)
    return open_release(out / STANDIN_DIR), "stand-in", _float_reader(released / "model.safetensors"), trained


def _eagle3_skip(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> StageSkipped:
    """Why an EAGLE-3 release has no FP8 form: its released head is not FP8 (the usual case), or it is and an
    FP8 drop-in of an EAGLE-3 head is not implemented."""
    head = released_head(cfg, inputs)
    files = {p.name for p in head.glob("*.safetensors")}
    if not files:
        raise StageError(f"the released EAGLE-3 head {head} has no *.safetensors files")
    infos = tensor_infos(head, files)
    fp8 = sorted(k for k, t in infos.items() if t.dtype in FP8_DTYPES)
    if not fp8:
        return StageSkipped(f"the released EAGLE-3 head {head} is not FP8: there is no FP8 release to match; the "
                            "fine-tuned head ships in the release's own dtype")
    return StageSkipped(f"the released EAGLE-3 head {head} has {len(fp8)} FP8 tensor(s) (e.g. {fp8[0]}), but an FP8 "
                        "drop-in of an EAGLE-3 head is not implemented: the fine-tuned head ships unquantized")


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.quantize_fp8
    if cfg.eagle3.enabled:
        raise _eagle3_skip(cfg, inputs)
    tdir = target_dir(inputs["prepare_target"])
    if cfg.dspark.enabled:
        release, source, start, trained = _dspark_release(cfg, inputs, out)
        return _dropin(release, source, start, trained, out, tdir, drafter="dspark")
    trained = Path(inputs["train"].path) / TRAINED_NAME
    if not trained.is_file():
        raise StageError(f"{trained} is missing: the train stage's output has no fine-tuned drafter")
    release = open_release(tdir)
    start = None
    if release is None:
        released = released_weights(inputs["bootstrap_drafter"])
        if released is None:
            raise StageSkipped(f"the released drafter in {tdir} is not FP8 (no FP8 MTP tensors in its index): "
                               "there is no FP8 release to match; the fine-tuned tensors ship in the release's own dtype")
        rule = c.demo_release_scale if c.scale == "auto" else c.scale
        write_standin_release(tdir, released, out / STANDIN_DIR, rule, tuple(c.block) if c.block else None)
        release, source = open_release(out / STANDIN_DIR), "stand-in"
        start = _float_reader(released)  # what training started from: unchanged tensors keep the release's bytes
    else:
        source = "target"
        if c.scale != "auto" and c.scale != release.rule:
            raise StageError(f"quantize_fp8.scale={c.scale} but the release {tdir} uses {release.rule} scales")
        if c.block and tuple(c.block) != release.block:
            raise StageError(f"quantize_fp8.block={c.block} but the release {tdir} uses {list(release.block)} blocks")
    return _dropin(release, source, start, trained, out, tdir, drafter="mtp")


def _dropin(release, source: str, start, trained: Path, out: Path, tdir: Path, drafter: str) -> Metrics:
    with progress("quantize_fp8", total=len(release.drafter_keys), unit="tensors") as bar:
        doc = build_dropin(release, trained, out / FP8_DIR, start=start, progress=lambda _k: bar.advance(1))
    if drafter == "dspark":  # the FP8 folder is a whole draft vLLM loads: its config (with quantization_config) too
        shutil.copyfile(release.dir / "config.json", out / FP8_DIR / "config.json")
    where = STANDIN_DIR if source == "stand-in" else str(release.dir if drafter == "dspark" else tdir)
    FP8ReleaseInfo.write(out, {"source": source, "dir": where, "rule": release.rule, "block": list(release.block),
                               "drafter": drafter})
    s = doc["summary"]
    return {"release": source, "rule": s["rule"], "block": "x".join(map(str, s["block"])), "tensors": s["tensors"],
            "fp8_tensors": s["fp8_tensors"], "kept_tensors": s["kept_tensors"], "cast_tensors": s["cast_tensors"],
            "max_fp8_rel_error": s["max_fp8_rel_error"], "max_fp8_rel_error_tensor": s["max_fp8_rel_error_tensor"],
            "max_moved_rel": s["max_moved_rel"]}


STAGE = Stage(
    name="quantize_fp8",
    version="1",
    inputs=("prepare_target", "bootstrap_drafter", "train"),
    sections=("quantize_fp8", "dspark", "eagle3"),  # eagle3: None while disabled, keys unchanged
    run=run,
    description="FP8 drop-in of the fine-tuned drafter in the release's own format (rule, names, untouched bytes)",
)
