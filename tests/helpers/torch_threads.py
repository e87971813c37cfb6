"""Torch's intra-op threads when the suite runs on several pytest-xdist workers.

`make test` runs two workers on two cores: each worker's torch would start an OpenMP team as large as the
machine, four threads on two cores, and every parallel op then waits at a barrier for a thread the other
worker's team has descheduled. The tiny models of the tests are thousands of small ops (lk_hybrid's 8-row
chunks, a decoder layer's element-wise work), so that wait, not the arithmetic, was most of their time (one
training step of the GPU check's dry-run size: 4.0 s with two threads, 0.36 s with one, beside another worker).
:func:`share_the_cores` (tests/conftest.py, in each worker) gives each worker's torch its share of the cores;
processes a test starts that compute with torch get :func:`same_threads_env` (bench/gpu_check.py's dry run) or,
one per core, :data:`ONE_THREAD_ENV` (torchrun's ranks and the training child beside them). vLLM servers bind
their own threads (VLLM_CPU_OMP_THREADS_BIND) and are left alone.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """The cores a worker's torch gets when ``workers`` share the machine's (at least one)."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // max(1, workers))


def share_the_cores(workers: int) -> int:
    """Sets this process's torch to :func:`threads_per_worker` intra-op threads; returns the count."""
    import torch

    n = threads_per_worker(workers)
    torch.set_num_threads(n)
    return n


def same_threads_env() -> dict[str, str]:
    """``OMP_NUM_THREADS`` for a child process: this process's torch thread count."""
    import torch

    return {"OMP_NUM_THREADS": str(torch.get_num_threads())}


@contextmanager
def all_cores() -> Iterator[int]:
    """torch at the machine's thread count for the block (a run whose bytes are compared with a container's,
    whose torch uses every core it sees), then back to this worker's share."""
    import torch

    before, n = torch.get_num_threads(), len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
