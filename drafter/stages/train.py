"""`train` stage: fine-tune the released drafter for acceptance.

Inputs: the target, the captured features, and the released drafter — the bootstrap's output on
the demo, or (bootstrap skipped) the MTP layer shipped inside the target checkpoint; a retrain
starts from its champion instead (``baseline.weights`` with ``baseline.init``).
Computes: K-step unrolled fine-tuning with the configured loss (LK hybrid by default) on the
``finetune`` half of the train split (see :mod:`drafter.training.loop`), checkpointing inside the stage's
in-progress directory so a retry resumes; then the same for each ablation loss (``ablation.losses``),
all else equal, for the released / KL / LK comparison.
With ``dspark.enabled`` the same for a DSpark block draft (:func:`drafter.training.run.run_dspark_training`):
from ``dspark.released`` or the bootstrap's draft, block loss over ``dspark.anchors`` anchors per window;
1/16 of the fine-tune's conversations (:data:`CALIBRATION_FRACTION`) are not trained on: the confidence head
is Platt-scaled on them after training (a head trained over several passes of its data is overconfident on
unseen text: 0.062 held-out ECE after 600 steps over 480 windows, 2026-12-03).
Writes: ``mtp-trained.safetensors`` (BF16/F32 under the release's names; DSpark: ``dspark/``), ``curves.png``,
``history.jsonl``, ``result.json``; ``ablations/<loss>/…`` likewise; ``table.md``.
Reports: held-out τ at T=0 and T=1 of the released and the fine-tuned drafter (and of each
ablation), α per position, tokens/s.
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError
from drafter.core.store import sha256_file
from drafter.models import TRAINED_NAME
from drafter.models.dspark import DSPARK_DIR
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir
from drafter.training.run import run_dspark_training, run_training, tau_metrics


CALIBRATION_FRACTION = 1 / 16  # of a DSpark fine-tune's conversations: the confidence head's calibration slice


def released_weights(bootstrap: Artifact) -> Path | None:
    """The bootstrap's tensors when it ran; None = the release inside the target checkpoint."""
    return None if bootstrap.status == "skipped" else bootstrap.path / TRAINED_NAME


