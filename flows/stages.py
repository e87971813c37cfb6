"""Entry points of the per-stage deployments (deployments/prefect.yaml): ``flows/stages.py:<stage>_flow``.

The flows live in :mod:`drafter_prefect.stages`; this file only names them for Prefect.
"""
from drafter_prefect.stages import STAGE_FLOWS

globals().update({f"{name}_flow": fl for name, fl in STAGE_FLOWS.items()})
__all__ = [f"{name}_flow" for name in STAGE_FLOWS]
