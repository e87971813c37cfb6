"""Planning the EXL3 conversion of :mod:`drafter.quant.exl3` (pure, no CUDA): how the MTP layer is
presented to exllamav3 as a one-layer model of the target's architecture (:func:`plan_presentation`,
:func:`write_input_dir`), and which bits each tensor gets (:func:`plan_bits`). The module doc of
:mod:`drafter.quant.exl3` describes the mapping.
"""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafter.core.errors import StageError

HALF_RATES = (1.5, 2.5, 3.5)
SUPPORTED_ARCHS = ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
INPUT_DTYPE = "bfloat16"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")
NOT_CONVERTED_REASON = ("exllamav3 has no MTP input layer for {arch}: the MTP layer is converted as a one-layer "
                        "model, which has no slot for {what}; kept unquantized (BF16)")
KEPT_BY_EXLLAMA = "unquantized in exllamav3's format (norms, router, embedding, MLA kv_b_proj)"

# linears exllamav3 quantizes in Glm4Moe / DeepseekV3 blocks (qmap set): attention and MLP projections
_QUANTIZED_RE = re.compile(
    r"^model\.layers\.0\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")
_OWN_INPUT = ("enorm.weight", "hnorm.weight", "eh_proj.weight")


# ------------------------------------------------------------------------------- presentation


@dataclass
class Presentation:
    """The MTP layer presented to exllamav3 as a one-layer model of the target's architecture."""

    arch: str
    mtp_index: int
    config: dict  # config.json of the 1-layer model
    names: dict[str, str]  # converter input name -> release name (tensors written to the input dir)
    shapes: dict[str, tuple[int, ...]]  # converter input name -> shape
    quantized: dict[str, str]  # EXL3 linear key (no `.weight`) -> release name
    head_key: str = "lm_head"
    not_converted: dict[str, str] = field(default_factory=dict)  # release name -> reason

    def to_json(self) -> dict:
        return {"architecture": self.arch, "mtp_layer": self.mtp_index, "input_to_release": self.names,
                "exl3_linears": self.quantized, "not_converted": self.not_converted}


def plan_presentation(config: dict, release_shapes: dict[str, tuple[int, ...]]) -> Presentation:
    """Name mapping from the release's MTP tensors (``release_shapes``: name → shape, as
    ``layout.to_release`` writes them, the shared embedding included) to a one-layer model.

    Raises :class:`StageError` for an architecture exllamav3 cannot take this way, or a release
    without the tensors a one-layer model needs (decoder block, ``shared_head.norm``/``head``, embedding).
    """
    cfg = dict(config.get("text_config", config))
    archs = config.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED_ARCHS:
        raise StageError(f"config.json architectures={archs}: the EXL3 form supports {list(SUPPORTED_ARCHS)} "
                         "(the MTP layer is converted as a one-layer model of that architecture)")
    L = int(cfg["num_hidden_layers"])
    pre = f"model.layers.{L}."
    names: dict[str, str] = {}
    not_converted: dict[str, str] = {}
    for rel in release_shapes:
        if rel.endswith("embed_tokens.weight"):
            names["model.embed_tokens.weight"] = rel
        elif not rel.startswith(pre):
            raise StageError(f"drafter tensor {rel} is outside the MTP layer {pre}* (only one MTP layer is supported)")
        else:
            rest = rel[len(pre):]
            if rest == "shared_head.norm.weight":
                names["model.norm.weight"] = rel
            elif rest == "shared_head.head.weight":
                names["lm_head.weight"] = rel
            elif rest in _OWN_INPUT:
                not_converted[rel] = NOT_CONVERTED_REASON.format(arch=arch, what=rest.split(".")[0])
            else:
                names["model.layers.0." + rest] = rel
    need = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    missing = [n for n in need if n not in names]
    if missing or not any(n.startswith("model.layers.0.self_attn.") for n in names):
        raise StageError(f"the drafter's tensors lack what a one-layer {arch} needs: {missing or 'self_attn.*'} "
                         f"(have {sorted(release_shapes)[:8]}…)")
    moe = any(".mlp.experts." in n for n in names)
    one = {k: v for k, v in cfg.items() if k not in ("quantization_config", "auto_map")}
    one.update(architectures=[arch], num_hidden_layers=1, num_nextn_predict_layers=0, tie_word_embeddings=False,
               first_k_dense_replace=0 if moe else 1, dtype=INPUT_DTYPE)
    one.pop("torch_dtype", None)
    if "model_type" in config:
        one["model_type"] = config["model_type"]
    quantized = {n[: -len(".weight")]: rel for n, rel in names.items() if _QUANTIZED_RE.match(n)}
    shapes = {n: tuple(release_shapes[rel]) for n, rel in names.items()}
    return Presentation(arch, L, one, names, shapes, quantized, not_converted=not_converted)


