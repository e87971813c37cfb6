"""Capturing target features through vLLM (``capture.engine: vllm``, issue 36): the same shards as
:func:`drafter.data.capture.capture_features`, computed by the serving engine, so that a target too large for one
device in transformers (the 671B ones) is captured where it is served.

One worker (:mod:`drafter.serving.hidden_states`, run with the serving env's python) runs the target over every
sequence of the shards still to write, with vLLM's ``extract_hidden_states`` speculator and the project's
hidden-states connector; it leaves one file per sequence: the aux hidden states ``[T, n, H]`` at the layer ids
``capture.layers ∪ {num_hidden_layers}`` (id ``i`` = the residual stream entering decoder layer ``i``, the
project's ``hidden_layer_{i}``) and the token ids it saw. Then each shard is packed:

* ``hidden_layer_{i}`` = aux state ``i``;
* ``hidden_final`` (the LM-head input) = the target's final RMSNorm (``model.norm.weight``, ``rms_norm_eps``,
  computed in float32 as transformers does) of aux state ``num_hidden_layers``: vLLM has no aux id after the norm;
* each file's ``token_ids`` must equal the sequence's ids (else :class:`StageError` naming the row).

The per-sequence files are removed once their shard is written. Planning, resume, the disk check (here also
counting the per-sequence files, which exist until packed), the checks before each write and the metadata are
those of the transformers engine (:func:`drafter.data.capture.plan_capture`): the shards are the same files.

Measured on the CPU build (vLLM 0.32, float32, 2026-12-05): the states equal transformers' to ~1e-6 relative to
the largest value (docs/training.md, "Capturing through vLLM").
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

import torch

from drafter.core.errors import StageError
from drafter.data.capture import (DTYPES, CaptureResult, Sequence, check_disk, layer_tensor_name, plan_capture)
from drafter.data.feature_shards import FINAL

WORK_DIR = ".vllm-capture"  # under the features directory while the worker runs; removed when done
WORKER_MODULE = "drafter.serving.hidden_states"
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
LOG_TAIL_LINES = 40


def target_shape(model_dir: str | Path) -> tuple[int, int, float]:
    """``(num_hidden_layers, hidden_size, rms_norm_eps)`` of the target's (text) config."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.num_hidden_layers), int(cfg.hidden_size), float(getattr(cfg, "rms_norm_eps", 1e-6))


def final_norm_weight(model_dir: str | Path) -> torch.Tensor:
    """The target's final norm weight (``model.norm.weight``) in float32, read from its safetensors files."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        where = {k: model_dir / f for k, f in weight_map.items() if k in NORM_KEYS}
    else:
        where = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                where.update({k: f for k in st.keys() if k in NORM_KEYS})
    for key in NORM_KEYS:
        if key in where:
            with safe_open(str(where[key]), framework="pt") as st:
                return st.get_tensor(key).to(torch.float32)
    raise StageError(f"capture.engine=vllm: no final norm weight ({' / '.join(NORM_KEYS)}) in {model_dir}'s "
                     "safetensors files: hidden_final (the LM-head input) cannot be computed from vLLM's states")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's RMSNorm as transformers computes it (float32)."""
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def aux_layer_ids(layers: Iterable[int], num_hidden_layers: int) -> list[int]:
    """The layer ids vLLM extracts: ``layers`` and ``num_hidden_layers`` (for ``hidden_final``), sorted, unique."""
    bad = [i for i in layers if not 0 <= i <= num_hidden_layers]
    if bad:
        raise StageError(f"capture.layers {bad} out of range: the target has {num_hidden_layers} decoder layers "
                         f"(valid: 0..{num_hidden_layers})")
    return sorted(set(layers) | {num_hidden_layers})


def tensor_parallel_size(extra_args: Iterable[str]) -> int:
    """``--tensor-parallel-size N`` / ``-tp N`` (or ``=N``) of the serving arguments; 1 without."""
    args = list(extra_args)
    for k, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            return int(val if eq else args[k + 1])
    return 1


