"""The scheduled retraining flow: the release flow over fresh traffic.

A cron deployment (see deployments/prefect.yaml) calls it with glob patterns of traffic files
(JSONL/Parquet chat conversations). The matching files become `generate.user_files`; their
contents are fingerprinted into the generate key, so new traffic means new data and a new
release, while an unchanged set of files recomputes nothing.
"""
from __future__ import annotations

import glob
from typing import Any

from prefect import flow

from drafter.core.config import ReleaseConfig
from drafter.core.errors import ConfigError
from flows.release import release, resolve_config


def expand_traffic(patterns: list[str]) -> list[str]:
    files = sorted({f for pat in patterns for f in glob.glob(pat, recursive=True)})
    if patterns and not files:
        raise ConfigError(f"retrain: no traffic files match {patterns}")
    return files


@flow(name="retrain", log_prints=True)
def retrain(config: ReleaseConfig | None = None, config_path: str | None = None, profile: str | None = None,
            overrides: list[str] | None = None, traffic: list[str] | None = None) -> dict[str, Any]:
    """Re-run the release on fresh traffic (`traffic`: glob patterns of JSONL/Parquet conversations)."""
    cfg = resolve_config(config, config_path, profile, overrides)
    files = expand_traffic(traffic or [])
    if files:
        cfg.generate.user_files = files
        print(f"retrain: {len(files)} traffic file(s)")
    return release(config=cfg)
