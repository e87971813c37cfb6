"""Dependency floors the code relies on (drafter/models/compat.py): transformers' decoder layers take `cache=`.

On transformers 5.17 (the GPU check machine's image) the keyword fell into ``**kwargs``: the unroll's second
draft step attended to its own keys only and failed with a size mismatch. These tests fail on such a version.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from drafter.core.errors import StageError
from drafter.models import EmbeddedGlm4MoeLayout, load_drafter
from drafter.models import mtp as mtp_mod
from drafter.models.compat import MIN_TRANSFORMERS, check_decoder_layer

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_floor_is_the_checked_version():
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"transformers>=([0-9.]+),<6"', text)
    assert floor, "pyproject.toml pins transformers as >=X,<6"
    assert floor.group(1) == MIN_TRANSFORMERS
    import transformers

    assert Version(transformers.__version__) >= Version(MIN_TRANSFORMERS)


def test_an_old_decoder_layer_is_refused_in_one_line():
    class OldDecoderLayer(torch.nn.Module):  # transformers < 5.24: the cache is `past_key_values`
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            return hidden_states

    with pytest.raises(StageError, match=r"OldDecoderLayer\.forward takes no `cache` argument.*transformers>=5\.24,<6"):
        check_decoder_layer(OldDecoderLayer)


@pytest.mark.parametrize("layout", ["embedded-glm4-moe", "deepseek-v3"])
def test_installed_decoder_layers_take_cache(layout):
    from drafter.models.layouts import get_layout

    check_decoder_layer(get_layout(layout).classes()[1])  # no error


def test_unroll_hands_every_step_to_the_cache(tiny_target, monkeypatch):
    """K = 3 with one MTP layer: each step's keys reach the step cache (3 updates, keys growing T, 2T, 3T)
    and the unroll completes — with a transformers that ignores `cache=` there would be no update."""
    drafter = load_drafter(tiny_target, EmbeddedGlm4MoeLayout())
    seen = []
    orig = mtp_mod._StepCache.update

    def update(self, key_states, value_states, *a, **kw):
        keys, values = orig(self, key_states, value_states, *a, **kw)
        seen.append(keys.shape[-2])
        return keys, values

    monkeypatch.setattr(mtp_mod._StepCache, "update", update)
    T = 12
    cfg = json.loads((tiny_target / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(1, T, cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        un = drafter.unroll(ids, hidden, 3)
    assert seen == [T, 2 * T, 3 * T]
    assert len(un.logits) == 3 and un.logits[2].shape[:2] == (1, T)
