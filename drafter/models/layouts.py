"""Where a release keeps its MTP layer, and how to load it into an :class:`MTPDrafter` and write it back.

A *layout* knows a release's tensor names, its transformers classes and its on-disk encoding:

* :class:`EmbeddedGlm4MoeLayout` — the embedded target (GLM-4-MoE, ``drafter/models/target.py``): MTP layer
  ``model.layers.{L}.*`` with ``L = num_hidden_layers``, per-expert MoE weights on disk
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers 5 fuses them in memory as
  ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``), the shared
  embedding ``model.embed_tokens.weight``; vLLM feeds back the pre-norm hidden state.
* :class:`DeepSeekV3Layout` — DeepSeek-V3 (``model.layers.61.*``): FP8 E4M3 weights with float32
  ``<name>_scale_inv`` in 128×128 blocks (dequantized on load), BF16 norms, the MTP layer's own copy
  of the embedding (``model.layers.61.embed_tokens.weight``); vLLM feeds back the post-norm hidden state.

Checks on load: keys under an MTP layer's prefix that the layout does not know, and keys it needs
that are absent, are errors listing them; a wrong shape or a NaN/inf names the tensor.

Example::

    drafter = load_drafter(release_dir, DeepSeekV3Layout())
    ...train...
    save_drafter(drafter, out / "mtp-trained.safetensors", DeepSeekV3Layout(), torch.bfloat16)
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drafter.core.errors import StageError
from drafter.models.mtp import MTPDrafter

Tensor = torch.Tensor

INDEX_NAME = "model.safetensors.index.json"
TRAINED_NAME = "mtp-trained.safetensors"
FP8_BLOCK = (128, 128)
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<p>gate_up_proj|down_proj)$")
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


# ---------------------------------------------------------------------- FP8 (DeepSeek-V3 blocks)


def dequantize_fp8_blocks(w: Tensor, scale_inv: Tensor, block: tuple[int, int] = FP8_BLOCK) -> Tensor:
    """``w`` (E4M3, ``[R, C]``) times its per-block float32 ``scale_inv`` → float32 (:func:`drafter.quant.fp8.dequantize`)."""
    from drafter.quant import fp8

    return fp8.dequantize(w, scale_inv.float(), block)


def quantize_fp8_blocks(w: Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 block FP8 (``s = amax/448``, float32): ``(w8, scale_inv)`` (:func:`drafter.quant.fp8.quantize`)."""
    from drafter.quant import fp8

    return fp8.quantize(w, block, "float32")


# ---------------------------------------------------------------------- reading a checkpoint


