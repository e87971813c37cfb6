"""One training run as a stage needs it: load the drafter and data, train (resumable), write the
tensors under the release's names, the curves and the results. Shared by `bootstrap_drafter`
and `train` (and its loss ablations).

The run's ``result.json`` (:data:`RESULT_JSON`) is read through :class:`TrainResult`
(``TrainResult.load(train_dir)``).

Example::

    res = run_training(model_dir, capture_artifact, cfg.train, out_dir, weights=None)
    TrainResult.of(res).final.t0.tau
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch

from drafter.core import procs
from drafter.core.config import TrainConfig
from drafter.models import TRAINED_NAME, layout_for, load_drafter, save_drafter
from drafter.models.dspark import DSPARK_DIR
from drafter.models.target import read_tensor
from drafter.core.errors import StageError
from drafter.core.hardware import describe, device_label, resolve_device
from drafter.training.frozen import restore_frozen
from drafter.training.loop import dist_info, plot_curves, train
from drafter.data.windows import in_calibration_slice, load_windows
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, build_draft_vocab, save_draft_vocab
from drafter.core.results import Part, ResultFile

RESULT_JSON = "result.json"


class RuleCheck(Part):
    """Held-out acceptance under one rule: τ and α per position."""

    tau: float
    alpha: list[float] = []


class HeldoutCheck(Part):
    """A held-out check of the drafter (before or after training) per rule; a DSpark draft's confidence head adds
    its ``calibration`` (ECE None: no held-out position to calibrate on)."""

    t0: RuleCheck
    t1_greedy: RuleCheck
    t1_prob: RuleCheck | None = None
    calibration: dict | None = None


class TrainResult(ResultFile):
    """``result.json`` of a training run (``train``, its ablations, ``bootstrap_drafter``). Outputs from before a
    field was recorded lack it: ``world_size`` (1), ``device``, ``experts``, ``hardware``, ``draft_vocab``, ``recalibration``, ``compiled``."""

    NAME: ClassVar[str] = RESULT_JSON
    baseline: HeldoutCheck
    final: HeldoutCheck
    trainable: int
    frozen: int | None = None
    seconds: float
    tokens: int | None = None
    tokens_per_s: float
    resumed_from: Any = None
    world_size: int = 1
    layout: str | None = None
    loss: str | None = None
    k_steps: int | None = None
    block_size: int | None = None
    anchors: int | None = None
    train_windows: int | None = None
    eval_windows: int | None = None
    weights_in: str | None = None
    draft_vocab: dict | None = None
    recalibration: dict | None = None
    fresh_process: bool | None = None
    device: str | None = None
    experts: str | None = None
    frozen_dtype: str | None = None
    compiled: int | None = None  # the layers train.compile compiled (0: eager)
    dtype: str | None = None  # the compute dtype the run used (train.dtype, auto resolved)
    hardware: dict | None = None


def load_train_result(out: str | Path) -> TrainResult:
    """A training output's :class:`TrainResult`."""
    return TrainResult.load(out)


def _finished(out: Path, weights_file: Path) -> dict | None:
    """The result of a finished run in ``out`` (``result.json`` and the weights present), else None."""
    if TrainResult.exists(out) and weights_file.is_file():
        return load_train_result(out).raw
    return None


def run_training(model_dir: Path, capture, cfg: TrainConfig, out: Path, *, weights: Path | None = None,
                 title: str = "drafter training", log=print) -> dict:
    """Train in ``out/work`` (checkpoints there; a retry resumes), then write into ``out``:
    ``mtp-trained.safetensors``, ``curves.png``, ``history.jsonl``, ``result.json``. Returns the result.
    A finished run (``result.json`` present) is not trained again."""
    out.mkdir(parents=True, exist_ok=True)
    if (done := _finished(out, out / TRAINED_NAME)) is not None:
        return done
    rank, world = dist_info()
    if cfg.nproc_per_node > 1 and world == 1:
        return _launch_torchrun(model_dir, capture, cfg, out, weights, title)
    if world == 1 and not os.environ.get(CHILD_ENV):
        return _launch_child(model_dir, capture, cfg, out, weights, title, log)
    device = resolve_device(cfg.device)
    layout = layout_for(model_dir)
    drafter = load_drafter(model_dir, layout, weights=weights).to(device)
    head = read_tensor(model_dir, "lm_head.weight", torch.float32).to(device)
    train_w = load_windows(capture, "train", cfg.data_part, cfg.window, min_tokens=cfg.k_steps + 2)
    eval_w = load_windows(capture, "heldout", "all", cfg.window, min_tokens=cfg.k_steps + 2, max_windows=cfg.eval_windows)
    # the draft vocabulary is chosen before training: the drafter trains over it, as it will be served
    ids = (build_draft_vocab((w.input_ids.tolist() for w in train_w), vocab_size=head.shape[0], size=cfg.draft_vocab_size)
           if cfg.draft_vocab_size else None)
    res = train(drafter, head, train_w, eval_w, cfg, out / "work", log=log, draft_vocab=ids)
    if rank != 0:
        return {}
    if res.get("frozen_dtype", "float32") != "float32":  # the written frozen tensors keep their loaded values
        restore_frozen(drafter, load_drafter(model_dir, layout, weights=weights))
    save_drafter(drafter.cpu(), out / TRAINED_NAME, layout, getattr(torch, cfg.save_dtype))
    vocab = write_draft_vocab(capture, ids, cfg, out, head.shape[0]) if ids is not None else None
    return _finish(res, out, title, {"layout": layout.name, "loss": cfg.loss, "k_steps": cfg.k_steps,
                                     "train_windows": len(train_w), "eval_windows": len(eval_w),
                                     "weights_in": str(weights) if weights else None, "draft_vocab": vocab,
                                     "fresh_process": bool(os.environ.get(CHILD_ENV)) and world == 1,
                                     "device": device_label(device)})