def request_key(k: int) -> str:
    return f"q{k:07d}"


def run_worker(cmd: list[str], env: dict[str, str], log_path: Path, on_tokens: Callable[[int], None] | None) -> None:
    """Run the worker (in its own process group, ended with this process), its output into ``log_path``;
    ``captured <id> <tokens>`` lines advance ``on_tokens``. A failure raises :class:`StageError` with the log's tail."""
    from drafter.core import procs

    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    try:
        proc = procs.spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    except OSError as e:
        raise StageError(f"capture.engine=vllm: cannot start the worker {cmd[0]}: {e}") from e
    try:
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip("\n"))
                parts = line.split()
                if on_tokens and len(parts) == 3 and parts[0] == "captured" and parts[2].isdigit():
                    on_tokens(int(parts[2]))
        rc = proc.wait()
    finally:
        procs.stop(proc)
    if rc != 0:
        raise StageError(f"capture.engine=vllm: the worker ({cmd[0]} -m {WORKER_MODULE}) failed with exit status {rc}; "
                         f"its log is {log_path}, the last lines:\n  " + "\n  ".join(tail))


def pack_shard(seqs: list[Sequence], files: list[Path], aux: list[int], layers: list[int], norm: torch.Tensor,
               eps: float, dtype: str) -> dict[str, torch.Tensor]:
    """A shard's tensors (as :func:`drafter.data.capture.capture_shard` returns them) from the worker's files."""
    from safetensors.torch import load_file

    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    H, store, col = norm.numel(), DTYPES[dtype], {i: j for j, i in enumerate(aux)}
    packed = {n: torch.empty((int(offsets[-1]), H), dtype=store) for n in [FINAL] + [layer_tensor_name(i) for i in layers]}
    for k, (s, f) in enumerate(zip(seqs, files)):
        got = load_file(str(f))
        ids, hs = got.get("token_ids"), got.get("hidden_states")
        if ids is None or ids.tolist() != s.input_ids.tolist():
            raise StageError(f"capture.engine=vllm: row {s.row_id!r}: vLLM's token ids differ from the conversation's "
                             f"({0 if ids is None else ids.numel()} vs {len(s)} tokens; file {f})")
        if hs is None or tuple(hs.shape) != (len(s), len(aux), H):
            raise StageError(f"capture.engine=vllm: row {s.row_id!r}: hidden_states has shape "
                             f"{None if hs is None else tuple(hs.shape)}, expected {(len(s), len(aux), H)} (file {f})")
        a, b = int(offsets[k]), int(offsets[k + 1])
        packed[FINAL][a:b] = rms_norm(hs[:, col[aux[-1]]], norm, eps).to(store)
        for i in layers:
            packed[layer_tensor_name(i)][a:b] = hs[:, col[i]].to(store)
    return {"input_ids": torch.cat([s.input_ids for s in seqs]), "loss_mask": torch.cat([s.loss_mask for s in seqs]),
            "seq_offsets": offsets, **packed}


