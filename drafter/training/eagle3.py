"""One EAGLE-3 training run (the stand-in's bootstrap, the fine-tune, its ablations): the head, its data
and its draft vocabulary, then :func:`drafter.training.loop.train` — the same loop, losses and held-out
checks as an MTP layer's, the head driven through the same unrolled interface (training-time test: step
``k`` fed the head's own output of step ``k−1``, :meth:`~drafter.models.eagle3.Eagle3Draft.unroll`).

Where a run starts: a released head (``weights``: a folder in the speculators or the EAGLE layout), or,
for the demo's stand-in, a seeded fresh head shaped like the target's layers. A fresh head's draft
vocabulary is the ``eagle3.draft_vocab_size`` tokens most frequent in its training windows
(:func:`drafter.serving.draft_vocab.build_draft_vocab`); its output layer starts as those rows of the
target's LM head and its final norm as the target's (the head then predicts as the target does from a
hidden state like the target's last one), everything else from torch's default initialization.

Example::

    res = run_eagle3_training(model_dir, capture, cfg.train, cfg.eagle3, out, weights=None, verifier="org/model")
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from drafter.core.config import TrainConfig
from drafter.core.errors import StageError
from drafter.core.hardware import device_label, resolve_device
from drafter.data.windows import load_windows
from drafter.models.eagle3 import EAGLE3_DIR, Eagle3Config, Eagle3Draft, default_aux_layer_ids, load_eagle3, save_eagle3
from drafter.models.target import read_tensor
from drafter.serving.draft_vocab import build_draft_vocab
from drafter.training.frozen import restore_frozen
from drafter.training.loop import train
from drafter.training.run import _finish, _finished


def released_head(weights: Path, embed: torch.Tensor, eagle3) -> Eagle3Draft:
    """A released head from its folder, checked against the config (aux layers, when the config names them)."""
    try:
        head, _ = load_eagle3(weights, embed_tokens=embed)
    except (OSError, ValueError) as e:
        raise StageError(f"the released EAGLE-3 head {weights}: {e}") from e
    if eagle3.aux_layer_ids and list(head.cfg.aux_layer_ids) != list(eagle3.aux_layer_ids):
        raise StageError(f"the released EAGLE-3 head {weights} reads aux layers {head.cfg.aux_layer_ids}; the config "
                         f"asks for eagle3.aux_layer_ids {eagle3.aux_layer_ids}")
    return head


def fresh_head(model_dir: Path, tcfg, eagle3, aux: list[int], train_windows) -> Eagle3Draft:
    """A seeded new head shaped like the target (the module docstring)."""
    V = tcfg.vocab_size
    size = eagle3.draft_vocab_size or V
    if size > V:
        raise StageError(f"eagle3.draft_vocab_size {size} exceeds the target's vocabulary of {V}")
    ids = build_draft_vocab((w.input_ids.tolist() for w in train_windows), vocab_size=V, size=size)
    torch.manual_seed(eagle3.init_seed)
    head = Eagle3Draft(Eagle3Config.for_target(tcfg, aux_layer_ids=aux, draft_vocab_size=size,
                                               norm_before_residual=eagle3.norm_before_residual))
    head.set_draft_vocab(ids)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(read_tensor(model_dir, "model.embed_tokens.weight", torch.float32))
        head.lm_head.weight.copy_(read_tensor(model_dir, "lm_head.weight", torch.float32)[torch.tensor(ids)])
        head.norm.weight.copy_(read_tensor(model_dir, "model.norm.weight", torch.float32))
    return head


def _aux_layers(eagle3, tcfg, weights: Path | None) -> list[int]:
    """The aux layers the run reads: the released head's, else the config's, else vLLM's default for the target."""
    import json

    if weights is not None and (Path(weights) / "config.json").is_file():
        try:
            return Eagle3Config.from_hf(json.loads((Path(weights) / "config.json").read_text()))[0].aux_layer_ids
        except ValueError as e:
            raise StageError(f"the released EAGLE-3 head {weights}: {e}") from e
    aux = list(eagle3.aux_layer_ids) or default_aux_layer_ids(tcfg.num_hidden_layers)
    L = tcfg.num_hidden_layers
    if any(i > L for i in aux):
        raise StageError(f"eagle3.aux_layer_ids {aux}: the target has {L} decoder layers (aux ids 0..{L})")
    return aux


