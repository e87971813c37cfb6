"""Errors the pipeline raises on purpose: each message names the file, key, shape or value at fault."""


class DrafterError(Exception):
    """Base class of the pipeline's own errors."""


class ConfigError(DrafterError):
    """The configuration is invalid (raised before any work starts)."""


class StageError(DrafterError):
    """A stage cannot produce its output from its inputs (bad input data, failed checks)."""


class StoreError(DrafterError):
    """The stage store is inconsistent (tampered or incomplete output, missing input)."""


class StageSkipped(DrafterError):
    """A stage cannot run on this machine (e.g. needs CUDA); recorded as `skipped` with the reason."""
