"""Run training and evaluation code with every tensor on the ``meta`` device (DESIGN.md, "Device rule").

A meta tensor has a shape, a dtype and a device but no values, and torch checks devices on it as it
does on CUDA: a tensor created on the CPU inside the code under test fails with "Tensor on device cpu
is not on the expected device meta!" — the bug that crashed every step on a GPU. What meta cannot do
is answer questions about values. :class:`MetaValues` answers those, and only those, with plausible
stand-ins; every other op is forwarded unchanged, so torch itself still enforces the devices:

* a scalar read (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``: ``aten._local_scalar_dense``,
  ``aten.item``, ``aten.is_nonzero``) → ``True`` for bool, ``1`` for integers, ``0.5`` for floats;
  ``torch.equal`` → ``True``;
* ``nonzero`` → every element is nonzero; boolean-mask indexing / ``masked_select`` / ``x[mask] = v``
  → the mask selects everything;
* ``unique`` → the input flattened (every element distinct), inverse = ``arange``, counts = 1;
* a copy from meta to the CPU (``.cpu()``, ``.tolist()``, ``.numpy()`` of a copy) → a CPU tensor of
  the same shape filled with the scalar stand-in above: results handed to the host (statistics,
  JSON) are computed there, as on a GPU.

Example::

    with MetaValues():
        loss, stats = window_loss(drafter.to("meta"), head.to("meta"), win.to("meta"), cfg, weights)
        loss.backward()
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
META = torch.device("meta")
FLOAT_VALUE, INT_VALUE = 0.5, 1


def scalar_for(dtype: torch.dtype):
    """The stand-in value of a scalar read from a meta tensor of ``dtype``."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return FLOAT_VALUE
    return INT_VALUE


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _long(*shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.long, device=META)


def _all_indices(mask: torch.Tensor) -> list[torch.Tensor]:
    """A boolean index as the long indices it selects when every element is True (``mask.nonzero().unbind(1)``)."""
    return [_long(mask.numel()) for _ in range(max(mask.dim(), 1))]


def _expand_bool_indices(indices) -> list:
    out = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            out.extend(_all_indices(i))
        else:
            out.append(i)
    return out


def _unique(x: torch.Tensor, return_inverse: bool, return_counts: bool):
    n = x.numel()
    inverse = _long(*x.shape) if return_inverse else _long(0)
    counts = _long(n) if return_counts else _long(0)
    return x.reshape(-1).clone(), inverse, counts


class MetaValues(TorchDispatchMode):
    """Answers the data-dependent ops on meta tensors (module docstring); forwards every other op.
    ``calls`` counts the answers per op, so a test can see that a path really ran."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def _answered(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if not any(_is_meta(x) for x in flat):
            return func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in (aten._local_scalar_dense, aten.item):  # item: not decomposed under inference_mode
            self._answered("item")
            return scalar_for(args[0].dtype)
        if packet is aten.is_nonzero:
            self._answered("item")
            return True
        if packet is aten.equal:
            self._answered("equal")
            return True
        if packet is aten.nonzero:
            self._answered("nonzero")
            x = args[0]
            return _long(x.numel(), x.dim())
        if packet is aten.masked_select:
            self._answered("masked_select")
            x, mask = args[0], args[1]
            return torch.empty(torch.broadcast_shapes(x.shape, mask.shape).numel(), dtype=x.dtype, device=META)
        if packet in (aten.index, aten._unsafe_index) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self._answered("bool_index")
            return func(args[0], _expand_bool_indices(args[1]))
        if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self._answered("bool_index_put")
            return func(args[0], _expand_bool_indices(args[1]), *args[2:], **kwargs)
        if packet in (aten._unique2, aten.unique_consecutive):
            self._answered("unique")
            names = ("sorted", "return_inverse", "return_counts") if packet is aten._unique2 else ("return_inverse", "return_counts")
            opts = dict(zip(names, args[1:])) | kwargs
            return _unique(args[0], bool(opts.get("return_inverse")), bool(opts.get("return_counts")))
        if packet is aten.unique_dim:
            raise NotImplementedError("MetaValues: torch.unique(dim=…) has no stand-in")
        if packet is aten._to_copy and _is_meta(args[0]):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu":
                self._answered("to_cpu")
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.full(args[0].shape, scalar_for(args[0].dtype), dtype=dtype)
        return func(*args, **kwargs)
