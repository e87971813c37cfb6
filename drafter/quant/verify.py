"""The release self-check: does our FP8 rule reproduce the release's bytes?

For every FP8 tensor of the released drafter: dequantize, quantize again with our rule
(:mod:`drafter.quant.fp8`), compare bytes block by block (the block's E4M3 bytes and its scale). Each
block is one of:

* **identical** — every byte equal;
* **edge** — bytes differ, the values after dequantization are bit-identical, and the block's
  maximum sits exactly on a rounding edge of the rule (``amax/448`` an exact power of two, so the
  ceil could go either way, or ``amax`` under the 1e-4 floor): the same values, written with a scale
  one power of two lower;
* **differ** — anything else (or NaN/inf in the release): the rule is wrong for this release.

One tensor at a time (peak memory near one tensor). A quantize-dequantize round trip is the identity
on any block the rule could have produced, so what this detects is a rule mismatch (scale rule or
block shape) or a block that no rule-following writer could have produced (e.g. a tampered block
maximum, a NaN byte) — not every altered byte: that is what the drop-in's hashes are for.

The ``verify_fp8`` stage records it with the drop-in's checks in ``verify.json`` (:data:`VERIFY_JSON`, read
through :class:`VerifyResult`).

Example::

    report = self_check(open_release(target_dir))
    report.totals   # {'identical': 1234, 'edge': 2, 'differ': 0, 'total': 1236}
    VerifyResult.load(verify_dir).self_check.totals.identical
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from drafter.core.results import Part, ResultFile
from drafter.quant import fp8 as F
from drafter.quant.release import FP8Release

Tensor = torch.Tensor
VERIFY_JSON = "verify.json"


@dataclass
class TensorCheck:
    name: str
    shape: tuple[int, ...]
    blocks: int
    identical: int
    edge: int
    differ: int
    first_differ: tuple[int, int] | None = None  # (block row, block col)

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "blocks": self.blocks, "identical": self.identical, "edge": self.edge,
                "differ": self.differ, "first_differ_block": list(self.first_differ) if self.first_differ else None}


@dataclass
class SelfCheckReport:
    rule: str
    block: tuple[int, int]
    tensors: list[TensorCheck] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, int]:
        t = {k: sum(getattr(c, k) for c in self.tensors) for k in ("identical", "edge", "differ")}
        return t | {"total": sum(c.blocks for c in self.tensors)}

    @property
    def failed(self) -> list[TensorCheck]:
        return [c for c in self.tensors if c.differ]

    def as_dict(self) -> dict:
        return {"rule": self.rule, "block": list(self.block), "totals": self.totals,
                "tensors": {c.name: c.as_dict() for c in self.tensors}}


def _per_block_any(mask: Tensor, block: tuple[int, int]) -> Tensor:
    return F._blocks(mask.to(torch.uint8), block).amax(dim=(1, 3)).bool()


def check_tensor(q: Tensor, s: Tensor, block: tuple[int, int], rule: F.ScaleRule, name: str = "<tensor>") -> TensorCheck:
    """Classify every block of one release tensor (``q`` E4M3, ``s`` its stored scales)."""
    if q.dtype != torch.float8_e4m3fn:
        raise F.FP8Error(f"tensor {name}: dtype {q.dtype}, expected float8_e4m3fn")
    if s.dtype != F.SCALE_DTYPES[rule]:
        raise F.FP8Error(f"tensor {name}: scale dtype {s.dtype} does not match rule {rule} ({F.SCALE_DTYPES[rule]})")
    d = F.dequantize(q, s, block, name=name)
    nR, nC = F.n_blocks(tuple(q.shape), block)
    bad = _per_block_any(~torch.isfinite(d), block)
    sf = F.scale_float(s)
    bad |= ~torch.isfinite(sf) | (sf <= 0)
    # NaN/inf bytes or scales: those blocks differ; the rest is checked with them zeroed (no branch on the data:
    # the same ops on every device)
    d = torch.where(torch.isfinite(d), d, torch.zeros((), dtype=d.dtype, device=d.device))
    q2, s2 = F.quantize(d, block, rule, name=name)
    q_neq = _per_block_any(q.view(torch.uint8) != q2.view(torch.uint8), block)
    s_bytes = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t.view(torch.int32))
    s_neq = s_bytes(s) != s_bytes(s2)
    bytes_differ = q_neq | s_neq | bad
    d2 = F.dequantize(q2, s2, block, name=name)
    values_equal = ~_per_block_any(d.view(torch.int32) != d2.view(torch.int32), block)
    amax = F.block_amax(d, block)
    on_edge = (F.div_e4m3_max(amax).view(torch.int32) & 0x7FFFFF == 0) | (amax < F.AMAX_FLOOR)
    edge = bytes_differ & values_equal & on_edge & ~bad
    differ = bytes_differ & ~edge
    first = None
    if differ.any():
        i = int(differ.flatten().nonzero()[0])
        first = (i // nC, i % nC)
    return TensorCheck(name=name, shape=tuple(q.shape), blocks=nR * nC, identical=int((~bytes_differ).sum()),
                       edge=int(edge.sum()), differ=int(differ.sum()), first_differ=first)


def self_check(release: FP8Release, progress=None) -> SelfCheckReport:
    """Run :func:`check_tensor` on every FP8 tensor of ``release`` (streamed one at a time)."""
    from safetensors import safe_open

    report = SelfCheckReport(rule=release.rule, block=release.block)
    for name in sorted(release.fp8):
        sname = release.fp8[name]
        with safe_open(str(release.path_of(name)), framework="pt") as f:
            q = f.get_tensor(name)
        with safe_open(str(release.path_of(sname)), framework="pt") as f:
            s = f.get_tensor(sname)
        report.tensors.append(check_tensor(q, s, release.block, release.rule, name))
        if progress is not None:
            progress(name)
    return report


class Totals(Part):
    identical: int
    edge: int
    differ: int
    total: int


class SelfCheck(Part):
    """:meth:`SelfCheckReport.as_dict`."""

    rule: str | None = None
    block: list[int] | None = None
    totals: Totals
    tensors: dict[str, dict] = {}


class DropinCheck(Part):
    """:func:`drafter.quant.dropin.check_dropin`'s record."""

    ok: bool | None = None
    keys: int | None = None
    kept: int | None = None
    kept_hash_equal: int | None = None
    problems: list[str] = []


class VerifyResult(ResultFile):
    """``verify.json`` of ``verify_fp8``: the release (dir, rule, block), the self-check, and — once the self-check
    passed — the drop-in's checks and the vLLM load (``ok``, ``unsupported: …``, ``skipped …``, ``not run: …``)."""

    NAME: ClassVar[str] = VERIFY_JSON
    SORTED: ClassVar[bool] = False  # json.dumps(indent=2), in the document's order
    release: dict
    self_check: SelfCheck
    dropin: DropinCheck | None = None
    vllm_load: str | None = None


def load_verify(stage_dir: str | Path) -> VerifyResult:
    """The ``verify_fp8`` output's :class:`VerifyResult`."""
    return VerifyResult.load(stage_dir)


def save_verify(stage_dir: str | Path, doc: dict) -> dict:
    """Write ``doc`` as ``stage_dir/verify.json`` (checked against :class:`VerifyResult`)."""
    return VerifyResult.write(stage_dir, doc)
