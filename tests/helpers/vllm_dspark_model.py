"""Load a DSpark draft into vLLM's own model class on CPU and compute with it (serving env):
``python vllm_dspark_model.py TARGET_DIR DRAFT_DIR IN.pt OUT.pt``.

vLLM 0.32 builds ``Qwen3DSparkForCausalLM`` (``model_executor/models/qwen3_dspark.py``) for the
draft folder exactly as for serving — ``SpeculativeConfig(method="dspark")`` against the target, its
``load_weights`` on the folder's safetensors (a name it does not know is an error there). The engine
itself refuses DSpark on CPU ("Model Runner V1 does not support: dspark"), so the config is attached
after ``VllmConfig`` validation; the model reads only its fields. Then, from IN (``features``
[T, n·H_t], ``positions`` [T], ``prev`` [N], ``hidden`` [N, K, H], ``base_logits`` [N, K, V],
``anchor`` [N]), OUT gets what vLLM's code computes:

* ``combined``: ``combine_hidden_states(features)`` — ``fc`` [T, H];
* ``context_k`` / ``context_v`` [L, T, kv_heads, head_dim]: ``precompute_and_store_context_kv`` —
  ``hidden_norm``, each layer's K/V projection, ``k_norm`` and RoPE with vLLM's fused CPU kernels,
  taken where it writes them into each layer's KV cache;
* ``bias``: ``markov_bias(markov_embed(prev))`` [N, V];
* ``tokens`` / ``confidence`` [N, K]: the greedy branch of ``DSparkSpeculator._sample_sequential``
  (``v1/worker/gpu/spec_decode/dspark/speculator.py``: ``prev`` starts at the anchor, argmax of base
  + bias) and ``compute_confidence``;
* ``params``: the names of the model's parameters after loading.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch


def main(target: str, draft: str, src: str, dst: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.utils.network_utils import get_open_port

    inp = torch.load(src)
    mc = ModelConfig(model=target, dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    pc = ParallelConfig()
    sc = SpeculativeConfig(model=draft, method="dspark", num_speculative_tokens=inp["base_logits"].shape[1],
                           target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, parallel_config=pc)
    object.__setattr__(vc, "speculative_config", sc)
    with set_current_vllm_config(vc), torch.no_grad():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=vc)
        weights = {}
        for f in sorted(Path(draft).glob("*.safetensors")):
            weights |= load_file(str(f))
        model.load_weights(weights.items())
        for module in model.modules():  # what the model loader does after loading (CPU GEMM dispatch)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)

        combined = model.combine_hidden_states(inp["features"])
        written = []
        for layer in model.model.layers:
            attn = layer.self_attn.attn
            attn.kv_cache = torch.empty(0)

            def keep(_layer, k, v, _cache, _slots, _out=written):
                _out.append((k.clone(), v.clone()))

            attn.impl.do_kv_cache_update = keep
        T = combined.shape[0]
        model.model.precompute_and_store_context_kv(combined, inp["positions"], torch.arange(T))

        bias = model.markov_bias(model.markov_embed(inp["prev"]))
        base, hidden = inp["base_logits"], inp["hidden"]
        N, K, _ = base.shape
        prev = inp["anchor"]
        tokens, embeds = [], []
        for i in range(K):
            e = model.markov_embed(prev)
            embeds.append(e)
            prev = (base[:, i] + model.markov_bias(e)).argmax(dim=-1)
            tokens.append(prev)
        confidence = model.compute_confidence(hidden.flatten(0, 1), torch.stack(embeds, dim=1).flatten(0, 1)).view(N, K)
    torch.save({"combined": combined, "context_k": torch.stack([k for k, _ in written]),
                "context_v": torch.stack([v for _, v in written]), "bias": bias,
                "tokens": torch.stack(tokens, dim=1), "confidence": confidence,
                "params": sorted(n for n, _ in model.named_parameters())}, dst)


if __name__ == "__main__":
    main(*sys.argv[1:5])
