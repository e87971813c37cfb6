"""`eval_offline` stage: offline acceptance of the released (baseline) and fine-tuned (candidate)
drafters on held-out windows.

Inputs: the target (its LM head and, to measure the draft cost, the model), the captured held-out
features (never trained on), the conversations (`scrub`: each row's domain and thinking mode), the
released drafter (`bootstrap_drafter`'s tensors, or the MTP layer inside the target when it was
skipped) and the fine-tuned one (`train`'s ``mtp-trained.safetensors``).
Computes: each drafter unrolled ``k_max`` steps over every held-out window; α per draft position
under the three rules (T=0; T=1 with greedy and with probabilistic drafts), τ(K) for K = 1..k_max
from the chain products; bootstrap intervals over conversations; the same per domain and per mode;
the draft cost (one drafter step vs one target forward over the same tokens, this machine, unless
configured) and the K maximizing the expected speed τ(K) / (1 + K·cost).
Writes: ``eval_offline.json`` (see :func:`drafter.evaluation.offline.evaluate`), ``eval_offline.md``,
``tau_vs_k.png``, ``acceptance_per_position.png``.
Reports: τ at every K per rule and drafter (``tau_<rule>_k<K>_<drafter>``), α per position, the
recommended K per drafter and its expected speedup, the draft cost.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from drafter.data.capture import load_target_model
from drafter.core.config import ReleaseConfig
from drafter.core.files import iter_rows, list_shards, write_json_atomic
from drafter.core.errors import StageError
from drafter.evaluation.offline import (conversation_labels, evaluate, heldout_alphas, measure_draft_cost,
                                plot_acceptance_per_position, plot_tau_vs_k, render_markdown)
from drafter.models import TRAINED_NAME, layout_for, load_drafter
from drafter.core.progress import progress
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.stages.train import baseline_weights
from drafter.models.target import read_tensor, target_dir
from drafter.data.windows import load_windows


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.eval_offline
    t_start = time.monotonic()
    model_dir = target_dir(inputs["prepare_target"])
    candidate = inputs["train"].path / TRAINED_NAME
    if not candidate.is_file():
        raise StageError(f"train output {inputs['train'].path} has no {TRAINED_NAME} (the fine-tuned drafter)")
    layout = layout_for(model_dir)
    drafters = {"baseline": load_drafter(model_dir, layout, weights=baseline_weights(cfg, inputs)),
                "candidate": load_drafter(model_dir, layout, weights=candidate)}
    head = read_tensor(model_dir, "lm_head.weight", torch.float32)
    windows = load_windows(inputs["capture"], "heldout", "all", c.window, min_tokens=c.k_max + 2,
                           max_windows=c.max_windows)
    conv_dir = inputs["scrub"].path / "shards"
    if not list_shards(conv_dir):
        raise StageError(f"scrub output {conv_dir} has no shard-*.jsonl files (needed for domains and modes)")
    labels = conversation_labels(iter_rows(conv_dir))

    with progress("eval_offline", total=len(windows), unit="windows") as bar:
        held = heldout_alphas(drafters, head, windows, c.k_max, on_window=bar.advance)
    if held.positions == 0:
        raise StageError(f"capture {inputs['capture'].path}: no held-out position has {c.k_max} assistant tokens "
                         f"after it (lower eval_offline.k_max or capture longer conversations)")
    eval_seconds = time.monotonic() - t_start

    cost = None
    if c.draft_cost is None:
        target = load_target_model(model_dir)
        longest = max(windows, key=lambda w: len(w.input_ids))
        cost = measure_draft_cost(target, drafters["candidate"], longest, repeats=c.cost_repeats)
        del target
    draft_cost = cost["ratio"] if cost else c.draft_cost

    res = evaluate(held, labels, draft_cost=draft_cost, draft_cost_measured=cost is not None,
                   samples=c.bootstrap_samples, seed=c.seed, confidence=c.confidence, speed_rule=c.speed_rule)
    res["windows"] = len(windows)
    if cost:
        res["draft_cost_timing"] = cost
    write_json_atomic(out / "eval_offline.json", res)
    (out / "eval_offline.md").write_text(render_markdown(res))
    plot_tau_vs_k(res, out / "tau_vs_k.png")
    plot_acceptance_per_position(res, out / "acceptance_per_position.png")

    metrics: Metrics = {"windows": len(windows), "positions": held.positions, "conversations": res["conversations"],
                        "draft_cost": round(draft_cost, 4), "draft_cost_measured": cost is not None}
    for name, d in res["drafters"].items():
        for rule, s in d.items():
            for k, t in enumerate(s["tau_by_k"], start=1):
                metrics[f"tau_{rule}_k{k}_{name}"] = round(t, 4)
        metrics[f"alpha_t0_{name}"] = [round(a, 3) for a in d["t0"]["alpha"]]
        k = res["recommended_k"][name]
        metrics[f"recommended_k_{name}"] = k
        metrics[f"expected_speedup_{name}"] = round(res["expected_speedup"][name][k - 1], 4)
    metrics["seconds_eval"] = round(eval_seconds, 1)
    metrics["seconds"] = round(time.monotonic() - t_start, 1)
    return metrics


STAGE = Stage(
    name="eval_offline",
    version="1",
    inputs=("prepare_target", "scrub", "capture", "bootstrap_drafter", "train"),
    sections=("eval_offline", "baseline"),
    run=run,
    description="Offline acceptance (τ vs K, α per position, bootstrap CIs, per domain/mode) of the released "
                "vs the fine-tuned drafter; recommended K",
)
