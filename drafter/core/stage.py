"""The stage contract.

A stage is ``run(cfg, inputs, out) -> Metrics``:

* ``cfg`` — the whole :class:`~drafter.core.config.ReleaseConfig`; a stage reads only the sections it
  declares in ``Stage.sections`` (those, and nothing else, go into its key);
* ``inputs`` — the finished outputs of the stages named in ``Stage.inputs``, as :class:`Artifact`;
* ``out`` — the stage's in-progress directory. It is the *same* directory on every retry of the
  same key, so a long stage checkpoints inside it and resumes from what it finds there. The
  runner publishes it atomically (manifest written, directory renamed into place) only after
  ``run`` returns;
* returns ``Metrics``: a flat JSON-serializable dict shown in the run table and artifacts.

A stage that cannot run on this machine raises :class:`~drafter.core.errors.StageSkipped`; bad input
raises :class:`~drafter.core.errors.StageError` naming the file/key/value.

Example::

    STAGE = Stage(name="scrub", version="1", inputs=("generate",), sections=("scrub",), run=run,
                  description="Remove secrets from conversations")
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from drafter.core.config import ReleaseConfig

Metrics = dict[str, Any]


@dataclass(frozen=True)
class Artifact:
    """A finished stage output in the store: read-only by convention."""

    stage: str
    key: str
    path: Path
    manifest: dict = field(repr=False, default_factory=dict)

    @property
    def metrics(self) -> Metrics:
        return self.manifest.get("metrics", {})

    @property
    def status(self) -> str:
        return self.manifest.get("status", "done")


@dataclass(frozen=True)
class Stage:
    name: str
    version: str
    inputs: tuple[str, ...]
    sections: tuple[str, ...]
    run: Callable[["ReleaseConfig", dict[str, Artifact], Path], Metrics]
    description: str = ""
    # what the stage reads from outside the store (user files, a local checkpoint): a JSON-able
    # fingerprint (e.g. sizes + sha256) that goes into the key, so changed files mean a new key
    fingerprint: Callable[["ReleaseConfig"], Any] | None = None
    # whether a config runs the stage at all (None: always); a disabled stage is not planned, and the stages
    # that name it among their inputs do without it (no input, no input key): their keys stay as they were
    enabled: Callable[["ReleaseConfig"], bool] | None = None

    def is_enabled(self, cfg: "ReleaseConfig") -> bool:
        return self.enabled is None or bool(self.enabled(cfg))


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def key_config(stage: Stage, cfg: "ReleaseConfig") -> dict[str, Any]:
    """The config a stage's key covers (and its manifest records): each of its sections'
    :meth:`~drafter.core.config.Section.key_dump` — operational settings (timeouts, retries, python paths,
    ports, the server's environment and other secrets) left out, so they never re-key a stage."""
    dumps = {s: getattr(cfg, s).key_dump() for s in stage.sections}
    return {s: d for s, d in dumps.items() if d is not None}  # a disabled optional section (eagle3) reads nothing


def stage_key(stage: Stage, cfg: "ReleaseConfig", input_keys: dict[str, str]) -> str:
    """hash(stage name, stage version, its config sections, the keys of its inputs) — 16 hex chars."""
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "config": key_config(stage, cfg),
        "inputs": dict(sorted(input_keys.items())),
    }
    if stage.fingerprint is not None:
        payload["external"] = stage.fingerprint(cfg)
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]
