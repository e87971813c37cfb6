"""The release folder: the exact tree a release sends to the Hub.

``README.md`` (the card), the fine-tuned drafter under the release's tensor names with a
``model.safetensors.index.json`` (the target's index, every drafter key pointed at the drafter file:
:func:`drafter.serving.served_model.drafter_index`), ``fp8/`` (the drop-in, its index and error
reports), ``exl3/`` when produced, ``assets/*.png`` (plots: the stages', and for MTP the live tok/s vs
concurrency drawn here from the A/B's numbers) and ``release.json`` (every metric the card shows, the config per
section with local paths redacted, stage keys, versions, the file list, the A/B's batch-size ``schedule``, the
``released`` configuration (the schedule or a fixed K, up to how many users, its ``--speculative-config``) and
``release_id``). MTP needs no server config beyond the index. A DSpark release has the draft folder
``dspark/`` (config.json + model.safetensors, what vLLM's ``method: dspark`` loads) in place of the
drafter file and index, and ``fp8/`` holds a whole FP8 draft folder. An EAGLE-3 release is the fine-tuned head
itself at the root — ``config.json`` (speculators format unless ``eagle3.layout: eagle``) and ``model.safetensors``,
what ``"model": <repo>`` in vLLM's ``method: eagle3`` config and ``vllm serve <repo>`` load — beside the card,
``release.json`` and ``assets/`` (the live tok/s plot too); no ``fp8/`` or ``exl3/`` (those stages skip an EAGLE-3
head, saying why).

``release_id`` = the first 16 hex of sha256 over the canonical JSON list of ``[path, sha256]`` of every
file except ``release.json`` (which records it): the same stage outputs give the same id.

Example::

    res = build_release_folder(cfg, inputs, out / "release", version=__version__,
                               git_commit=git_commit_of(repo_root), repo_id="org/tiny-mtp")
    print(res["release_id"], [f["path"] for f in res["files"]])
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import ClassVar

from drafter.core.errors import StageError
from drafter.core.stage import Artifact, canonical_json
from drafter.core.store import sha256_file
from drafter.core.results import Part, ResultFile
from drafter.models.dspark import DSPARK_DIR
from drafter.quant.layout import FP8_DIR
from drafter.evaluation.ab_live import ScheduleRecord
from drafter.release.card import card_context, drafter_kind, render_card, stage_reason
from drafter.release.card_speed import SPEED_PLOT, write_speed_plot
from drafter.release.redact import redact_obj
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE

RELEASE_JSON = "release.json"
CARD = "README.md"
INDEX_NAME = "model.safetensors.index.json"
EAGLE3_CONFIG, EAGLE3_WEIGHTS = "config.json", "model.safetensors"  # an EAGLE-3 head at the release's root
ASSETS = {("eval_offline", "tau_vs_k.png"): "assets/tau_vs_k.png",
          ("eval_offline", "acceptance_per_position.png"): "assets/acceptance_per_position.png",
          ("eval_offline", "reliability.png"): "assets/reliability.png",
          ("train", "curves.png"): "assets/train_curves.png"}


class ReleaseFile(Part):
    """One file of a release: its path in the folder, size and sha256 (``release.json`` itself has none)."""

    path: str
    size: int | None = None
    sha256: str | None = None


class ReleaseRecord(ResultFile):
    """``release.json`` of a release folder: the release id, what it is, every file with its sha256, every metric
    the card shows (``metrics``), the config, the stage keys, the target."""

    NAME: ClassVar[str] = RELEASE_JSON
    release_id: str
    name: str | None = None
    kind: str | None = None
    repo_id: str | None = None
    version: str | None = None
    git_commit: str | None = None
    files: list[ReleaseFile] = []
    metrics: dict = {}
    config: dict = {}
    config_hash: str | None = None
    stage_keys: dict[str, str] = {}
    target: dict = {}
    schedule: ScheduleRecord | None = None  # ab_live.json's schedule as written (none: no sweep or no live A/B)
    released: dict | None = None  # what the release serves: the schedule or a fixed K (sweep.released_record)


def write_release_record(folder: Path, doc: dict) -> Path:
    """Write ``doc`` (local paths redacted) as ``folder/release.json``; returns its path."""
    ReleaseRecord.of(doc)
    path = ReleaseRecord.path(folder)
    path.write_text(json.dumps(redact_obj(doc), indent=2, sort_keys=True, default=str) + "\n")
    return path


def safetensors_summary(path: Path) -> tuple[int, str]:
    """(tensor count, dtypes with counts) read from a safetensors header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    counts: dict[str, int] = {}
    for v in header.values():
        counts[v["dtype"]] = counts.get(v["dtype"], 0) + 1
    return len(header), ", ".join(f"{d} ×{c}" for d, c in sorted(counts.items()))


