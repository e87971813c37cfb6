"""Removing secrets from text before it is trained on.

Built-in kinds (each a set of regular expressions):

* ``private_key`` — PEM/OpenSSH/PGP private key blocks (``-----BEGIN … PRIVATE KEY-----`` …
  ``-----END …-----``; a block cut off before its END line is redacted to the end of the text);
* ``api_key`` — provider keys (OpenAI/Anthropic ``sk-…``, Stripe ``sk_live_…``, AWS ``AKIA…``,
  GitHub ``ghp_…``/``github_pat_…``, GitLab ``glpat-…``, Slack ``xox?-…`` and webhooks, Google
  ``AIza…``, Hugging Face ``hf_…``, npm, SendGrid) and the value of generic assignments such as
  ``api_key = "…"``, ``"client_secret": "…"``, ``AWS_SECRET_ACCESS_KEY=…``;
* ``token`` — ``Bearer``/``Basic`` credentials and JWTs (``eyJ….eyJ….…``);
* ``url_password`` — the password of ``scheme://user:password@host`` (user and host are kept);
* ``password`` — the value of ``password = "…"`` / ``PASSWORD=…`` style assignments (a literal
  string, or a bare value containing a digit — never code such as ``password = input()``);
* ``email`` — e-mail addresses (``user@`` or ``@handle`` without a domain are left alone).

Matches of all kinds are found on the original text, overlaps are resolved by kind priority
(the order above, then user patterns), and each accepted match counts once.

Example::

    s = Scrubber(kinds=["api_key", "email"], replacement="[REDACTED:{kind}]")
    text, counts = s.scrub_text("mail bob@example.com the key sk-proj-abcdefghijklmnopqrstuvwx")
    # text   == 'mail [REDACTED:email] the key [REDACTED:api_key]'
    # counts == {'api_key': 1, 'email': 1}
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable

from drafter.core.config import SECRET_KINDS
from drafter.core.urls import redact_url, url_has_credentials  # noqa: F401 - re-exported for callers of the scrubber

# Each pattern: the secret is group "s" when the pattern has one, else the whole match.
_PEM = re.compile(
    r"-----BEGIN (?P<label>[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?)-----"
    r"(?:[\s\S]*?-----END (?P=label)-----|[\s\S]*\Z)"
)

_KEYWORD_SECRET = (
    r"api[_-]?key|apikey|api[_-]?secret|secret(?:[_-]?(?:access[_-]?)?key)?|client[_-]?secret|"
    r"access[_-]?token|auth[_-]?token|refresh[_-]?token|private[_-]?token|session[_-]?token|"
    r"access[_-]?key[_-]?id"
)
_KEYWORD_PASSWORD = r"password|passwd|passphrase|pwd"


def _assignment(keywords: str) -> re.Pattern:
    """``<name containing a keyword> [quote] (= | : | := | =>) value``; the value is group "s".

    The value is a quoted literal (no whitespace right after the quote, ≥ 4 chars) or a bare
    word of ≥ 6 chars that contains a digit and ends at a delimiter — so identifiers and calls
    (``password = input()``, ``secret = os.environ["X"]``, ``api_key = key``) stay untouched.
    """
    return re.compile(
        r"(?<![\w-])[\w.-]*(?i:" + keywords + r")(?:[_-][\w-]*|[A-Z][\w-]*)?[\"']?\s*(?::=|=>|=|:)\s*"
        r"(?:(?P<q>[\"'`])(?P<s>[^\s\"'`][^\"'`\n]{3,}?)(?P=q)"
        r"|(?P<s2>(?=[^\s\"'`(]*\d)[^\s\"'`(),;&<>\[\]{}]{6,})(?=[\s,;&)}\]]|$))"
    )


_PATTERNS: dict[str, list[re.Pattern]] = {
    "private_key": [_PEM],
    "url_password": [
        re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]{1,20}://[^\s:/?#@\"'<>]*:(?P<s>[^\s/?#@\"'<>]+)@(?=[\w\[\-])"),
    ],
    "token": [
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        re.compile(r"(?i)\b(?:bearer|basic|token)\s+(?P<s>(?=[A-Za-z0-9\-._~+/]*\d)[A-Za-z0-9\-._~+/]{16,}=*)"),
    ],
    "api_key": [
        re.compile(r"(?<![\w-])sk-(?:proj-|ant-(?:api\d\d-)?|live-|test-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}"),
        re.compile(r"(?<![\w-])(?:sk|rk|pk)_(?:live|test)_[0-9A-Za-z]{16,}"),
        re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Z0-9])"),
        re.compile(r"(?<![\w-])gh[pousr]_[A-Za-z0-9]{30,}"),
        re.compile(r"(?<![\w-])github_pat_[A-Za-z0-9_]{22,}"),
        re.compile(r"(?<![\w-])glpat-[A-Za-z0-9_\-]{20,}"),
        re.compile(r"(?<![\w-])xox[abposr]-[A-Za-z0-9\-]{10,}"),
        re.compile(r"https://hooks\.slack\.com/services/[A-Za-z0-9/_\-]{20,}"),
        re.compile(r"(?<![\w-])AIza[0-9A-Za-z_\-]{35}"),
        re.compile(r"(?<![\w-])hf_[A-Za-z0-9]{30,}"),
        re.compile(r"(?<![\w-])npm_[A-Za-z0-9]{36}"),
        re.compile(r"(?<![\w-])SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}"),
        _assignment(_KEYWORD_SECRET),
    ],
    "password": [_assignment(_KEYWORD_PASSWORD)],
    "email": [
        re.compile(
            r"(?<![\w.%+\-/:@])(?!git@)[A-Za-z0-9][A-Za-z0-9._%+\-]*@"
            r"(?:[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?\.)+"
            r"(?!(?:png|jpe?g|gif|svg|webp|ico|bmp)\b)[A-Za-z]{2,24}\b"
        ),
    ],
}

BUILTIN_KINDS: tuple[str, ...] = SECRET_KINDS
assert tuple(_PATTERNS) == SECRET_KINDS, "drafter.core.config.SECRET_KINDS names the kinds of _PATTERNS in order"
"""Built-in kinds in priority order (an overlap goes to the earlier kind)."""

def _span(m: re.Match) -> tuple[int, int]:
    for g in ("s", "s2"):
        if g in m.re.groupindex and m.group(g) is not None:
            return m.span(g)
    return m.span()


class Scrubber:
    """Finds and replaces secrets. ``kinds``: built-in kinds to use; ``extra_patterns``: more
    kinds, name → regex (the secret is the named group ``s`` if present, else the whole match);
    ``replacement``: text put in place of a secret, ``{kind}`` is replaced by the kind's name."""

    def __init__(self, kinds: Iterable[str] = BUILTIN_KINDS, extra_patterns: dict[str, str] | None = None,
                 replacement: str = "[REDACTED:{kind}]"):
        kinds = tuple(kinds)
        unknown = [k for k in kinds if k not in _PATTERNS]
        if unknown:
            raise ValueError(f"unknown secret kind(s) {unknown}; built-in kinds are: {', '.join(BUILTIN_KINDS)}")
        self.kinds = kinds
        self.extra_patterns = dict(extra_patterns or {})
        self.replacement = replacement
        self._compiled = [(k, p) for k in BUILTIN_KINDS if k in kinds for p in _PATTERNS[k]]
        self._compiled += [(name, re.compile(pat)) for name, pat in self.extra_patterns.items()]

    @property
    def all_kinds(self) -> list[str]:
        return list(dict.fromkeys([*self.kinds, *self.extra_patterns]))

    def find(self, text: str) -> list[tuple[int, int, str]]:
        """Non-overlapping secret spans ``(start, end, kind)`` of ``text``, in text order."""
        taken: list[tuple[int, int, str]] = []
        for kind, pat in self._compiled:  # priority order
            for m in pat.finditer(text):
                a, b = _span(m)
                if b > a and all(b <= s or a >= e for s, e, _ in taken):
                    taken.append((a, b, kind))
        return sorted(taken)

    def scrub_text(self, text: str) -> tuple[str, Counter]:
        """``text`` with every secret replaced, and the count of secrets per kind."""
        spans = self.find(text)
        if not spans:
            return text, Counter()
        parts, pos, counts = [], 0, Counter()
        for a, b, kind in spans:
            parts.append(text[pos:a])
            parts.append(self.replacement.replace("{kind}", kind))
            pos = b
            counts[kind] += 1
        parts.append(text[pos:])
        return "".join(parts), counts

    def scrub_value(self, value: Any, counts: Counter) -> Any:
        """Scrub every string inside a JSON value (dicts, lists, nested), adding to ``counts``."""
        if isinstance(value, str):
            new, c = self.scrub_text(value)
            counts.update(c)
            return new
        if isinstance(value, list):
            return [self.scrub_value(v, counts) for v in value]
        if isinstance(value, dict):
            return {k: self.scrub_value(v, counts) for k, v in value.items()}
        return value


