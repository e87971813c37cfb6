"""Building blocks of the config sections: :class:`Section` (the base of every section), the
:func:`Operational` / :func:`Device` field helpers and the vocabularies (prompt domains, secret kinds)
the sections validate against. :mod:`drafter.core.config` re-exports every name here."""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


DOMAINS = ("general", "code", "math", "agent")
"""The built-in prompt domains (:mod:`drafter.data.prompts` writes prompts of each)."""

SECRET_KINDS = ("private_key", "url_password", "token", "api_key", "password", "email")
"""The built-in secret kinds of :mod:`drafter.data.scrub`, in its priority order (an overlap goes to the earlier kind)."""


def check_domains(domains: dict[str, float]) -> None:
    unknown = sorted(set(domains) - set(DOMAINS))
    if unknown:
        raise ValueError(f"unknown prompt domain(s) {unknown}; built-in domains are {list(DOMAINS)}")
    if any(w < 0 or not math.isfinite(w) for w in domains.values()):
        raise ValueError("domain weights must be finite and ≥ 0")
    if not any(w > 0 for w in domains.values()):
        raise ValueError("at least one domain needs a weight > 0")


def Operational(default: Any = ..., **kw: Any) -> Any:  # noqa: N802 - used like pydantic's Field
    """A ``Field`` for an *operational* setting: how a stage runs (timeouts, retries, python paths,
    ports, the server's environment, disk margins), never what it computes. Operational fields stay
    out of stage keys and manifests (:meth:`Section.key_dump`), so changing one recomputes nothing."""
    return Field(default, json_schema_extra={"operational": True}, **kw)


def is_operational(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("operational"))


DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def Device(what: str) -> Any:  # noqa: N802 - used like pydantic's Field
    """An operational ``device`` field (``auto``, ``cpu``, ``cuda``, ``cuda:N``; drafter.core.hardware.resolve_device)."""
    return Operational("auto", pattern=DEVICE_PATTERN,
                       description=f"Device {what} runs on: `auto` = a CUDA GPU when torch sees one (under torchrun each "
                       "rank takes its `LOCAL_RANK` GPU), else the CPU; or `cpu`, `cuda`, `cuda:N`. Operational: not in "
                       "stage keys (the same result on any device, within float tolerance).")


def Experts(what: str) -> Any:  # noqa: N802 - used like pydantic's Field
    """An operational ``experts`` field: how routed experts are computed (drafter.models.experts)."""
    return Operational("auto", pattern=r"^(auto|eager|grouped_mm)$",
                       description=f"How {what} computes a MoE drafter's routed experts: `grouped_mm` (one grouped "
                       "matmul over all experts), `eager` (transformers' loop, one matmul pair per expert) or `auto` "
                       "(grouped_mm where torch's kernel takes the experts' device and dtype: any on the CPU, bfloat16 "
                       "on CUDA). Operational: the same result within float tolerance.")


def refuse_api_key_arg(args: list[str]) -> list[str]:
    """Server arguments must not carry vLLM's ``--api-key`` (the command line is written to the server log)."""
    if any(a.split("=", 1)[0] == "--api-key" for a in args):
        raise ValueError("--api-key on the server command line would be written to the server log: give the server "
                         "its key through serving.env (e.g. VLLM_API_KEY: '${MY_KEY}') and set serving.api_key_env: MY_KEY")
    return args


class Section(BaseModel):
    """Base of every config section: unknown keys are errors (typos fail loudly). Validation errors
    never carry the input value in their text (it may be a secret; :func:`format_validation_error`
    shows values of non-secret fields only)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    @classmethod
    def operational_fields(cls) -> frozenset[str]:
        """Names of this section's operational fields (see :func:`Operational`)."""
        return frozenset(n for n, f in cls.model_fields.items() if is_operational(f))

    def key_dump(self) -> dict[str, Any]:
        """The section as it enters stage keys and manifests: JSON values, operational fields left out
        (secrets are operational, so they never appear here, not even masked)."""
        return self.model_dump(mode="json", exclude=set(self.operational_fields()))
