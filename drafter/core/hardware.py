"""What a measurement ran on, for reports and the model card: CPU model, cores, memory, accelerators,
torch version — never the host name or user.

Example::

    describe()   # {'cpu': 'AMD EPYC 9654 96-Core Processor', 'cores': 2, 'memory_gib': 23.4, 'gpus': [], 'torch': '2.13.0+cpu'}
    summary(describe())   # 'AMD EPYC 9654 96-Core Processor (2 cores, 23.4 GiB), no GPU'
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict:
    """The machine this process runs on (the cores it may use, not the host's total)."""
    gpus, torch_version = [], None
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": _cpu_model(), "cores": cores, "memory_gib": _memory_gib(), "gpus": gpus, "torch": torch_version,
            "machine": platform.machine()}


def summary(hw: dict) -> str:
    """One line: ``'<cpu> (2 cores, 23.4 GiB), no GPU'`` or ``'…, 8 × NVIDIA H200'``."""
    gpus = hw.get("gpus") or []
    g = f"{len(gpus)} × {gpus[0]}" if gpus else "no GPU"
    mem = f", {hw['memory_gib']} GiB" if hw.get("memory_gib") else ""
    return f"{hw.get('cpu')} ({hw.get('cores')} cores{mem}), {g}"


# a container id in the source of a bind mount: podman's …/overlay-containers/<id>/userdata/hostname, Docker's
# …/docker/containers/<id>/hostname, containerd's …/io.containerd.runtime.v2.task/<ns>/<id>/…
_CONTAINER_ID = re.compile(r"/(?:overlay-containers|containers|io\.containerd\.runtime\.v2\.task/[^/]+)/([0-9a-f]{64})/")


def container(mountinfo: str | None = None) -> dict | None:
    """The container this process runs in — ``{"id": <full id>, "image": <$DRAFTER_IMAGE>, "engine": …}`` —
    or None outside one. The id is read from the bind mounts the engine makes for ``/etc/hostname`` and
    ``/etc/resolv.conf``; the image is what the image says it is (``DRAFTER_IMAGE``, set by our
    Dockerfiles to the tag they were built as, or by a worker's job variables)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            mountinfo = ""
    engine = "podman" if Path("/run/.containerenv").exists() else "docker" if Path("/.dockerenv").exists() else None
    ids = [m.group(1) for line in mountinfo.splitlines()
           if any(f" {t} " in line for t in ("/etc/hostname", "/etc/resolv.conf", "/etc/hosts"))
           for m in [_CONTAINER_ID.search(line)] if m]
    if not ids and engine is None:
        return None
    return {"id": ids[0] if ids else None, "image": os.environ.get("DRAFTER_IMAGE"), "engine": engine or "unknown"}


def native_bf16(device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a CUDA GPU that supports bf16; a CPU whose
    oneDNN has bf16 kernels (AVX512-BF16 or AMX). On an AVX2-only CPU a bf16 matmul is emulated — measured
    150× slower than float32 (1024³, 2026-12-05) — so bfloat16 autocast makes training far slower there."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return True  # meta and other devices: no arithmetic to be slow at; take the setting as written


def compute_dtype(choice: str, device) -> str:
    """``train.dtype`` resolved on ``device``: ``auto`` = bfloat16 where the device computes it natively
    (:func:`native_bf16`), else float32; ``float32`` / ``bfloat16`` as written."""
    if choice != "auto":
        return choice
    return "bfloat16" if native_bf16(device) else "float32"


def resolve_device(spec: str = "auto"):
    """The ``torch.device`` a config's ``device`` field names (DESIGN.md, the device rule).

    ``auto``: a CUDA GPU when torch sees one, else the CPU. Under torchrun (``LOCAL_RANK`` set) ``auto`` and
    ``cuda`` take the rank's own GPU, ``cuda:LOCAL_RANK``. ``cuda`` or ``cuda:N`` on a machine without CUDA is
    an error naming what torch sees, never a silent fall-back to the CPU.

    Example::

        resolve_device("auto")   # device(type='cpu') here; device(type='cuda', index=0) on a GPU node
    """
    import torch

    from drafter.core.errors import ConfigError

    spec = (spec or "auto").strip()
    if spec == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if spec == "auto" and not cuda:
        return torch.device("cpu")
    if not cuda:
        raise ConfigError(f"device {spec!r}: torch {torch.__version__} sees no CUDA GPU on this machine "
                          f"(torch.cuda.is_available() is False); use device: auto or cpu")
    if spec in ("auto", "cuda"):
        rank = os.environ.get("LOCAL_RANK")
        index = int(rank) if rank is not None else torch.cuda.current_device()
    elif re.fullmatch(r"cuda:[0-9]+", spec):
        index = int(spec.split(":")[1])
    else:
        raise ConfigError(f"device {spec!r}: use auto, cpu, cuda or cuda:N")
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {spec!r} (index {index}): this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device("cuda", index)


def device_label(device) -> str:
    """``'cpu'`` or ``'cuda:0 (NVIDIA H200)'``: what a result file and the card record."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        import torch.cuda

        idx = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{idx} ({torch.cuda.get_device_name(idx)})"
    return str(device)
