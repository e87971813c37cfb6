"""Prefect task of the `quantize_fp8` stage (see `drafter.stages.quantize_fp8`)."""
from tasks import for_stage

quantize_fp8 = for_stage("quantize_fp8")
