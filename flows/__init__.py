"""Prefect flows: `release` (end to end), `retrain` (scheduled), one flow per stage."""
