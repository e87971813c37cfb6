"""The stage store: content-addressed, atomically published stage outputs.

Layout (local path or any fsspec URL)::

    <root>/<stage>/<key>/            finished output + manifest.json (never modified again)
    <root>/<stage>/.<key>.partial/   in-progress output; checkpoints live here; reused on retry
    <root>/<stage>/.<key>.lock       held while a process works on <key>
    <root>/runs/<run-id>.json        one summary per pipeline run (`drafter runs`)
    <root>/records/<name>            store-level records (the retrain's ledger of traffic already seen)

A finished output is published by writing ``manifest.json`` (every file with size + sha256) and
renaming the partial directory into place, so a reader sees either nothing or a whole output.
When a stage fails, its partial directory stays only if the failure is transient (a retry or a
rerun resumes from it: connection errors, timeouts, a dead server); on a permanent failure (bad
config or input, permission or decode errors, :func:`drafter.core.errors.is_permanent`) it is removed,
since a retry would fail the same way. :meth:`Store.remove_partials` (``drafter clean``) removes
leftover partial directories that no process is working on (their lock is free).
On a remote (fsspec) store the work happens in a local partial directory under ``cache_dir``. The
files are uploaded first, to an upload directory of their own
(``<stage>/.<key>.uploads/<attempt>/``), and ``<stage>/<key>/manifest.json`` — naming that upload —
last: the manifest is the commit. It is created exclusively (S3's conditional ``If-None-Match: *``
through s3fs; on other filesystems an existence check), so of two writers of the same key one wins
and the other discards its upload and reuses the winner's output. A key without a manifest counts as
absent, whatever a killed writer left in its upload directory. Reuse verifies the manifest (sizes
and sha256), so a tampered output is reported by name.

Example::

    store = Store("store")
    art = store.find("scrub", key)          # None if absent; StoreError if tampered
    art = store.produce("scrub", key, write_fn, manifest_extra)
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator


from drafter import __version__
from drafter.core import procs
from drafter.core.errors import StageSkipped, StoreError, is_permanent
from drafter.core.hardware import container
from drafter.core.remote_store import (S3_PROTOCOLS, StoreAccessError, describe_access_error,  # noqa: F401 - re-exported
                                       open_fs)
from drafter.core.stage import Artifact, Metrics

MANIFEST = "manifest.json"
EXCLUSIVE_CREATE = ("s3", "s3a")  # fsspec protocols whose put_file(mode="create") is an atomic create-if-absent
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_fingerprints(paths: list[str], setting: str) -> list[dict[str, Any]]:
    """Size + sha256 of each outside file a stage reads (``setting``: the config field naming them, for
    errors) — a stage's :attr:`~drafter.core.stage.Stage.fingerprint`, so a changed file means a new key."""
    from drafter.core.errors import BadInputError

    fps = []
    for f in paths:
        p = Path(f).expanduser()
        if not p.is_file():
            raise BadInputError(f"{setting}: {p} does not exist; fix the path or remove it from the list")
        fps.append({"path": str(f), "size": p.stat().st_size, "sha256": sha256_file(p)})
    return fps


def list_files(root: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``root`` (except the manifest) with size and sha256, sorted by path."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return files


def verify_dir(root: Path, manifest: dict, verify: str = "sha256") -> None:
    """Raise StoreError naming the first file that differs from ``manifest``."""
    where = f"{manifest.get('stage')}/{manifest.get('key')}"
    listed = manifest.get("files", {})
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST}
    missing = sorted(set(listed) - present)
    extra = sorted(present - set(listed))
    hint = f"remove {root} to recompute it"
    if missing:
        raise StoreError(f"store output {where}: file {missing[0]} is listed in the manifest but missing ({hint})")
    if extra:
        raise StoreError(f"store output {where}: file {extra[0]} is not in the manifest ({hint})")
    for rel, info in listed.items():
        p = root / rel
        size = p.stat().st_size
        if size != info["size"]:
            raise StoreError(f"store output {where}: {rel} has {size} bytes, manifest says {info['size']} ({hint})")
        if verify == "sha256" and sha256_file(p) != info["sha256"]:
            raise StoreError(f"store output {where}: {rel} does not match its sha256 in the manifest ({hint})")


# What this process has verified: (output dir, its files' sizes and mtimes) → the strongest check it passed. A
# stored output is hashed once per process — preflight, the flow's presence check and the stage's own reuse
# check share it —, again only when a file changed since (a different size or mtime).
_VERIFIED: dict[tuple, str] = {}
_VERIFIED_LOCK = threading.Lock()
_STRENGTH = {"size": 1, "sha256": 2}


