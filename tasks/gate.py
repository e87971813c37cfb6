"""Prefect task of the `gate` stage (see `drafter.stages.gate`)."""
from tasks import for_stage

gate = for_stage("gate")
