"""Prefect task of the `generate` stage (see `drafter.stages.generate` for what it computes)."""
from tasks import for_stage

generate = for_stage("generate")