def run_eagle3_training(model_dir: Path, capture, cfg: TrainConfig, eagle3, out: Path, *, weights: Path | None = None,
                        verifier: str = "", title: str = "EAGLE-3 training", log=print) -> dict:
    """Train an EAGLE-3 head in ``out/work`` (a retry resumes), then write into ``out``: the head folder vLLM loads
    (``eagle3/config.json`` + ``eagle3/model.safetensors``, ``eagle3.layout``), ``curves.png``, ``history.jsonl``,
    ``result.json``. ``eagle3`` is the config's :class:`~drafter.core.config.Eagle3Section`; ``verifier`` the
    target's name for the speculators config. A finished run is not trained again."""
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    if (done := _finished(out, out / EAGLE3_DIR / "model.safetensors")) is not None:
        return done
    if cfg.nproc_per_node > 1:
        raise StageError("EAGLE-3 training runs on one process here (train.nproc_per_node must be 1)")
    tcfg = AutoConfig.from_pretrained(str(model_dir))
    aux = _aux_layers(eagle3, tcfg, weights)
    train_w = load_windows(capture, "train", cfg.data_part, cfg.window, min_tokens=cfg.k_steps + 2, feature_layers=aux)
    eval_w = load_windows(capture, "heldout", "all", cfg.window, min_tokens=cfg.k_steps + 2,
                          max_windows=cfg.eval_windows, feature_layers=aux)
    embed = read_tensor(model_dir, "model.embed_tokens.weight", torch.float32)
    head = released_head(weights, embed, eagle3) if weights is not None else fresh_head(model_dir, tcfg, eagle3, aux, train_w)
    if head.cfg.vocab_size != tcfg.vocab_size or head.cfg.target_hidden_size != tcfg.hidden_size:
        raise StageError(f"the EAGLE-3 head (vocabulary {head.cfg.vocab_size}, target hidden size "
                         f"{head.cfg.target_hidden_size}) does not fit the target {model_dir} "
                         f"({tcfg.vocab_size}, {tcfg.hidden_size})")
    device = resolve_device(cfg.device)
    original = copy.deepcopy(head) if cfg.frozen_dtype != "float32" else None
    Vd = head.cfg.draft_vocab_size
    ids = head.draft_ids().tolist() if Vd < head.cfg.vocab_size else None  # read on the host, before the move
    head = head.to(device)
    lm_head = read_tensor(model_dir, "lm_head.weight", torch.float32).to(device)
    res = train(head, lm_head, train_w, eval_w, cfg, out / "work", log=log, draft_vocab=ids)
    head = head.cpu()
    if original is not None and res.get("frozen_dtype", "float32") != "float32":
        restore_frozen(head, original)  # the written frozen tensors keep their loaded values
    save_eagle3(head, out / EAGLE3_DIR, layout=eagle3.layout, verifier=verifier,
                verifier_architectures=list(getattr(tcfg, "architectures", None) or ["LlamaForCausalLM"]),
                speculative_tokens=eagle3.speculative_tokens, dtype=getattr(torch, cfg.save_dtype))
    return _finish(res, out, title, {"layout": "eagle3", "loss": cfg.loss, "k_steps": cfg.k_steps,
                                     "train_windows": len(train_w), "eval_windows": len(eval_w),
                                     "weights_in": str(weights) if weights else None,
                                     "draft_vocab": {"size": Vd, "vocab_size": head.cfg.vocab_size, "file": None,
                                                     "trained_over": True, "aux_layer_ids": list(head.cfg.aux_layer_ids)},
                                     "device": device_label(device)})
