"""`eval_offline` stage: offline acceptance of the released (baseline) and fine-tuned (candidate)
drafters on held-out windows.

Inputs: the target (its LM head and, to measure the draft cost, the model), the captured held-out
features (never trained on), the conversations (`scrub`: each row's domain and thinking mode), the
released drafter (`bootstrap_drafter`'s tensors, or the MTP layer inside the target when it was
skipped) and the fine-tuned one (`train`'s ``mtp-trained.safetensors``).
The held-out set: the built-in held-out split (`capture`'s ``features/heldout``), or, with
``heldout.files``, the user's own conversations (:mod:`drafter.data.heldout`) — read, scrubbed with
``cfg.scrub``'s rules, then captured here as the `capture` stage would (its settings, the same layers:
:func:`drafter.data.capture.capture_rows`) into ``heldout-features/`` inside the in-progress
directory, which is removed once the windows are loaded (a retry resumes from its finished shards).
The files' size + sha256 are part of the key. With an `answer_heldout` input (prompt-only files,
``heldout.benchmarks``: :mod:`drafter.data.heldout_answers`) its rows are captured so instead of the files, the
T=0 rule measured on the answers given at T=0 and the T=1 rules on those sampled at T=1; each benchmark is a
domain of its own, kept out of the overall figures (:func:`drafter.evaluation.offline.evaluate_with_benchmarks`).
Computes: each drafter unrolled ``k_max`` steps over every held-out window; α per draft position
under the three rules (T=0; T=1 with greedy and with probabilistic drafts), τ(K) for K = 1..k_max
from the chain products; bootstrap intervals over conversations; the same per domain and per mode;
the draft cost (one drafter step vs one target forward over the same tokens, this machine, unless
configured) and the K maximizing the expected speed τ(K) / (1 + K·cost).
With ``eagle3.enabled``: the released (``train.init`` or the bootstrap's) and fine-tuned EAGLE-3 heads, the
same way (fed the captured aux layers; each drafts over its own vocabulary, scattered to the target's).
With ``dspark.enabled``: the released and fine-tuned DSpark drafts at every eligible anchor (τ per
block at K = 1..block size, the same intervals, domains, modes and paired difference, cost of one
block pass) and each confidence head's calibration (ECE, ``reliability.png``).
Writes: ``eval_offline.json`` (see :func:`drafter.evaluation.offline.evaluate`; ``heldout`` records which
held-out set was used), ``eval_offline.md``, ``tau_vs_k.png``, ``acceptance_per_position.png``.
Reports: τ at every K per rule and drafter (``tau_<rule>_k<K>_<drafter>``), α per position, the
recommended K per drafter and its expected speedup, the draft cost.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.data.capture import capture_rows, load_target_model
from drafter.data.heldout import (SETTING as HELDOUT_SETTING, describe_builtin, fingerprint, record_truncation,
                                  user_heldout)
from drafter.data.heldout_answers import TEMPERATURES, heldout_record, load_answered
from drafter.core.config import ReleaseConfig
from drafter.core.files import iter_rows, list_shards
from drafter.core.errors import BadInputError, StageError
from drafter.evaluation.acceptance import window_block_alphas
from drafter.evaluation.calibration import plot_reliability, reliability
from drafter.evaluation.offline_result import save_eval_offline
from drafter.evaluation.offline import (HeldoutAlphas, concat_alphas, conversation_labels, evaluate_with_benchmarks,
                                        heldout_alphas, with_t1_text,
                                        measure_block_cost, measure_draft_cost, plot_acceptance_per_position,
                                        plot_tau_vs_k,
                                        render_markdown)
from drafter.models.dspark import DSPARK_DIR, capture_layers, load_dspark
from drafter.models.experts import set_experts
from drafter.training.run import target_embedding
from drafter.models import TRAINED_NAME, layout_for, load_drafter
from drafter.serving.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from drafter.core.hardware import device_label, resolve_device
from drafter.core.progress import progress
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.models.eagle3 import EAGLE3_DIR, load_eagle3
from drafter.release.baselines import baseline_weights, released_draft, released_head
from drafter.models.target import read_tensor, target_dir
from drafter.data.windows import load_windows


HELDOUT_FEATURES = "heldout-features"  # the held-out files captured: t0/, t1/ (removed once loaded)


@dataclass
class _Heldout:
    """The held-out windows: the built-in split's (`capture`'s), those captured here (``heldout.files``, the
    benchmarks: answered at T=0, or as written) and, with an `answer_heldout` input, the same sampled at T=1."""

    builtin: list
    captured: list
    captured_t1: list | None
    labels: dict
    info: dict
    target: object | None  # the target model when it was loaded and is needed again (the draft cost)

    @property
    def windows(self) -> list:
        return self.builtin + self.captured

    def alphas(self, measure) -> tuple[HeldoutAlphas, HeldoutAlphas | None]:
        """``measure(windows) → HeldoutAlphas`` of the T=0 set, and of the T=1 set (the built-in split's windows
        are measured once: they are in both)."""
        b = measure(self.builtin)
        t1 = concat_alphas(b, measure(self.captured_t1)) if self.captured_t1 is not None else None
        return concat_alphas(b, measure(self.captured)), t1


def _heldout(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path, min_tokens: int,
             feature_layers: list[int] | tuple[int, ...] = ()) -> _Heldout:
    """The built-in held-out split as `capture` stored it, or the user's ``heldout.files`` captured now; with an
    `answer_heldout` input, its rows (the files' and the benchmarks', answered at T=0 and at T=1) captured now."""
    c = cfg.eval_offline
    answered = inputs.get("answer_heldout")
    windows, labels, base = [], {}, None
    if not cfg.heldout.files:
        conv_dir = inputs["scrub"].path / "shards"
        if not list_shards(conv_dir):
            raise StageError(f"scrub output {conv_dir} has no shard-*.jsonl files (needed for domains and modes)")
        rows = list(iter_rows(conv_dir))
        windows = load_windows(inputs["capture"], "heldout", "all", c.window, min_tokens=min_tokens,
                               max_windows=c.max_windows, feature_layers=feature_layers)
        labels, base = conversation_labels(rows), describe_builtin(sum(r.get("split") == "heldout" for r in rows))
        if answered is None:
            return _Heldout(windows, [], None, labels, base, None)
    sets = {}
    if answered is not None:
        for t in TEMPERATURES:
            rows, record = load_answered(answered, t)
            sets[t] = rows if cfg.heldout.files else [r for r in rows if r.get("benchmark")]
        info = heldout_record(base, record)
    else:
        sets[0.0], info = user_heldout(cfg)
    model_dir = target_dir(inputs["prepare_target"])
    target = load_target_model(model_dir, device=resolve_device(c.device))
    got = {}
    for t, rows in sets.items():
        got[t], truncated = _capture(cfg, model_dir, target, rows, out / HELDOUT_FEATURES / f"t{t:g}", min_tokens,
                                     feature_layers, info, None if base else c.max_windows)
        if t == 0.0:
            info = record_truncation(info, truncated, cfg.capture.max_seq_len)  # what was cut, in the held-out record
    shutil.rmtree(out / HELDOUT_FEATURES)
    # the target stays loaded only when it is needed again (to measure the draft cost)
    return _Heldout(windows, got[0.0], got.get(1.0), labels | conversation_labels(sets[0.0]), info,
                    target if c.draft_cost is None else None)


def _capture(cfg: ReleaseConfig, model_dir: Path, target, rows: list[dict], features: Path, min_tokens: int,
             feature_layers, info: dict, max_windows: int | None) -> tuple[list, int]:
    """The windows of ``rows`` captured as the `capture` stage would (in ``features``, removed once loaded; the
    benchmarks' windows are not capped by max_windows: each is its own domain) and how many rows were cut."""
    cap = capture_rows(model_dir, rows, features, cfg.capture, what="eval_offline: capture the held-out files",
                       model=target, serving=cfg.serving)
    try:
        windows = load_windows(features, "heldout", "all", cfg.eval_offline.window, min_tokens=min_tokens,
                               max_windows=max_windows, feature_layers=feature_layers)
    except StageError as e:
        raise BadInputError(f"{HELDOUT_SETTING}: no conversation of the {info['text']} has a window of at least "
                            f"{min_tokens} tokens (capture.max_seq_len={cfg.capture.max_seq_len}); add longer "
                            "conversations or lower eval_offline.k_max") from e
    shutil.rmtree(features)
    return windows, cap.truncated


def _evaluate(cfg: ReleaseConfig, held: HeldoutAlphas, held_t1: HeldoutAlphas | None, labels: dict, draft_cost: float,
              measured: bool, block: bool = False) -> dict:
    """The eval_offline.json document (:func:`drafter.evaluation.offline.evaluate`), each benchmark measured apart;
    with ``held_t1`` (the answered conversations sampled at T=1) the T=1 rules measured on it."""
    c = cfg.eval_offline
    kw = {"draft_cost": draft_cost, "draft_cost_measured": measured, "samples": c.bootstrap_samples, "seed": c.seed,
          "confidence": c.confidence, "speed_rule": c.speed_rule, "block": block}
    res = evaluate_with_benchmarks(held, labels, list(cfg.heldout.benchmarks), **kw)
    if held_t1 is None:
        return res
    return with_t1_text(res, evaluate_with_benchmarks(held_t1, labels, list(cfg.heldout.benchmarks), **kw))


def _run_dspark(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path, t_start: float) -> Metrics:
    """The block-drafting evaluation: both DSpark drafts at every eligible anchor (block of
    ``dspark.block_size``), the same intervals, domains, modes and paired difference, plus each
    confidence head's calibration (reliability bins, ECE, ``reliability.png``)."""
    c = cfg.eval_offline
    model_dir = target_dir(inputs["prepare_target"])
    candidate = inputs["train"].path / DSPARK_DIR
    if not (candidate / "config.json").is_file():
        raise StageError(f"train output {inputs['train'].path} has no {DSPARK_DIR}/ (the fine-tuned DSpark draft)")
    drafts = {}
    for name, folder in (("baseline", released_draft(cfg, inputs)), ("candidate", candidate)):
        try:
            drafts[name] = load_dspark(folder).eval()
        except (OSError, ValueError) as e:
            raise StageError(f"the {name} DSpark draft {folder}: {e}") from e
    K = drafts["candidate"].cfg.block_size
    device = resolve_device(c.device)
    drafts = {name: d.to(device) for name, d in drafts.items()}
    head = read_tensor(model_dir, "lm_head.weight", torch.float32).to(device)
    embed = target_embedding(model_dir).to(device)
    hs = _heldout(cfg, inputs, out, K + 2, capture_layers(drafts["candidate"].cfg))
    windows, labels, heldout, target = hs.windows, hs.labels, hs.info, hs.target
    conf = {n: ([], []) for n, d in drafts.items() if d.confidence_head is not None}

    def alphas_fn(win):
        res = {}
        for name, d in drafts.items():
            alphas, confidence = window_block_alphas(d, embed, head, win)
            res[name] = alphas
            if confidence is not None:
                conf[name][0].append(confidence)
                conf[name][1].append(alphas["t0"])
        return res

    with progress("eval_offline", total=len(windows) + len(hs.captured_t1 or []), unit="windows") as bar:
        held, held_t1 = hs.alphas(lambda ws: heldout_alphas(drafts, head, ws, K, on_window=bar.advance,
                                                            alphas_fn=alphas_fn))
    if held.positions == 0:
        raise StageError(f"{heldout['text']}: no held-out anchor has a block of {K} assistant tokens "
                         "after it (capture longer conversations)")
    eval_seconds = time.monotonic() - t_start
    cost = None
    if c.draft_cost is None:
        target = target if target is not None else load_target_model(model_dir, device=device)
        longest = max(windows, key=lambda w: len(w.input_ids))
        cost = measure_block_cost(target, drafts["candidate"], embed, head, longest, repeats=c.cost_repeats)
    del target
    draft_cost = cost["ratio"] if cost else c.draft_cost
    res = _evaluate(cfg, held, held_t1, labels, draft_cost, cost is not None, block=True)
    res |= {"windows": len(windows), "heldout": heldout, "device": device_label(device)}
    if cost:
        res["draft_cost_timing"] = cost
    calibration = {n: reliability(torch.cat(cs), torch.cat(ys)) for n, (cs, ys) in conf.items() if cs}
    res["calibration"] = calibration
    save_eval_offline(out, res)
    md = render_markdown(res)
    if calibration:
        md += "\n### Confidence head calibration (held-out, outcome: accepted at T=0)\n\n| drafter | ECE | mean confidence | accepted |\n|---|---|---|---|\n"
        md += "".join(f"| {n} | {r['ece']:.4f} | {r['mean_confidence']:.3f} | {r['mean_outcome']:.3f} |\n"
                      for n, r in calibration.items())
        plot_reliability(calibration["candidate"] if "candidate" in calibration else next(iter(calibration.values())),
                         out / "reliability.png", "confidence head (fine-tuned), held-out")
    (out / "eval_offline.md").write_text(md)
    plot_tau_vs_k(res, out / "tau_vs_k.png")
    plot_acceptance_per_position(res, out / "acceptance_per_position.png")
    metrics = _metrics(res, len(windows), held.positions, draft_cost, cost is not None)
    metrics["drafting"] = "block"
    metrics["block_size"] = K
    for name, r in calibration.items():
        metrics[f"ece_{name}"] = round(r["ece"], 4)
    d = res["difference"]
    for rule in ("t0", "t1_greedy", "t1_prob"):
        metrics[f"tau_{rule}_k{K}_difference"] = round(d[rule]["tau_by_k"][K - 1], 4)
        metrics[f"tau_{rule}_k{K}_difference_ci"] = [round(x, 4) for x in d[rule]["tau_ci"][K - 1]]
        for name in drafts:
            metrics[f"tau_{rule}_k{K}_{name}_ci"] = [round(x, 4) for x in res["drafters"][name][rule]["tau_ci"][K - 1]]
    metrics["seconds_eval"] = round(eval_seconds, 1)
    metrics["seconds"] = round(time.monotonic() - t_start, 1)
    return metrics


def _metrics(res: dict, windows: int, positions: int, draft_cost: float, measured: bool) -> Metrics:
    metrics: Metrics = {"windows": windows, "positions": positions, "conversations": res["conversations"],
                        "heldout": res["heldout"]["source"], "heldout_conversations": res["heldout"]["conversations"],
                        "draft_cost": round(draft_cost, 4), "draft_cost_measured": measured}
    for name, d in res["drafters"].items():
        for rule, s in d.items():
            for k, t in enumerate(s["tau_by_k"], start=1):
                metrics[f"tau_{rule}_k{k}_{name}"] = round(t, 4)
        metrics[f"alpha_t0_{name}"] = [round(a, 3) for a in d["t0"]["alpha"]]
        k = res["recommended_k"][name]
        metrics[f"recommended_k_{name}"] = k
        metrics[f"expected_speedup_{name}"] = round(res["expected_speedup"][name][k - 1], 4)
    return metrics


def _mtp_drafters(cfg: ReleaseConfig, inputs: dict[str, Artifact], model_dir: Path, device, head: torch.Tensor):
    """The released and fine-tuned MTP layers (the candidate over its draft vocabulary when it has one), the
    draft vocabulary's size, and the feature layers they read (none: the LM-head input)."""
    candidate = inputs["train"].path / TRAINED_NAME
    if not candidate.is_file():
        raise StageError(f"train output {inputs['train'].path} has no {TRAINED_NAME} (the fine-tuned drafter)")
    layout = layout_for(model_dir)
    drafters = {"baseline": load_drafter(model_dir, layout, weights=baseline_weights(cfg, inputs)).to(device),
                "candidate": load_drafter(model_dir, layout, weights=candidate).to(device)}
    for d in drafters.values():
        set_experts(d, cfg.eval_offline.experts)
    vocab_file = inputs["train"].path / DRAFT_VOCAB_FILE
    draft_vocab = None
    if vocab_file.is_file():  # the fine-tuned drafter is served over its draft vocabulary: measured so here too
        ids = load_draft_vocab(vocab_file, head.shape[0])
        drafters["candidate"].draft_vocab_ids = ids.to(device)
        draft_vocab = int(ids.numel())
    return drafters, {"candidate": draft_vocab, "baseline": None}, ()


def _eagle3_drafters(cfg: ReleaseConfig, inputs: dict[str, Artifact], model_dir: Path, device, head: torch.Tensor):
    """The released and fine-tuned EAGLE-3 heads (each over its own draft vocabulary), those vocabularies'
    sizes, and the aux layers they read (the same for both: the fine-tune starts from the release)."""
    embed = read_tensor(model_dir, "model.embed_tokens.weight", torch.float32)
    candidate = inputs["train"].path / EAGLE3_DIR
    drafters = {}
    for name, folder in (("baseline", released_head(cfg, inputs)), ("candidate", candidate)):
        try:
            drafters[name] = load_eagle3(folder, embed_tokens=embed)[0].eval().to(device)
        except (OSError, ValueError) as e:
            raise StageError(f"the {name} EAGLE-3 head {folder}: {e}") from e
    layers = {n: list(d.cfg.aux_layer_ids) for n, d in drafters.items()}
    if layers["baseline"] != layers["candidate"]:
        raise StageError(f"the released and fine-tuned EAGLE-3 heads read different aux layers ({layers}): "
                         "one held-out capture cannot feed both")
    sizes = {n: d.cfg.draft_vocab_size for n, d in drafters.items()}
    return drafters, sizes, layers["candidate"]


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    c = cfg.eval_offline
    t_start = time.monotonic()
    if cfg.dspark.enabled:
        return _run_dspark(cfg, inputs, out, t_start)
    model_dir = target_dir(inputs["prepare_target"])
    device = resolve_device(c.device)
    head = read_tensor(model_dir, "lm_head.weight", torch.float32).to(device)
    loader = _eagle3_drafters if cfg.eagle3.enabled else _mtp_drafters
    drafters, draft_vocab, layers = loader(cfg, inputs, model_dir, device, head)
    hs = _heldout(cfg, inputs, out, c.k_max + 2, layers)
    windows, labels, heldout, target = hs.windows, hs.labels, hs.info, hs.target

    with progress("eval_offline", total=len(windows) + len(hs.captured_t1 or []), unit="windows") as bar:
        held, held_t1 = hs.alphas(lambda ws: heldout_alphas(drafters, head, ws, c.k_max, on_window=bar.advance))
    if held.positions == 0:
        raise StageError(f"{heldout['text']}: no held-out position has {c.k_max} assistant tokens "
                         f"after it (lower eval_offline.k_max or capture longer conversations)")
    eval_seconds = time.monotonic() - t_start

    cost = None
    if c.draft_cost is None:
        target = target if target is not None else load_target_model(model_dir, device=device)
        longest = max(windows, key=lambda w: len(w.input_ids))
        cost = measure_draft_cost(target, drafters["candidate"], longest, repeats=c.cost_repeats)
    del target
    draft_cost = cost["ratio"] if cost else c.draft_cost

    res = _evaluate(cfg, held, held_t1, labels, draft_cost, cost is not None)
    res |= {"windows": len(windows), "heldout": heldout, "device": device_label(device)}
    res["draft_vocab"] = draft_vocab
    if cost:
        res["draft_cost_timing"] = cost
    save_eval_offline(out, res)
    (out / "eval_offline.md").write_text(render_markdown(res))
    plot_tau_vs_k(res, out / "tau_vs_k.png")
    plot_acceptance_per_position(res, out / "acceptance_per_position.png")

    metrics = _metrics(res, len(windows), held.positions, draft_cost, cost is not None)
    metrics["seconds_eval"] = round(eval_seconds, 1)
    metrics["seconds"] = round(time.monotonic() - t_start, 1)
    return metrics


STAGE = Stage(
    name="eval_offline",
    version="3",  # 2: the held-out set recorded (`heldout`); heldout.files (the user's, captured here);
                  # 3: the fine-tuned drafter measured over its draft vocabulary (train.draft_vocab_size)
    # answer_heldout: only when it is planned (held-out conversations without answers, heldout.benchmarks)
    inputs=("prepare_target", "scrub", "answer_heldout", "capture", "bootstrap_drafter", "train"),
    # capture: the settings the user's held-out files are captured with; scrub: the rules they are scrubbed with
    sections=("eval_offline", "heldout", "baseline", "dspark", "capture", "scrub", "eagle3"),
    run=run,
    fingerprint=fingerprint,
    description="Offline acceptance (τ vs K, α per position, bootstrap CIs, per domain/mode) of the released "
                "vs the fine-tuned drafter; recommended K",
)
