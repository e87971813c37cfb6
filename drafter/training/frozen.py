"""Frozen weights held in the training's compute dtype (``train.frozen_dtype``).

A drafter is loaded in float32 (:func:`drafter.models.load_drafter`); under ``train.dtype: bfloat16`` every
matmul runs in bfloat16 under autocast, which casts each float32 weight it reads — and, for a frozen weight
whose matmul input requires grad, keeps that bfloat16 copy for the backward pass at every use. Holding the
frozen matmul weights in bfloat16 from the start halves their memory and removes the copies (a DeepSeek-V3
MTP layer: 106.8 GiB → ~37 GiB per step on one H200, DESIGN.md) and computes the same numbers: autocast
rounds a float32 weight to bfloat16 exactly as the cast does.

What is cast (frozen, floating point): the weights of ``nn.Linear`` modules and the fused routed experts
(``gate_up_proj``, ``down_proj``) — weights autocast casts anyway — and an ``nn.Embedding`` table only where
every value is exactly representable in bfloat16 (a lookup is not autocast: a rounded table would change the
inputs). Routers (transformers computes them in float32), norms and biases stay float32. The written drafter
keeps the frozen tensors' original values: :func:`restore_frozen` copies them back from the checkpoint before
saving, so a frozen FP8 tensor re-quantizes to the release's bytes.

``auto`` = bfloat16 under ``train.dtype: bfloat16`` on a device with autocast (CPU, CUDA), else float32; the
memory plan (``drafter plan``, :mod:`drafter.training.memory`) counts the frozen weights in that dtype.
"""
from __future__ import annotations

import torch
from torch import nn

FUSED_EXPERTS = ("gate_up_proj", "down_proj")


def frozen_dtype_of(train, device_type: str | None = None) -> str:
    """The dtype training holds frozen matmul weights in: ``train.frozen_dtype``, ``auto`` resolved (bfloat16
    under bfloat16 compute where ``device_type`` has autocast — every device when None —, else float32)."""
    choice = getattr(train, "frozen_dtype", "auto")
    if choice != "auto":
        return choice
    if train.dtype == "float32" or (train.dtype == "auto" and device_type not in (None, "cuda")):
        return "float32"  # auto compute is bfloat16 only where it is native: a CUDA GPU here (a CPU: its run decides)
    if device_type is not None and not torch.amp.is_autocast_available(device_type):
        return "float32"
    return "bfloat16"


def _castable(module: nn.Module, name: str, p: nn.Parameter) -> bool:
    if p.requires_grad or not p.is_floating_point() or p.dtype == torch.bfloat16:
        return False
    if isinstance(module, nn.Linear):
        return name == "weight"
    if name in FUSED_EXPERTS:
        return True
    if isinstance(module, nn.Embedding):
        return torch.equal(p, p.to(torch.bfloat16).to(p.dtype))
    return False


def hold_frozen(model: nn.Module, dtype: str) -> dict:
    """Cast ``model``'s frozen matmul weights (see the module docstring) to ``dtype`` in place; returns
    ``{"dtype", "tensors", "elements", "bytes_saved"}`` (``tensors`` 0 for float32)."""
    out = {"dtype": dtype, "tensors": 0, "elements": 0, "bytes_saved": 0}
    if dtype == "float32":
        return out
    target = getattr(torch, dtype)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if _castable(module, name, p):
                before = p.element_size()
                p.data = p.data.to(target)
                out["tensors"] += 1
                out["elements"] += p.numel()
                out["bytes_saved"] += p.numel() * (before - p.element_size())
    return out


def restore_frozen(model: nn.Module, original: nn.Module) -> int:
    """Copy back, from ``original`` (the same drafter as loaded), every frozen parameter :func:`hold_frozen` cast;
    returns how many."""
    src = dict(original.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        if not p.requires_grad and p.dtype != src[name].dtype:
            p.data = src[name].data.to(p.device)
            n += 1
    return n