def write_draft_vocab(capture, ids: list[int], cfg: TrainConfig, out: Path, vocab_size: int) -> dict:
    """``out/draft_vocab.safetensors`` holding ``ids`` (built from the training windows' tokens, trained
    over); returns its size and the share of the held-out split's assistant tokens it holds (a token
    outside it can never be drafted)."""
    save_draft_vocab(ids, out / DRAFT_VOCAB_FILE, metadata={"built_from": "train windows", "size": str(len(ids))})
    held = load_windows(capture, "heldout", "all", cfg.window, min_tokens=1)
    toks = torch.cat([w.input_ids[w.loss_mask] for w in held]) if held else torch.zeros(0, dtype=torch.long)
    inside = torch.isin(toks, torch.tensor(ids)).float().mean().item() if len(toks) else None
    return {"size": len(ids), "vocab_size": vocab_size, "file": DRAFT_VOCAB_FILE,
            "heldout_coverage": None if inside is None else round(inside, 4), "heldout_tokens": len(toks),
            "trained_over": True}


def _finish(res: dict, out: Path, title: str, extra: dict) -> dict:
    """The curves, ``history.jsonl`` and ``result.json`` (written last) of a finished training; the
    checkpoints in ``out/work`` served their purpose and go."""
    plot_curves(res["history"], out / "curves.png", title)
    with open(out / ".history.jsonl.tmp", "w") as f:
        for h in res["history"]:
            f.write(json.dumps(h) + "\n")
    (out / ".history.jsonl.tmp").replace(out / "history.jsonl")
    result = {k: v for k, v in res.items() if k != "history"} | extra | {"hardware": describe()}
    TrainResult.write(out, result)
    shutil.rmtree(out / "work", ignore_errors=True)
    return result


def target_embedding(model_dir: Path) -> torch.nn.Embedding:
    """The target's token embedding, frozen (a DSpark draft shares it, as vLLM serves it)."""
    w = read_tensor(model_dir, "model.embed_tokens.weight", torch.float32)
    return torch.nn.Embedding.from_pretrained(w, freeze=True)


def dspark_evaluate(draft, embed, head: torch.Tensor, windows) -> dict:
    """Held-out block acceptance under the three rules (JSON values) and, with a confidence head, its
    calibration (``calibration.ece``, the reliability bins)."""
    from drafter.evaluation.acceptance import block_acceptance
    from drafter.evaluation.calibration import reliability

    res = block_acceptance(draft, embed, head, windows)
    conf = res.pop("confidence", None)
    if conf is not None:
        res["calibration"] = reliability(conf["confidence"], conf["accepted"])
    return res


