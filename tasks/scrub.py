"""Prefect task of the `scrub` stage (see `drafter.stages.scrub` for what it computes)."""
from tasks import for_stage

scrub = for_stage("scrub")
