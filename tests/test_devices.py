"""Device settings (train.device, capture.device, eval_offline.device) and their resolution
(drafter/core/hardware.py), the torchrun backend rule (drafter/training/run.py)."""
from __future__ import annotations

import pytest
import torch

from drafter.core.config import ReleaseConfig
from drafter.core.errors import ConfigError
from drafter.core.hardware import device_label, resolve_device
from drafter.core.pipeline import plan
from drafter.training.run import process_group_backend


def test_auto_and_cpu_resolve_here():
    assert resolve_device("cpu") == torch.device("cpu")
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want
    assert device_label("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_an_error_naming_what_torch_sees(spec):
    with pytest.raises(ConfigError, match=rf"device '{spec}': torch .* sees no CUDA GPU.*use device: auto or cpu"):
        resolve_device(spec)


def test_torchrun_rank_takes_its_local_gpu(monkeypatch):
    """Under torchrun (LOCAL_RANK set) `auto` and `cuda` take the rank's own GPU; a rank beyond the GPUs is named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:5") == torch.device("cuda", 5)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"index 3.*has 2 CUDA GPU"):
        resolve_device("auto")


def test_backend_follows_the_device_not_the_machine():
    """NCCL only for ranks whose gradients are on GPUs (a GPU machine training on CPUs uses gloo: the NCCL
    choice by `torch.cuda.is_available()` failed with 'No backend type associated with device type cpu')."""
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"


@pytest.mark.parametrize("section", ["train", "bootstrap_drafter", "capture", "eval_offline"])
def test_device_is_operational_and_validated(section):
    base = ReleaseConfig()
    keys = {p.stage.name: p.key for p in plan(base)}
    other = ReleaseConfig(**{section: {"device": "cuda:1"}})
    assert {p.stage.name: p.key for p in plan(other)} == keys  # the same result on any device: no stage recomputed
    with pytest.raises(Exception, match="device"):
        ReleaseConfig(**{section: {"device": "gpu0"}})


def test_auto_compute_dtype_is_bfloat16_only_where_it_is_native(monkeypatch):
    """``train.dtype: auto``: bfloat16 autocast where the device multiplies bf16 in hardware, else float32 (an
    AVX2 CPU emulates bf16 matmuls); an explicit bfloat16 there is kept, with a warning naming the fix."""
    from drafter.core import hardware
    from drafter.core.config import TrainConfig
    from drafter.training import loop

    assert hardware.native_bf16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert hardware.compute_dtype("float32", "meta") == "float32" and hardware.compute_dtype("auto", "meta") == "bfloat16"
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(hardware, "native_bf16", lambda device, n=native: n)
        monkeypatch.setattr(loop, "native_bf16", lambda device, n=native: n)
        logs = []
        got = loop._resolved_dtype(TrainConfig(dtype="auto"), torch.device("cpu"), logs.append)
        assert got.dtype == want and logs == [f"train: dtype auto → {want} on cpu" +
                                              ("" if native else " (no native bf16 matmul here: float32 is faster)")]
        logs = []
        assert loop._resolved_dtype(TrainConfig(dtype="bfloat16"), torch.device("cpu"), logs.append).dtype == "bfloat16"
        assert bool(logs) is (not native) and all("set train.dtype: auto or float32" in x for x in logs)