def run_dspark_training(model_dir: Path, capture, cfg: TrainConfig, dspark, out: Path, *,
                        weights: Path | None = None, title: str = "DSpark training", log=print,
                        calibration_fraction: float = 0.0) -> dict:
    """:func:`run_training` for a DSpark block draft (``dspark`` is the config's
    :class:`~drafter.core.config.DSparkSection`): start from the draft folder ``weights`` (a release,
    the bootstrap's output) or, without it, from a seeded random draft shaped like the target; train
    with :func:`drafter.training.dspark.block_loss` on the captured target layers; write the draft
    folder vLLM loads (``dspark/config.json`` + ``dspark/model.safetensors``), ``curves.png``,
    ``history.jsonl``, ``result.json`` (held-out block acceptance and ECE before and after).

    ``calibration_fraction`` > 0 (with a confidence head): that fraction of the training conversations
    (:func:`~drafter.data.windows.in_calibration_slice`) is not trained on; after training the confidence
    head is Platt-scaled on it (:func:`~drafter.evaluation.calibration.fit_platt`, folded into
    ``confidence_head.proj``), because a head trained over several passes of its data learns the acceptance
    reached there, above what unseen text gets. ``result["recalibration"]`` records the slice, ``a``, ``b``
    and its ECE before/after; ``result["final"]["calibration"]`` is the held-out one after the fold (the
    history's last evaluation is before it). Draft tokens do not depend on the head: τ is unchanged."""
    from drafter.models.dspark import capture_layers, save_dspark
    from drafter.training.dspark import block_loss

    out.mkdir(parents=True, exist_ok=True)
    if (done := _finished(out, out / DSPARK_DIR / "model.safetensors")) is not None:
        return done
    if cfg.nproc_per_node > 1:
        raise StageError("DSpark training runs on one process here (train.nproc_per_node must be 1)")
    draft = _initial_draft(model_dir, dspark, weights)
    device = resolve_device(cfg.device)
    draft = draft.to(device)
    head = read_tensor(model_dir, "lm_head.weight", torch.float32).to(device)
    embed = target_embedding(model_dir).to(device)
    layers = capture_layers(draft.cfg)
    K = draft.cfg.block_size
    train_w = load_windows(capture, "train", cfg.data_part, cfg.window, min_tokens=K + 2, feature_layers=layers)
    eval_w = load_windows(capture, "heldout", "all", cfg.window, min_tokens=K + 2, max_windows=cfg.eval_windows,
                          feature_layers=layers)
    if not train_w:
        raise StageError(f"capture {getattr(capture, 'path', capture)}: no {cfg.data_part} windows of at least {K + 2} tokens")
    train_w, cal_w, extra = _calibration_slice(draft, train_w, cfg, calibration_fraction, log)
    # anchors from torch's global generator: seeded by train(), kept in its checkpoints, so a resumed
    # run draws the anchors an uninterrupted one would
    res = train(draft, head, train_w, eval_w, cfg, out / "work", log=log,
                loss_fn=lambda win: block_loss(draft, embed, head, win, cfg, anchors=dspark.anchors,
                                               confidence_w=dspark.confidence_w if dspark.confidence_head else 0.0),
                evaluate=lambda: dspark_evaluate(draft, embed, head, eval_w))
    if cal_w:
        r = extra["recalibration"] = recalibrate_confidence(draft, embed, head, cal_w, calibration_fraction)
        if "skipped" in r:
            log(f"confidence head: not recalibrated ({r['skipped']})")
        else:
            res["final"]["calibration"] = dspark_evaluate(draft, embed, head, eval_w)["calibration"]
            held = res["final"]["calibration"]["ece"]
            log(f"confidence head: Platt-scaled on {len(cal_w)} unseen windows (a {r['a']:.3f}, b {r['b']:+.3f}); "
                f"their ECE {r['ece_before']:.4f} → {r['ece_after']:.4f}, held-out "
                f"{'n/a' if held is None else f'{held:.4f}'}")
    save_dspark(draft.cpu(), out / DSPARK_DIR, dtype=getattr(torch, cfg.save_dtype))
    return _finish(res, out, title, {"layout": "dspark", "loss": cfg.loss, "block_size": K, "anchors": dspark.anchors,
                                     "train_windows": len(train_w), "eval_windows": len(eval_w),
                                     "weights_in": str(weights) if weights else None, **extra,
                                     "device": device_label(device)})


