"""The stage registry: every stage of the release pipeline, in pipeline order. Stages are found by
name (``drafter.stages.<name>``), so the core never imports a stage module at import time.

Each module of :mod:`drafter.stages` defines ``STAGE`` (a :class:`drafter.core.stage.Stage`). A stage's name is the same in
the config, the task module, the flow, the store path, the CLI and the docs.
"""
from __future__ import annotations

import importlib

from drafter.core.stage import Stage

ORDER = ("prepare_target", "generate", "scrub", "answer_heldout", "capture", "bootstrap_drafter", "train", "eval_offline", "quantize_fp8", "verify_fp8", "quantize_exl3", "ab_live", "gate", "publish")


def get(name: str) -> Stage:
    if name not in ORDER:
        raise KeyError(f"unknown stage {name!r}; stages are: {', '.join(ORDER)}")
    return importlib.import_module(f"drafter.stages.{name}").STAGE


def all_stages() -> list[Stage]:
    return [get(n) for n in ORDER]