class _Reader:
    """Lazy access to the tensors of a safetensors checkpoint (index + shards, or one file)."""

    def __init__(self, source: Path):
        source = Path(source)
        if source.is_file():
            self.files = {source.name: source}
            self.weight_map = self._keys_of(source)
        else:
            idx = source / INDEX_NAME
            if idx.is_file():
                try:
                    wm = json.loads(idx.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise StageError(f"{idx}: not a safetensors index ({e})") from e
                self.weight_map = dict(wm)
                self.files = {f: source / f for f in set(wm.values())}
                missing = sorted(f for f, p in self.files.items() if not p.is_file())
                if missing:
                    raise StageError(f"{idx} names shard(s) that do not exist: {missing}")
            else:
                shards = sorted(source.glob("*.safetensors"))
                if len(shards) != 1:
                    raise StageError(f"{source}: no {INDEX_NAME} and {len(shards)} *.safetensors files (need an index or exactly one file)")
                self.files = {shards[0].name: shards[0]}
                self.weight_map = self._keys_of(shards[0])
        self.source = source

    @staticmethod
    def _keys_of(path: Path) -> dict[str, str]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: path.name for k in f.keys()}

    def read(self, names) -> dict[str, Tensor]:
        from safetensors import safe_open

        by_file = defaultdict(list)
        for n in names:
            by_file[self.weight_map[n]].append(n)
        out = {}
        for fname, keys in by_file.items():
            with safe_open(str(self.files[fname]), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out


# ---------------------------------------------------------------------- layouts


@dataclass
class MTPLayout:
    """A release's MTP layout (see the module docstring); subclasses fill in the classes and names."""

    name: str = "mtp"
    recycle_normed: bool = False
    fp8: bool = False
    keep_fp32: tuple[str, ...] = ("*.e_score_correction_bias",)

    # --- model classes (transformers) -----------------------------------------------------------
    def classes(self) -> tuple[type, type, type, type]:
        """``(config_cls, decoder_layer_cls, norm_cls, rotary_cls)``."""
        raise NotImplementedError

    def embed_key(self, mtp_start: int) -> str:
        raise NotImplementedError

    def build(self, config: dict[str, Any], device: str | torch.device | None = None) -> MTPDrafter:
        """An (uninitialized) :class:`MTPDrafter` for a release ``config.json`` dict."""
        from drafter.models.compat import check_decoder_layer

        config_cls, layer_cls, norm_cls, rotary_cls = self.classes()
        check_decoder_layer(layer_cls)
        cfg = dict(config.get("text_config", config))
        cfg.pop("quantization_config", None)  # weights are dequantized on load
        tcfg = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
        n = int(cfg.get("num_nextn_predict_layers") or 0)
        if n < 1:
            raise StageError(f"{self.name}: the release config has num_nextn_predict_layers={n}: no MTP layer to load")
        return MTPDrafter(tcfg, n_layers=n, decoder_layer_cls=layer_cls, norm_cls=norm_cls, rotary_cls=rotary_cls,
                          recycle_normed=self.recycle_normed, device=device)

    # --- names: module state dict <-> release ------------------------------------------------------
    def _prefix(self, drafter: MTPDrafter, i: int) -> str:
        return f"model.layers.{drafter.mtp_start + i}."

    def to_release(self, drafter: MTPDrafter, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The drafter's tensors under the release's names (routed experts split per expert)."""
        state = drafter.state_dict() if state is None else state
        out: dict[str, Tensor] = {}
        for k, v in state.items():
            if k == "embed_tokens.weight":
                out[self.embed_key(drafter.mtp_start)] = v
                continue
            m = re.match(r"^layers\.(\d+)\.(.*)$", k)
            if not m:
                raise StageError(f"{self.name}: no release name for drafter tensor {k}")
            i, rest = int(m.group(1)), m.group(2)
            rest = rest[len("mtp_block."):] if rest.startswith("mtp_block.") else rest
            name = self._prefix(drafter, i) + rest
            f = _FUSED_RE.match(name)
            if f and f.group("p") == "gate_up_proj":
                gate, up = v.chunk(2, dim=1)
                for e in range(v.shape[0]):
                    out[f"{f.group('pre')}.{e}.gate_proj.weight"] = gate[e]
                    out[f"{f.group('pre')}.{e}.up_proj.weight"] = up[e]
            elif f:
                for e in range(v.shape[0]):
                    out[f"{f.group('pre')}.{e}.down_proj.weight"] = v[e]
            else:
                out[name] = v
        return out

    def from_release(self, drafter: MTPDrafter, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Inverse of :meth:`to_release`: release tensors → the drafter's state dict (experts fused)."""
        rev = {}
        for k in drafter.state_dict():
            if k == "embed_tokens.weight":
                rev[self.embed_key(drafter.mtp_start)] = k
                continue
            i, rest = re.match(r"^layers\.(\d+)\.(.*)$", k).groups()
            rev[self._prefix(drafter, int(i)) + (rest[len("mtp_block."):] if rest.startswith("mtp_block.") else rest)] = k
        state: dict[str, Tensor] = {}
        experts: dict[str, dict[tuple[int, str], Tensor]] = defaultdict(dict)
        for name, t in tensors.items():
            m = _EXPERT_RE.match(name)
            if m:
                experts[m.group("pre")][(int(m.group("e")), m.group("proj"))] = t
            else:
                state[rev[name]] = t
        for pre, parts in experts.items():
            E = 1 + max(e for e, _ in parts)
            gate_up = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(E)])
            down = torch.stack([parts[(e, "down_proj")] for e in range(E)])
            state[rev[pre + ".gate_up_proj"]] = gate_up
            state[rev[pre + ".down_proj"]] = down
        return state

    def is_mtp_key(self, name: str, drafter: MTPDrafter) -> bool:
        """Whether a release key belongs to one of the drafter's MTP layers."""
        return any(name.startswith(self._prefix(drafter, i)) for i in range(drafter.n_layers))


