"""Prefect task of the `capture` stage (see `drafter.stages.capture` for what it computes)."""
from tasks import for_stage

capture = for_stage("capture")
