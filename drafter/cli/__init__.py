"""The `drafter` command line (also ``python -m drafter``).

    drafter release -c configs/demo.yaml [--profile quick] [--set generate.num_prompts=64]
    drafter publish -c configs/demo.yaml --repo-id ORG/NAME [--dry-run]
    drafter stage capture -c configs/demo.yaml          # one stage: the container entrypoint
    drafter plan -c configs/demo.yaml                   # stage keys and whether they are done
    drafter runs -c configs/demo.yaml [--json]          # stage table of the latest run
    drafter clean -c configs/demo.yaml [--dry-run]      # remove partial directories no process works on
    drafter heldout-sample -c configs/demo.yaml -t 1 -o heldout-t1.jsonl   # the held-out split re-sampled at T=1

One module per command group (:mod:`~drafter.cli.run`: release, publish; :mod:`~drafter.cli.stage`: stage,
heldout-sample; :mod:`~drafter.cli.store`: plan, clean, runs), what they print in :mod:`~drafter.cli.render`,
options and errors in :mod:`~drafter.cli.common`. Errors are one line, ``error: …``, exit 2 for bad input and
1 for other failures. `release`, `stage` and `plan` run the preflight checks (:mod:`drafter.data.preflight`)
before any stage starts. Only `release` and `publish` import Prefect (through :mod:`drafter_prefect`).
"""
from __future__ import annotations

import os

from drafter.cli import run, stage, store  # noqa: F401 - registers the commands
from drafter.cli.common import app

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover - console script
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    app()
