"""Writes into an image the `.pyc` files of the modules its processes import, instead of compiling every file of its
environment (about a tenth of them are ever imported: docs/measurements.md, "Installing with uv; .pyc files").

Imports each MODULE given (a third-party package a stage or a vLLM server imports, with the submodules named), then
every module of each package given with --packages (the project's own; a module whose optional dependency this
environment lacks, such as vLLM or exllamav3, is skipped), with Python writing the bytecode of each imported module.
Prints how many modules it imported. Used by deployments/Dockerfile.project and .serving.

usage (from the project's root, as the images' WORKDIR): python deployments/compile_imported.py [--packages PKG,...] MODULE...
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys


def import_package(name: str) -> list[str]:
    """Imports every module of package ``name``; returns the ones skipped for a dependency this environment lacks."""
    skipped = []
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, prefix=name + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:  # an optional dependency (vLLM, exllamav3) not in this environment
            skipped.append(f"{info.name} (no {e.name})")
    return skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default="", help="comma-separated packages whose every module is imported")
    parser.add_argument("modules", nargs="*", help="modules to import")
    args = parser.parse_args(argv)
    sys.dont_write_bytecode = False  # the point: whatever the environment says
    sys.path.insert(0, os.getcwd())  # the project's packages that are not installed (flows/)
    before = len(sys.modules)
    for name in args.modules:
        importlib.import_module(name)
    skipped = [s for pkg in filter(None, args.packages.split(",")) for s in import_package(pkg)]
    print(f"compile_imported: {len(sys.modules) - before} modules imported, their .pyc written"
          + (f"; skipped {', '.join(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
