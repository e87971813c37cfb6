"""Local paths, the user name and the host name out of everything a release publishes (card, ``release.json``,
copied reports).

Example::

    redact_local("/home/me/store/x.safetensors")   # '<local path>/x.safetensors'
"""
from __future__ import annotations

import getpass
import os
import re
import socket
from pathlib import Path
from typing import Any


def _local_words() -> list[str]:
    words = [os.getcwd(), str(Path.home()), socket.gethostname()]
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name on some containers
        user = ""
    if len(user) > 2:
        words.append(user)
    return sorted({w for w in words if w and w != "/"}, key=len, reverse=True)


_ABS_PATH = re.compile(r"(?<![\w.~/])/(?:[^\s'\"(),;]+/)+[^\s'\"(),;]*")


def redact_local(text: str) -> str:
    """``text`` without absolute local paths (each becomes ``<local path>/<its last part>``), the user name or
    the host name."""
    text = _ABS_PATH.sub(lambda m: "<local path>/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)
    for w in _local_words():
        if len(w) > 2 and w in text:
            text = text.replace(w, "<local>")
    return text


def redact_obj(obj: Any) -> Any:
    """:func:`redact_local` over every string of a JSON-like object."""
    if isinstance(obj, str):
        return redact_local(obj)
    if isinstance(obj, dict):
        return {redact_local(str(k)): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj
