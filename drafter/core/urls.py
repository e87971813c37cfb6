"""Credentials in URLs: detect them, and mask them in messages and logs.

Example::

    redact_url("http://u:pw@10.0.0.1:8000/health")  # 'http://u:***@10.0.0.1:8000/health'
"""
from __future__ import annotations

import re

# scheme://USERINFO@ — userinfo is everything up to the first "@" before the path
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^\s/?#@\"'<>]+)@")


def url_has_credentials(url: str) -> bool:
    """Whether ``url`` (or a URL inside the text) carries credentials: ``scheme://user:pass@…`` or ``scheme://token@…``."""
    return _URL_USERINFO.search(url) is not None


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it masked, for messages and logs:
    ``https://bob:hunter2@host/v1`` → ``https://bob:***@host/v1``; a lone user part (often a
    token, ``https://ghp_…@github.com``) → ``https://***@github.com``.

    Example::

        redact_url("no server at http://u:pw@10.0.0.1:8000/health")  # 'no server at http://u:***@10.0.0.1:8000/health'
    """
    def mask(m: re.Match) -> str:
        user, sep, _ = m.group("userinfo").partition(":")
        return m.group("scheme") + (f"{user}:***@" if sep else "***@")

    return _URL_USERINFO.sub(mask, text)