def _initial_draft(model_dir: Path, dspark, weights: Path | None):
    """Where a DSpark fine-tune starts: the draft folder ``weights`` (its shape checked against the config) or,
    without it, a seeded random draft shaped like the target."""
    from transformers import AutoConfig

    from drafter.models.dspark import DSparkConfig, DSparkDraft, load_dspark

    if weights is not None:
        try:
            draft = load_dspark(weights)
        except (OSError, ValueError) as e:
            raise StageError(f"the released DSpark draft {weights}: {e}") from e
        if draft.cfg.block_size != dspark.block_size or list(draft.cfg.target_layer_ids) != list(dspark.target_layer_ids):
            raise StageError(f"the released DSpark draft {weights} has block_size {draft.cfg.block_size} and "
                             f"target_layer_ids {draft.cfg.target_layer_ids}; the config asks for "
                             f"dspark.block_size {dspark.block_size}, dspark.target_layer_ids {dspark.target_layer_ids}")
    else:
        tcfg = AutoConfig.from_pretrained(str(model_dir))
        n_layers = tcfg.num_hidden_layers
        bad = [i for i in dspark.target_layer_ids if i >= n_layers]
        if bad:
            raise StageError(f"dspark.target_layer_ids {bad} do not exist: the target has {n_layers} decoder layers "
                             f"(0..{n_layers - 1})")
        torch.manual_seed(dspark.init_seed)
        draft = DSparkDraft(DSparkConfig.for_target(
            tcfg, target_layer_ids=dspark.target_layer_ids, block_size=dspark.block_size,
            markov_rank=dspark.markov_rank, num_hidden_layers=dspark.num_hidden_layers,
            enable_confidence_head=dspark.confidence_head))
        torch.nn.init.zeros_(draft.markov_head.markov_w2.weight)  # the Markov bias starts at zero: no random logit noise
    return draft


def _calibration_slice(draft, train_w: list, cfg: TrainConfig, fraction: float, log) -> tuple[list, list, dict]:
    """``(train windows, calibration windows, extra result)``: with a confidence head and ``fraction`` > 0, that
    fraction of the conversations is set aside (not trained on) to Platt-scale the head after training."""
    cal_w: list = []
    extra: dict = {}
    if fraction > 0 and draft.confidence_head is not None:
        cal_w = [w for w in train_w if in_calibration_slice(w.row_id, fraction)]
        rest = [w for w in train_w if not in_calibration_slice(w.row_id, fraction)]
        if cal_w and rest:
            train_w = rest
        else:  # too few conversations to set any aside: train on all of them, the head as trained
            extra["recalibration"] = {"fraction": fraction, "windows": 0, "skipped":
                                      f"{len(train_w)} {cfg.data_part} windows leave no calibration slice of "
                                      f"{fraction:.4g} beside the training windows"}
            log(f"confidence head: not recalibrated ({extra['recalibration']['skipped']})")
            cal_w = []
    return train_w, cal_w, extra


def recalibrate_confidence(draft, embed, head: torch.Tensor, windows, fraction: float) -> dict:
    """Platt-scale ``draft``'s confidence head on ``windows`` (never trained on) and fold it into the head;
    returns what was done: the slice's size, ``a``, ``b`` and its ECE before and after — or, when the slice
    cannot calibrate (no eligible position, every outcome equal), ``skipped`` with why and the head untouched."""
    from drafter.evaluation.acceptance import block_acceptance
    from drafter.evaluation.calibration import fit_platt, reliability

    conf = block_acceptance(draft, embed, head, windows)["confidence"]
    before = reliability(conf["confidence"], conf["accepted"])
    size = {"fraction": fraction, "windows": len(windows), "conversations": len({w.row_id for w in windows}),
            "positions": before["n"]}
    try:
        a, b = fit_platt(conf["confidence"], conf["accepted"])
    except ValueError as e:
        return {**size, "skipped": f"the calibration slice ({len(windows)} windows): {e}", "ece_before": before["ece"]}
    draft.confidence_head.recalibrate(a, b)
    conf = block_acceptance(draft, embed, head, windows)["confidence"]
    after = reliability(conf["confidence"], conf["accepted"])
    return {**size, "a": a, "b": b, "ece_before": before["ece"], "ece_after": after["ece"]}


def tau_metrics(result: TrainResult | dict, prefix: str = "") -> dict:
    """Flat metrics: held-out τ before/after at T=0 and T=1 (greedy drafts), α per position."""
    res = TrainResult.of(result)
    b, f = res.baseline, res.final
    m = {}
    for rule, name in (("t0", "t0"), ("t1_greedy", "t1")):
        before, after = getattr(b, rule).tau, getattr(f, rule).tau
        m[f"{prefix}tau_{name}_before"] = round(before, 4)
        m[f"{prefix}tau_{name}_after"] = round(after, 4)
        m[f"{prefix}tau_{name}_ratio"] = round(after / before, 4)
    m[f"{prefix}alpha_t0_after"] = [round(a, 3) for a in f.t0.alpha]
    if "calibration" in f.model_fields_set:  # a DSpark draft's confidence head: expected calibration error, held-out
        for when, r in (("before", b), ("after", f)):
            ece = (r.calibration or {}).get("ece")  # None: no held-out position to calibrate on
            m[f"{prefix}ece_{when}"] = None if ece is None else round(ece, 4)
    return m


