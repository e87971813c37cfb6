"""The GPU memory one training step of a drafter needs, computed without weights (``drafter plan``).

The drafter is built on the ``meta`` device from the target's ``config.json`` (no weights are read or
allocated) and its parameters counted, the config's ``train.freeze`` patterns applied as training
applies them (:func:`drafter.models.freeze` on in-memory names for MTP layers; release names for the
DeepSeek-V4.1 DSpark layout, :func:`drafter.models.dspark_v41.trainable_keys`). The plan is a sum of
terms, each with its formula (N: parameters, b(x): bytes of dtype x, c: the compute dtype — bfloat16
under ``train.dtype: bfloat16`` autocast, else float32; T: ``train.window``; K: ``train.k_steps``;
V': the vocabulary the loss runs over (``train.draft_vocab_size`` or the whole vocabulary)):

* **frozen weights** N_frozen · b(frozen): training holds the frozen matmul weights in ``train.frozen_dtype``
  (:mod:`drafter.training.frozen`; ``auto``: bfloat16 under bfloat16 compute, else float32 as
  :func:`drafter.models.load_drafter` loads them); the plan counts every frozen weight in it (routers and
  norms, kept float32, are a negligible share).
* **trainable weights** N_train · 4: float32 — AdamW updates them in place, so they are the master copy
  (holding them in bfloat16 would need a float32 master copy: the same 4 bytes, plus 2).
* **gradients** N_train · 4 (float32, as the weights); **AdamW state** N_train · 8 (``exp_avg`` and
  ``exp_avg_sq``, float32).
* **autocast copies**: under bfloat16 autocast every float32 weight a matmul reads is cast to bfloat16.
  Trainable weights: cached once per forward, N_train · 2. Frozen float32 weights: the copy is kept for the
  backward pass (the input of the matmul requires grad) at every use — K uses per window for the MTP
  layer reused over K steps: K · (N_experts_hit + N_frozen_heads) · 2, with N_experts_hit = the routed
  experts times the share of experts that receive at least one of the T·top_k routed tokens,
  1 − (1 − top_k/E)^T. None when the frozen weights are bfloat16 already.
* **target LM head** V · H · 4 (MTP): :mod:`drafter.training.run` reads ``lm_head.weight`` in float32 for
  the target's logits.
* **activations** K · B·T · A · b(c) + the attention masks K · T · (k·T) · b(c), with B = ``micro_batch`` (its
  windows of one length run as one batch; all B of one length is the upper bound) and A the values kept for
  the backward pass per token and drafter-layer pass (:func:`activation_values`, from the hidden size, the
  attention's dimensions, the experts' top-k and intermediate width). Attention is assumed to run in a
  fused SDPA kernel (no T×T scores kept).
* **loss logits** at the real vocabulary (rows n = B·T, an upper bound: every position an assistant token):
  the target's logits n · V' · 4 (float32, once per micro batch); kept for the backward pass per draft
  step: the fused LK-hybrid loss (:class:`drafter.training.losses.LKHybridRows`) keeps only its float32
  gradient, n · V' · 4, other losses ~3 float32 [n, V'] tensors (log q, p, and the autograd's copy);
  the working set at the loss: the draft logits n · V' · b(c) plus, in the backward pass, the float32
  gradient and its cast, n · V' · (4 + b(c)); the fused loss's chunk temporaries, 6 float32 [rows, V'] with
  rows = :func:`drafter.training.losses.chunk_rows` on a GPU (≤ 128 MiB each).

GPUs: ``train.nproc_per_node`` ranks each hold a whole replica (data parallel), so a step needs one GPU
with ``total / (1 − reserve)`` memory per rank; the plan also says how many such GPUs the step would
need with its weights and optimizer state sharded (FSDP / expert parallel — not what the train stage
does today). Measured references to compare with (one H200, DESIGN.md): DeepSeek-V3's MTP layer,
lk_hybrid, K = 2, bfloat16 autocast, AdamW: 33.6 GiB at window 1024 and 37.0 GiB at 2048 with bfloat16
frozen weights; 106.8 GiB with every weight in float32.

Example::

    from drafter.training.memory import plan_for_config
    plan = plan_for_config(cfg, target_config("configs/targets/deepseek-v3-0324.config.json"))
    print(plan.total / GiB, plan.params.trainable)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from drafter.training.frozen import frozen_dtype_of
from drafter.training.losses import CHUNK_TEMPORARIES, chunk_rows

GiB = 1024 ** 3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TARGETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "targets"
"""Shipped target facts (``configs/targets/*.config.json``) for targets not in the store yet."""

DEFAULT_RESERVE = 0.1
"""Share of a GPU kept free for the CUDA context, NCCL buffers and the allocator's fragmentation."""


# ---------------------------------------------------------------------------------------- target config


@dataclass(frozen=True)
class TargetConfig:
    """A target's ``config.json`` (the text model's fields at top level) and where it was read."""

    config: dict[str, Any]
    source: str


def read_target_config(path: str | Path, source: str | None = None) -> TargetConfig:
    """A ``config.json`` file (V4.1's nested ``text_config`` flattened to top level)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable config.json ({e})") from None
    cfg = {**raw, **raw.get("text_config", {})}
    return TargetConfig(cfg, source or str(path))


def shipped_target_config(hub_id: str | None, directory: Path = TARGETS_DIR) -> TargetConfig | None:
    """The shipped facts file whose ``_name_or_path`` is ``hub_id`` (configs/targets/README.md), or None."""
    if not hub_id or not directory.is_dir():
        return None
    for p in sorted(directory.glob("*.config.json")):
        try:
            name = json.loads(p.read_text()).get("_name_or_path")
        except (OSError, json.JSONDecodeError):
            continue
        if name == hub_id:
            try:
                shown = p.relative_to(Path.cwd())
            except ValueError:
                shown = p
            return read_target_config(p, f"{shown} (shipped facts for {hub_id}; configs/targets/README.md)")
    return None


# ---------------------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the drafter as training holds it (elements, not bytes)."""

    total: int
    trainable: int
    routed_experts: int
    frozen_matmul: int
    """Frozen parameters read as matmul weights at every draft step (routed experts, a frozen output head)."""
    vocab_tables: int = 0
    """Vocabulary-sized tables among them (embeddings, output heads)."""
    shared_with_target: int = 0
    """Held for the step but owned by the target (V4.1: its embedding and LM head); counted in ``total``."""

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


@dataclass(frozen=True)
class DrafterShape:
    """What the plan needs to know about a drafter: its parameters and the sizes its activations scale with."""

    name: str
    kind: str  # "mtp" or "dspark_v41"
    params: ParamCount
    hidden: int
    vocab: int
    layers: int
    top_k: int
    experts: int
    values_per_token: int
    """Activation values kept for the backward pass per token and drafter-layer pass (:func:`activation_values`)."""
    notes: tuple[str, ...] = ()


def _moe(config: dict) -> tuple[int, int, int, int]:
    """(experts E, top_k, routed intermediate I, shared intermediate) of a DeepSeek-style MoE config."""
    E = int(config.get("n_routed_experts") or 0)
    k = int(config.get("num_experts_per_tok") or 0)
    inter = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    shared = int(config.get("n_shared_experts") or 0) * inter
    return E, k, inter, shared


def activation_values(config: dict, kind: str = "mtp") -> int:
    """Values kept for the backward pass per token and drafter-layer pass (an estimate; the sum below).

    MTP layer (DeepSeek-V3 / GLM-4-MoE): the input side 8H (embedding, enorm/hnorm in and out, the
    concatenation 2H, eh_proj's output), the decoder block's norms and residuals 6H, attention —
    MLA: q_lora·2 + heads·qk + (kv_lora + rope) + kv_lora + heads·(nope + v) + 2·heads·qk (q, k after
    RoPE) + 2·heads·v (v, the output); GQA: 3·(heads + 2·kv_heads)·d — the router's float32 logits 2E,
    the routed experts top_k·(H + 4I) (each token's copy, gate/up, the activation and its product), the
    shared expert H + 4I_s, the recycled hidden state's norm 2H.
    DeepSeek-V4.1 DSpark stage: hyper-connection streams 4·hc·H, norms and residuals 4H, attention
    q_rank·2 + 3·heads·head_dim + 2·head_dim + groups·o_rank + H, the same MoE terms.
    """
    H = int(config["hidden_size"])
    E, k, inter, shared = _moe(config)
    moe = 2 * E + k * (H + 4 * inter) + ((H + 4 * shared) if shared else 0)
    if E == 0:  # a dense MLP
        moe = H + 4 * int(config.get("intermediate_size") or 4 * H)
    if kind == "dspark_v41":
        heads, hd = int(config["num_attention_heads"]), int(config["head_dim"])
        attn = (2 * int(config["q_lora_rank"]) + 3 * heads * hd + 2 * hd
                + int(config["o_groups"]) * int(config["o_lora_rank"]) + H)
        return 4 * int(config.get("hc_mult", 1)) * H + 4 * H + attn + moe
    heads = int(config["num_attention_heads"])
    if config.get("kv_lora_rank"):
        nope, rope, v = (int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]), int(config["v_head_dim"]))
        q_rank, kv_rank = int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"])
        qk = nope + rope
        attn = 2 * q_rank + heads * qk + (kv_rank + rope) + kv_rank + heads * (nope + v) + 2 * heads * qk + 2 * heads * v
    else:
        d = int(config.get("head_dim") or H // heads)
        kv = int(config.get("num_key_value_heads") or heads)
        attn = 3 * (heads + 2 * kv) * d
    return 8 * H + 6 * H + attn + moe + 2 * H


def mtp_shape(config: dict, freeze: Iterable[str]) -> DrafterShape:
    """Build the release's MTP layer(s) on the meta device (:func:`drafter.models.layout_for` by
    ``model_type``) and count its parameters under ``freeze`` (:func:`drafter.models.freeze`)."""
    import fnmatch

    from drafter.models import freeze as apply_freeze
    from drafter.models.layouts import _LAYOUT_BY_MODEL_TYPE, get_layout

    mt = config.get("model_type")
    if mt not in _LAYOUT_BY_MODEL_TYPE:
        raise ValueError(f"no MTP drafter layout for model_type {mt!r} (known: {sorted(_LAYOUT_BY_MODEL_TYPE)})")
    layout = get_layout(_LAYOUT_BY_MODEL_TYPE[mt])
    drafter = layout.build(config, device="meta")
    trainable, frozen = apply_freeze(drafter, list(freeze))
    total = trainable + frozen
    named = list(drafter.named_parameters())
    experts = sum(p.numel() for n, p in named if fnmatch.fnmatchcase(n, "*.mlp.experts.*"))
    frozen_matmul = sum(p.numel() for n, p in named if not p.requires_grad and p.dim() >= 2
                        and not n.startswith("embed_tokens."))
    vocab_tables = sum(p.numel() for n, p in named if p.dim() == 2 and p.shape[0] == int(config["vocab_size"]))
    E, k, _, _ = _moe(config)
    return DrafterShape(
        name=f"{layout.name} MTP layer{'s' if drafter.n_layers > 1 else ''} ×{drafter.n_layers}", kind="mtp",
        params=ParamCount(total, trainable, experts, frozen_matmul, vocab_tables),
        hidden=int(config["hidden_size"]), vocab=int(config["vocab_size"]), layers=drafter.n_layers, top_k=k,
        experts=E, values_per_token=activation_values(config, "mtp"))


def dspark_v41_tensors(config: dict, stages: int, target_layers: int) -> dict[str, tuple[int, ...]]:
    """Every ``mtp.*`` tensor of the DeepSeek-V4.1 DSpark layout (:mod:`drafter.models.dspark_v41`) with its
    shape, from the config (vLLM 0.32's ``DeepseekV4Attention`` / ``DeepseekV4DecoderLayer`` / ``DSparkDeepseekV4Model``)."""
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    heads, hd, qr = int(config["num_attention_heads"]), int(config["head_dim"]), int(config["q_lora_rank"])
    groups, orank, hc = int(config["o_groups"]), int(config["o_lora_rank"]), int(config.get("hc_mult", 1))
    E = int(config.get("dspark_n_routed_experts") or config["n_routed_experts"])
    inter, n_shared = int(config["moe_intermediate_size"]), int(config.get("n_shared_experts") or 0)
    rank = int(config.get("dspark_markov_rank") or 0)
    mix = (2 + hc) * hc
    out: dict[str, tuple[int, ...]] = {}
    for i in range(stages):
        p = f"mtp.{i}."
        out |= {p + "attn.wq_a.weight": (qr, H), p + "attn.wkv.weight": (hd, H), p + "attn.wq_b.weight": (heads * hd, qr),
                p + "attn.wo_a.weight": (groups * orank, heads * hd // groups), p + "attn.wo_b.weight": (H, groups * orank),
                p + "attn.q_norm.weight": (qr,), p + "attn.kv_norm.weight": (hd,), p + "attn.attn_sink": (heads,),
                p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,), p + "ffn.gate.weight": (E, H),
                p + "ffn.gate.bias": (E,),
                p + "hc_attn_fn": (mix, hc * H), p + "hc_attn_base": (mix,), p + "hc_attn_scale": (3,),
                p + "hc_ffn_fn": (mix, hc * H), p + "hc_ffn_base": (mix,), p + "hc_ffn_scale": (3,)}
        if n_shared:
            si = n_shared * inter
            out |= {p + "ffn.shared_experts.w1.weight": (si, H), p + "ffn.shared_experts.w3.weight": (si, H),
                    p + "ffn.shared_experts.w2.weight": (H, si)}
        for e in range(E):
            out |= {f"{p}ffn.experts.{e}.w1.weight": (inter, H), f"{p}ffn.experts.{e}.w3.weight": (inter, H),
                    f"{p}ffn.experts.{e}.w2.weight": (H, inter)}
    out |= {"mtp.0.main_proj.weight": (H, target_layers * H), "mtp.0.main_norm.weight": (H,)}
    last = f"mtp.{stages - 1}."
    out |= {last + "norm.weight": (H,), last + "markov_head.embed.weight": (V, rank),
            last + "markov_head.head.weight": (int(config.get("draft_vocab_size") or V), rank)}
    if config.get("enable_confidence_head", True):
        out[last + "confidence_head.proj.weight"] = (1, H + rank)
    return out


def dspark_v41_shape(config: dict, stages: int, target_layers: int, freeze: Iterable[str]) -> DrafterShape:
    """The DeepSeek-V4.1 DSpark drafter counted from its tensor shapes (:func:`dspark_v41_tensors`, checked
    against the layout by :func:`drafter.models.dspark_v41.describe`), ``freeze`` applied to release names
    as :func:`drafter.models.dspark_v41.trainable_keys` applies it; the target's embedding and LM head,
    which the draft shares, are held frozen for the step."""
    from drafter.models.dspark_v41 import _matches, describe

    shapes = dspark_v41_tensors(config, stages, target_layers)
    describe(shapes)  # the names are the layout's
    freeze = list(freeze)
    n = {k: math.prod(s) for k, s in shapes.items()}
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    shared = 2 * V * H
    trainable = sum(v for k, v in n.items() if not _matches(k, freeze))
    experts = sum(v for k, v in n.items() if ".ffn.experts." in k)
    frozen_matmul = sum(v for k, v in n.items() if _matches(k, freeze) and len(shapes[k]) == 2) + V * H
    vocab_tables = sum(v for k, v in n.items() if shapes[k][0] == V) + shared
    E = int(config.get("dspark_n_routed_experts") or config["n_routed_experts"])
    k = int(config.get("dspark_num_experts_per_tok") or config["num_experts_per_tok"])
    cfg_moe = {**config, "n_routed_experts": E, "num_experts_per_tok": k}
    notes = () if config.get("dspark_n_routed_experts") else (
        "the config has no dspark_n_routed_experts: the DSpark stages are counted with the backbone's "
        f"{E} routed experts (vLLM uses a smaller draft set when the release sets it): an upper bound",)
    return DrafterShape(
        name=f"DeepSeek-V4.1 DSpark drafter, {stages} stages (mtp.0..{stages - 1})", kind="dspark_v41",
        params=ParamCount(sum(n.values()) + shared, trainable, experts, frozen_matmul, vocab_tables, shared),
        hidden=H, vocab=V, layers=stages, top_k=k, experts=E, values_per_token=activation_values(cfg_moe, "dspark_v41"),
        notes=notes)


# ---------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MemoryLine:
    what: str
    formula: str
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """GPU memory of one training step on one rank (see the module docstring for every term)."""

    drafter: DrafterShape
    dims_source: str
    frozen_dtype: str
    compute_dtype: str
    window: int
    k_steps: int
    loss_rows: int
    loss_vocab: int
    lines: list[MemoryLine]
    gpu_memory: int
    reserve: float = DEFAULT_RESERVE
    assumptions: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(ln.bytes for ln in self.lines)

    @property
    def usable(self) -> int:
        """Memory of one GPU the step may use (``gpu_memory · (1 − reserve)``)."""
        return int(self.gpu_memory * (1 - self.reserve))

    @property
    def fits_one_gpu(self) -> bool:
        return self.total <= self.usable

    @property
    def gpus_sharded(self) -> int:
        """GPUs of this size the step needs with weights, gradients and optimizer state sharded evenly
        (FSDP / expert parallel), activations and logits on every rank."""
        per_rank = sum(ln.bytes for ln in self.lines if ln.what.startswith(("activations", "loss", "target logits")))
        shardable = self.total - per_rank
        room = self.usable - per_rank
        return max(1, math.ceil(shardable / room)) if room > 0 else 0


def _b(dtype: str) -> int:
    return BYTES[dtype]


def plan_memory(shape: DrafterShape, train, *, dims_source: str, frozen_dtype: str = "float32",
                gpu_memory: int = 80 * GiB, anchors: int | None = None, block_size: int | None = None,
                reserve: float = DEFAULT_RESERVE) -> MemoryPlan:
    """The memory plan of one training step of ``shape`` under ``train`` (a :class:`TrainConfig`).

    ``frozen_dtype``: the dtype frozen weights are held in (``train.frozen_dtype``, see the module docstring).
    DSpark: ``anchors`` × ``block_size`` block tokens per window in one pass (no K unrolling)."""
    p = shape.params
    c = "bfloat16" if train.dtype in ("bfloat16", "auto") else "float32"  # auto: bfloat16 on a GPU
    T = train.window
    fused = train.loss == "lk_hybrid"
    lines: list[MemoryLine] = []
    add = lambda what, formula, n: lines.append(MemoryLine(what, formula, int(n)))  # noqa: E731
    add(f"frozen weights ({frozen_dtype})", f"{p.frozen:,} × {_b(frozen_dtype)}", p.frozen * _b(frozen_dtype))
    add("trainable weights (float32, the AdamW master copy)", f"{p.trainable:,} × 4", p.trainable * 4)
    add("gradients (float32)", f"{p.trainable:,} × 4", p.trainable * 4)
    add("AdamW exp_avg + exp_avg_sq (float32)", f"{p.trainable:,} × 8", p.trainable * 8)
    if c == "bfloat16":
        add("autocast bfloat16 copies of trainable weights", f"{p.trainable:,} × 2", p.trainable * 2)
    if shape.kind == "dspark_v41":
        if anchors is None or block_size is None:
            raise ValueError("a DSpark plan needs anchors and block_size (the dspark section)")
        tokens, passes, uses = anchors * block_size, shape.layers, 1
        rows = tokens
    else:  # a micro batch's windows of one length run as one batch: at most micro_batch windows at once
        tokens, passes, uses = train.micro_batch * T, train.k_steps, train.k_steps
        rows = tokens
    hit = 1.0 if not shape.experts else 1 - (1 - shape.top_k / shape.experts) ** tokens
    if c == "bfloat16" and frozen_dtype == "float32":
        n_copy = int((p.frozen_matmul - p.routed_experts) + p.routed_experts * hit)
        add("autocast bfloat16 copies of frozen float32 weights, kept for backward",
            f"{uses} use{'s' if uses > 1 else ''} × ({p.frozen_matmul - p.routed_experts:,} + {p.routed_experts:,} × {hit:.3f} experts hit) × 2",
            uses * n_copy * 2)
    if shape.kind == "mtp":
        add("target LM head (float32, for the target's logits)", f"{shape.vocab:,} × {shape.hidden:,} × 4",
            shape.vocab * shape.hidden * 4)
    bc = _b(c)
    A = shape.values_per_token
    if shape.kind == "dspark_v41":
        ctx = T * (4 * shape.hidden) * bc  # the target layers' concatenation (3H) and main_proj's output
        add("activations", f"{passes} stages × {tokens} block tokens × {A:,} values × {bc} + context {T} × 4H × {bc}",
            passes * tokens * A * bc + ctx)
    else:
        mask = sum(T * (k * T if shape.layers == 1 else T) for k in range(1, train.k_steps + 1)) * bc
        add("activations", f"{passes} passes × {tokens} tokens × {A:,} values × {bc} + masks {mask:,} B",
            passes * tokens * A * bc + mask)
    Vp = train.draft_vocab_size or shape.vocab
    add("target logits (float32)", f"{rows} × {Vp:,} × 4", rows * Vp * 4)
    if shape.kind == "dspark_v41":
        add("loss state kept for backward", f"{rows} × {Vp:,} × 4 × 3 (log q, p, ‖p − q‖₁'s sign; Markov logits)",
            rows * Vp * 4 * 3 + rows * Vp * bc)
    else:
        keep = 1 if fused else 3
        add("loss state kept for backward",
            f"K={train.k_steps} × {rows} × {Vp:,} × 4 × {keep} ({'fused LK hybrid: its gradient' if fused else 'unfused loss'})",
            train.k_steps * rows * Vp * 4 * keep)
    add("loss working set (draft logits; backward gradient + cast)", f"{rows} × {Vp:,} × ({bc} + 4 + {bc})",
        rows * Vp * (2 * bc + 4))
    if fused and shape.kind != "dspark_v41":
        ch = min(rows, chunk_rows("cuda", Vp))
        add("fused loss chunk temporaries (float32)", f"{ch} rows × {Vp:,} × 4 × {CHUNK_TEMPORARIES}",
            ch * Vp * 4 * CHUNK_TEMPORARIES)
    assumptions = [
        f"frozen weights held in {frozen_dtype}"
        + (" (train.frozen_dtype: what this config's training does)" if frozen_dtype == frozen_dtype_of(train) else
           " (not what this config's training does: see train.frozen_dtype)"),
        "trainable weights, gradients and AdamW state in float32 (16 B per trainable parameter)",
        f"compute in {c}" + (" (train.dtype bfloat16: autocast)" if c == "bfloat16" else ""),
        (f"micro_batch {train.micro_batch}: its windows run as one batch (all {train.micro_batch} of one length: "
         "an upper bound)" if shape.kind == "mtp" else "windows run one at a time (activations of one window at once)"),
        f"loss rows = {rows} (every position an assistant token: an upper bound)",
        "attention in a fused SDPA kernel (no T×T scores kept); routed experts hit: "
        f"1 − (1 − {shape.top_k}/{shape.experts})^{tokens} = {hit:.3f}" if shape.experts else
        "attention in a fused SDPA kernel (no T×T scores kept)",
        f"{reserve:.0%} of each GPU reserved (CUDA context, NCCL, fragmentation)",
        *shape.notes,
    ]
    return MemoryPlan(drafter=shape, dims_source=dims_source, frozen_dtype=frozen_dtype, compute_dtype=c, window=T,
                      k_steps=train.k_steps, loss_rows=rows, loss_vocab=Vp, lines=lines, gpu_memory=int(gpu_memory),
                      reserve=reserve, assumptions=assumptions)


def shape_for_config(cfg, target: TargetConfig) -> DrafterShape:
    """The drafter ``cfg`` trains, from the target's config: DSpark on a DeepSeek-V4.1 target, else the
    release's MTP layer(s)."""
    mt = target.config.get("model_type")
    if cfg.dspark.enabled:
        if mt not in ("deepseek_v41", "deepseek_v41_text", "deepseek_v4"):
            raise ValueError(f"the memory plan models DSpark drafters of DeepSeek-V4.1 targets only (the target's "
                             f"model_type is {mt!r}); the Qwen3 DSpark draft of the demo is not modelled")
        return dspark_v41_shape(target.config, cfg.dspark.num_hidden_layers, len(cfg.dspark.target_layer_ids),
                                cfg.train.freeze)
    return mtp_shape(target.config, cfg.train.freeze)


def plan_for_config(cfg, target: TargetConfig, *, frozen_dtype: str | None = None, gpu_memory: int = 80 * GiB,
                    reserve: float = DEFAULT_RESERVE) -> MemoryPlan:
    """:func:`plan_memory` for a :class:`ReleaseConfig`'s ``train`` section and drafter; ``frozen_dtype`` None:
    the one its training holds frozen weights in (:func:`~drafter.training.frozen.frozen_dtype_of`)."""
    frozen_dtype = frozen_dtype or frozen_dtype_of(cfg.train)
    shape = shape_for_config(cfg, target)
    return plan_memory(shape, cfg.train, dims_source=target.source, frozen_dtype=frozen_dtype, gpu_memory=gpu_memory,
                       anchors=cfg.dspark.anchors if cfg.dspark.enabled else None,
                       block_size=cfg.dspark.block_size if cfg.dspark.enabled else None, reserve=reserve)


def parse_size(text: str) -> int:
    """``80GiB``, ``141 GiB``, ``80GB``, ``80`` (GiB) → bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|G|TiB|TB)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 80GiB, 141GiB or 80GB")
    unit = (m.group(2) or "GiB").lower()
    mult = {"gib": GiB, "g": GiB, "gb": 10 ** 9, "tib": 1024 * GiB, "tb": 10 ** 12}[unit]
    return int(float(m.group(1)) * mult)


__all__ = ["BYTES", "DEFAULT_RESERVE", "GiB", "TARGETS_DIR", "DrafterShape", "MemoryLine", "MemoryPlan", "ParamCount",
           "TargetConfig", "activation_values", "dspark_v41_shape", "dspark_v41_tensors", "mtp_shape", "parse_size",
           "plan_for_config", "plan_memory", "read_target_config", "shape_for_config", "shipped_target_config"]
