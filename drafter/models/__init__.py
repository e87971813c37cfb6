"""Drafter models: DeepSeek-style MTP layers (:mod:`drafter.models.mtp`), release layouts
(:mod:`drafter.models.layouts`) and DSpark block drafters (:mod:`drafter.models.dspark`).

Example::

    from drafter.models import EmbeddedGlm4MoeLayout, freeze, load_drafter, save_drafter
    drafter = load_drafter(model_dir, EmbeddedGlm4MoeLayout())
    n_trainable, n_frozen = freeze(drafter)          # embeddings + routed experts frozen
    out = drafter.unroll(input_ids, target_hidden, k_steps=4)
"""
from drafter.models.layouts import (
    LAYOUTS,
    TRAINED_NAME,
    DeepSeekV3Layout,
    EmbeddedGlm4MoeLayout,
    MTPLayout,
    dequantize_fp8_blocks,
    get_layout,
    layout_for,
    load_drafter,
    quantize_fp8_blocks,
    save_drafter,
)
from drafter.models.mtp import DEFAULT_FROZEN, MTPDrafter, MTPLayer, Unrolled, causal_mask, freeze, reuse_mask

__all__ = [
    "DEFAULT_FROZEN",
    "LAYOUTS",
    "TRAINED_NAME",
    "DeepSeekV3Layout",
    "EmbeddedGlm4MoeLayout",
    "MTPDrafter",
    "MTPLayer",
    "MTPLayout",
    "Unrolled",
    "causal_mask",
    "dequantize_fp8_blocks",
    "freeze",
    "get_layout",
    "layout_for",
    "load_drafter",
    "quantize_fp8_blocks",
    "reuse_mask",
    "save_drafter",
]
