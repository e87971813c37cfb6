"""Prefect task of the `bootstrap_drafter` stage (see `drafter.stages.bootstrap_drafter`)."""
from tasks import for_stage

bootstrap_drafter = for_stage("bootstrap_drafter")