def git_commit_of(repo_dir: str | Path) -> str | None:
    """The checked-out commit of ``repo_dir`` (with ``+dirty`` when tracked files changed); None outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(repo_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo_dir), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def _what(path: str, drafter_file: str) -> str:
    from drafter.quant.dropin import ERROR_NAME  # torch: imported when a folder is built, not with this module
    from drafter.quant.verify import VerifyResult

    if path == drafter_file == EAGLE3_WEIGHTS:
        return ("the fine-tuned EAGLE-3 head (`fc`, `layers.0.*`, `norm`, `lm_head` over the draft vocabulary, "
                "`d2t`, `t2d`)")
    if path == drafter_file:
        return "the fine-tuned drafter (release tensor names)"
    if path == EAGLE3_CONFIG and drafter_file == EAGLE3_WEIGHTS:
        return "the EAGLE-3 head's config (what vLLM's `method: eagle3` loads; the speculators format names the target)"
    if path == f"{DSPARK_DIR}/config.json":
        return "the DSpark draft's config (Qwen3DSparkModel, as vLLM loads it)"
    if path == "fp8/config.json":
        return "the FP8 draft's config (with its quantization_config)"
    if path == INDEX_NAME:
        return f"the target's index with every drafter key pointed at `{drafter_file}`"
    return {"fp8/mtp-ft.safetensors": "FP8 drop-in: the fine-tuned drafter in the FP8 release's format",
            "fp8/model.safetensors.index.json": "the FP8 release's index with every drafter key pointed at `mtp-ft.safetensors`",
            f"{FP8_DIR}/{ERROR_NAME}": "FP8 error per tensor (quantize_fp8)",
            DRAFT_VOCAB_FILE: "the draft vocabulary: the tokens the drafter proposes (put it next to the served model; "
                              "read by drafter-release's vLLM plugin, ignored by a vLLM without it)",
            f"{FP8_DIR}/{VerifyResult.NAME}": "FP8 self-check and drop-in checks (verify_fp8)",
            "assets/tau_vs_k.png": "plot: offline τ vs K",
            "assets/acceptance_per_position.png": "plot: offline acceptance per draft position",
            "assets/train_curves.png": "plot: training curves",
            "assets/reliability.png": "plot: the confidence head's reliability (held-out)",
            SPEED_PLOT: "plot: live tok/s vs concurrent users (no speculation, the drafters, the released configuration)",
            CARD: "this card", RELEASE_JSON: "every metric, the config, stage keys, versions, file hashes, release id"}.get(
        path, "EXL3 form (exllamav3)" if path.startswith("exl3/") else "")


def _copy_json_redacted(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(redact_obj(json.loads(src.read_text())), indent=2, sort_keys=True) + "\n")


def _file_rows(out: Path, drafter_file: str) -> list[dict]:
    rows = []
    for p in sorted(x for x in out.rglob("*") if x.is_file()):
        rel = p.relative_to(out).as_posix()
        row = {"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p), "what": _what(rel, drafter_file),
               "tensors": None, "dtypes": None}
        if p.suffix == ".safetensors":
            row["tensors"], row["dtypes"] = safetensors_summary(p)
        rows.append(row)
    return rows


def _copy_drafter(cfg, inputs: dict[str, Artifact], trained: Path, out: Path, kind: str) -> None:
    """The fine-tuned drafter: a DSpark draft folder (config.json + model.safetensors, what vLLM loads), or the MTP
    drafter + the target's index pointed at it (+ its draft vocabulary, when it has one)."""
    from safetensors import safe_open

    from drafter.models import TRAINED_NAME
    from drafter.models.target import target_dir
    from drafter.serving.served_model import drafter_index

    if kind == "dspark":
        shutil.copytree(trained.parent, out / DSPARK_DIR)
        return
    if kind == "eagle3":  # the head folder at the root: what vLLM and speculators load from the repo
        shutil.copyfile(trained, out / EAGLE3_WEIGHTS)
        src = trained.parent / EAGLE3_CONFIG
        doc = json.loads(src.read_text())
        if redact_obj(doc) == doc:
            shutil.copyfile(src, out / EAGLE3_CONFIG)  # the bytes train wrote
        else:  # a local verifier path: not published
            _copy_json_redacted(src, out / EAGLE3_CONFIG)
        return
    shutil.copyfile(trained, out / TRAINED_NAME)
    if (trained.parent / DRAFT_VOCAB_FILE).is_file():
        shutil.copyfile(trained.parent / DRAFT_VOCAB_FILE, out / DRAFT_VOCAB_FILE)
    if stage_reason(inputs, "prepare_target") is None:
        tindex = target_dir(inputs["prepare_target"]) / INDEX_NAME
        if tindex.is_file():
            with safe_open(str(trained), framework="pt") as f:
                keys = list(f.keys())
            index = drafter_index(json.loads(tindex.read_text()), keys, TRAINED_NAME, what=TRAINED_NAME)
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _copy_quantized(inputs: dict[str, Artifact], out: Path) -> None:
    """The FP8 drop-in with its reports (JSON redacted), and the EXL3 form when produced (without its logs)."""
    from drafter.quant.verify import VerifyResult

    if stage_reason(inputs, "quantize_fp8") is None:
        src = Path(inputs["quantize_fp8"].path) / FP8_DIR
        for p in sorted(src.iterdir()) if src.is_dir() else []:
            if p.suffix == ".json":
                _copy_json_redacted(p, out / FP8_DIR / p.name)
            else:
                (out / FP8_DIR).mkdir(exist_ok=True)
                shutil.copyfile(p, out / FP8_DIR / p.name)
        if stage_reason(inputs, "verify_fp8") is None and VerifyResult.exists(inputs["verify_fp8"].path):
            _copy_json_redacted(VerifyResult.path(inputs["verify_fp8"].path), out / FP8_DIR / VerifyResult.NAME)
    if stage_reason(inputs, "quantize_exl3") is None:
        src = Path(inputs["quantize_exl3"].path) / "exl3"
        for p in sorted(x for x in src.rglob("*") if x.is_file()) if src.is_dir() else []:
            if p.name.endswith(".log"):
                continue  # converter logs carry local paths; the error json has the numbers
            dst = out / "exl3" / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if p.suffix == ".json":
                _copy_json_redacted(p, dst)
            else:
                shutil.copyfile(p, dst)


