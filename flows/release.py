"""Entry point of the `release` deployments (deployments/prefect.yaml): the end-to-end flow.

The flow lives in :mod:`drafter_prefect.release`; this file only names it for Prefect.
"""
from drafter_prefect.release import release

__all__ = ["release"]
