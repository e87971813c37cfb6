"""Capturing target features: the hidden states a drafter is trained on.

The target runs (transformers, float32) over each tokenized conversation; per token we keep

* ``hidden_final`` — the **LM-head input**: the last decoder layer's output *after* the final
  norm (``model.norm``). This is exactly what vLLM feeds an MTP drafter during speculative
  decoding: GLM-4-MoE's model returns ``hidden_states, _ = self.norm(hidden_states, residual)``
  (vllm/model_executor/models/glm4_moe.py:490; DeepSeek-V2/V3 the same, deepseek_v2.py:1589),
  the runner passes that output on as ``target_hidden_states = hidden_states[:num_scheduled_tokens]``
  (vllm/v1/worker/gpu_model_runner.py:4958), and the MTP layer normalizes it again with ``hnorm``
  before ``eh_proj`` (glm4_moe_mtp.py:118, deepseek_mtp.py). So the drafter sees post-norm states.
* ``hidden_layer_{i}`` for each configured ``i`` — the residual stream *entering* decoder layer
  ``i`` (``0`` = token embeddings, ``num_hidden_layers`` = the last layer's output before the
  final norm): vLLM's EAGLE-3 aux-hidden-state index (``hidden_states + residual`` after ``i``
  layers, vllm/model_executor/models/llama.py:429-441, interfaces.py:1608-1610), and
  transformers' ``output_hidden_states[i]`` for ``i < num_hidden_layers`` (transformers 5
  returns the post-norm state at the last index; here that is ``hidden_final``).

Shard format (``features/<split>/shard-00000.safetensors``; conversations packed back to back):

=================== ============ ===========================================================
tensor              shape/dtype  meaning
=================== ============ ===========================================================
``input_ids``       [T] int64    token ids (chat template applied, truncated to max_seq_len)
``loss_mask``       [T] bool     True on assistant tokens (the ones to train on)
``seq_offsets``     [N+1] int64  conversation ``k`` is rows ``seq_offsets[k]:seq_offsets[k+1]``
``hidden_final``    [T, H]       LM-head input (post final norm), float32 or bfloat16
``hidden_layer_{i}`` [T, H]      residual stream entering decoder layer i
=================== ============ ===========================================================

Metadata (safetensors header, strings): ``format``, ``split``, ``row_ids`` (JSON list, one per
conversation), ``layers`` (JSON), ``hidden_size``, ``dtype``, ``num_tokens``,
``num_sequences``, ``truncated`` (JSON list of row ids cut to max_seq_len), ``plan`` (hash of
the shard's token ids, used to verify a shard kept on resume).

Example::

    from drafter.data.capture import iter_feature_shards
    for shard in iter_feature_shards(capture_artifact, "train"):
        h = shard.tensors["hidden_final"]            # [T, H]
        for k, row_id in enumerate(shard.row_ids):
            seq = shard.sequence(k)                  # dict of per-conversation slices
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from drafter.core.files import list_shards, shard_name, tokenize_conversation
from drafter.core.errors import ResourceError, StageError, describe_value
from drafter.data.feature_shards import (FINAL, FORMAT, SPLITS, FeatureShard, check_features,  # noqa: F401
                                        hidden_tensor_names, iter_feature_shards, layer_tensor_name,
                                        read_shard_metadata, write_feature_shard)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- sequences


@dataclass
class Sequence:
    """One tokenized conversation."""

    row_id: str
    split: str
    input_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def template_kwargs_for(row: dict) -> dict:
    """Chat-template arguments of a row: its ``chat_template_kwargs`` if present, else
    ``enable_thinking`` derived from ``mode`` (``thinking`` / ``non-thinking``)."""
    kw = row.get("chat_template_kwargs")
    if isinstance(kw, dict):
        return kw
    mode = str(row.get("mode") or "").lower().replace("_", "-")
    if mode in ("thinking", "think", "on"):
        return {"enable_thinking": True}
    if mode in ("non-thinking", "no-thinking", "nothink", "off"):
        return {"enable_thinking": False}
    return {}


def tokenize_rows(tokenizer, rows: Iterable[dict], max_seq_len: int,
                  on_row: Callable[[], None] | None = None) -> list[Sequence]:
    """Tokenize conversation rows (``id``, ``split``, ``messages``) into :class:`Sequence` s,
    truncated to ``max_seq_len`` tokens. Bad rows raise :class:`StageError` naming the row."""
    seqs = []
    for row in rows:
        rid = row.get("id")
        if rid is None:
            raise StageError(f"a row has no 'id' (it is {describe_value(row)})")
        split = row.get("split")
        if split not in SPLITS:
            raise StageError(f"row {rid!r}: split must be one of {SPLITS}, got {describe_value(split)}")
        ids, mask = tokenize_conversation(tokenizer, row.get("messages") or [], row_id=rid,
                                          template_kwargs=template_kwargs_for(row))
        truncated = len(ids) > max_seq_len
        seqs.append(Sequence(str(rid), split, torch.tensor(ids[:max_seq_len], dtype=torch.int64),
                             torch.tensor(mask[:max_seq_len], dtype=torch.bool), truncated))
        if on_row:
            on_row()
    return seqs


# --------------------------------------------------------------------------- planning


@dataclass
class ShardPlan:
    split: str
    index: int
    seqs: list[Sequence]

    @property
    def name(self) -> str:
        return shard_name(self.index, "safetensors")

    @property
    def relpath(self) -> str:
        return f"{self.split}/{self.name}"

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.seqs:
            h.update(s.row_id.encode() + b"\0")
            h.update(s.input_ids.numpy().tobytes())
            h.update(s.loss_mask.numpy().tobytes())
        return h.hexdigest()[:32]


def plan_shards(seqs: list[Sequence], shard_tokens: int) -> list[ShardPlan]:
    """Cut each split's sequences, in order, into shards of about ``shard_tokens`` tokens
    (a shard closes once it reaches ``shard_tokens``). Deterministic, so a retry finds the
    same shards."""
    plans: list[ShardPlan] = []
    for split in SPLITS:
        cur: list[Sequence] = []
        n = 0
        for s in (s for s in seqs if s.split == split):
            cur.append(s)
            n += len(s)
            if n >= shard_tokens:
                plans.append(ShardPlan(split, sum(p.split == split for p in plans), cur))
                cur, n = [], 0
        if cur:
            plans.append(ShardPlan(split, sum(p.split == split for p in plans), cur))
    return plans


def bytes_per_token(num_hidden: int, hidden_size: int, dtype: str) -> int:
    """Stored bytes per token: hidden tensors + input_ids (int64) + loss_mask (bool)."""
    return num_hidden * hidden_size * DTYPES[dtype].itemsize + 8 + 1


def estimate_bytes(num_tokens: int, num_sequences: int, num_hidden: int, hidden_size: int, dtype: str,
                   num_shards: int = 1) -> int:
    """Bytes the shards will take: tokens × (hidden tensors × hidden × dtype bytes + ids + mask),
    plus offsets and a header allowance per shard."""
    return (num_tokens * bytes_per_token(num_hidden, hidden_size, dtype)
            + 8 * (num_sequences + num_shards) + 4096 * num_shards + 64 * num_sequences)


def check_disk(directory: Path, need_bytes: int, margin: float) -> int:
    """Raise :class:`~drafter.core.errors.ResourceError` (not retried: a retry meets the same disk) unless the
    disk holding ``directory`` has at least ``margin × need_bytes`` free; returns the free bytes."""
    directory = Path(directory)
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < margin * need_bytes:
        raise ResourceError(
            f"not enough disk for capture at {directory}: the features need an estimated "
            f"{need_bytes:,} bytes ({need_bytes / 2**30:.2f} GiB; × margin {margin:g} = "
            f"{int(margin * need_bytes):,} bytes) but only {free:,} bytes ({free / 2**30:.2f} GiB) are free. "
            "Free space, point store.root elsewhere, or reduce capture.layers / capture.max_seq_len / "
            "the number of prompts, or store capture.dtype=bfloat16."
        )
    return free


# --------------------------------------------------------------------------- the model


def load_target_model(model_dir: str | Path, dtype: str = "float32", device="cpu"):
    """Load a target checkpoint for capture (transformers, eval mode, SDPA attention) onto ``device``. Keys
    transformers does not know (e.g. an MTP layer) are ignored quietly. The whole target must fit on that one
    device: a target larger than one GPU is captured through its serving engine (issue 36), not here."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], attn_implementation="sdpa")
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model.to(device).eval()


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class HiddenStates:
    """Callable that runs the target's decoder (no LM head) and returns the requested hidden
    states, ``{name: [B, T, H]}``. Layer states are taken with forward hooks (the embedding
    output for ``i = 0``, decoder layer ``i-1``'s output otherwise), so nothing else is kept.

    Use as a context manager (removes its hooks on exit)::

        with HiddenStates(model, layers=[1]) as hs:
            out = hs(input_ids, attention_mask)   # {"hidden_final": …, "hidden_layer_1": …}
    """

    def __init__(self, model, layers: Iterable[int] = ()):
        self.model = model
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = list(layers)
        n = int(text_config(model).num_hidden_layers)
        bad = [i for i in self.layers if not 0 <= i <= n]
        if bad:
            raise StageError(f"capture.layers {bad} out of range: the target has {n} decoder layers (valid: 0..{n})")
        self._got: dict[str, torch.Tensor] = {}
        self._hooks = []
        decoder_layers = self.decoder.layers
        for i in self.layers:
            mod = self.decoder.embed_tokens if i == 0 else decoder_layers[i - 1]
            self._hooks.append(mod.register_forward_hook(self._keeper(layer_tensor_name(i))))

    def _keeper(self, name: str):
        def hook(module, args, output):
            self._got[name] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self._got = {}
        device = self.decoder.embed_tokens.weight.device  # the batch goes where the target is
        input_ids = input_ids.to(device)
        attention_mask = None if attention_mask is None else attention_mask.to(device)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        got = {FINAL: out.last_hidden_state}
        for i in self.layers:
            got[layer_tensor_name(i)] = self._got[layer_tensor_name(i)]
        self._got = {}
        return got

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> "HiddenStates":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence indices into forward batches: longest first, each batch padded to its
    longest sequence with ``count × longest ≤ batch_tokens`` (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    cur: list[int] = []
    for k in order:
        longest = lengths[cur[0]] if cur else lengths[k]
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    if cur:
        batches.append(cur)
    return batches


def pad_batch(seqs: list[Sequence], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-padded ``[B, T]`` input ids and attention mask (``None`` when nothing is padded)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64)
    att = torch.zeros((len(seqs), T), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s.input_ids
        att[b, : len(s)] = 1
    return ids, (None if bool(att.all()) else att)


def capture_shard(hs: HiddenStates, seqs: list[Sequence], batch_tokens: int, dtype: str,
                  on_batch: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Run the target over ``seqs`` and return the shard's packed tensors (see module doc)."""
    lengths = [len(s) for s in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    total = int(offsets[-1])
    names = hidden_tensor_names(hs.layers)
    H = int(text_config(hs.model).hidden_size)
    store = DTYPES[dtype]
    packed = {n: torch.empty((total, H), dtype=store) for n in names}
    for batch in make_batches(lengths, batch_tokens):
        bseqs = [seqs[k] for k in batch]
        ids, att = pad_batch(bseqs)
        # no attention mask: the padding is on the right and attention is causal, so no real token attends
        # to a pad and its state is what the masked forward gives; without a mask SDPA runs its causal
        # kernel instead of materialising a [B, heads, T, T] masked score tensor (bench/capture.py)
        got = hs(ids, None)
        # destination rows in the packed tensors, in the batch's row-major valid order
        dest = torch.cat([torch.arange(int(offsets[k]), int(offsets[k + 1])) for k in batch])
        for n in names:
            h = got[n]
            flat = h.reshape(-1, h.shape[-1]) if att is None else h[att.to(h.device).bool()]
            packed[n].index_copy_(0, dest, flat.to(device="cpu", dtype=store))  # shards are written from host memory
        if on_batch:
            on_batch(int(dest.numel()))
    return {
        "input_ids": torch.cat([s.input_ids for s in seqs]),
        "loss_mask": torch.cat([s.loss_mask for s in seqs]),
        "seq_offsets": offsets,
        **packed,
    }


# --------------------------------------------------------------------------- capture


@dataclass
class CaptureResult:
    tokens: int = 0
    sequences: int = 0
    shards: int = 0
    shards_reused: int = 0
    tokens_computed: int = 0
    compute_seconds: float = 0.0
    estimated_bytes: int = 0
    bytes_written: int = 0
    truncated: int = 0
    per_split: dict = field(default_factory=dict)
    shard_files: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.compute_seconds if self.compute_seconds > 0 else 0.0

    def metrics(self) -> dict:
        return {
            "tokens": self.tokens,
            "sequences": self.sequences,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "bytes_per_token": round(self.bytes_written / self.tokens, 1) if self.tokens else 0.0,
            "shards": self.shards,
            "estimated_bytes": self.estimated_bytes,
            "bytes_written": self.bytes_written,
            "shards_reused": self.shards_reused,
            "truncated": self.truncated,
        }


@dataclass
class CapturePlan:
    """What a capture still has to do in ``out_dir``: the shards planned, which of them an earlier try
    already wrote (kept on resume), their fingerprints and the metadata every shard carries. Shared by the
    engines (:func:`capture_features`, :func:`drafter.data.capture_vllm.capture_features_vllm`), so both
    write the same files."""

    out_dir: Path
    plans: list[ShardPlan]
    done: dict[str, bool]
    fingerprints: dict[str, str]
    meta_base: dict[str, str]
    num_hidden: int
    hidden_size: int
    dtype: str
    res: CaptureResult

    @property
    def remaining(self) -> list[ShardPlan]:
        return [p for p in self.plans if not self.done[p.relpath]]

    def remaining_bytes(self) -> int:
        rem = self.remaining
        return estimate_bytes(sum(p.num_tokens for p in rem), sum(len(p.seqs) for p in rem), self.num_hidden,
                              self.hidden_size, self.dtype, len(rem)) if rem else 0

    def write(self, p: ShardPlan, tensors: dict[str, torch.Tensor], seconds: float) -> None:
        """Check and write shard ``p`` atomically (its metadata as :func:`capture_features` writes it)."""
        path = self.out_dir / p.relpath
        row_ids = [s.row_id for s in p.seqs]
        check_features(tensors, str(path), row_ids)
        meta = dict(self.meta_base, split=p.split, row_ids=json.dumps(row_ids), num_tokens=str(p.num_tokens),
                    num_sequences=str(len(p.seqs)), truncated=json.dumps([s.row_id for s in p.seqs if s.truncated]),
                    plan=self.fingerprints[p.relpath])
        write_feature_shard(path, tensors, meta)
        self.res.compute_seconds += seconds
        self.res.tokens_computed += p.num_tokens

    def record(self, p: ShardPlan) -> None:
        """Count shard ``p`` (written or kept) in the result."""
        size = (self.out_dir / p.relpath).stat().st_size
        self.res.shards_reused += int(self.done[p.relpath])
        self.res.bytes_written += size
        self.res.shard_files.append({"path": p.relpath, "tokens": p.num_tokens, "sequences": len(p.seqs),
                                     "bytes": size, "reused": self.done[p.relpath]})


def plan_capture(seqs: list[Sequence], out_dir: Path, *, layers: list[int], hidden_size: int, dtype: str,
                 shard_tokens: int) -> CapturePlan:
    """Plan the shards of ``seqs`` and find those an earlier try left in ``out_dir`` that match the plan
    (kept); other shard files there are removed."""
    out_dir = Path(out_dir)
    names = hidden_tensor_names(layers)
    plans = plan_shards(seqs, shard_tokens)
    res = CaptureResult(tokens=sum(len(s) for s in seqs), sequences=len(seqs), shards=len(plans),
                        truncated=sum(s.truncated for s in seqs))
    res.estimated_bytes = estimate_bytes(res.tokens, res.sequences, len(names), hidden_size, dtype, max(len(plans), 1))
    for split in SPLITS:
        sp = [s for s in seqs if s.split == split]
        res.per_split[split] = {"sequences": len(sp), "tokens": sum(len(s) for s in sp),
                                "shards": sum(p.split == split for p in plans)}

    # which shards are already done (a previous try of this same output)
    planned = {p.relpath for p in plans}
    for split in SPLITS:
        for f in list_shards(out_dir / split, "safetensors"):
            if f"{split}/{f.name}" not in planned:
                f.unlink()
    done: dict[str, bool] = {}
    fingerprints = {p.relpath: p.fingerprint() for p in plans}
    meta_base = {"format": FORMAT, "layers": json.dumps(layers), "hidden_size": str(hidden_size), "dtype": dtype,
                 "hidden_final": "LM-head input: last decoder layer output after the final norm"}
    for p in plans:
        path = out_dir / p.relpath
        meta = read_shard_metadata(path) if path.exists() else None
        ok = meta is not None and meta.get("plan") == fingerprints[p.relpath] and all(
            meta.get(k) == v for k, v in meta_base.items())
        if path.exists() and not ok:
            path.unlink()
        done[p.relpath] = ok
    return CapturePlan(out_dir, plans, done, fingerprints, meta_base, len(names), hidden_size, dtype, res)


def capture_features(
    model,
    seqs: list[Sequence],
    out_dir: Path,
    *,
    layers: Iterable[int] = (),
    dtype: str = "float32",
    batch_tokens: int = 4096,
    shard_tokens: int = 16384,
    min_free_margin: float = 1.2,
    on_tokens: Callable[[int], None] | None = None,
) -> CaptureResult:
    """Capture features of ``seqs`` into ``out_dir/<split>/shard-*.safetensors``.

    Before any forward pass: estimates the bytes still to write and refuses (``StageError``
    with both numbers) when free disk < ``min_free_margin`` × that estimate. Shards already in
    ``out_dir`` whose metadata matches the plan are kept (resume); others are recomputed. Each
    shard is checked (:func:`check_features`) before it is written atomically.
    """
    layers = list(layers)
    cp = plan_capture(seqs, out_dir, layers=layers, hidden_size=int(text_config(model).hidden_size), dtype=dtype,
                      shard_tokens=shard_tokens)
    if cp.remaining:
        check_disk(cp.out_dir, cp.remaining_bytes(), min_free_margin)

    with HiddenStates(model, layers) as hs:
        for p in cp.plans:
            if cp.done[p.relpath]:
                if on_tokens:
                    on_tokens(p.num_tokens)
            else:
                t0 = time.perf_counter()
                tensors = capture_shard(hs, p.seqs, batch_tokens, dtype, on_batch=on_tokens)
                cp.write(p, tensors, time.perf_counter() - t0)
            cp.record(p)
    return cp.res


def capture_rows(model_dir: str | Path, rows: list[dict], out_dir: Path, c, *, what: str = "capture",
                 model=None, serving=None) -> CaptureResult:
    """Tokenize conversation rows with the target's chat template and capture their features into
    ``out_dir/<split>/`` with the settings of ``c`` (a :class:`~drafter.core.config.CaptureConfig`: engine, layers,
    dtype, max_seq_len, batch and shard sizes, disk margin), showing progress as ``what``. The `capture`
    stage does this for the scrubbed conversations, `eval_offline` for the user's held-out files.
    ``model``: the target already loaded (:func:`load_target_model`), else it is loaded here (engine
    ``transformers``). Engine ``vllm`` runs the target in the serving env instead
    (:func:`drafter.data.capture_vllm.capture_rows_vllm`; ``serving``: the :class:`~drafter.core.config.ServingConfig`
    whose python, environment and ``--tensor-parallel-size`` it uses)."""
    from transformers import AutoTokenizer

    from drafter.core.progress import progress

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with progress(f"{what}: tokenize", total=len(rows), unit="rows") as bar:
        seqs = tokenize_rows(tokenizer, rows, c.max_seq_len, on_row=lambda: bar.advance(1))
    if getattr(c, "engine", "transformers") == "vllm":
        from drafter.data.capture_vllm import capture_rows_vllm

        with progress(what, total=sum(len(s) for s in seqs), unit="tok") as bar:
            return capture_rows_vllm(model_dir, seqs, out_dir, c, serving=serving, on_tokens=bar.advance)
    if model is None:
        from drafter.core.hardware import resolve_device

        model = load_target_model(model_dir, device=resolve_device(getattr(c, "device", "auto")))
    with progress(what, total=sum(len(s) for s in seqs), unit="tok") as bar:
        return capture_features(model, seqs, out_dir, layers=c.layers, dtype=c.dtype, batch_tokens=c.batch_tokens,
                                shard_tokens=c.shard_tokens, min_free_margin=c.min_free_margin, on_tokens=bar.advance)
