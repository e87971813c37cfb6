"""Prefect task of the `train` stage (see `drafter.stages.train`)."""
from tasks import for_stage

train = for_stage("train")
