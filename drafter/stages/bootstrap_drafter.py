"""`bootstrap_drafter` stage (demo only): the stand-in for a released drafter.

Inputs: the target (whose MTP layer starts as a copy of its last decoder layer with
``eh_proj = [0 | I]``) and the captured features.
Computes: trains the MTP layer the way DeepSeek's was trained — next-next-token prediction only
(step 1, CE on data tokens) — on the ``bootstrap`` half of the train split, disjoint from the
half the fine-tune uses. Real targets ship their own released drafter: with ``enabled: auto`` the
stage is skipped for them (recorded as skipped, with the reason).
With ``eagle3.enabled`` the stand-in is an EAGLE-3 head trained from scratch the way EAGLE-3 heads are (on the
target's regenerated data, training-time test over ``k_steps``; drafter/training/eagle3.py), written as the
folder ``eagle3/`` vLLM loads.
With ``dspark.enabled`` the stand-in is a DSpark block draft (a seeded random initialization shaped
like the target, trained on the same half with the bootstrap's loss, CE by default).
Writes: ``mtp-trained.safetensors`` (the MTP layer under the release's names: the "released"
drafter every later comparison uses) — for DSpark the draft folder ``dspark/`` (config.json +
model.safetensors, what vLLM loads) —, ``curves.png``, ``history.jsonl``, ``result.json``.
Reports: held-out τ at T=0 and T=1 before and after, α per position, tokens/s.
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageSkipped
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir, target_info
from drafter.training.run import TrainResult, run_dspark_training, run_training, tau_metrics


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.bootstrap_drafter
    info = target_info(inputs["prepare_target"])
    if c.enabled == "off" or (c.enabled == "auto" and info.get("source") != "embedded"):
        raise StageSkipped(f"target {info.get('name')} ships its own released drafter (bootstrap_drafter.enabled={c.enabled})")
    if cfg.eagle3.enabled:  # an EAGLE-3 head from scratch (drafter/training/eagle3.py)
        from drafter.training.eagle3 import run_eagle3_training

        res = run_eagle3_training(target_dir(inputs["prepare_target"]), inputs["capture"], c, cfg.eagle3, out,
                                  verifier=str(info.get("name") or ""), title=f"bootstrap EAGLE-3: {c.loss}, K={c.k_steps}")
    elif cfg.dspark.enabled:  # a DSpark block draft from a seeded random initialization (drafter/models/dspark.py)
        d = cfg.dspark
        res = run_dspark_training(target_dir(inputs["prepare_target"]), inputs["capture"], c, d, out,
                                  title=f"bootstrap DSpark: {c.loss}, block {d.block_size}")
    else:
        res = run_training(target_dir(inputs["prepare_target"]), inputs["capture"], c, out,
                           title=f"bootstrap: {c.loss}, K={c.k_steps}")
    res = TrainResult.of(res)
    return {**tau_metrics(res), "tokens_per_s": round(res.tokens_per_s, 1), "trainable": res.trainable,
            "seconds": round(res.seconds, 1)}


STAGE = Stage(
    name="bootstrap_drafter",
    version="2",  # 2: a micro batch's windows of one length run as one batch (the same loss, other float rounding)
    inputs=("prepare_target", "capture"),
    sections=("bootstrap_drafter", "dspark", "eagle3"),
    run=run,
    description="Demo only: train the stand-in released MTP drafter (next-next-token CE)",
)
