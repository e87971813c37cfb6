"""Config sections of drafter training: the fine-tune, the demo's bootstrap, the DSpark block drafter,
the EAGLE-3 head and the loss ablation (re-exported by :mod:`drafter.core.config`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from drafter.core.config_base import Device, Experts, Operational, Section


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
    micro_batch: int = Field(4, ge=1, description="Windows per micro batch: an MTP or EAGLE-3 drafter runs its windows of one length as one batch (a DSpark draft one at a time).")
    grad_accum: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="Compute dtype (bfloat16 = autocast); `auto` = bfloat16 where the device multiplies it "
        "natively (a GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32 (an AVX2 CPU emulates bf16 matmuls).")
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
    experts: str = Experts("training")
    frozen_dtype: Literal["auto", "float32", "bfloat16"] = Operational(
        "auto", description="dtype of the frozen matmul weights (experts, output head, bf16-exact embeddings) during "
        "training: `auto` = bfloat16 under `dtype: bfloat16` (autocast casts them anyway: the same numbers, half the "
        "memory, no per-use copies), else float32. The written drafter keeps their original values.")
    compile: bool = Operational(
        False, description="torch.compile each drafter layer for training (drafter/training/compiled.py: Inductor fuses "
        "a layer's element-wise work; the head and loss stay eager). Pays where kernel launches bound the step (a GPU "
        "at demo size), costs a compile before the first step; the same result within float rounding.")
    nproc_per_node: int = Field(1, ge=1, description="Training processes (one per GPU): >1 runs the same loop under "
                                "torchrun (gradients averaged across ranks; NCCL on GPUs, gloo on CPU).")
    draft_vocab_size: int = Field(
        0, ge=0, description="MTP only: >0 writes `draft_vocab.safetensors` next to the fine-tuned drafter, the N tokens "
        "it may propose (every token of its training windows, most frequent first, then the lowest ids); vLLM with the "
        "project's plugin computes draft logits over those rows of the output head only (drafter/serving/draft_vocab.py). "
        "The fine-tune trains over it too: draft and target logits over those tokens (the target's distribution "
        "renormalised over them; CE counts only labels inside), a head |V'|/|V| the cost. Lossless; 0 = the whole vocabulary.")

    init: str | None = Field(
        None, description="EAGLE-3 only: the released head to fine-tune, a folder (config.json + *.safetensors) in the "
        "speculators or the EAGLE layout; None: the bootstrap's stand-in (the demo).")

    def key_dump(self) -> dict:
        """As :meth:`Section.key_dump`, without ``init`` when unset (keys made before the field existed stay valid)."""
        d = super().key_dump()
        if d.get("init") is None:
            d.pop("init", None)
        return d

    @model_validator(mode="after")
    def _frozen_needs_bf16_compute(self) -> "TrainConfig":
        if self.frozen_dtype == "bfloat16" and self.dtype == "float32":
            raise ValueError("frozen_dtype: bfloat16 needs dtype: bfloat16 (float32 compute would mix float32 inputs "
                             "with bfloat16 weights); set dtype: bfloat16 or frozen_dtype: auto")
        return self


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


class Eagle3Section(Section):
    """An EAGLE-3 head (vLLM's ``method: eagle3``) in place of the MTP layer, for targets that ship no drafter:
    `bootstrap_drafter` trains the stand-in from scratch, `train` fine-tunes it (or ``train.init``), `eval_offline`
    and `ab_live` evaluate and serve it (drafter/models/eagle3.py). The training recipe is `train`'s."""

    enabled: bool = Field(False, description="Train and evaluate an EAGLE-3 head instead of the MTP layer.")
    aux_layer_ids: list[int] = Field(default_factory=list, description="The target's aux hidden states the head reads "
                                     "(vLLM's eagle_aux_hidden_state_layer_ids: id i = the residual stream entering layer "
                                     "i, 0 = embeddings; capture.layers must hold them); [] = vLLM's default (2, L//2, L−3).")
    draft_vocab_size: int = Field(0, ge=0, description="Rows of the head's output layer (d2t / t2d maps): the N tokens "
                                  "most frequent in the training windows; 0 = the whole vocabulary.")
    speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens per step served (num_speculative_tokens) "
                                    "and written into the speculators config.")
    norm_before_residual: bool = Field(True, description="The residual after hidden_norm (speculators' default) or "
                                       "before it (the original EAGLE-3).")
    init_seed: int = Field(0, description="Seed of the bootstrap's random initialization of the head.")
    layout: Literal["speculators", "eagle"] = Field("speculators", description="Checkpoint layout written and "
                                                    "published: speculators (config with speculators_config) or eagle.")

    @field_validator("aux_layer_ids")
    @classmethod
    def _aux_ids(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v) or v != sorted(set(v)):
            raise ValueError(f"eagle3.aux_layer_ids {v}: layer ids must be distinct, increasing and ≥ 0")
        return v

    def key_dump(self) -> dict | None:
        """None when disabled: the section then enters no stage key (keys made before it existed stay valid)."""
        return super().key_dump() if self.enabled else None


class AblationConfig(Section):
    losses: list[Literal["kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1"]] = Field(
        default_factory=list, description="Extra fine-tunes with other losses, all else equal (e.g. [kl] for the "
        "released / KL / LK table of the DeepSeek-V3 card).")
