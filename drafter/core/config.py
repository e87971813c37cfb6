"""Release configuration: one pydantic section per stage, loaded from YAML.

Example::

    from drafter.core.config import load_config
    cfg = load_config("configs/demo.yaml", profile="quick", overrides=["generate.num_prompts=32"])
    cfg.generate.temperature

Every field carries a description, so the Prefect UI renders the config as a form.
Invalid configs fail here, before any work starts, with the dotted path of the bad field.

This module holds :class:`ReleaseConfig` and the loading; the sections live next to it, by concern, and
are imported from here: :mod:`~drafter.core.config_base` (:class:`Section`, :func:`Operational`),
:mod:`~drafter.core.config_data` (store, target, serving, generate, scrub, capture),
:mod:`~drafter.core.config_training` (train, bootstrap, DSpark, ablation), :mod:`~drafter.core.config_eval`
(held-out set, offline evaluation, FP8 / EXL3, live A/B, gate) and :mod:`~drafter.core.config_release`
(publish, baseline, retrain, runner).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from drafter.core.config_base import (DEVICE_PATTERN, DOMAINS, SECRET_KINDS, Device, Operational, Section,  # noqa: F401
                                      check_domains, is_operational, refuse_api_key_arg)
from drafter.core.config_data import (CaptureConfig, GenerateConfig, PrepareTargetConfig, ScrubConfig,  # noqa: F401
                                      ServingConfig, StoreConfig)
from drafter.core.config_eval import (AbLiveConfig, EvalOfflineConfig, GateConfig, HeldoutConfig,  # noqa: F401
                                      QuantizeExl3Config, QuantizeFp8Config, Temperatures, VerifyFp8Config)
from drafter.core.config_release import BaselineConfig, PublishConfig, RetrainConfig, RunnerConfig  # noqa: F401
from drafter.core.config_training import (LOSS_NAMES, AblationConfig, BootstrapConfig, DSparkSection,  # noqa: F401
                                          Eagle3Section, TrainConfig)
from drafter.core.errors import ConfigError


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
    eagle3: Eagle3Section = Field(default_factory=Eagle3Section, description="An EAGLE-3 head in place of the MTP "
                                  "layer (vLLM's method eagle3), for targets that ship no drafter.")
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

    @model_validator(mode="after")
    def _eagle3(self) -> "ReleaseConfig":
        e = self.eagle3
        if self.train.init is not None and not e.enabled:
            raise ValueError("train.init is for EAGLE-3 heads (eagle3.enabled); an MTP fine-tune starts from the "
                             "release's own MTP layer (or baseline.weights)")
        if not e.enabled:
            return self
        if self.dspark.enabled:
            raise ValueError("eagle3.enabled and dspark.enabled: a release trains one kind of drafter; disable one")
        if self.ab_live.method != "eagle3":
            raise ValueError(f"eagle3.enabled: the heads are served as vLLM's method eagle3, but ab_live.method is "
                             f"{self.ab_live.method!r}; set ab_live.method: eagle3")
        missing = [i for i in e.aux_layer_ids if i not in self.capture.layers]
        if missing:
            raise ValueError(f"capture.layers {self.capture.layers} lacks {missing}: eagle3.aux_layer_ids "
                             f"{e.aux_layer_ids} are the aux hidden states the head reads (set capture.layers to "
                             f"include them)")
        if self.train.draft_vocab_size:
            raise ValueError(f"train.draft_vocab_size {self.train.draft_vocab_size}: an EAGLE-3 head has its own draft "
                             f"vocabulary, eagle3.draft_vocab_size; set train.draft_vocab_size to 0")
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
