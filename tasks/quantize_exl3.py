"""Prefect task of the `quantize_exl3` stage (see `drafter.stages.quantize_exl3`)."""
from tasks import for_stage

quantize_exl3 = for_stage("quantize_exl3")
