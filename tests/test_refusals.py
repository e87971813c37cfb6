"""Refusals are not retried (issue 33, class 4): an error a retry cannot change fails once, named, with
nothing partial left — not enough disk for capture's estimate, a full disk, a read-only file system."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from drafter.core.errors import ResourceError, StageError, is_permanent
from drafter.core.store import Store
from drafter.data.capture import check_disk


class _State:
    def __init__(self, exc):
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EROFS, "Read-only file system"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    ResourceError("not enough disk"),
])
def test_full_or_read_only_disk_is_permanent(exc):
    from drafter_prefect.task import _retry_condition

    assert is_permanent(exc) and _retry_condition(None, None, _State(exc)) is False


def test_not_enough_disk_is_refused_once_and_leaves_nothing(tmp_path, monkeypatch):
    """capture's disk check: a ResourceError (a StageError, so callers that catch those still do), not retried by
    the stage task, and the store's partial directory is removed — it was retried 3 times and left an empty
    `.partial` before."""
    import shutil

    from drafter_prefect.task import _retry_condition

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    store = Store(tmp_path / "store")
    calls = []

    def write(out: Path):
        calls.append(out)
        check_disk(out, need_bytes=10**6, margin=1.2)

    with pytest.raises(ResourceError, match=r"not enough disk for capture at .* only 100 bytes .* Free space") as ei:
        store.produce("capture", "k1", write, {})
    assert isinstance(ei.value, StageError) and _retry_condition(None, None, _State(ei.value)) is False
    assert len(calls) == 1
    assert not store.partial_dir("capture", "k1").exists() and store.partials() == []


def test_a_full_disk_while_writing_leaves_nothing(tmp_path):
    store = Store(tmp_path / "store")

    def write(out: Path):
        (out / "shard-00000.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "shard-00001.safetensors"))

    with pytest.raises(OSError, match="No space left on device"):
        store.produce("capture", "k2", write, {})
    assert not store.partial_dir("capture", "k2").exists() and store.partials() == []


def test_a_checkpoint_without_weights_is_bad_input(tmp_path):
    """prepare_target.path without weights: bad input (exit 2, not retried), was a StageError retried twice."""
    from drafter.core.errors import BadInputError
    from drafter.models.target import resolve_path_target

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInputError, match=r"has no \*\.safetensors or \*\.bin weights; point prepare_target\.path") as ei:
        resolve_path_target(tmp_path)
    assert is_permanent(ei.value)
    with pytest.raises(BadInputError, match="is not a directory"):
        resolve_path_target(tmp_path / "missing")
