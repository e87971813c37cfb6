"""Entry points of the per-stage deployments (deployments/prefect.yaml): ``flows/stages.py:<stage>_flow``.

The flows live in :mod:`drafter_prefect.stages`; this file only names them for Prefect, each made when Prefect
first asks for it (a stage's process builds only its own flow: drafter_prefect.stages says why).
"""
from drafter_prefect.stages import ORDER, stage_flow

__all__ = [f"{name}_flow" for name in ORDER]


def __getattr__(attr: str):
    if attr in __all__:
        return stage_flow(attr.removesuffix("_flow"))
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
