"""Errors the pipeline raises on purpose: each message names the file, key, shape or value at fault.

Messages never quote data (a row's text may hold secrets): name the file:line and the key, and
describe a bad value with :func:`describe_value` (its type and size, never its content).
"""
from __future__ import annotations

import errno
from typing import Any


class DrafterError(Exception):
    """Base class of the pipeline's own errors.

    ``permanent``: the error cannot change on a retry (bad config, bad input, an inconsistent
    store): it is not retried and the stage's partial directory is removed (see :func:`is_permanent`).
    """

    permanent = False


class ConfigError(DrafterError):
    """The configuration is invalid (raised before any work starts)."""

    permanent = True


class StageError(DrafterError):
    """A stage cannot produce its output from its inputs (bad input data, failed checks)."""


class BadInputError(StageError):
    """An input the user gave (a prompt file, a row, a conversation) is invalid: the message names
    the file:line (or file row N) and the key; retrying cannot help."""

    permanent = True


class ResourceError(StageError):
    """The machine cannot hold the stage's work (not enough disk for its estimate, a full or read-only disk):
    a retry seconds later meets the same machine, so it is not retried; the message says what to free or change."""

    permanent = True


class StoreError(DrafterError):
    """The stage store is inconsistent (tampered or incomplete output, missing input)."""

    permanent = True


class StageSkipped(DrafterError):
    """A stage cannot run on this machine (e.g. needs CUDA); recorded as `skipped` with the reason."""


def describe_value(v: Any) -> str:
    """The type and shape of ``v`` for an error message, never its content:
    ``a string of 12 characters``, ``a list of 3 items``, ``an object with 2 keys``, ``null``, ``an integer``.
    """
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "an empty string" if not v else ("a blank string" if not v.strip() else f"a string of {len(v)} characters")
    if isinstance(v, dict):
        return f"an object with {len(v)} key{'s' if len(v) != 1 else ''}"
    if isinstance(v, (list, tuple)):
        return "an empty list" if not v else f"a list of {len(v)} item{'s' if len(v) != 1 else ''}"
    if isinstance(v, bytes):
        return f"{len(v)} bytes"
    return f"a value of type {type(v).__name__}"


# errors from outside the pipeline that a retry cannot fix: the same file stays unreadable or
# undecodable, the same path stays a file where a directory should be
_PERMANENT_BUILTINS = (PermissionError, UnicodeError, IsADirectoryError, NotADirectoryError)
# OSError numbers a retry cannot fix either: a full disk or quota, a read-only file system, no permission
_PERMANENT_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM") if hasattr(errno, n))


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` cannot change on a retry: ConfigError, BadInputError, ResourceError, StoreError, the
    gate's refusal (``permanent`` set on the class), PermissionError, UnicodeDecodeError, IsADirectoryError,
    NotADirectoryError, an OSError of a full disk or quota or a read-only file system (ENOSPC, EDQUOT, EROFS,
    EACCES, EPERM) — also when one of them is the explicit cause (``raise … from e``) of ``exc``.

    Everything else (connection errors, timeouts, a server that died, a generate stage that lost
    too many requests) is transient: retried, and the stage resumes from its partial directory.

    >>> is_permanent(ConfigError("x")), is_permanent(TimeoutError())
    (True, False)
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "permanent", False) is True or isinstance(e, _PERMANENT_BUILTINS):
            return True
        if isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS:
            return True
        e = e.__cause__
    return False