def build_release_folder(cfg, inputs: dict[str, Artifact], out: Path, *, version: str, git_commit: str | None,
                         repo_id: str | None) -> dict:
    """Write the release folder at ``out`` (absent or empty) from the finished stage outputs.

    Returns ``{"release_id", "files": [{"path", "size", "sha256"}, …], "card": "README.md"}``.
    Raises :class:`StageError` when ``out`` is not empty or the fine-tuned drafter is missing.
    """
    from drafter.models import TRAINED_NAME

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise StageError(f"release folder {out} is not empty: give a new or empty directory")
    from drafter.models.eagle3 import EAGLE3_DIR

    kind = drafter_kind(cfg)
    why = stage_reason(inputs, "train")
    drafter_file = {"dspark": f"{DSPARK_DIR}/model.safetensors", "eagle3": EAGLE3_WEIGHTS}.get(kind, TRAINED_NAME)
    train_file = f"{EAGLE3_DIR}/{EAGLE3_WEIGHTS}" if kind == "eagle3" else drafter_file
    trained = Path(inputs["train"].path) / train_file if why is None else None
    if trained is None or not trained.is_file():
        raise StageError(f"no fine-tuned drafter to release: {why or f'{trained} is missing'}")
    out.mkdir(parents=True, exist_ok=True)
    _copy_drafter(cfg, inputs, trained, out, kind)
    _copy_quantized(inputs, out)
    for (stage, name), dst in ASSETS.items():
        if stage_reason(inputs, stage) is None and (Path(inputs[stage].path) / name).is_file():
            (out / dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(inputs[stage].path) / name, out / dst)
    if kind in ("mtp", "eagle3"):
        write_speed_plot(cfg, inputs, out)  # from ab_live.json's numbers: no stage writes it

    # the card lists every file (README.md and release.json without a hash: they cannot hold their own)
    rows = _file_rows(out, drafter_file)
    rows += [{"path": CARD, "size": None, "sha256": None, "what": _what(CARD, ""), "tensors": None, "dtypes": None},
             {"path": RELEASE_JSON, "size": None, "sha256": None, "what": _what(RELEASE_JSON, ""), "tensors": None,
              "dtypes": None}]
    ctx = card_context(cfg, inputs, files=rows, repo_id=repo_id, version=version, git_commit=git_commit)
    (out / CARD).write_text(str(render_card(ctx, kind=kind)), encoding="utf-8")

    files = [{"path": r["path"], "size": r["size"], "sha256": r["sha256"]} for r in _file_rows(out, drafter_file)]
    release_id = hashlib.sha256(canonical_json([[f["path"], f["sha256"]] for f in files]).encode()).hexdigest()[:16]
    doc = {"release_id": release_id, "name": cfg.name, "kind": kind, "repo_id": repo_id, "version": version,
           "git_commit": git_commit, "files": files, "metrics": ctx["raw"], "config": ctx["config"],
           "config_hash": ctx["provenance"]["config_hash"], "stage_keys": ctx["provenance"]["stage_keys"],
           "target": {k: ctx["target"][k] for k in ("name", "base_model", "license", "source", "revision",
                                                    "chat_template_sha256")},
           "schedule": (ctx["raw"]["speed"] or {}).get("schedule"),
           "released": (ctx["raw"]["speed"] or {}).get("released")}
    rel = write_release_record(out, doc)
    files.append({"path": RELEASE_JSON, "size": rel.stat().st_size, "sha256": sha256_file(rel)})
    return {"release_id": release_id, "files": sorted(files, key=lambda f: f["path"]), "card": CARD}
