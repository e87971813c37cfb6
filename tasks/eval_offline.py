"""Prefect task of the `eval_offline` stage (see `drafter.stages.eval_offline`)."""
from tasks import for_stage

eval_offline = for_stage("eval_offline")