@dataclass
class EmbeddedGlm4MoeLayout(MTPLayout):
    """The embedded target's MTP layer (GLM-4-MoE, ``Glm4MoeMTPModel`` in vLLM: pre-norm hidden recycled)."""

    name: str = "embedded-glm4-moe"
    recycle_normed: bool = False
    keep_fp32: tuple[str, ...] = ("*.mlp.gate.weight", "*.e_score_correction_bias")

    def classes(self):
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import (
            Glm4MoeDecoderLayer, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding)

        return Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding

    def embed_key(self, mtp_start: int) -> str:
        return "model.embed_tokens.weight"  # vLLM's glm4_moe_mtp loads the shared embedding from here


@dataclass
class DeepSeekV3Layout(MTPLayout):
    """DeepSeek-V3's MTP layer (``DeepSeekMTPModel`` in vLLM: post-norm hidden recycled), FP8 blocks on disk."""

    name: str = "deepseek-v3"
    recycle_normed: bool = True
    fp8: bool = True
    keep_fp32: tuple[str, ...] = ("*.e_score_correction_bias",)

    def classes(self):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

        return DeepseekV3Config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding

    def embed_key(self, mtp_start: int) -> str:
        return f"model.layers.{mtp_start}.embed_tokens.weight"  # the MTP layer's own copy (V3 release)


LAYOUTS: dict[str, Callable[[], MTPLayout]] = {
    "embedded-glm4-moe": EmbeddedGlm4MoeLayout,
    "deepseek-v3": DeepSeekV3Layout,
}


def get_layout(name: str) -> MTPLayout:
    """A layout by its config name (``embedded-glm4-moe``, ``deepseek-v3``)."""
    try:
        return LAYOUTS[name]()
    except KeyError:
        raise StageError(f"unknown drafter layout {name!r}; known: {sorted(LAYOUTS)}") from None


# ---------------------------------------------------------------------- load / save


def _read_release_tensors(reader: _Reader, names: list[str], layout: MTPLayout, where: str) -> dict[str, Tensor]:
    """Read ``names`` (and the FP8 scales they need), dequantizing FP8 blocks to float32."""
    scale_of = {n: n + "_scale_inv" for n in names if n + "_scale_inv" in reader.weight_map}
    raw = reader.read(list(names) + list(scale_of.values()))
    out = {}
    for n in names:
        t = raw[n]
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if n not in scale_of:
                raise StageError(f"{where}: tensor {n} is {t.dtype} but {n}_scale_inv is missing")
            try:
                t = dequantize_fp8_blocks(t, raw[scale_of[n]])
            except ValueError as e:
                raise StageError(f"{where}: tensor {n}: {e}") from e
        elif n in scale_of:
            raise StageError(f"{where}: tensor {n} is {t.dtype} but has a {n}_scale_inv (expected FP8 E4M3)")
        out[n] = t
    return out


