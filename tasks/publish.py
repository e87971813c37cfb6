"""Prefect task of the `publish` stage (see `drafter.stages.publish`)."""
from tasks import for_stage

publish = for_stage("publish")