def verify_once(root: Path, manifest: dict, verify: str = "sha256") -> None:
    """:func:`verify_dir`, unless this process already verified ``root`` at least as strongly and no file
    changed since (the files' sizes and mtimes are compared, not their bytes)."""
    files = sorted((p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)
                   for p in root.rglob("*") if p.is_file() and (st := p.stat()))
    seen = (str(root), tuple(files))
    with _VERIFIED_LOCK:
        done = _VERIFIED.get(seen)
    if done is not None and _STRENGTH.get(done, 0) >= _STRENGTH.get(verify, 0):
        return
    verify_dir(root, manifest, verify)
    with _VERIFIED_LOCK:
        if _STRENGTH.get(verify, 0) > _STRENGTH.get(_VERIFIED.get(seen, ""), 0):
            _VERIFIED[seen] = verify


class Store:
    """Stage outputs under ``root`` (local path or fsspec URL)."""

    def __init__(self, root: str | os.PathLike, cache_dir: str | os.PathLike = "~/.cache/drafter-release/store",
                 verify: str = "sha256"):
        root = str(root)
        self.fs, self._root = open_fs(root)
        self.local = self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol
        self.root_url = root
        self.verify = verify
        if self.local:
            self.root = Path(self._root).resolve()
            self.work = self.root
        else:
            self.root = None
            self.work = Path(os.path.expanduser(str(cache_dir))) / hashlib.sha256(root.encode()).hexdigest()[:12]
        try:
            self.work.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            where = "store.root" if self.local else "store.cache_dir"
            blocker = next((p for p in [self.work, *self.work.parents] if p.exists() and not p.is_dir()), self.work)
            raise StoreError(f"{where} {self.work}: {blocker} is a file, not a directory; point {where} "
                             "(or --store) at a directory") from None
        except OSError as e:
            where = "store.root" if self.local else "store.cache_dir"
            raise StoreError(f"{where} {self.work}: cannot create it ({e.strerror}); choose a writable {where} "
                             "(or --store)") from None

    def check_access(self) -> None:
        """Of a remote store: one cheap request (on S3 a one-key listing under the root), one attempt with short
        timeouts (:data:`S3_PROBE_OPTIONS`). Raises :class:`StoreAccessError` naming the store, what is wrong and
        what to set (:func:`describe_access_error`). A local store: nothing (preflight checks it is writable)."""
        if self.local:
            return
        fs, path = open_fs(self.root_url, probe=True)
        try:
            if fs.protocol in S3_PROTOCOLS or (isinstance(fs.protocol, tuple) and set(fs.protocol) & set(S3_PROTOCOLS)):
                bucket, key, _ = fs.split_path(path)
                fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/" if key else "", MaxKeys=1)
            else:
                fs.exists(path)
        except Exception as e:  # noqa: BLE001 - botocore / s3fs / network errors have no common base
            from drafter.core.urls import redact_url

            err = describe_access_error(self.root_url, e)
            if err is None:
                err = StoreAccessError(f"store.root {redact_url(self.root_url)} cannot be read "
                                       f"({type(e).__name__}: {' '.join(redact_url(str(e)).split())[:300]}); check "
                                       "store.root and the store's credentials and endpoint, or use a local store "
                                       "(--store DIR)", permanent=False)
            raise err from None

    # ---- paths -------------------------------------------------------------------------
    def _remote(self, *parts: str) -> str:
        return "/".join([self._root.rstrip("/"), *parts])

    def final_dir(self, stage: str, key: str) -> Path:
        """Local directory of a finished output (for remote stores, the local copy)."""
        return self.work / stage / key

    def partial_dir(self, stage: str, key: str) -> Path:
        return self.work / stage / f".{key}.partial"

    def location(self, stage: str, key: str) -> str:
        """Where a finished output lives, as the user would type it."""
        return str(self.final_dir(stage, key)) if self.local else self._remote(stage, key)

    # ---- reading -----------------------------------------------------------------------
    def find(self, stage: str, key: str) -> Artifact | None:
        """The finished output of (stage, key), verified against its manifest; None if absent."""
        if not self.local:
            self._download(stage, key)
        d = self.final_dir(stage, key)
        mpath = d / MANIFEST
        if not mpath.is_file():
            return None
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"store output {stage}/{key}: manifest.json is not valid JSON ({e}); remove {d} to recompute it") from e
        if manifest.get("stage") != stage or manifest.get("key") != key:
            raise StoreError(
                f"store output {stage}/{key}: manifest.json names {manifest.get('stage')}/{manifest.get('key')}; remove {d} to recompute it"
            )
        verify_once(d, manifest, self.verify)
        return Artifact(stage=stage, key=key, path=d, manifest=manifest)

    def _download(self, stage: str, key: str) -> None:
        """Copy the committed output (stage, key) into the local cache (its manifest, then the files it
        names, from the upload directory it names); nothing when no manifest is committed."""
        mpath = self._remote(stage, key, MANIFEST)
        d = self.final_dir(stage, key)
        if (d / MANIFEST).is_file() or not self.fs.exists(mpath):
            return
        try:
            data = self.fs.cat_file(mpath)
            manifest = json.loads(data)
        except (OSError, ValueError) as e:
            raise StoreError(f"store output {self._remote(stage, key)}: manifest.json cannot be read ({e}); "
                             "remove it to recompute the output") from e
        upload = manifest.get("upload")
        src = self._remote(stage, *upload.split("/")) if upload else self._remote(stage, key)  # earlier layout: files beside it
        tmp = d.with_name(f".{key}.download")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for rel in manifest.get("files") or {}:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(f"{src}/{rel}", str(tmp / rel))
            except FileNotFoundError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise StoreError(f"store output {self._remote(stage, key)}: {rel} is listed in its manifest but missing "
                                 f"from {src}; remove the manifest to recompute the output") from None
        (tmp / MANIFEST).write_bytes(data)
        if d.exists():  # a stale local leftover without a manifest
            shutil.rmtree(d)
        os.replace(tmp, d)

    # ---- writing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Exclusive lock on (stage, key) on this machine; released when the process dies.

        A stage directory this user may not write (or a read-only file system) is refused at once with a
        :class:`~drafter.core.errors.ConfigError` naming it and what to do (not retried; nothing is left)."""
        lock_path = self.work / stage / f".{key}.lock"
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(lock_path, "w")
        except OSError as e:
            if not isinstance(e, PermissionError) and e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            from drafter.core.errors import ConfigError

            setting = "store.root" if self.local else "store.cache_dir"
            where = Path(e.filename) if e.filename else lock_path.parent
            if where == lock_path:
                where = lock_path.parent
            raise ConfigError(f"{setting} {self.work}: cannot write {where} ({e.strerror or e}); make it writable by "
                              f"this user, or point {setting} (or --store) elsewhere") from e
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"[store] {stage}/{key} is being produced by another process; waiting", flush=True)
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def produce(self, stage: str, key: str, write: Callable[[Path], Metrics], meta: dict[str, Any]) -> tuple[Artifact, bool]:
        """Run ``write(partial_dir)`` and publish its output atomically as (stage, key).

        The partial directory persists across failed attempts (checkpoints survive for resume).
        A :class:`StageSkipped` from ``write`` publishes an output with status ``skipped`` and the
        reason (the partial files are dropped, never a fake file). Returns (artifact, computed):
        ``computed`` is False when another process published the output while we waited.
        """
        with self.lock(stage, key):
            found = self.find(stage, key)
            if found is not None:  # another process finished it while we waited
                return found, False
            part = self.partial_dir(stage, key)
            resumed = part.is_dir() and any(part.iterdir())
            part.mkdir(parents=True, exist_ok=True)
            started = datetime.now(timezone.utc)
            t0 = time.monotonic()
            status, reason = "done", None
            try:
                metrics = write(part) or {}
            except StageSkipped as e:
                shutil.rmtree(part)
                part.mkdir(parents=True)
                status, reason, metrics = "skipped", str(e), {}
            except BaseException as e:
                # a retry would fail the same way: nothing of this attempt is worth resuming from.
                # A transient failure keeps the directory: the retry resumes from its checkpoints.
                if is_permanent(e):
                    shutil.rmtree(part, ignore_errors=True)
                raise
            if procs.stopping():  # a signal is ending this process: leave the partial directory for the rerun
                raise StoreError(f"{stage}/{key} was not published: the run is stopping; a rerun resumes from {part}")
            manifest = {
                **meta,
                "stage": stage,
                "key": key,
                "status": status,
                "reason": reason,
                "metrics": json.loads(json.dumps(metrics, default=str)),
                "library_version": __version__,
                "host": socket.gethostname(),
                "container": container(),  # id and image when a container computed it (runner: containers)
                "resumed": resumed,
                "started_at": started.isoformat(),
                "finished_at": datetime.now(timezone.utc).isoformat(),
                "seconds": round(time.monotonic() - t0, 3),
                "files": list_files(part),
            }
            if not self.local:
                manifest["upload"] = f".{key}.uploads/{uuid.uuid4().hex[:16]}"
            (part / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            final = self.final_dir(stage, key)
            if not self.local and not self._upload(part, stage, key, manifest["upload"]):
                # another machine committed this key first: its output is the one; ours is dropped
                shutil.rmtree(part, ignore_errors=True)
                found = self.find(stage, key)
                if found is None:
                    raise StoreError(f"{self._remote(stage, key)}: another writer committed it, but it cannot be read")
                return found, False
            if final.exists():  # a stale, manifest-less leftover: never published, safe to drop
                shutil.rmtree(final)
            os.replace(part, final)
            return Artifact(stage=stage, key=key, path=final, manifest=manifest), True

    def _upload(self, part: Path, stage: str, key: str, upload: str) -> bool:
        """Upload ``part`` to ``<stage>/<upload>/`` then commit its manifest exclusively. False when another
        writer's manifest was there first (our upload directory is then removed)."""
        base = self._remote(stage, *upload.split("/"))
        files = [p for p in sorted(part.rglob("*")) if p.is_file() and p.name != MANIFEST]
        for p in files:
            rel = p.relative_to(part)
            self.fs.makedirs("/".join([base, *rel.parent.parts]), exist_ok=True)
            self.fs.put_file(str(p), f"{base}/{rel.as_posix()}")
        mpath = self._remote(stage, key, MANIFEST)
        self.fs.makedirs(self._remote(stage, key), exist_ok=True)
        try:
            if self.fs.protocol in EXCLUSIVE_CREATE or (isinstance(self.fs.protocol, tuple)
                                                         and set(self.fs.protocol) & set(EXCLUSIVE_CREATE)):
                self.fs.put_file(str(part / MANIFEST), mpath, mode="create")  # If-None-Match: *
            else:
                if self.fs.exists(mpath):
                    raise FileExistsError(mpath)
                self.fs.put_file(str(part / MANIFEST), mpath)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(base, recursive=True)
            return False
        return True

    # ---- run summaries -----------------------------------------------------------------
    def read_record(self, name: str) -> str | None:
        """A store-level record (``<root>/records/<name>``, e.g. the retrain's traffic ledger), or None."""
        if self.local:
            p = self.root / "records" / name
            return p.read_text() if p.is_file() else None
        path = self._remote("records", name)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as f:
            return f.read()

    def write_record(self, name: str, text: str) -> str:
        """Replace the record ``name`` (atomically on a local store); returns where it lives."""
        if self.local:
            d = self.root / "records"
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, d / name)
            return str(d / name)
        path = self._remote("records", name)
        self.fs.makedirs(self._remote("records"), exist_ok=True)
        with self.fs.open(path, "w") as f:
            f.write(text)
        return path

    def write_run(self, run_id: str, summary: dict) -> str:
        text = json.dumps(summary, indent=2, sort_keys=True, default=str)
        if self.local:
            d = self.root / "runs"
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{run_id}.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, d / f"{run_id}.json")
            return str(d / f"{run_id}.json")
        path = self._remote("runs", f"{run_id}.json")
        self.fs.makedirs(self._remote("runs"), exist_ok=True)
        with self.fs.open(path, "w") as f:
            f.write(text)
        return path

    def runs(self, warn: Callable[[str], None] | None = None) -> list[dict]:
        """All readable run summaries, oldest first.

        A summary that cannot be read or is not a run summary (truncated, not JSON, a field missing or
        of the wrong type: :func:`run_summary_problem`) is skipped: ``warn`` (default: a logged warning)
        gets one line per skipped file, naming the file and what is wrong with it. The good ones are
        still returned; when every summary is bad the list is empty (``drafter runs`` then exits 1).
        """
        if warn is None:
            import logging

            warn = logging.getLogger(__name__).warning
        out = []
        if self.local:
            paths = sorted((self.root / "runs").glob("*.json")) if (self.root / "runs").is_dir() else []
            sources = [(str(p), p.read_bytes) for p in paths]
        else:
            rd = self._remote("runs")
            paths = sorted(self.fs.glob(rd + "/*.json")) if self.fs.exists(rd) else []
            sources = [(p, (lambda p=p: self.fs.cat_file(p))) for p in paths]
        for name, read in sources:
            try:
                summary = json.loads(read().decode("utf-8"))
                problem = run_summary_problem(summary)
            except OSError as e:
                problem = f"cannot be read ({e.strerror or e})"
            except UnicodeDecodeError:
                problem = "is not UTF-8 text"
            except json.JSONDecodeError as e:
                problem = f"is not valid JSON (line {e.lineno}: {e.msg})"
            if problem:
                problem = " ".join(str(problem).split())  # one line, whatever the OS / JSON error said
                warn(f"run summary {name}: {problem}; skipped (fix or remove the file)")
                continue
            out.append(summary)
        return sorted(out, key=lambda r: r.get("started_at", ""))

    def partials(self) -> list[Path]:
        """In-progress directories left by interrupted runs (resumed by a rerun of the same key)."""
        return sorted(p for p in self.work.glob("*/.*.partial") if p.is_dir())

    @staticmethod
    def partial_owner(path: Path) -> tuple[str, str]:
        """(stage, key) of a partial directory ``<stage>/.<key>.partial``."""
        return path.parent.name, path.name[1:-len(".partial")]

    def partial_in_use(self, stage: str, key: str) -> bool:
        """Whether a process holds the lock of (stage, key), i.e. is working on its partial directory."""
        lock_path = self.work / stage / f".{key}.lock"
        if not lock_path.is_file():
            return False
        with open(lock_path, "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
        return False

    def remove_partials(self, keep: set[tuple[str, str]] | frozenset = frozenset(),
                        dry_run: bool = False) -> tuple[list[Path], list[Path]]:
        """Remove partial directories no process is working on; ``keep`` lists (stage, key) pairs to
        leave alone. Returns (removed — or, with ``dry_run``, removable —, in use)."""
        removed, busy = [], []
        for part in self.partials():
            stage, key = self.partial_owner(part)
            if (stage, key) in keep:
                continue
            lock_path = part.parent / f".{key}.lock"
            with open(lock_path, "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy.append(part)
                    continue
                try:  # removed while holding the lock: no process can start on it meanwhile
                    if not dry_run:
                        shutil.rmtree(part)
                    removed.append(part)
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
        return removed, busy


def _kind(v: Any) -> str:
    """How a JSON value reads in a message: ``5 (a number)``, ``null``, ``a list``…"""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, (int, float)):
        return f"{v!r} (a number)"
    if isinstance(v, str):
        return f"{v[:40]!r} (a string)"
    return {dict: "an object", list: "a list"}.get(type(v), type(v).__name__)


def run_summary_problem(summary: Any) -> str | None:
    """What is wrong with a run summary (as ``drafter runs`` reads it), in a few words naming the
    field and what it holds, or None when it has the shape ``drafter runs`` shows.

    >>> run_summary_problem({"run_id": "r", "status": "completed", "started_at": "t", "stages": [],
    ...                      "computed": [1], "reused": []})
    '`computed[0]` is 1 (a number), not a stage name'
    """
    if not isinstance(summary, dict):
        return f"is {_kind(summary)}, not a JSON object"
    for k in ("run_id", "status", "started_at"):
        if k not in summary:
            return f"has no `{k}`"
        if not isinstance(summary[k], str) or not summary[k]:
            return f"`{k}` is {_kind(summary[k])}, not a non-empty string"
    for k in ("stages", "computed", "reused"):
        if k not in summary:
            return f"has no `{k}`"
        if not isinstance(summary[k], list):
            return f"`{k}` is {_kind(summary[k])}, not a list"
    for k in ("computed", "reused"):
        for i, v in enumerate(summary[k]):
            if not isinstance(v, str):
                return f"`{k}[{i}]` is {_kind(v)}, not a stage name"
    for i, s in enumerate(summary["stages"]):
        where = f"`stages[{i}]`"
        if not isinstance(s, dict):
            return f"{where} is {_kind(s)}, not an object"
        for k in ("stage", "key", "status", "seconds", "metrics"):
            if k not in s:
                return f"{where} has no `{k}`"
        for k in ("stage", "key", "status"):
            if not isinstance(s[k], str):
                return f"`stages[{i}].{k}` is {_kind(s[k])}, not a string"
        if not isinstance(s["metrics"], dict):
            return f"`stages[{i}].metrics` is {_kind(s['metrics'])}, not an object"
        for k in ("seconds", *(("compute_seconds",) if s["status"] == "reused" else ())):
            v = s.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), -float("inf")):
                return f"`stages[{i}].{k}` is {_kind(v) if k in s else 'missing'}, not a number of seconds" + (
                    " (a reused stage records its original compute time)" if k == "compute_seconds" else "")
    return None
