"""The stages of the release pipeline, one module per stage; each defines ``STAGE`` (a
:class:`drafter.core.stage.Stage`). Their order and lookup: :mod:`drafter.core.registry`."""
from drafter.core.registry import ORDER, all_stages, get  # noqa: F401
