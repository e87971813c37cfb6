"""Load EAGLE-3 heads into vLLM's own model class on CPU and compute with them (serving env):
``python vllm_eagle3_model.py TARGET_DIR HEAD_DIR IN.pt OUT.pt [HEAD_DIR IN.pt OUT.pt …]`` (one process: vLLM
is imported and its process group set up once for all the heads).

vLLM 0.32 builds ``Eagle3LlamaForCausalLM`` (``model_executor/models/llama_eagle3.py``) for the head
folder exactly as for serving — ``SpeculativeConfig(method="eagle3")`` against the target (either
checkpoint layout), its ``load_weights`` on the folder's safetensors — and shares the target's
embedding as the proposer does when the head has none. Its attention layer needs the engine's
paged KV cache and forward context, so the ``Attention`` module of the layer is replaced by plain
scaled-dot-product attention over the q/k/v vLLM's own projections and rotary kernel produce,
with the KV cache the proposer gives: a causal first pass, then one query per sequence end reading
the first pass's keys up to it plus its own. Everything else is vLLM's code.

From IN (``features`` [T, n·H_t], ``ids`` [T] (token after each position), ``positions`` [T],
``step2_ids`` [T], ``end`` (int p: step 2 runs at position p + 1)), OUT gets:

* ``combined``: ``combine_hidden_states(features)`` [T, H];
* ``logits1`` [T, V]: ``compute_logits`` of the first pass (−inf outside the draft vocabulary);
* ``prenorm1`` [T, H]: the first pass's hidden state fed to the next step;
* ``logits2`` [V]: step 2 at position ``p + 1``, fed ``prenorm1[p]`` and ``step2_ids[p]``;
* ``params``: the model's parameter names after loading, ``has_own_embed_tokens``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch


class _PlainAttention(torch.nn.Module):
    """q/k/v [T, heads·hd] → causal SDPA; with ``prefix`` set, one query reads the stored keys up to it."""

    def __init__(self, nh: int, nkv: int, hd: int, scale: float):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale = nh, nkv, hd, scale
        self.stored: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefix: int | None = None

    def forward(self, q, k, v, *args, **kwargs):
        T = q.shape[0]
        q = q.view(T, self.nh, self.hd).transpose(0, 1)
        k = k.view(T, self.nkv, self.hd).transpose(0, 1)
        v = v.view(T, self.nkv, self.hd).transpose(0, 1)
        if self.prefix is None:
            self.stored = (k, v)
            mask = torch.ones(T, T, dtype=torch.bool).tril()
        else:
            k = torch.cat([self.stored[0][:, : self.prefix + 1], k], dim=1)
            v = torch.cat([self.stored[1][:, : self.prefix + 1], v], dim=1)
            mask = torch.ones(T, k.shape[1], dtype=torch.bool)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1).reshape(T, self.nh * self.hd)


def main(target: str, *runs: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    for i in range(0, len(runs), 3):
        head, src, dst = runs[i:i + 3]
        vc = _config(target, head)
        with set_current_vllm_config(vc), torch.no_grad():
            if i == 0:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
                initialize_model_parallel(1, 1)
            torch.save(_compute(vc, target, head, torch.load(src)), dst)


def _config(target: str, head: str):
    from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    mc = ModelConfig(model=target, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    pc = ParallelConfig()
    sc = SpeculativeConfig(model=head, method="eagle3", num_speculative_tokens=2, target_model_config=mc,
                           target_parallel_config=pc)
    return VllmConfig(model_config=mc, parallel_config=pc, speculative_config=sc,
                      compilation_config=CompilationConfig(mode=0))


def _compute(vc, target: str, head: str, inp: dict) -> dict:
    from safetensors.torch import load_file
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    model = Eagle3LlamaForCausalLM(vllm_config=vc)
    weights = {}
    for f in sorted(Path(head).glob("*.safetensors")):
        weights |= load_file(str(f))
    model.load_weights(weights.items())
    for module in model.modules():  # what the model loader does after loading (CPU GEMM dispatch)
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    own_embed = bool(getattr(model, "has_own_embed_tokens", False))
    if not own_embed:  # llm_base_proposer shares the target's embedding
        tw = {}
        for f in sorted(Path(target).glob("*.safetensors")):
            tw |= load_file(str(f))
        model.model.embed_tokens.weight.copy_(tw["model.embed_tokens.weight"])
    attns = []
    for layer in model.model.layers:
        a = layer.self_attn
        plain = _PlainAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.scaling)
        a.attn = plain
        attns.append(plain)

    combined = model.combine_hidden_states(inp["features"])
    normed, prenorm = model(inp["ids"], inp["positions"], combined)
    logits1 = model.compute_logits(normed)
    p = int(inp["end"])
    for plain in attns:
        plain.prefix = p
    normed2, _ = model(inp["step2_ids"][p : p + 1], inp["positions"][p : p + 1] + 1, prenorm[p : p + 1])
    logits2 = model.compute_logits(normed2)[0]
    return {"combined": combined, "logits1": logits1, "prenorm1": prenorm, "logits2": logits2,
            "params": sorted(n for n, _ in model.named_parameters()), "has_own_embed_tokens": own_embed}


if __name__ == "__main__":
    main(*sys.argv[1:])
