"""The DeepSeek-V4.1 DSpark release layout: the drafter's ``mtp.{0..n-1}.*`` tensors in the target
checkpoint, as vLLM 0.32's ``DSparkDeepseekV4ForCausalLM`` loads them
(``vllm/models/deepseek_v41/nvidia/dspark.py``, ``load_weights`` / ``_remap_dspark_name``).

* **Per stage** ``mtp.{i}.`` (one DeepSeek-V4 decoder layer each): attention ``attn.wq_a``, ``attn.wkv``
  (fused by vLLM into ``fused_wqa_wkv``), ``attn.wq_b``, ``attn.wo_a``, ``attn.wo_b`` (FP8 with a
  ``.scale`` companion), ``attn.q_norm``, ``attn.kv_norm``, ``attn.attn_sink``; ``attn_norm``,
  ``ffn_norm``; the router ``ffn.gate.weight`` and ``ffn.gate.bias`` (vLLM's
  ``e_score_correction_bias``); shared experts ``ffn.shared_experts.w{1,2,3}``; routed experts
  ``ffn.experts.{e}.w{1,2,3}`` (MXFP4 in the release: kept as its bytes); hyper-connection
  parameters ``hc_{attn,ffn}_{fn,base,scale}`` (F32).
* **Model level**, stored under one stage: the context combiner ``main_proj`` and ``main_norm`` under
  ``mtp.0.`` (``main_x = main_norm(main_proj(cat[target layer inputs]))``); the head stack ``norm``,
  ``markov_head.embed`` / ``markov_head.head`` (vLLM's ``markov_w1`` / ``markov_w2``) and
  ``confidence_head.proj`` under the last stage.

:func:`describe` checks a checkpoint's drafter keys against this layout (a missing tensor is named);
:func:`trainable_keys` applies the freeze patterns (routed experts and anything not float frozen by
default); :func:`load_trainable` reads the trainable tensors as float32 (FP8 dequantized with the
release's own scales) and :func:`write_trained` writes them under the release's names, the input of
:func:`drafter.quant.dropin.build_dropin`, which re-quantizes what moved with the release's rule
(32×32 UE8M0 for V4.1) and keeps everything else as the release's bytes.

Example::

    rel = open_release(release_dir)
    layout = describe(rel.drafter_keys)
    tensors = load_trainable(rel)                  # name → float32, routed experts left out
    write_trained(tensors, work / "trained.safetensors")
    build_dropin(rel, work / "trained.safetensors", out / "fp8")
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

#: Frozen by default: the routed experts (the bulk of each stage; MXFP4 bytes in the release).
DEFAULT_FROZEN: tuple[str, ...] = ("mtp.*.ffn.experts.*",)

LAYER_TENSORS: tuple[str, ...] = (
    "attn.wq_a.weight", "attn.wkv.weight", "attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.q_norm.weight", "attn.kv_norm.weight", "attn.attn_sink", "attn_norm.weight", "ffn_norm.weight",
    "ffn.gate.weight", "ffn.gate.bias", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
    "hc_ffn_scale",
)
FIRST_STAGE_TENSORS: tuple[str, ...] = ("main_proj.weight", "main_norm.weight")
LAST_STAGE_TENSORS: tuple[str, ...] = ("norm.weight", "markov_head.embed.weight", "markov_head.head.weight",
                                       "confidence_head.proj.weight")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.w[123]\.(weight|scale)$")
_KEY = re.compile(r"mtp\.(\d+)\.(.+)$")


@dataclass
class V41Layout:
    stages: int
    experts: int
    roles: dict[str, str]  # key → "stage i: <part>" / "model: <part>" / "scale of <key>"


def role_of(key: str, stages: int) -> str | None:
    """What a ``mtp.*`` key is in the layout, or None if it is not one of its tensors."""
    m = _KEY.match(key)
    if m is None:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if rest in FIRST_STAGE_TENSORS:
        return f"model: {rest}" if i == 0 else None
    if rest in LAST_STAGE_TENSORS:
        return f"model: {rest}" if i == stages - 1 else None
    if rest.endswith(".scale") and rest.removesuffix(".scale") + ".weight" in LAYER_TENSORS + FIRST_STAGE_TENSORS:
        return f"scale of mtp.{i}.{rest.removesuffix('.scale')}.weight"
    if rest in LAYER_TENSORS or _EXPERT.match(rest):
        return f"stage {i}: {rest}"
    return None


def describe(keys: Iterable[str], *, where: str = "the release") -> V41Layout:
    """Check the drafter keys of a V4.1 checkpoint: every stage has its layer tensors, ``mtp.0`` the
    context combiner, the last stage the head stack; routed experts the same count in every stage.
    Errors name the missing or unknown tensors."""
    keys = sorted(k for k in keys if k.startswith("mtp."))
    if not keys:
        raise ValueError(f"{where}: no mtp.* tensors (a DeepSeek-V4.1 DSpark drafter ships them in the target checkpoint)")
    stages = 1 + max(int(_KEY.match(k).group(1)) for k in keys if _KEY.match(k))
    have = set(keys)
    missing = [f"mtp.{i}.{t}" for i in range(stages) for t in LAYER_TENSORS if f"mtp.{i}.{t}" not in have]
    missing += [f"mtp.0.{t}" for t in FIRST_STAGE_TENSORS if f"mtp.0.{t}" not in have]
    missing += [f"mtp.{stages - 1}.{t}" for t in LAST_STAGE_TENSORS if f"mtp.{stages - 1}.{t}" not in have]
    roles = {k: role_of(k, stages) for k in keys}
    unknown = [k for k, r in roles.items() if r is None]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) not in the V4.1 DSpark layout: {', '.join(unknown[:8])}")
    counts = {i: len({int(_EXPERT.match(_KEY.match(k).group(2)).group(1)) for k in keys
                      if _KEY.match(k) and int(_KEY.match(k).group(1)) == i and _EXPERT.match(_KEY.match(k).group(2))})
              for i in range(stages)}
    if len(set(counts.values())) > 1:
        problems.append(f"routed experts per stage differ: {counts}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return V41Layout(stages=stages, experts=counts[0], roles=roles)


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p[3:], key) if p.startswith("re:") else fnmatch.fnmatchcase(key, p) for p in patterns)


def trainable_keys(release, freeze: Iterable[str] = DEFAULT_FROZEN) -> list[str]:
    """The drafter weights training may change: not a scale, not frozen by ``freeze`` (fnmatch globs
    or ``re:`` regexes on release names), and stored as a float or FP8 E4M3 (the formats the drop-in
    writes back; MXFP4 and other packed tensors are kept as release bytes)."""
    scales = set(release.fp8.values()) | set(release.other_scales.values())
    out = []
    for k in release.drafter_keys:
        if k in scales or k in release.other_scales or _matches(k, freeze):
            continue
        if release.info[k].dtype in ("F32", "BF16", "F16", "F64", "F8_E4M3"):
            out.append(k)
    return out


def load_trainable(release, freeze: Iterable[str] = DEFAULT_FROZEN) -> dict[str, torch.Tensor]:
    """The trainable tensors as float32: FP8 weights dequantized with their release scales."""
    from safetensors import safe_open

    from drafter.quant import fp8 as F

    describe(release.drafter_keys, where=str(release.dir))
    out: dict[str, torch.Tensor] = {}
    for k in trainable_keys(release, freeze):
        with safe_open(str(release.path_of(k)), "pt") as f:
            t = f.get_tensor(k)
        if k in release.fp8:
            s_key = release.fp8[k]
            with safe_open(str(release.path_of(s_key)), "pt") as f:
                t = F.dequantize(t, f.get_tensor(s_key), release.block, name=k)
        out[k] = t.float().contiguous()
    return out


def write_trained(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    """The trained tensors under their release names (float32), atomically: :func:`build_dropin`'s input."""
    from drafter.core.files import save_safetensors

    bad = [k for k in tensors if not k.startswith("mtp.")]
    if bad:
        raise ValueError(f"{path}: not V4.1 drafter tensors: {bad[:5]}")
    save_safetensors({k: v.detach().float().contiguous() for k, v in tensors.items()}, path)
    return Path(path)


__all__ = ["DEFAULT_FROZEN", "FIRST_STAGE_TENSORS", "LAST_STAGE_TENSORS", "LAYER_TENSORS", "V41Layout", "describe",
           "load_trainable", "role_of", "trainable_keys", "write_trained"]
