"""Generates the README's configuration reference from the config models (docs match the code).

    python -m drafter.core.docs            # prints the markdown table
    python -m drafter.core.docs --write    # rewrites the block between the markers in README.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from drafter.core.config import ReleaseConfig, Section, is_operational

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


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


def write_readme(path: Path) -> bool:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: markers {BEGIN} / {END} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{reference()}\n{END}{tail}"
    changed = new != text
    path.write_text(new)
    return changed


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_readme(Path(__file__).resolve().parents[2] / "README.md")
    else:
        print(reference())
