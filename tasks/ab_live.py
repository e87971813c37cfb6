"""Prefect task of the `ab_live` stage (see `drafter.stages.ab_live`)."""
from tasks import for_stage

ab_live = for_stage("ab_live")
