"""Typed stage result files: the base every result model derives from.

A stage's result file (``ab_live.json``, ``eval_offline.json``, ``gate.json`` …) is written by one library
module, which owns its name (a module constant) and a :class:`ResultFile` model of its content. Readers load
it through that model (``AbLiveResult.load(stage_dir)``) and use attributes, so a renamed key fails in one
place, at load time, with one line naming the file and the key (:class:`StageError`), never as a silently
empty card.

The models accept every document the current code writes and the older ones readers tolerate (optional
fields with their fallbacks), and keep unknown keys (``extra="allow"``). What is written stays the stage's
own dict (:meth:`ResultFile.write`): the bytes on disk do not depend on the model. :attr:`ResultFile.raw`
is the document as read (what a release records verbatim).

Example::

    ab = AbLiveResult.load(inputs["ab_live"].path)   # StageError "ab_live.json: missing key 'summary'"
    ab.num_speculative_tokens, ab.lossless.ok if ab.lossless else None
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from drafter.core.errors import StageError
from drafter.core.files import atomic_path, write_json_atomic


def missing_key(name: str, key: str, where: str | None = None) -> StageError:
    """The one-line error of a result file without a required key: ``<name>[ <where>]: missing key '<key>'``."""
    return StageError(f"{name}{' ' + where if where else ''}: missing key {key!r}")


def validation_error(name: str, e: ValidationError) -> StageError:
    """A pydantic :class:`ValidationError` of result file ``name`` as one line naming the file and the key."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "missing" and loc:
        return missing_key(name, loc[-1], ".".join(loc[:-1]) or None)
    where = ".".join(loc) or "the document"
    got = repr(err.get("input"))
    return StageError(f"{name}: {where}: {err['msg']} (got {got[:80]}{'…' if len(got) > 80 else ''})")


class Part(BaseModel):
    """A nested part of a result document: typed fields, unknown keys kept."""

    model_config = ConfigDict(extra="allow")


class HeldoutRecord(Part):
    """Which held-out set a measurement used (:mod:`drafter.data.heldout`'s record); outputs from before the
    record have none (the built-in split, the only set there was)."""

    source: str | None = None
    conversations: int | None = None
    text: str | None = None
    files: list[dict] = []
    # drafter.data.heldout_answers.heldout_record: conversations answered by the served target, the benchmarks
    # measured (drafter.data.benchmarks.benchmark_record) and the turns ab_live replayed of each
    answered: int | None = None
    benchmarks: list[dict] = []
    replayed: dict[str, int] = {}


class ResultFile(Part):
    """A stage's result file. Subclasses set ``NAME`` (their owner module's constant)."""

    NAME: ClassVar[str]
    SORTED: ClassVar[bool] = True  # written with sorted keys (write_json_atomic); False: in the document's order
    _raw: Any = PrivateAttr(default=None)

    @classmethod
    def of(cls, data: Any):
        """``data`` (the parsed JSON, or already a model) as this model; :class:`StageError` naming the file and
        the key when it does not fit."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise StageError(f"{cls.NAME}: expected a JSON object, got {type(data).__name__}")
        try:
            m = cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(cls.NAME, e) from None
        m._raw = data
        return m

    @classmethod
    def path(cls, stage_dir: str | Path) -> Path:
        return Path(stage_dir) / cls.NAME

    @classmethod
    def exists(cls, stage_dir: str | Path) -> bool:
        return cls.path(stage_dir).is_file()

    @classmethod
    def load(cls, stage_dir: str | Path):
        """The stage output's file, typed; :class:`StageError` when it does not exist, is not JSON or does not fit."""
        return cls.from_file(cls.path(stage_dir))

    @classmethod
    def from_file(cls, path: str | Path):
        """:meth:`load` of the file at ``path`` (e.g. a copy downloaded from the Hub)."""
        path = Path(path)
        if not path.is_file():
            raise StageError(f"{path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise StageError(f"{path}: not valid JSON ({e})") from e
        return cls.of(data)

    @property
    def raw(self) -> dict:
        """The document as read (or as given): what a release records verbatim."""
        return self._raw if self._raw is not None else self.model_dump(mode="json", exclude_unset=True)

    def require(self, *keys: str) -> None:
        """:class:`StageError` naming the first of ``keys`` the document does not have (null counts as present)."""
        for k in keys:
            if k not in self.model_fields_set:
                raise missing_key(self.NAME, k)

    @classmethod
    def write(cls, stage_dir: str | Path, doc: dict) -> dict:
        """Check ``doc`` against the model and write it (sorted keys, as every stage JSON); returns ``doc``."""
        cls.of(doc)
        if cls.SORTED:
            write_json_atomic(cls.path(stage_dir), doc)
        else:
            with atomic_path(cls.path(stage_dir)) as tmp:
                tmp.write_text(json.dumps(doc, indent=2) + "\n")
        return doc
