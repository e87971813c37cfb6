"""Where the ``quantize_fp8`` output keeps what: the drop-in (``fp8/``), the demo's stand-in release
(``release/``) and the record of the release it was made against (``release.json``: :class:`FP8ReleaseInfo`),
read by ``verify_fp8``, the card and the release folder.

Example::

    rdir = release_dir(quantize_fp8_artifact, target_dir)   # the stand-in, the target, or a released DSpark draft
    FP8ReleaseInfo.load(quantize_fp8_artifact.path).drafter  # "mtp" or "dspark"
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from drafter.core.stage import Artifact
from drafter.core.results import ResultFile

FP8_DIR = "fp8"  # the drop-in: mtp-ft.safetensors, its index, fp8-error.json (+ config.json for a DSpark draft)
STANDIN_DIR = "release"  # the demo's stand-in release, written by the reference implementation
FP8_RELEASE_JSON = "release.json"  # not the release folder's release.json (drafter.release.folder.RELEASE_JSON)


class FP8ReleaseInfo(ResultFile):
    """``release.json`` of a ``quantize_fp8`` output: which FP8 release the drop-in matches. ``source``: ``stand-in``
    (``dir`` is :data:`STANDIN_DIR`), ``target`` or ``released`` (a DSpark draft folder: ``dir``)."""

    NAME: ClassVar[str] = FP8_RELEASE_JSON
    SORTED: ClassVar[bool] = False
    source: str
    dir: str | None = None
    rule: str | None = None
    block: list[int] | None = None
    drafter: str | None = None  # outputs from before DSpark: an MTP drafter


def release_dir(quantize_fp8: Artifact, target: Path) -> Path:
    """Where the release a ``quantize_fp8`` output was made against lives (stand-in, the target, or a
    released DSpark draft folder)."""
    info = FP8ReleaseInfo.load(quantize_fp8.path)
    if info.source == "stand-in":
        return Path(quantize_fp8.path) / STANDIN_DIR
    return Path(info.dir) if info.drafter == "dspark" else target