def baseline_weights(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> Path | None:
    """What the candidate is compared with: ``baseline.weights`` (a champion; its sha256 checked) when
    set, else the released drafter (:func:`released_weights`)."""
    b = cfg.baseline
    if b.weights is None:
        return released_weights(inputs["bootstrap_drafter"])
    path = Path(b.weights).expanduser()
    if not path.is_file():
        raise BadInputError(f"baseline.weights {path} does not exist (the champion's drafter file)")
    got = sha256_file(path)
    if got != b.sha256:
        raise BadInputError(f"baseline.weights {path}: sha256 {got} is not baseline.sha256 {b.sha256}; the file "
                            "changed since the baseline was chosen")
    return path


def init_weights(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> Path | None:
    """Where fine-tuning starts: the baseline when ``baseline.init`` (a retrain from its champion), else the released drafter."""
    if cfg.baseline.weights is not None and cfg.baseline.init:
        return baseline_weights(cfg, inputs)
    return released_weights(inputs["bootstrap_drafter"])


def baseline_label(cfg: ReleaseConfig) -> str:
    """How reports name the baseline: ``released`` or ``champion <release id>``."""
    b = cfg.baseline
    return "released" if b.weights is None else f"champion {b.release_id or b.sha256[:16]}"


def acceptance_table(rows: list[tuple[str, dict]]) -> str:
    """Markdown table: held-out τ per drafter at T=0 and T=1 (the DeepSeek-V3 card's layout)."""
    lines = ["| drafter | τ (T=0) | τ (T=1) |", "|---|---|---|"]
    for name, acc in rows:
        lines.append(f"| {name} | {acc['t0']['tau']:.3f} | {acc['t1_greedy']['tau']:.3f} |")
    return "\n".join(lines) + "\n"


def released_draft(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> Path:
    """The released DSpark draft folder: ``dspark.released`` when set, else the bootstrap's."""
    if cfg.dspark.released:
        path = Path(cfg.dspark.released).expanduser()
        if not (path / "config.json").is_file():
            raise BadInputError(f"dspark.released {path} has no config.json (a DSpark draft folder as vLLM loads it)")
        return path
    boot = inputs["bootstrap_drafter"]
    if boot.status == "skipped":
        raise BadInputError("a DSpark fine-tune needs the released draft: set dspark.released to its folder "
                            "(the bootstrap only stands in for it on the embedded target)")
    return boot.path / DSPARK_DIR


def _run_dspark(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    if cfg.baseline.weights is not None:
        raise BadInputError("baseline.weights (a champion) is for MTP drafters; a DSpark release compares with "
                            "dspark.released (or the bootstrap)")
    model_dir = target_dir(inputs["prepare_target"])
    c, d = cfg.train, cfg.dspark
    weights = released_draft(cfg, inputs)
    res = run_dspark_training(model_dir, inputs["capture"], c, d, out, weights=weights,
                              title=f"DSpark fine-tune: {c.loss}, block {d.block_size}",
                              calibration_fraction=CALIBRATION_FRACTION)
    metrics = {**tau_metrics(res), "tokens_per_s": round(res["tokens_per_s"], 1), "trainable": res["trainable"],
               "seconds": round(res["seconds"], 1), "loss": c.loss, "block_size": d.block_size}
    r = res.get("recalibration") or {}
    if "skipped" in r:
        metrics["calibration_skipped"] = r["skipped"]
    elif r:
        metrics |= {"calibration_windows": r["windows"], "calibration_a": round(r["a"], 4),
                    "calibration_b": round(r["b"], 4), "calibration_ece_before": round(r["ece_before"], 4),
                    "calibration_ece_after": round(r["ece_after"], 4)}
    rows = [("released", res["baseline"])]
    for loss in cfg.ablation.losses:
        ab = run_dspark_training(model_dir, inputs["capture"], c.model_copy(update={"loss": loss}), d,
                                 out / "ablations" / loss, weights=weights, title=f"ablation: {loss}, block {d.block_size}",
                                 calibration_fraction=CALIBRATION_FRACTION)
        metrics |= tau_metrics(ab, prefix=f"{loss}_")
        rows.append((f"{loss} fine-tune", ab["final"]))
    rows.append((f"{c.loss} fine-tune", res["final"]))
    (out / "table.md").write_text(acceptance_table(rows))
    return metrics


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    if cfg.dspark.enabled:
        return _run_dspark(cfg, inputs, out)
    model_dir = target_dir(inputs["prepare_target"])
    weights = init_weights(cfg, inputs)
    c = cfg.train
    res = run_training(model_dir, inputs["capture"], c, out, weights=weights,
                       title=f"fine-tune: {c.loss}, K={c.k_steps}")
    metrics = {**tau_metrics(res), "tokens_per_s": round(res["tokens_per_s"], 1), "trainable": res["trainable"],
               "seconds": round(res["seconds"], 1), "loss": c.loss}
    start = "released" if weights == released_weights(inputs["bootstrap_drafter"]) else baseline_label(cfg)
    rows = [(start, res["baseline"])]
    for loss in cfg.ablation.losses:
        ab = run_training(model_dir, inputs["capture"], c.model_copy(update={"loss": loss}), out / "ablations" / loss,
                          weights=weights, title=f"ablation: {loss}, K={c.k_steps}")
        metrics |= tau_metrics(ab, prefix=f"{loss}_")
        rows.append((f"{loss} fine-tune", ab["final"]))
    rows.append((f"{c.loss} fine-tune", res["final"]))
    (out / "table.md").write_text(acceptance_table(rows))
    return metrics


STAGE = Stage(
    name="train",
    version="4",  # 2: a DSpark fine-tune Platt-scales its confidence head on a slice it did not train on;
                  # 3: train.draft_vocab_size (draft_vocab.safetensors); 4: the fine-tune trains over the draft
                  # vocabulary, and the held-out checks mask to it
    inputs=("prepare_target", "capture", "bootstrap_drafter"),
    sections=("train", "ablation", "baseline", "dspark"),
    run=run,
    description="Fine-tune the released drafter with acceptance-targeted (LK) losses, K-step unrolled",
)
