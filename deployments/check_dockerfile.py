"""Checks a Dockerfile of this project without building it (for the CUDA images, which need a CUDA base
image from a registry and cannot be built on a machine without one).

What is checked: every ``FROM`` names its image through a declared ``ARG`` (so the same file builds from a
registry's image or a local one); every ``COPY``/``ADD`` source and every ``RUN --mount=type=bind`` source
exists in the build context and is not excluded by ``.dockerignore``; a ``python -m MODULE`` command names a
module of the repository or of the image's declared packages. ``--cuda`` also says, at run time, that the
image is not built here and why.

usage: python deployments/check_dockerfile.py [--cuda] Dockerfile...   (exit 1 naming each problem)
"""
from __future__ import annotations

import fnmatch
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf, start = [], "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not buf:
            start = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((start, word.upper(), rest.strip()))
        buf = ""
    return out


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins, `!` re-includes; a pattern matches a
    path or any folder above it."""
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        if any(fnmatch.fnmatchcase(c, p) or (p.startswith("**/") and fnmatch.fnmatchcase(c.split("/")[-1], p[3:]))
               for c in candidates):
            result = not neg
    return result


def check(path: Path, context: Path = ROOT) -> tuple[list[str], list[str]]:
    """(problems, FROM images) of one Dockerfile."""
    text = path.read_text()
    ign_file = context / ".dockerignore"
    patterns = [ln.strip() for ln in ign_file.read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")] if ign_file.is_file() else []
    problems: list[str] = []
    args: dict[str, str | None] = {}
    froms: list[str] = []
    for n, ins, rest in instructions(text):
        where = f"{path.name}:{n}"
        if ins == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"') or None
        elif ins == "FROM":
            image = rest.split()[0]
            refs = re.findall(r"\$\{?(\w+)", image)
            if not refs:
                problems.append(f"{where}: FROM {image} is fixed: declare `ARG BASE_IMAGE=…` and build FROM ${{BASE_IMAGE}}")
            for r in refs:
                if r not in args:
                    problems.append(f"{where}: FROM uses ${{{r}}}, which no ARG before it declares")
            froms.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1)) or m.group(0), image))
        elif ins in ("COPY", "ADD"):
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            if any(w.startswith("--from") for w in shlex.split(rest)):
                continue
            for src in words[:-1]:
                problems += _source(where, src, context, patterns)
        elif ins == "RUN":
            for src in re.findall(r"--mount=type=bind,[^ ]*?source=([^, ]+)", rest):
                problems += _source(where, src, context, patterns)
        if ins in ("RUN", "CMD", "ENTRYPOINT"):
            for mod in re.findall(r"python3?\"?,?\s*\"?-m\"?,?\s*\"?([\w.]+)", rest):
                top = mod.split(".")[0]
                if (context / top).is_dir() and not ((context / top / "__main__.py").is_file()
                                                      or (context / Path(*mod.split("."))).with_suffix(".py").is_file()
                                                      or (context / Path(*mod.split("."))).is_dir()):
                    problems.append(f"{where}: `python -m {mod}`: no such module in the repository")
    return problems, froms


# COPY sources that `make images` writes before it builds (deployments/wheelhouse.sh): checked for what
# they are, not for being there yet
BUILT = ("build/wheelhouse/",)


def _source(where: str, src: str, context: Path, patterns: list[str]) -> list[str]:
    if not (context / src).exists() and not (src.rstrip("/") + "/").startswith(BUILT):
        return [f"{where}: {src} does not exist in the build context {context}"]
    if ignored(src, patterns):
        return [f"{where}: {src} is excluded by .dockerignore"]
    return []


def main(argv: list[str]) -> int:
    cuda = "--cuda" in argv
    files = [Path(a) for a in argv if a != "--cuda"]
    bad = 0
    for f in files:
        problems, froms = check(f)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        bad += len(problems)
        status = "checked" if not problems else f"{len(problems)} problem(s)"
        if cuda:
            print(f"{f.name}: {status}; not built here: it builds FROM {', '.join(froms)}, a CUDA base image from a "
                  f"registry, and its stages need an NVIDIA GPU (build it where both are: docker build -f {f} .)")
        else:
            print(f"{f.name}: {status}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