def acceptance_table(rows: list[tuple[str, HeldoutCheck]]) -> str:
    """Markdown table: held-out τ per drafter at T=0 and T=1 (the DeepSeek-V3 card's layout); ``rows`` are
    (name, a :class:`TrainResult`'s ``baseline`` or ``final`` check)."""
    lines = ["| drafter | τ (T=0) | τ (T=1) |", "|---|---|---|"]
    for name, acc in rows:
        lines.append(f"| {name} | {acc.t0.tau:.3f} | {acc.t1_greedy.tau:.3f} |")
    return "\n".join(lines) + "\n"


CHILD_ENV = "DRAFTER_TRAIN_CHILD"  # set in the fresh process that trains (see _launch_child)


def _child_args(model_dir: Path, capture, cfg: TrainConfig, out: Path, weights: Path | None, title: str) -> list[str]:
    args = ["-m", "drafter.training.run", "--model-dir", str(model_dir), "--capture", str(getattr(capture, "path", capture)),
            # a TrainConfig's fields only: a subclass (BootstrapConfig) has more, which TrainConfig refuses
            "--config-json", cfg.model_dump_json(include=set(TrainConfig.model_fields)), "--out", str(out), "--title", title]
    return args + (["--weights", str(weights)] if weights is not None else [])


def _launch_child(model_dir: Path, capture, cfg: TrainConfig, out: Path, weights: Path | None, title: str, log) -> dict:
    """Run this training in a fresh process and return its result; its output lines (progress, held-out
    checks) are passed on to ``log``. A fresh process because a long-lived one trains slower: after the
    float32 whole-vocabulary bootstrap, the draft-vocabulary fine-tune ran at 775 tok/s in the demo's
    process against 1,268 alone (the allocator's state, docs/measurements.md, "The default: make demo")."""
    import collections
    import subprocess

    cmd = [sys.executable, *_child_args(model_dir, capture, cfg, out, weights, title)]
    proc = procs.spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                       env=os.environ | {CHILD_ENV: "1", "PYTHONUNBUFFERED": "1"})
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log(line)
        proc.wait()
    finally:
        procs.stop(proc)
    if proc.returncode != 0 or not TrainResult.exists(out):
        raise StageError(f"{title} (a fresh process: {' '.join(cmd[:3])} …) failed with exit code {proc.returncode}; "
                         "its last lines:\n" + "\n".join(tail))
    return load_train_result(out).raw


def _launch_torchrun(model_dir: Path, capture, cfg: TrainConfig, out: Path, weights: Path | None, title: str) -> dict:
    """Run this training on ``cfg.nproc_per_node`` processes with torchrun and return rank 0's result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.nproc_per_node}",
           *_child_args(model_dir, capture, cfg, out, weights, title)]
    proc = procs.spawn(cmd)  # its own process group: torchrun and its ranks die with this process
    try:
        proc.wait()
    finally:
        procs.stop(proc)
    if proc.returncode != 0:
        raise StageError(f"torchrun training ({cfg.nproc_per_node} processes) failed with exit code {proc.returncode}; "
                         f"command: {' '.join(cmd[:8])} …")
    return load_train_result(out).raw


def _main() -> None:
    """``torchrun --nproc_per_node N -m drafter.training.run --model-dir D --capture C --config-json J --out O``:
    the same training on N processes (gloo on CPU, NCCL on GPUs); rank 0 writes the outputs. Without
    torchrun (``DRAFTER_TRAIN_CHILD=1 python -m drafter.training.run …``): one process, no process group."""
    import argparse

    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--capture", type=Path, required=True)
    ap.add_argument("--config-json", required=True, help="a TrainConfig as JSON")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--weights", type=Path)
    ap.add_argument("--title", default="drafter training")
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:  # the fresh single process of _launch_child
        os.environ.setdefault(CHILD_ENV, "1")
        run_training(args.model_dir, args.capture, TrainConfig.model_validate_json(args.config_json), args.out,
                     weights=args.weights, title=args.title)
        return
    cfg = TrainConfig.model_validate_json(args.config_json)
    device = resolve_device(cfg.device)  # under torchrun: this rank's LOCAL_RANK GPU, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))
    try:
        run_training(args.model_dir, args.capture, cfg, args.out, weights=args.weights, title=args.title)
    finally:
        dist.destroy_process_group()


def process_group_backend(device: torch.device) -> str:
    """NCCL when the ranks train on GPUs, gloo when they train on CPUs: the backend follows where the gradients
    live, not whether the machine has CUDA (NCCL cannot reduce CPU tensors: "No backend type associated with
    device type cpu")."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


if __name__ == "__main__":
    _main()
