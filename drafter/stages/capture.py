"""`capture` stage: the target's hidden states over the scrubbed conversations — what a drafter
trains on.

Inputs: `prepare_target` (the checkpoint, tokenizer and chat template) and `scrub`
(``shards/shard-*.jsonl`` conversations with ``id``, ``split``, ``messages``).
Computes: each conversation tokenized with the chat template (loss mask = assistant tokens,
truncated to ``max_seq_len``), run through the target in float32 in batches of
``batch_tokens`` (``engine: transformers``) or by the serving env's vLLM (``engine: vllm``,
:mod:`drafter.data.capture_vllm`: the same shards); per token the LM-head input (``hidden_final``, post final norm — what vLLM
feeds the MTP layer) and the configured layers' states (see :mod:`drafter.data.capture`).
Before the first forward pass it estimates the bytes to write and refuses to start when the
disk lacks ``min_free_margin`` × that.
Writes: ``features/train/shard-*.safetensors``, ``features/heldout/shard-*.safetensors``
(~``shard_tokens`` tokens each, written atomically and checked for all-zero / non-finite rows
first) and ``report.json``.
Reports: tokens, sequences, tokens_per_s, bytes_per_token, shards, estimated_bytes,
bytes_written, shards_reused (shards kept from an interrupted earlier try).
"""
from __future__ import annotations

from pathlib import Path

from drafter.data.capture import FORMAT, capture_rows, hidden_tensor_names
from drafter.data.reports import CaptureReport
from drafter.core.config import ReleaseConfig
from drafter.core.files import iter_rows, list_shards, remove_partial_files
from drafter.core.errors import StageError
from drafter.core.hardware import device_label, resolve_device
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.target import target_dir, target_info


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.capture
    model_dir = target_dir(inputs["prepare_target"])
    src = inputs["scrub"].path / "shards"
    shards = list_shards(src)
    if not shards:
        raise StageError(f"scrub output {src} has no shard-*.jsonl files")
    remove_partial_files(out)

    rows = list(iter_rows(src))
    if not rows:
        raise StageError(f"scrub output {src} has no conversations")
    res = capture_rows(model_dir, rows, out / "features", c, serving=cfg.serving)
    del rows

    metrics = res.metrics()
    CaptureReport.write(out, {
        "format": FORMAT,
        "target": {k: v for k, v in target_info(inputs["prepare_target"]).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "tensors": ["input_ids", "loss_mask", "seq_offsets", *hidden_tensor_names(c.layers)],
        "hidden_final": "LM-head input: the last decoder layer's output after the final norm "
                        "(what vLLM passes to the MTP layer as target_hidden_states)",
        "hidden_layer_i": "residual stream entering decoder layer i (0 = embeddings)",
        "layers": list(c.layers),
        "dtype": c.dtype,
        "max_seq_len": c.max_seq_len,
        "splits": res.per_split,
        "shards": res.shard_files,
        "compute_seconds": round(res.compute_seconds, 3),
        "engine": c.engine,
        "device": device_label(resolve_device(c.device)) if c.engine == "transformers" else "vllm (the serving env)",
        "metrics": metrics,
    })
    return metrics


STAGE = Stage(
    name="capture",
    version="1",
    inputs=("prepare_target", "scrub"),
    sections=("capture",),
    run=run,
    description="Capture the target's hidden states (LM-head input + chosen layers) over the conversations, in "
    "transformers or through the serving engine (`capture.engine: vllm`)",
)
