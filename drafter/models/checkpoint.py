"""Reading a drafter folder's ``*.safetensors`` against the tensors its config implies.

DSpark drafts and EAGLE-3 heads are folders of ``config.json`` and safetensors files, as vLLM loads them;
both are read the same way: every stored tensor must be one the model built from the config has, with its
shape and finite values, or the error names the file and the tensor (:func:`read_tensors`). What is missing
is for the caller to decide (shared tensors, optional maps).

Example::

    expected = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}
    got = read_tensors(folder, expected, "DSpark draft", folder / "config.json")
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor


def read_tensors(folder: Path, expected: dict[str, Tensor], what: str, cfg_file: Path, *,
                 rename: Callable[[str], str] = lambda n: n,
                 skip: Callable[[str], bool] = lambda n: False) -> dict[str, Tensor]:
    """The tensors of ``folder/*.safetensors`` by model name (``rename``: stored name → model name), except those
    ``skip`` says (stored name). Raises FileNotFoundError without safetensors files and ValueError naming the file
    and stored tensor for a tensor the model has no place for, a shape other than ``expected``'s (implied by
    ``cfg_file``) or NaN/inf values."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    got: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for stored in st.keys():
                if skip(stored):
                    continue
                name = rename(stored)
                if name not in expected:
                    raise ValueError(f"{f}: tensor {stored!r} is not {_article(what)} {what} tensor")
                t = st.get_tensor(stored)
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise ValueError(f"{f}: tensor {stored!r} has shape {tuple(t.shape)}, the config ({cfg_file}) "
                                     f"implies {tuple(expected[name].shape)}")
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{f}: tensor {stored!r} has non-finite values (NaN or inf)")
                got[name] = t
    return got


def _article(what: str) -> str:
    return "an" if what[:1].upper() in "AEIOU" else "a"
