"""Entry point of the `retrain` deployment (deployments/prefect.yaml): the scheduled champion/challenger flow.

The flow lives in :mod:`drafter_prefect.retrain`; this file only names it for Prefect.
"""
from drafter_prefect.retrain import retrain

__all__ = ["retrain"]
