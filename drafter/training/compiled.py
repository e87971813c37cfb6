"""``train.compile``: the drafter's layers compiled by ``torch.compile`` (TorchDynamo + Inductor) for training.

A training step runs the drafter's layers K times (the MTP unroll; one decoder layer per EAGLE-3 step; a DSpark
draft's layers once per block) and around them the head and the loss. Eager, every operation of a layer is one
kernel launch; on a GPU at demo size (hidden 576, 4 windows of 256 tokens) the launches, not the arithmetic, are
the step (``bench/gpu_check.sh`` writes the profile). Compiled, Inductor fuses a layer's element-wise work (norms,
rotary embedding, activations, residual adds, the masks' arithmetic) into a few generated kernels, forward and
backward, and leaves the matmuls to the vendor library.

What is compiled: each module of ``drafter.layers`` (:class:`~drafter.models.mtp.MTPLayer`, the EAGLE-3 layer, a
DSpark draft's decoder layers), in place (``nn.Module.compile``: parameter names, checkpoints and the written
drafter stay as they are). The head and the loss stay eager: their rows are the assistant tokens of the batch, a
data-dependent count that would make every step a new shape. Data-dependent checks inside a layer (the exact MoE
shortcuts of :class:`~drafter.models.mtp.OnePassMoE`) split its graph where they run; the rest stays compiled.
Windows of a new length compile once more, then Dynamo treats the length as dynamic (one graph for all lengths).

The numbers: the same computation with the element-wise work fused, so equal to the eager step within float
rounding (``tests/test_compiled.py``); operational, like ``train.device``. Compiling costs time before the first
step (on a CPU, a minute or more per window length); it pays only where launches dominate — ``bench/train.py
--compile`` and ``bench/gpu_check.sh`` measure both, on the same windows from the same weights.

Example::

    n = compile_layers(drafter)        # before the first step; returns the number of layers compiled
"""
from __future__ import annotations

from torch import nn


def compile_layers(drafter: nn.Module, **options) -> int:
    """``torch.compile`` every module of ``drafter.layers`` in place (``options`` go to ``torch.compile``, e.g.
    ``backend="aot_eager"``); returns how many. A drafter without a non-empty ``layers`` list raises
    ``ValueError`` naming its class."""
    layers = getattr(drafter, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"train.compile: {type(drafter).__name__} has no `layers` list of modules to compile")
    for layer in layers:
        layer.compile(**options)
    return len(layers)