# Row fields that identify a row; they are never rewritten.
IDENTITY_FIELDS = ("id", "split", "domain", "mode")


def _drop_token_ids(value: Any, path: str, dropped: list[str]) -> Any:
    """Remove every field named ``*token_ids*``/``*tokens*`` holding integers (they would decode
    back to the text that was just redacted)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            p = f"{path}.{k}" if path else k
            if ("token" in k.lower() or k.lower().endswith("ids")) and _is_int_list(v):
                dropped.append(p)
                continue
            out[k] = _drop_token_ids(v, p, dropped)
        return out
    if isinstance(value, list):
        return [_drop_token_ids(v, f"{path}[{i}]", dropped) for i, v in enumerate(value)]
    return value


def _is_int_list(v: Any) -> bool:
    if not isinstance(v, list) or not v:
        return False
    flat = v
    while flat and isinstance(flat[0], list):  # lists of lists (one per turn)
        flat = [x for sub in flat for x in sub]
    return bool(flat) and all(isinstance(x, int) and not isinstance(x, bool) for x in flat)


def scrub_row(row: dict, scrubber: Scrubber) -> tuple[dict, Counter]:
    """Scrub one conversation row: every string field except the identity fields (``id``,
    ``split``, ``domain``, ``mode``). When something was redacted, integer token-id fields are
    dropped too (they encode the original text) and listed under ``scrub_dropped``. The row
    gets ``scrubbed: {kind: count}`` (empty when nothing was found)."""
    counts: Counter = Counter()
    out = {}
    for k, v in row.items():
        out[k] = v if k in IDENTITY_FIELDS or k in ("scrubbed", "scrub_dropped") else scrubber.scrub_value(v, counts)
    if counts:
        dropped: list[str] = []
        out = _drop_token_ids(out, "", dropped)
        if dropped:
            out["scrub_dropped"] = dropped
    out["scrubbed"] = dict(sorted(counts.items()))
    return out, counts


def scrubber_for(cfg: Any) -> Scrubber:
    """The :class:`Scrubber` of a ``scrub`` config section (:class:`~drafter.core.config.ScrubConfig`)."""
    return Scrubber(kinds=cfg.kinds, extra_patterns=cfg.extra_patterns, replacement=cfg.replacement)


def scrub_conversations(convs: list, scrubber: Scrubber) -> tuple[list, Counter, int]:
    """Scrub user conversations (:class:`~drafter.data.prompts.Conversation`, ``source != "builtin"``)
    before anything is sent to a server or written: every message's content, and the row's ``id``
    and ``domain`` (a secret there becomes ``redacted-<hash of the scrubbed row>`` / ``user``).
    Built-in prompts (written for this project) pass unchanged. Returns the conversations, the
    count of secrets per kind and how many conversations changed."""
    import dataclasses
    import hashlib
    import json

    counts: Counter = Counter()
    out, changed, ids = [], 0, {}
    for c in convs:
        if c.source == "builtin":
            out.append(c)
            ids[c.id] = c
            continue
        found: Counter = Counter()
        msgs = tuple(m if m["content"] is None else {**m, "content": scrubber.scrub_value(m["content"], found)}
                     for m in c.messages)
        rid, domain = c.id, c.domain
        if scrubber.find(rid):
            _, cid = scrubber.scrub_text(rid)
            found.update(cid)
            rid = "redacted-" + hashlib.sha256(json.dumps([scrubber.scrub_text(c.id)[0], msgs]).encode()).hexdigest()[:16]
        if scrubber.find(domain):
            found.update(scrubber.scrub_text(domain)[1])
            domain = "user"
        if rid in ids:  # two conversations with secret ids, equal after scrubbing
            from drafter.core.errors import BadInputError

            prev = ids[rid]
            raise BadInputError(f"the conversations at {prev.origin or prev.source} and {c.origin or c.source} are "
                                "identical once the secrets in their ids are removed; remove one of them or give "
                                "them ids without secrets")
        ids[rid] = c
        if found:
            changed += 1
            counts.update(found)
            c = dataclasses.replace(c, id=rid, domain=domain, messages=msgs)
        out.append(c)
    return out, counts, changed
