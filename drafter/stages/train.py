"""`train` stage: fine-tune the released drafter for acceptance.

Inputs: the target, the captured features, and the released drafter — the bootstrap's output on
the demo, or (bootstrap skipped) the MTP layer shipped inside the target checkpoint; a retrain
starts from its champion instead (``baseline.weights`` with ``baseline.init``).
Computes: K-step unrolled fine-tuning with the configured loss (LK hybrid by default) on the
``finetune`` half of the train split (see :mod:`drafter.training.loop`), checkpointing inside the stage's
in-progress directory so a retry resumes; then the same for each ablation loss (``ablation.losses``),
all else equal, for the released / KL / LK comparison.
With ``eagle3.enabled`` the same for an EAGLE-3 head (:func:`drafter.training.eagle3.run_eagle3_training`): from
``train.init`` or the bootstrap's head, the training-time test over ``k_steps``; writes ``eagle3/``.
With ``dspark.enabled`` the same for a DSpark block draft (:func:`drafter.training.run.run_dspark_training`):
from ``dspark.released`` or the bootstrap's draft, block loss over ``dspark.anchors`` anchors per window;
1/16 of the fine-tune's conversations (:data:`CALIBRATION_FRACTION`) are not trained on: the confidence head
is Platt-scaled on them after training (a head trained over several passes of its data is overconfident on
unseen text: 0.062 held-out ECE after 600 steps over 480 windows, 2026-12-03).
Writes: ``mtp-trained.safetensors`` (BF16/F32 under the release's names; DSpark: ``dspark/``),
``draft_vocab.safetensors`` (with ``train.draft_vocab_size`` > 0), ``curves.png``, ``history.jsonl``,
``result.json``; ``ablations/<loss>/…`` likewise; ``table.md``.
Reports: held-out τ at T=0 and T=1 of the released and the fine-tuned drafter (and of each
ablation), α per position, tokens/s.
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir, target_info
from drafter.release.baselines import baseline_label, init_weights, released_draft, released_head, released_weights
from drafter.training.run import TrainResult, acceptance_table, run_dspark_training, run_training, tau_metrics


CALIBRATION_FRACTION = 1 / 16  # of a DSpark fine-tune's conversations: the confidence head's calibration slice


def _metrics(res: TrainResult, loss: str) -> Metrics:
    return {**tau_metrics(res), "tokens_per_s": round(res.tokens_per_s, 1), "trainable": res.trainable,
            "seconds": round(res.seconds, 1), "loss": loss}


def _calibration_metrics(res: TrainResult) -> Metrics:
    """The fine-tuned confidence head's Platt scaling (or why it was not done)."""
    r = res.recalibration or {}
    if "skipped" in r:
        return {"calibration_skipped": r["skipped"]}
    if not r:
        return {}
    return {"calibration_windows": r["windows"], "calibration_a": round(r["a"], 4),
            "calibration_b": round(r["b"], 4), "calibration_ece_before": round(r["ece_before"], 4),
            "calibration_ece_after": round(r["ece_after"], 4)}


def _run_dspark(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    if cfg.baseline.weights is not None:
        raise BadInputError("baseline.weights (a champion) is for MTP drafters; a DSpark release compares with "
                            "dspark.released (or the bootstrap)")
    model_dir = target_dir(inputs["prepare_target"])
    c, d = cfg.train, cfg.dspark
    weights = released_draft(cfg, inputs)
    res = TrainResult.of(run_dspark_training(model_dir, inputs["capture"], c, d, out, weights=weights,
                                             title=f"DSpark fine-tune: {c.loss}, block {d.block_size}",
                                             calibration_fraction=CALIBRATION_FRACTION))
    metrics = _metrics(res, c.loss) | {"block_size": d.block_size} | _calibration_metrics(res)
    rows = [("released", res.baseline)]
    for loss in cfg.ablation.losses:
        ab = TrainResult.of(run_dspark_training(
            model_dir, inputs["capture"], c.model_copy(update={"loss": loss}), d, out / "ablations" / loss,
            weights=weights, title=f"ablation: {loss}, block {d.block_size}", calibration_fraction=CALIBRATION_FRACTION))
        metrics |= tau_metrics(ab, prefix=f"{loss}_")
        rows.append((f"{loss} fine-tune", ab.final))
    rows.append((f"{c.loss} fine-tune", res.final))
    (out / "table.md").write_text(acceptance_table(rows))
    return metrics


def _run_eagle3(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    from drafter.training.eagle3 import run_eagle3_training

    if cfg.baseline.weights is not None:
        raise BadInputError("baseline.weights (a champion) is for MTP drafters; an EAGLE-3 release compares with "
                            "train.init (or the bootstrap)")
    model_dir = target_dir(inputs["prepare_target"])
    c, e = cfg.train, cfg.eagle3
    weights = released_head(cfg, inputs)
    name = str(target_info(inputs["prepare_target"]).get("name") or "")

    def one(tc, where: Path, title: str) -> TrainResult:
        return TrainResult.of(run_eagle3_training(model_dir, inputs["capture"], tc, e, where, weights=weights,
                                                  verifier=name, title=title))

    res = one(c, out, f"EAGLE-3 fine-tune: {c.loss}, K={c.k_steps}")
    metrics = _metrics(res, c.loss)
    rows = [("released", res.baseline)]
    for loss in cfg.ablation.losses:
        ab = one(c.model_copy(update={"loss": loss}), out / "ablations" / loss, f"ablation: {loss}, K={c.k_steps}")
        metrics |= tau_metrics(ab, prefix=f"{loss}_")
        rows.append((f"{loss} fine-tune", ab.final))
    rows.append((f"{c.loss} fine-tune", res.final))
    (out / "table.md").write_text(acceptance_table(rows))
    return metrics


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    if cfg.eagle3.enabled:
        return _run_eagle3(cfg, inputs, out)
    if cfg.dspark.enabled:
        return _run_dspark(cfg, inputs, out)
    model_dir = target_dir(inputs["prepare_target"])
    weights = init_weights(cfg, inputs)
    c = cfg.train
    res = TrainResult.of(run_training(model_dir, inputs["capture"], c, out, weights=weights,
                                      title=f"fine-tune: {c.loss}, K={c.k_steps}"))
    metrics = _metrics(res, c.loss)
    start = "released" if weights == released_weights(inputs["bootstrap_drafter"]) else baseline_label(cfg)
    rows = [(start, res.baseline)]
    for loss in cfg.ablation.losses:
        ab = TrainResult.of(run_training(model_dir, inputs["capture"], c.model_copy(update={"loss": loss}),
                                         out / "ablations" / loss, weights=weights, title=f"ablation: {loss}, K={c.k_steps}"))
        metrics |= tau_metrics(ab, prefix=f"{loss}_")
        rows.append((f"{loss} fine-tune", ab.final))
    rows.append((f"{c.loss} fine-tune", res.final))
    (out / "table.md").write_text(acceptance_table(rows))
    return metrics


STAGE = Stage(
    name="train",
    version="5",  # 2: a DSpark fine-tune Platt-scales its confidence head on a slice it did not train on;
                  # 3: train.draft_vocab_size (draft_vocab.safetensors); 4: the fine-tune trains over the draft
                  # vocabulary, and the held-out checks mask to it; 5: a micro batch's windows of one length
                  # run as one batch (the same loss, other float rounding)
    inputs=("prepare_target", "capture", "bootstrap_drafter"),
    sections=("train", "ablation", "baseline", "dspark", "eagle3"),
    run=run,
    description="Fine-tune the released drafter with acceptance-targeted (LK) losses, K-step unrolled",
)
