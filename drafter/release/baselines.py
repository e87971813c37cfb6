"""What a release's candidate drafter is compared with and starts from: the released drafter (the bootstrap's
tensors, or the MTP layer inside the target checkpoint), a champion (``baseline.weights``, sha256-checked), the
released DSpark draft folder. Read by the stages that train, measure and quantize (``train``, ``eval_offline``,
``ab_live``, ``quantize_fp8``).

Example::

    weights = baseline_weights(cfg, inputs)   # None: the release inside the target checkpoint
    label = baseline_label(cfg)               # "released" or "champion <release id>"
"""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError
from drafter.core.stage import Artifact
from drafter.core.store import sha256_file
from drafter.models import TRAINED_NAME
from drafter.models.dspark import DSPARK_DIR


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


def released_head(cfg: ReleaseConfig, inputs: dict[str, Artifact]) -> Path:
    """The released EAGLE-3 head folder: ``train.init`` when set, else the bootstrap's stand-in."""
    from drafter.models.eagle3 import EAGLE3_DIR

    if cfg.train.init:
        path = Path(cfg.train.init).expanduser()
        if not (path / "config.json").is_file():
            raise BadInputError(f"train.init {path} has no config.json (an EAGLE-3 head folder: speculators or EAGLE layout)")
        return path
    boot = inputs["bootstrap_drafter"]
    if boot.status == "skipped":
        raise BadInputError("an EAGLE-3 fine-tune needs the released head: set train.init to its folder "
                            "(the bootstrap only stands in for it on the embedded target)")
    return boot.path / EAGLE3_DIR