def capture_features_vllm(
    model_dir: str | Path,
    seqs: list[Sequence],
    out_dir: Path,
    *,
    layers: Iterable[int] = (),
    dtype: str = "float32",
    shard_tokens: int = 16384,
    min_free_margin: float = 1.2,
    on_tokens: Callable[[int], None] | None = None,
    serve_python: str | Path,
    env: dict[str, str] | None = None,
    tensor_parallel_size: int = 1,
    engine_dtype: str = "float32",
) -> CaptureResult:
    """:func:`drafter.data.capture.capture_features` through vLLM: the same shards in ``out_dir/<split>/``, computed
    by one worker (``serve_python -m drafter.serving.hidden_states``, environment ``env``) for all shards not kept
    from an earlier try. ``engine_dtype``: the dtype vLLM runs the target in (float32, as the transformers engine)."""
    layers = list(layers)
    L, H, eps = target_shape(model_dir)
    aux = aux_layer_ids(layers, L)
    cp = plan_capture(seqs, out_dir, layers=layers, hidden_size=H, dtype=dtype, shard_tokens=shard_tokens)
    work = cp.out_dir / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)
    todo = [(p, s) for p in cp.remaining for s in p.seqs]
    if todo:  # the per-sequence files exist until their shard is packed: count them too
        temp = sum(len(s) for _, s in todo) * (len(aux) * H * DTYPES[engine_dtype].itemsize + 8) + 1024 * len(todo)
        check_disk(cp.out_dir, cp.remaining_bytes() + temp, min_free_margin)
    for p in cp.plans:
        if cp.done[p.relpath] and on_tokens:
            on_tokens(p.num_tokens)
    if todo:
        from safetensors.torch import save_file

        norm = final_norm_weight(model_dir)
        work.mkdir(parents=True)
        save_file({request_key(k): s.input_ids.contiguous() for k, (_, s) in enumerate(todo)}, str(work / "requests.safetensors"))
        cmd = [str(serve_python), "-m", WORKER_MODULE, "--model", str(Path(model_dir).resolve()),
               "--requests", str(work / "requests.safetensors"), "--out", str(work), "--layers", ",".join(map(str, aux)),
               "--dtype", engine_dtype, "--tensor-parallel-size", str(tensor_parallel_size)]
        t0 = time.perf_counter()
        run_worker(cmd, dict(os.environ if env is None else env), work / "worker.log", on_tokens)
        per_token = (time.perf_counter() - t0) / max(sum(len(s) for _, s in todo), 1)
        keys = {id(s): request_key(k) for k, (_, s) in enumerate(todo)}
        for p in cp.remaining:
            t1 = time.perf_counter()
            files = [work / f"{keys[id(s)]}.safetensors" for s in p.seqs]
            tensors = pack_shard(p.seqs, files, aux, layers, norm, eps, dtype)
            cp.write(p, tensors, time.perf_counter() - t1 + per_token * p.num_tokens)
            for f in files:
                f.unlink()
        shutil.rmtree(work, ignore_errors=True)
    for p in cp.plans:
        cp.record(p)
    return cp.res


def capture_rows_vllm(model_dir: str | Path, seqs: list[Sequence], out_dir: Path, c, *, serving=None,
                      on_tokens: Callable[[int], None] | None = None) -> CaptureResult:
    """:func:`capture_features_vllm` with the settings of ``c`` (CaptureConfig) and the serving env of ``serving``
    (ServingConfig; default: the default one): its python, its environment as a vLLM server of the project gets it
    (CPU KV-cache size, libiomp5, thread binding; :mod:`drafter.serving.server`), and ``--tensor-parallel-size``
    from ``serving.extra_args``. vLLM runs the target in ``capture.dtype`` (float32 as the transformers engine; bfloat16
    for a target only bfloat16 fits: its states then differ from a float32 pass by bfloat16 round-off)."""
    from drafter.core.config import ServingConfig
    from drafter.core.errors import DrafterError
    from drafter.serving.server import REPO_ROOT, cpu_server_env, server_env, serving_python

    serving = serving or ServingConfig()
    try:
        py = serving_python(serving)
        env = server_env(serving) | cpu_server_env(py, serving)
    except DrafterError as e:
        raise StageError(f"capture.engine=vllm needs the serving env: {e}") from e
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker steps the engine core in its own process
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return capture_features_vllm(model_dir, seqs, out_dir, layers=c.layers, dtype=c.dtype, shard_tokens=c.shard_tokens,
                                 min_free_margin=c.min_free_margin, on_tokens=on_tokens, serve_python=py, env=env,
                                 tensor_parallel_size=tensor_parallel_size(serving.extra_args), engine_dtype=c.dtype)
