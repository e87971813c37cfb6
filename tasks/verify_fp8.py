"""Prefect task of the `verify_fp8` stage (see `drafter.stages.verify_fp8`)."""
from tasks import for_stage

verify_fp8 = for_stage("verify_fp8")
