"""Prefect task of the `prepare_target` stage (see `drafter.stages.prepare_target` for what it computes)."""
from tasks import for_stage

prepare_target = for_stage("prepare_target")
