"""Run with the serving env's python: vLLM's rejection sampler at T > 0 on CPU, after the plugins load and the
platform registers its kernel fallbacks (as a vLLM worker does). Prints one JSON object."""

import json

import torch
from vllm.plugins import load_general_plugins

load_general_plugins()
from vllm.platforms import current_platform  # noqa: E402

current_platform.register_triton_kernel_overrides()
from vllm.utils import cpu_triton_utils as cpu_tl  # noqa: E402
from vllm.v1.sample import rejection_sampler as rs  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402

out: dict = {"fixed": bool(getattr(cpu_tl._expand_kernel_impl, "_drafter_fixed", False))}

# the kernel fallback itself, into an output that starts as NaN
expanded = torch.full((5,), float("nan"))
cpu_tl._expand_kernel_impl(expanded, torch.tensor([1.0, 0.5]), torch.tensor([2, 5]), -1, 1)
out["expand_kernel"] = [None if v != v else v for v in expanded.tolist()]

# the per-token temperatures as the rejection sampler spreads them (2 requests: 2 and 3 draft tokens)
cu = torch.tensor([2, 5], dtype=torch.int32)
V = 64
temperature = torch.tensor([1.0, 0.5])
md = SamplingMetadata(temperature=temperature, all_greedy=False, all_random=True, top_p=None, top_k=None,
                      generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                      frequency_penalties=torch.zeros(2), presence_penalties=torch.zeros(2),
                      repetition_penalties=torch.ones(2), output_token_ids=[[], []], allowed_token_ids_mask=None,
                      bad_words_token_ids={}, logitsprocs=None)
torch.manual_seed(0)
logits = torch.randn(5, V)
scaled = rs.apply_sampling_constraints(logits.clone(), cu, md)
want = logits / torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5]).unsqueeze(-1)
out["temperature_applied"] = bool(torch.allclose(scaled, want))

# acceptance: the target puts ~all its mass on each drafted token, so at T=1 every draft is accepted
draft = torch.tensor([3, 7, 11, 13, 17], dtype=torch.int32)
target = torch.zeros(5, V)
target[torch.arange(5), draft.long()] = 40.0
target = rs.apply_sampling_constraints(target, cu, md)
result = rs.rejection_sample(draft, [2, 3], 3, cu, None, target, torch.tensor([[21], [23]], dtype=torch.int32), md)
out["output_tokens"] = result.tolist()
print(json.dumps(out))
