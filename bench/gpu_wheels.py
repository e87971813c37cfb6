"""Download the wheels bench/gpu_check.sh installs on an offline GPU machine: transformers (≥ 5.24), pydantic,
pyyaml, rich, safetensors and what they need, at the versions of this project's environment, for CPython
3.11–3.13 on x86-64 Linux — not torch or numpy (the GPU image has its own CUDA torch, and numpy with it).

    .venv/bin/python bench/gpu_wheels.py [--dest bench/gpu_wheels]   # or: make gpu-check-wheels

The folder is git-ignored; the device tool carries it with the working tree (under 64 MiB: the size is printed).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

ROOTS = ("transformers", "pydantic", "pyyaml", "rich", "safetensors", "packaging")
SKIP = {"torch", "numpy", "triton", "setuptools"}
PYTHONS = ("3.11", "3.12", "3.13")  # 3.10: annotated-doc 0.0.7 (typer) needs 3.11
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "linux_x86_64", "any")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ROOTS) -> dict[str, str]:
    """Installed name → version for the roots and their (non-extra) requirements, recursively."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in seen or name in SKIP or name.startswith("nvidia-"):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional platform-specific requirement not installed here
        seen[name] = dist.version
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent / "gpu_wheels")
    args = ap.parse_args()
    pins = closure()
    args.dest.mkdir(parents=True, exist_ok=True)
    specs = [f"{n}=={v}" for n, v in sorted(pins.items())]
    print(f"gpu_wheels: {len(specs)} packages: {' '.join(specs)}")
    for py in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", py, "-d", str(args.dest), *[a for p in PLATFORMS for a in ("--platform", p)], *specs]
        r = subprocess.run(cmd)
        if r.returncode != 0:
            print(f"gpu_wheels: pip download for Python {py} failed (exit {r.returncode})", file=sys.stderr)
            return r.returncode
    # what bench/gpu_check.sh installs (no dependency resolution there: the image's own packages are not consulted)
    (args.dest / "requirements.txt").write_text("".join(f"{s}\n" for s in specs))
    size = sum(f.stat().st_size for f in args.dest.glob("*.whl"))
    print(f"gpu_wheels: {len(list(args.dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {args.dest}")
    return 0 if size < 64 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