def write_input_dir(pres: Presentation, tensors: dict[str, Any], target_dir: Path, in_dir: Path) -> Path:
    """Write the one-layer model: ``config.json``, ``model.safetensors`` (BF16, converter names) and
    the target's tokenizer files (exllamav3 tokenizes its calibration corpus with them).
    ``tensors``: release name → tensor (all of ``pres.names``' values)."""
    import torch
    from drafter.core.files import save_safetensors

    in_dir = Path(in_dir)
    if in_dir.exists():
        shutil.rmtree(in_dir)
    in_dir.mkdir(parents=True)
    out = {}
    for name, rel in pres.names.items():
        t = tensors[rel].detach().to("cpu")
        if tuple(t.shape) != pres.shapes[name]:
            raise StageError(f"drafter tensor {rel} has shape {tuple(t.shape)}, expected {pres.shapes[name]}")
        if not torch.isfinite(t.float()).all():
            raise StageError(f"drafter tensor {rel} has NaN/inf values; refusing to quantize it")
        out[name] = t.to(torch.bfloat16).contiguous()
    save_safetensors(out, str(in_dir / "model.safetensors"), metadata={"format": "pt"})
    (in_dir / "config.json").write_text(json.dumps(pres.config, indent=2))
    copied = [f for f in TOKENIZER_FILES if (Path(target_dir) / f).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise StageError(f"{target_dir}: no tokenizer.json / tokenizer.model (exllamav3 needs the tokenizer to calibrate)")
    for f in copied:
        shutil.copy(Path(target_dir) / f, in_dir / f)
    return in_dir


# ---------------------------------------------------------------------------------- bits plan


@dataclass
class BitsPlan:
    """Which bits each tensor gets, and what the overrides did."""

    bits: float
    head_bits: float
    per_tensor: dict[str, float]  # EXL3 linear key -> bits fixed by an override (recipe entry)
    overrides: dict[str, dict]  # pattern -> {"bits", "applied_to": [release], "not_applied": {release: why}}

    @property
    def recipe(self) -> dict | None:
        """exllamav3 ``--recipe`` content, or None when no override touches a budgeted tensor."""
        if not self.per_tensor:
            return None
        return {"target_bpw": self.bits, "head_bits": rate_number(self.head_bits),
                "tensors": {"*": rate_number(self.bits), **{k: rate_number(v) for k, v in self.per_tensor.items()}}}


def rate_number(b: float) -> int | float:
    return int(b) if float(b).is_integer() else float(b)


def is_exl3_rate(b: float) -> bool:
    return (float(b).is_integer() and (1 <= b <= 8 or b == 16)) or float(b) in HALF_RATES


def _matches(pattern: str, release_name: str) -> bool:
    return fnmatch.fnmatchcase(release_name, pattern) or pattern in release_name


def plan_bits(pres: Presentation, bits: float, head_bits: float, overrides: dict[str, float],
              codebook: str = "mul1") -> BitsPlan:
    """Resolve ``overrides`` (pattern → bits, on release names) against the presented tensors.

    A pattern matching no drafter tensor at all is a :class:`StageError` (a typo); one matching only
    tensors the converter does not take (``eh_proj``…) is reported as not applied. With overrides on
    budgeted tensors the base ``bits`` must be a rate exllamav3's recipe accepts (integer 1-8, or
    1.5/2.5/3.5 with the mul1 codebook)."""
    if not 1 <= bits <= 8:
        raise StageError(f"quantize_exl3.bits={bits}: exllamav3 takes 1-8 bits per weight")
    if not is_exl3_rate(head_bits):
        raise StageError(f"quantize_exl3.head_bits={head_bits}: exllamav3 takes an integer 1-8 or 16")
    per_tensor: dict[str, float] = {}
    report: dict[str, dict] = {}
    head_rel = pres.names.get(pres.head_key + ".weight")
    all_release = list(pres.names.values()) + list(pres.not_converted)
    for pattern, b in overrides.items():
        if not is_exl3_rate(b) or (float(b) in HALF_RATES and codebook != "mul1"):
            raise StageError(f"quantize_exl3.overrides[{pattern!r}]={b}: not a rate exllamav3 takes "
                             f"(integer 1-8, 16, or {HALF_RATES} with the mul1 codebook)")
        hit = [r for r in all_release if _matches(pattern, r)]
        if not hit:
            raise StageError(f"quantize_exl3.overrides[{pattern!r}] matches no drafter tensor "
                             f"(names look like {sorted(all_release)[:4]}…)")
        applied, not_applied = [], {}
        for key, rel in pres.quantized.items():
            if _matches(pattern, rel):
                per_tensor[key] = float(b)
                applied.append(rel)
        if head_rel is not None and _matches(pattern, head_rel):
            head_bits = float(b)
            applied.append(head_rel)
        for rel in hit:
            if rel in applied:
                continue
            not_applied[rel] = pres.not_converted.get(rel, KEPT_BY_EXLLAMA)
        report[pattern] = {"bits": rate_number(b), "applied_to": sorted(applied), "not_applied": not_applied}
    if per_tensor and not (is_exl3_rate(bits) and bits <= 8 and (float(bits) not in HALF_RATES or codebook == "mul1")):
        raise StageError(f"quantize_exl3.bits={bits} with per-tensor overrides: exllamav3's recipe needs a whole rate "
                         f"(integer 1-8, or {HALF_RATES} with the mul1 codebook) for the other tensors")
    return BitsPlan(float(bits), float(head_bits), per_tensor, report)
