"""Config sections of releasing and operating: publishing, the baseline / champion, scheduled retraining
and where stages run (re-exported by :mod:`drafter.core.config`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from drafter.core.config_base import Operational, Section


class PublishConfig(Section):
    """The release: model card, release folder and the Hugging Face Hub upload (dry run by default)."""

    repo_id: str | None = Field(None, description="Hub repo `ORG/NAME` to publish to; required unless dry_run "
                                "(the plan then names `<repo_id or ORG/NAME>`).")
    private: bool = Field(True, description="Create the repo private (an existing repo keeps its visibility).")
    branch: str = Field("main", description="Branch the release commit goes to (mode `commit`), or the PR's base (mode `pr`).")
    mode: Literal["commit", "pr"] = Field("commit", description="`commit`: one commit on the branch; `pr`: one pull "
                                          "request (`refs/pr/N`) for review, the branch untouched.")
    tag: str | None = Field("v{version}", description="Tag put on the release commit; `{version}` is the library version, "
                            "`{name}` the release name, `{key}` the publish stage key. None: no tag.")
    endpoint: str | None = Operational(None, description="Hub endpoint; default: `HF_ENDPOINT` or https://huggingface.co.")
    token_env: str = Operational("HF_TOKEN", description="Environment variable holding the Hub token (never stored, "
                                 "logged or put into parameters).")
    token_block: str | None = Operational(None, description="Deployments: name of a Prefect Secret block holding the token, "
                                          "read by the worker when `token_env` is not set.")
    commit_message: str = Field("Release {name} {version}", description="Commit / PR title; `{name}`, `{version}`, `{key}` "
                                "as for `tag`. The release id is appended as a trailer.")
    dry_run: bool = Field(True, description="Write the release folder and publish-plan.json, send nothing "
                          "(`drafter publish --repo-id ORG/NAME` sends).")
    license: str | None = Field(None, description="License of the card's front matter; default: the target's.")
    tags: list[str] = Field(default_factory=list, description="Extra tags of the card's front matter.")
    datasets: list[str] = Field(default_factory=list, description="Hub data sets named in the card's front matter.")
    retries: int = Operational(4, ge=0, description="Retries of a Hub call on 5xx or connection errors (backoff doubles).")
    retry_backoff_s: float = Operational(1.0, ge=0, description="First retry delay in seconds.")

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str | None) -> str | None:
        import re

        if v is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", v):
            raise ValueError(f"repo_id must look like ORG/NAME (letters, digits, '-', '_', '.'), got {v!r}")
        return v

    @field_validator("tag", "commit_message")
    @classmethod
    def _fields_known(cls, v: str | None) -> str | None:
        import string

        if v is not None:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
            unknown = sorted(names - {"name", "version", "key"})
            if unknown:
                raise ValueError(f"unknown placeholder(s) {unknown}; use {{name}}, {{version}} or {{key}}")
        return v

    @model_validator(mode="after")
    def _repo_when_sending(self) -> "PublishConfig":
        if not self.dry_run and self.repo_id is None:
            raise ValueError("publish.dry_run is false but publish.repo_id is not set: name the Hub repo (ORG/NAME)")
        return self


class BaselineConfig(Section):
    """The drafter the candidate is compared with (offline, live, at the gate), in place of the released
    one — a retrain sets it to the champion (the last release). Empty: the released drafter."""

    weights: str | None = Field(None, description="Safetensors file of the drafter under the release's tensor names "
                                "(`mtp-trained.safetensors` of a release folder). None: the released drafter.")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="sha256 of `weights`; checked before use "
                               "(a changed file is an error, never a silent new baseline).")
    release_id: str | None = Field(None, description="Release id of the baseline (shown in reports and the card).")
    init: bool = Field(True, description="Fine-tune from the baseline (true) or from the released drafter (false).")

    @model_validator(mode="after")
    def _hash_with_weights(self) -> "BaselineConfig":
        if self.weights is not None and self.sha256 is None:
            raise ValueError("baseline.weights is set but baseline.sha256 is not: give the file's sha256")
        if self.weights is None and (self.sha256 is not None or self.release_id is not None):
            raise ValueError("baseline.sha256 / baseline.release_id are set but baseline.weights is not")
        return self


class RetrainConfig(Section):
    """Scheduled retraining on fresh traffic (flows/retrain.py), champion / challenger: the candidate
    is published only if it beats the last release (the champion) on the same held-out set."""

    traffic: list[str] = Field(default_factory=list, description="Glob patterns of traffic files (JSONL/Parquet chat "
                               "conversations, as `generate.user_files`); the flow's `traffic` parameter overrides them.")
    min_new_rows: int = Field(100, ge=1, description="A retrain runs only with at least this many conversations never "
                              "seen by an earlier retrain (deduplicated by content); else it ends at once, starting no server.")
    champion: bool = Field(True, description="Compare with the last release (read from the Hub when publishing is on, "
                           "else from the store's runs) and publish only a candidate that beats it; false: every "
                           "retrain is a plain release.")
    start_from: Literal["champion", "released"] = Field("champion", description="Fine-tune the candidate from the "
                                                        "champion's weights or from the released drafter.")
    min_tau_gain: float = Field(0.0, ge=0, description="The candidate's offline held-out τ (T=0, at the served K) must "
                                "exceed the champion's by more than this; the gate's live checks apply as well.")


class RunnerConfig(Section):
    """Where the release flow runs each stage. Only *where*: every field is operational, so a stage's
    key, and its output, are the same whichever runner computed it."""

    kind: Literal["local", "containers"] = Operational(
        "local", description="`local`: every stage in the flow's own process. `containers`: each stage as its own "
        "flow run of a per-stage deployment (its image, on its work pool); the store must be shared with them "
        "(an s3:// store, or a folder mounted into the containers at the same path).")
    deployment: str = Operational(
        "stage-{stage}/docker", description="containers: the deployment each stage runs as; {stage} is the stage's "
        "flow name (`capture`, `quantize-fp8`, …). deployments/prefect.yaml has `stage-*/docker` for every stage.")
    deployments: dict[str, str] = Operational(
        default_factory=dict, description="containers: per-stage exceptions, e.g. {train: stage-train/docker-gpu}.")
    job_variables: dict[str, Any] = Operational(
        default_factory=dict, description="containers: job variables for every stage's flow run, on top of its "
        "deployment's (e.g. volumes: [/data/store:/data/store]); secrets by block reference only, "
        "e.g. env: {AWS_SECRET_ACCESS_KEY: '{{ prefect.blocks.secret.s3-key }}'} — never a value.")
    timeout_s: float = Operational(6 * 3600.0, gt=0, description="containers: a stage's flow run still not finished "
                                   "after this many seconds is cancelled and the release fails naming it.")
    poll_s: float = Operational(2.0, gt=0, description="containers: how often the parent reads a stage's flow run state.")

    @field_validator("deployment")
    @classmethod
    def _has_stage(cls, v: str) -> str:
        if "{stage}" not in v:
            raise ValueError("runner.deployment must contain {stage} (e.g. stage-{stage}/docker); "
                             "use runner.deployments for a fixed name per stage")
        return v

    @field_validator("deployments")
    @classmethod
    def _known_stages(cls, v: dict[str, str]) -> dict[str, str]:
        from drafter.core.registry import ORDER

        unknown = sorted(set(v) - set(ORDER))
        if unknown:
            raise ValueError(f"runner.deployments: unknown stage(s) {unknown}; stages are: {', '.join(ORDER)}")
        for stage, name in v.items():
            if name.count("/") != 1:
                raise ValueError(f"runner.deployments.{stage}: {name!r} is not FLOW/DEPLOYMENT")
        return v
