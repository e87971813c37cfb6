"""How a drafter's routed experts are computed: transformers' experts implementations, chosen per device.

transformers 5 computes a MoE block's routed experts (``Glm4MoeNaiveMoe``, ``DeepseekV3NaiveMoe``) with the
implementation its config's ``_experts_implementation`` names, read at every forward:

* ``eager`` — a Python loop over the experts hit, one matmul pair (and on a GPU one launch and wait) per
  expert: the reference;
* ``grouped_mm`` — the tokens sorted by expert and every routed expert computed by one grouped matmul
  (``torch.nn.functional.grouped_mm``); transformers falls back to a loop of plain matmuls inside the same
  path where the kernel cannot run (a GPU below compute capability 8.0, unaligned CPU tensors on old torch).

The two agree within float tolerance, forward and backward, frozen or trainable experts
(``tests/test_grouped_experts.py``). ``train.experts`` / ``eval_offline.experts`` choose: ``auto`` =
``grouped_mm`` where the kernel takes the experts' dtype (any dtype on the CPU; bfloat16 on CUDA, whose
kernel and the ``meta`` device's checks refuse float32), else ``eager``.

Example::

    impl = set_experts(drafter, "auto")     # "grouped_mm" on the CPU
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

EXPERTS = ("auto", "eager", "grouped_mm")
ExpertsChoice = Literal["auto", "eager", "grouped_mm"]


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding fused routed experts (``gate_up_proj`` [E, 2I, H] and a config)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and hasattr(m, "config")]


def grouped_kernel_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs on ``device`` with weights of ``dtype``: the CPU kernel takes any
    floating dtype; CUDA's (and the ``meta`` device's checks, which are CUDA's) take bfloat16 only."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    return device.type == "cpu" or dtype == torch.bfloat16


def resolve_experts(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → ``grouped_mm`` where :func:`grouped_kernel_takes` the experts' device and dtype, else ``eager``;
    an explicit ``grouped_mm`` the kernel cannot take raises ``ValueError`` naming the device and dtype."""
    if choice not in EXPERTS:
        raise ValueError(f"experts={choice!r}: expected one of {', '.join(EXPERTS)}")
    takes = grouped_kernel_takes(device, dtype)
    if choice == "auto":
        return "grouped_mm" if takes else "eager"
    if choice == "grouped_mm" and not takes:
        raise ValueError(f"experts=grouped_mm: torch {torch.__version__}'s grouped matmul does not take {dtype} "
                         f"experts on {device.type} (CUDA's kernel takes bfloat16 only): load the experts in "
                         "bfloat16 or set experts: eager")
    return choice


def set_experts(model: nn.Module, choice: str = "auto") -> str | None:
    """Make every routed-experts block of ``model`` compute with ``choice`` (resolved for the experts' device and
    dtype); returns the implementation set, or None when ``model`` has no routed experts."""
    mods = _expert_modules(model)
    if not mods:
        return None
    w = mods[0].gate_up_proj
    impl = resolve_experts(choice, w.device, w.dtype)
    for m in mods:
        m.config._experts_implementation = impl
    return impl
