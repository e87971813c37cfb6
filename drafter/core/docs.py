"""Generates the blocks of the documentation that come from the code, so the docs match it.

* the configuration reference in ``docs/configuration.md`` — from the config models (every field, its
  default and description; operational fields marked);
* the stage table in ``README.md`` — from the stage registry (:data:`drafter.core.registry.ORDER`): per
  stage its description (``Stage.description``), its inputs (``Stage.inputs``), the config sections in its
  key (``Stage.sections``) and the files it writes (the ``Writes:`` paragraph of its module docstring).

Each block sits between its markers (``<!-- config-reference:begin -->`` … ``:end -->``)::

    python -m drafter.core.docs            # prints every generated block
    python -m drafter.core.docs --write    # rewrites the blocks between the markers in place
    python -m drafter.core.docs --check    # exit 1 naming every file whose block is stale
"""
from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Callable

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from drafter.core.config import ReleaseConfig, Section, is_operational

ROOT = Path(__file__).resolve().parents[2]

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
STAGES_BEGIN, STAGES_END = "<!-- stage-table:begin -->", "<!-- stage-table:end -->"


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    return "`" + json.dumps(value) + "`"


def _describe(field) -> str:
    """The field's description; operational fields (not in stage keys) say so."""
    return f"{field.description} *(operational)*" if is_operational(field) else field.description


def reference() -> str:
    """The configuration reference: one table of top-level fields, then one per section."""
    lines = []
    top = [(n, f) for n, f in ReleaseConfig.model_fields.items()]
    lines += ["| field | default | description |", "|---|---|---|"]
    for name, f in top:
        ann = f.annotation
        if not (isinstance(ann, type) and issubclass(ann, Section)):
            lines.append(f"| `{name}` | {_default(f)} | {_describe(f)} |")
    for name, f in top:
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            lines += ["", f"**`{name}`** — {f.description}", "", "| field | default | description |", "|---|---|---|"]
            for sub, sf in ann.model_fields.items():
                lines.append(f"| `{name}.{sub}` | {_default(sf)} | {_describe(sf)} |")
    return "\n".join(lines)


_NEXT_PART = re.compile(r"\n\s*(?:Reports|Resumes|Fails)\b|(?<=[.)])\s+Reports:")


def _without_parentheses(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def stage_writes(name: str, doc: str | None) -> list[str]:
    """The files a stage writes: the ````literal```` names of its module docstring's ``Writes`` paragraph,
    leaving out what parentheses say about them (formats, keys inside a file, optional extras)."""
    m = re.search(r"(?:^|\n)\s*Writes\b[^:]*:(.*)", doc or "", re.S)
    if m is None:
        raise ValueError(f"drafter/stages/{name}.py: its module docstring has no 'Writes:' paragraph "
                         "(the README's stage table lists what each stage writes from it)")
    part = _NEXT_PART.split(m.group(1), maxsplit=1)[0]
    names = list(dict.fromkeys(re.findall(r"``([^`]+)``", _without_parentheses(part))))
    if not names:
        raise ValueError(f"drafter/stages/{name}.py: the 'Writes:' paragraph names no file as ``name``")
    return names


def stage_table() -> str:
    """The README's stage table, in pipeline order."""
    from drafter.core.registry import ORDER, get

    lines = ["| stage | what it does | inputs (stages) | config sections (its key) | writes (under `store/<stage>/<key>/`) |",
             "|---|---|---|---|---|"]
    for i, name in enumerate(ORDER):
        stage = get(name)
        doc = importlib.import_module(f"drafter.stages.{name}").__doc__
        if not stage.inputs:
            inputs = "—"
        elif len(stage.inputs) > 4 and set(stage.inputs) == set(ORDER[:i]):
            inputs = "every stage before it"
        else:
            inputs = ", ".join(f"`{s}`" for s in stage.inputs)
        sections = ", ".join(f"`{s}`" for s in stage.sections)
        writes = ", ".join(f"`{w}`" for w in stage_writes(name, doc))
        what = stage.description.replace("|", "\\|")
        lines.append(f"| [`{name}`](drafter/stages/{name}.py) | {what} | {inputs} | {sections} | {writes} |")
    return "\n".join(lines)


# file (relative to the repository root) -> its generated blocks: (begin marker, end marker, generator)
BLOCKS: dict[str, list[tuple[str, str, Callable[[], str]]]] = {
    "README.md": [(STAGES_BEGIN, STAGES_END, stage_table)],
    "docs/configuration.md": [(BEGIN, END, reference)],
}


def _split(path: Path, text: str, begin: str, end: str) -> tuple[str, str, str]:
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: markers {begin} / {end} not found")
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    return head, block, tail


def current_block(path: Path, begin: str, end: str) -> str:
    """The text between the markers of ``path`` as it is on disk (stripped)."""
    return _split(path, path.read_text(), begin, end)[1].strip()


def rewrite(path: Path, blocks: list[tuple[str, str, Callable[[], str]]]) -> bool:
    """Rewrites every generated block of one file; True when the file changed."""
    text = path.read_text()
    new = text
    for begin, end, make in blocks:
        head, _, tail = _split(path, new, begin, end)
        new = f"{head}{begin}\n{make()}\n{end}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def stale(root: Path = ROOT) -> list[str]:
    """Files whose generated blocks differ from what the code generates now."""
    return [f"{rel} ({begin})" for rel, blocks in BLOCKS.items() for begin, end, make in blocks
            if current_block(root / rel, begin, end) != make().strip()]


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for rel, blocks in BLOCKS.items():
            if rewrite(ROOT / rel, blocks):
                print(f"rewrote {rel}")
        return 0
    if "--check" in argv:
        bad = stale()
        for item in bad:
            print(f"stale: {item}: run `python -m drafter.core.docs --write`", file=sys.stderr)
        return 1 if bad else 0
    print(stage_table(), reference(), sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