def _check(name: str, t: Tensor, shape: tuple, where: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise StageError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_floating_point() and not torch.isfinite(t.float()).all():
        n_bad = int((~torch.isfinite(t.float())).sum())
        raise StageError(f"{where}: tensor {name} has {n_bad} NaN/inf value(s)")


def load_drafter(
    checkpoint_dir: Path | str,
    layout: MTPLayout,
    *,
    weights: Path | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> MTPDrafter:
    """Build an :class:`MTPDrafter` from a release checkpoint (``config.json`` + safetensors index).

    Only the MTP layers' tensors and the embedding are read (a real release is hundreds of GB).
    ``weights``: a safetensors file written by :func:`save_drafter` (e.g. ``mtp-trained.safetensors``)
    whose tensors replace the release's. FP8 tensors are dequantized; everything is cast to ``dtype``
    except the router tensors transformers keeps in float32. Raises :class:`StageError` listing
    unknown and missing keys, or naming a tensor with a wrong shape or NaN/inf.
    """
    checkpoint_dir = Path(checkpoint_dir)
    cfg_path = checkpoint_dir / "config.json"
    if not cfg_path.is_file():
        raise StageError(f"{checkpoint_dir}: config.json is missing (need the release's config to build its MTP layer)")
    config = json.loads(cfg_path.read_text())
    drafter = layout.build(config, device="meta")
    expected = {k: tuple(v.shape) for k, v in layout.to_release(drafter).items()}

    reader = _Reader(checkpoint_dir)
    where = str(checkpoint_dir)
    present = [k for k in reader.weight_map if layout.is_mtp_key(k, drafter) or k in expected]
    scales = {k for k in present if k.endswith("_scale_inv") and k[: -len("_scale_inv")] in expected}
    unknown = sorted(k for k in present if k not in expected and k not in scales)
    missing = sorted(k for k in expected if k not in reader.weight_map)
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) the {layout.name} layout needs: {missing}")
        if unknown:
            parts.append(f"{len(unknown)} unknown key(s) under the MTP layer: {unknown}")
        raise StageError(f"{where}: " + "; ".join(parts))
    tensors = _read_release_tensors(reader, sorted(expected), layout, where)

    if weights is not None:
        wreader = _Reader(Path(weights))
        bad = sorted(k for k in wreader.weight_map if k not in expected)
        if bad:
            raise StageError(f"{weights}: {len(bad)} unknown key(s) for the {layout.name} layout: {bad}")
        tensors |= _read_release_tensors(wreader, sorted(wreader.weight_map), layout, str(weights))
        where = f"{where} + {weights}"

    for k, t in tensors.items():
        _check(k, t, expected[k], where)
    fp32 = _fp32_names(drafter, layout)
    state = layout.from_release(drafter, tensors)
    state = {k: v.to(torch.float32 if k in fp32 else dtype) for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def _fp32_names(drafter: MTPDrafter, layout: MTPLayout) -> set[str]:
    """State-dict names kept in float32 (router weights/bias, as transformers and vLLM keep them)."""
    import fnmatch

    keep = set(layout.keep_fp32) | {"*.mlp.gate.weight", "*.e_score_correction_bias"}
    return {k for k in drafter.state_dict() if any(fnmatch.fnmatchcase(k, p) for p in keep)}


def save_drafter(
    drafter: MTPDrafter,
    out_path: Path | str,
    layout: MTPLayout,
    dtype: torch.dtype = torch.bfloat16,
    *,
    include_embedding: bool = False,
    only_trainable: bool = False,
) -> Path:
    """Write the drafter's tensors under the release's names to ``out_path`` (a ``.safetensors`` file).

    Floating tensors are written in ``dtype`` (BF16 or F32), except those matching the layout's
    ``keep_fp32`` patterns (the router tensors the release keeps in float32), which stay float32. FP8
    re-quantization is the ``quantize-fp8`` stage's job. The shared embedding (the target's, frozen)
    is left out unless ``include_embedding``; ``only_trainable`` also leaves out frozen parameters
    and buffers (the export keeps the release's exact bytes for those). Written atomically (temp file + rename).
    """
    import fnmatch

    from drafter.core.files import save_safetensors

    out_path = Path(out_path)
    state = {k: v for k, v in drafter.state_dict().items()}
    if not include_embedding:
        state.pop("embed_tokens.weight", None)
    if only_trainable:  # parameters with requires_grad only (no buffers such as e_score_correction_bias)
        trainable = {k for k, p in drafter.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    tensors = layout.to_release(drafter, state)
    out = {}
    for k, v in tensors.items():
        keep32 = any(fnmatch.fnmatchcase(k, p) for p in layout.keep_fp32)
        t = v.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.float32 if keep32 else dtype)
        if not torch.isfinite(t.float()).all():
            raise StageError(f"save_drafter: tensor {k} has NaN/inf values; refusing to write {out_path}")
        out[k] = t.contiguous().clone()
    save_safetensors(out, out_path, metadata={"format": "pt", "layout": layout.name})  # atomic, same bytes every time
    return out_path


_LAYOUT_BY_MODEL_TYPE = {"glm4_moe": "embedded-glm4-moe", "deepseek_v3": "deepseek-v3"}


def layout_for(checkpoint_dir: Path | str, name: str = "auto") -> MTPLayout:
    """The layout of a release: ``name``, or (``auto``) chosen by ``model_type`` in its config.json."""
    if name != "auto":
        return get_layout(name)
    cfg_path = Path(checkpoint_dir) / "config.json"
    if not cfg_path.is_file():
        raise StageError(f"{checkpoint_dir}: config.json is missing")
    model_type = json.loads(cfg_path.read_text()).get("model_type")
    if model_type not in _LAYOUT_BY_MODEL_TYPE:
        raise StageError(f"{cfg_path}: no drafter layout for model_type {model_type!r}; known: "
                         f"{sorted(_LAYOUT_BY_MODEL_TYPE)} (set the layout explicitly)")
    return get_layout(_LAYOUT_BY_MODEL_TYPE[model_type])
