"""What the drafter models need of transformers, checked before a model is built.

The MTP unroll hands each draft step's keys and values to the decoder layer through a ``cache=`` argument
(:class:`drafter.models.mtp._StepCache`). transformers' decoder layers take ``cache`` from 5.24 on; older
ones (5.17 on the GPU check machine) swallow the unknown keyword into ``**kwargs``, so step 2 attends to
step 2's keys only and fails with a size mismatch deep inside attention. :func:`check_decoder_layer` turns
that into one line naming the version and the fix.

Example::

    check_decoder_layer(DeepseekV3DecoderLayer)   # raises StageError on transformers < 5.24
"""
from __future__ import annotations

import inspect

from drafter.core.errors import StageError

MIN_TRANSFORMERS = "5.24"
"""The oldest transformers whose decoder layers take ``cache=`` (pyproject.toml's floor; tests/test_compat.py)."""


def check_decoder_layer(layer_cls: type) -> None:
    """Refuse a decoder layer class whose ``forward`` takes no ``cache`` argument (transformers < 5.24)."""
    params = inspect.signature(layer_cls.forward).parameters
    if "cache" in params:
        return
    import transformers

    raise StageError(
        f"transformers {transformers.__version__}: {layer_cls.__name__}.forward takes no `cache` argument "
        f"(it has {', '.join(p for p in params if p != 'self')}); the MTP unroll needs transformers >= "
        f"{MIN_TRANSFORMERS}, where decoder layers take `cache=`. Install it: pip install 'transformers>={MIN_TRANSFORMERS},<6'")
