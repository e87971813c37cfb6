"""The model card's sections, each read from a stage's output (:func:`drafter.release.card.card_context` assembles
them): display strings at the precision the card shows and, under ``"raw"``, the values unformatted. A stage that is
absent or was skipped gives ``"not measured: <why>"``.

Example::

    gate = gate_section(inputs)     # {"ok", "verdict", "forced", "checks", ...} or {"ok": False, "reason"}
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from drafter.core.hardware import summary as hw_summary
from drafter.core.stage import Artifact
from drafter.evaluation.ab_live import (NO_ENTRY, AbLiveResult, benchmark_markdown, compile_mode, primary,
                                        summary_of, temperatures)
from drafter.evaluation.ab_live.sweep import SCHEDULE, drafter_order, sweep_k
from drafter.evaluation.gate import GateResult, offline_rule
from drafter.evaluation.offline_result import OfflineResult
from drafter.core.results import ResultFile
from drafter.data.reports import CaptureReport, GenerateSummary, ScrubReport
from drafter.quant.layout import FP8_DIR, FP8ReleaseInfo
from drafter.release.redact import redact_local

NOT_MEASURED = "not measured"
# licenses of targets the pipeline builds itself (prepare_target does not record one)
EMBEDDED_LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0"}
RULES = {"t0": "T=0 (greedy target)", "t1_greedy": "T=1, greedy drafts (vLLM default)",
         "t1_prob": "T=1, probabilistic drafts"}


def stage_reason(inputs: dict[str, Artifact], stage: str) -> str | None:
    """None when ``stage`` finished; else why its numbers are missing (``not measured: …``)."""
    a = inputs.get(stage)
    if a is None:
        return f"{NOT_MEASURED}: the {stage} stage did not run for this release"
    if a.status == "skipped":
        return f"{NOT_MEASURED}: {stage} was skipped ({redact_local(a.manifest.get('reason') or 'no reason recorded')})"
    return None


def read_json(inputs: dict[str, Artifact], stage: str, name: str) -> tuple[dict | None, str | None]:
    """(the stage's json ``name``, None) or (None, why not)."""
    why = stage_reason(inputs, stage)
    if why:
        return None, why
    p = Path(inputs[stage].path) / name
    if not p.is_file():
        return None, f"{NOT_MEASURED}: the {stage} output has no {name}"
    return json.loads(p.read_text()), None


def read_result(inputs: dict[str, Artifact], stage: str, model: type[ResultFile]) -> tuple[Any, str | None]:
    """(the stage's result file as ``model``, None) or (None, why not)."""
    why = stage_reason(inputs, stage)
    if why:
        return None, why
    if not model.exists(inputs[stage].path):
        return None, f"{NOT_MEASURED}: the {stage} output has no {model.NAME}"
    return model.load(inputs[stage].path), None


def f3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def f2(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def ci(pair) -> str:
    return f"[{pair[0]:.3f}, {pair[1]:.3f}]"


def sci(x: float) -> str:
    return f"{x:.2e}"


def _stage_config(inputs: dict[str, Artifact], stage: str, section: str, cfg) -> dict:
    """The config section the stage ran with (its manifest), else the current config's."""
    a = inputs.get(stage)
    if a is not None and section in (a.manifest.get("config") or {}):
        return a.manifest["config"][section]
    return getattr(cfg, section).key_dump()


def _baseline_name(cfg, inputs) -> str:
    """``released``, or ``champion <release id>`` when the run compared with an earlier release (a retrain)."""
    b = _stage_config(inputs, "eval_offline", "baseline", cfg)
    if not b.get("weights"):
        return "released"
    return f"champion {b.get('release_id') or str(b.get('sha256'))[:16]}"


# ---------------------------------------------------------------------------


def target_section(cfg, inputs) -> dict:
    from drafter.models.target import TARGET_JSON  # torch: imported when a card is built, not with this module

    info, why = read_json(inputs, "prepare_target", TARGET_JSON)
    info = info or {}
    pt = cfg.prepare_target
    name = info.get("name") or pt.hub_id or (Path(pt.path).name if pt.path else "target")
    base_model = pt.hub_id if pt.source == "hub" and pt.hub_id else info.get("name") if info.get("source") == "embedded" else None
    license_ = cfg.publish.license or info.get("license") or EMBEDDED_LICENSES.get(name) or "other"
    source = info.get("source", pt.source)
    if source == "embedded" and info.get("architecture") == "llama":
        how = (f"built by the pipeline's `prepare_target` stage: {name} ({redact_local(str(info.get('revision')))}) "
               "written as the Llama it is (no MTP layer)")
    elif source == "embedded":
        how = (f"built by the pipeline's `prepare_target` stage: {name} ({redact_local(str(info.get('revision')))}) "
               "re-expressed, weights unchanged, as GLM-4-MoE with one MTP layer")
    elif source == "hub":
        how = f"`hf download {pt.hub_id} --revision {info.get('revision') or pt.revision}`"
    else:
        how = f"the local checkpoint the release was built from (revision {redact_local(str(info.get('revision')))})"
    return {"name": name, "short": name.rsplit("/", 1)[-1], "base_model": base_model, "license": license_,
            "source": source, "architecture": info.get("architecture"),
            "revision": redact_local(str(info.get("revision"))) if info else why,
            "chat_template_sha256": info.get("chat_template_sha256") or why or "none",
            "how": how, "missing": why}


def served_k(cfg, ab: AbLiveResult | None) -> int:
    return int(ab.num_speculative_tokens) if ab else cfg.ab_live.num_speculative_tokens


def _offline_tables(ev: OfflineResult, k: int, rules: list[str]) -> dict:
    """The offline τ at the served K per rule (released, fine-tuned, difference), τ by K, τ by domain."""
    d, diff, k_max = ev.drafters, ev.difference, ev.k_max
    served = []
    if 1 <= k <= k_max:
        for r in rules:
            b, c = d["baseline"][r], d["candidate"][r]
            dd = diff.get(r)
            served.append({"rule": RULES[r], "released": f3(b.tau_by_k[k - 1]), "released_ci": ci(b.tau_ci[k - 1]),
                           "finetuned": f3(c.tau_by_k[k - 1]), "finetuned_ci": ci(c.tau_ci[k - 1]),
                           "delta": f"{dd.tau_by_k[k - 1]:+.3f}" if dd else "—",
                           "delta_ci": ci(dd.tau_ci[k - 1]) if dd else "—"})
    by_k = []
    for kk in range(1, k_max + 1):
        row = {"k": kk}
        for r in rules:
            row[r] = (f3(d["baseline"][r].tau_by_k[kk - 1]), f3(d["candidate"][r].tau_by_k[kk - 1]))
        by_k.append(row)
    domains = []
    kk = min(max(k, 1), k_max)
    for dom, g in sorted(d["candidate"]["t0"].by_domain.items()):
        row = {"domain": dom, "conversations": g.conversations, "positions": g.positions}
        for r in rules:
            bd, cd = d["baseline"][r].by_domain.get(dom), d["candidate"][r].by_domain.get(dom)
            row[r] = (f3(bd.tau_by_k[kk - 1]) if bd else "—", f3(cd.tau_by_k[kk - 1]) if cd else "—")
        domains.append(row)
    return {"served": served, "by_k": by_k, "domains": domains, "domain_k": kk}


def benchmark_table(ev: OfflineResult, k: int, rules: list[str]) -> dict | None:
    """τ per benchmark (``heldout.benchmarks``, each a domain of the held-out set) at the served K (else k_max),
    released and fine-tuned with intervals, τ(K) of the fine-tuned drafter for K = 1..k_max, and the mean over
    the benchmarks; None when no benchmark was measured."""
    marks = ev.heldout.benchmarks if ev.heldout else []
    d, kk = ev.drafters, min(max(k, 1), ev.k_max)
    rows, means = [], {r: ([], []) for r in rules}
    for b in marks:
        row = {"name": b["name"], "title": b["title"], "hub_dataset": b["hub_dataset"], "license": b["license"],
               "package": b["package"], "prompts": b["prompts"], "measured": False}
        g = {r: (d["baseline"][r].by_domain.get(b["name"]), d["candidate"][r].by_domain.get(b["name"])) for r in rules}
        if all(bg is not None and cg is not None for bg, cg in g.values()):
            row |= {"measured": True, "conversations": g["t0"][1].conversations, "positions": g["t0"][1].positions,
                    "by_k": ", ".join(f3(t) for t in g["t0"][1].tau_by_k)}
            for r, (bg, cg) in g.items():
                row[r] = (f3(bg.tau_by_k[kk - 1]), ci(bg.tau_ci[kk - 1]), f3(cg.tau_by_k[kk - 1]), ci(cg.tau_ci[kk - 1]))
                means[r][0].append(bg.tau_by_k[kk - 1])
                means[r][1].append(cg.tau_by_k[kk - 1])
        rows.append(row)
    if not rows:
        return None
    mean = {r: (f3(sum(b) / len(b)), f3(sum(c) / len(c))) for r, (b, c) in means.items() if c}
    return {"k": kk, "rows": rows, "mean": mean, "mean_of": sum(r["measured"] for r in rows)}


def offline_section(cfg, inputs, k: int, ev: OfflineResult | None, why: str | None) -> dict:
    if ev is None:
        return {"ok": False, "reason": why}
    k_max = ev.k_max
    heldout = ev.heldout
    out: dict[str, Any] = {"ok": True, "k": k, "k_max": k_max, "confidence": ev.confidence,
                           "baseline_name": _baseline_name(cfg, inputs),
                           # outputs from before the record: the built-in split (the only set there was)
                           "heldout": (heldout.text if heldout else None) or "built-in held-out split",
                           "heldout_files": [f["name"] for f in heldout.files] if heldout else [],
                           "windows": ev.windows, "positions": ev.positions,
                           "conversations": ev.conversations, "bootstrap_samples": ev.bootstrap_samples,
                           "bootstrap_unit": ev.bootstrap_unit,
                           "k_in_range": 1 <= k <= k_max,
                           "reason_k": None if 1 <= k <= k_max else
                           f"{NOT_MEASURED}: the served K={k} is beyond eval_offline.k_max={k_max}"}
    rules = [r for r in RULES if r in ev.drafters["candidate"]]
    out |= {"rules": [(r, RULES[r]) for r in rules], **_offline_tables(ev, k, rules),
            "benchmarks": benchmark_table(ev, k, rules),
            "recommended_k": ev.recommended_k, "draft_cost": f3(ev.draft_cost),
            "draft_cost_measured": ev.draft_cost_measured, "raw": ev.raw}
    return out


def _drafter_label(drafter: str, names: dict[str, str]) -> str:
    """A server's drafter in the card: the sweep's ``candidate-k<K>`` as ``fine-tuned, K=<K>``, the schedule's."""
    if drafter in names:
        return names[drafter]
    if drafter == SCHEDULE:
        return "schedule (released configuration)"
    k = sweep_k(drafter, 0)
    return f"fine-tuned, K={k}" if k else drafter


def _live_rows(cfg, inputs, summ: dict) -> list[dict]:
    names = {"none": "no speculation", "baseline": _baseline_name(cfg, inputs), "candidate": "fine-tuned"}
    rows = []
    for key in sorted(summ, key=lambda x: (x[0], x[3], drafter_order(x[1]), x[2])):
        t, drafter, method, c = key
        s = summ[key]
        none = summ.get((t, "none", "none", c), NO_ENTRY).tok_s
        rows.append({"temperature": f"{t:g}", "drafter": _drafter_label(drafter, names),
                     "method": "—" if method == "none" else method, "users": c,
                     "tau": f3(s.tau), "tok_s": f2(s.tok_s), "speedup": f2(s.tok_s / none if none else None),
                     "decode_tok_s": f2(s.decode_tok_s), "ttft_s": f3(s.ttft_mean_s),
                     "p50_s": f3(s.latency_p50_s), "rounds": s.rounds})
    return rows


def _platform(inputs) -> str | None:
    """The engine's device (``device_config`` in the first server log that says it)."""
    logs = Path(inputs["ab_live"].path) / "logs"
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        m = re.search(r"device_config=(\w+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
    return None


def _live_ratio(ab: AbLiveResult, summ: dict, ev: OfflineResult | None, k_max: int | None) -> dict | None:
    """Live τ over the offline prediction at the live K and the matching rule, at the primary measurement."""
    t0, m0 = primary(ab)
    c_min = min((key[3] for key in summ), default=None)
    live_tau = summ.get((t0, "candidate", m0, c_min), NO_ENTRY).tau
    rule = offline_rule(t0, m0)
    k = ab.num_speculative_tokens
    if ev is None or live_tau is None or not (1 <= k <= k_max):
        return None
    off = ev.drafters["candidate"][rule].tau_by_k[k - 1]
    return {"live": f3(live_tau), "offline": f3(off), "ratio": f3(live_tau / off), "rule": RULES[rule], "k": k,
            "temperature": f"{t0:g}", "method": m0}


def live_section(cfg, inputs, ab: AbLiveResult | None, why: str | None, ev: OfflineResult | None) -> dict:
    if ab is None:
        return {"ok": False, "reason": why}
    summ = summary_of(ab)
    serving = _stage_config(inputs, "ab_live", "serving", cfg)
    ab_cfg = _stage_config(inputs, "ab_live", "ab_live", cfg)
    # an ab_live.json without ``compiled`` (older outputs) ran as serving.enforce_eager said
    compiled = ab.compiled if "compiled" in ab.model_fields_set else not serving.get("enforce_eager")
    args = ["--dtype", serving["dtype"], "--max-model-len", str(serving["max_model_len"])]
    if not compiled:
        args.append("--enforce-eager")
    args += [redact_local(a) for a in ab.server_args or []]
    platform = _platform(inputs)
    k = ab.num_speculative_tokens
    ratio = _live_ratio(ab, summ, ev, ev.k_max if ev is not None else None)
    lossless, replay = ab.lossless, ab.replay
    return {"ok": True, "rows": _live_rows(cfg, inputs, summ), "k": k, "method": ab.method,
            "temperatures": [f"{t:g}" for t in temperatures(ab)],
            "engine_version": ab.engine_version or f"{NOT_MEASURED}: ab_live recorded no engine version",
            "compiled": compiled, "eager": compile_mode(compiled),
            "server_args": shlex.join(args), "args_list": args, "rounds": ab_cfg.get("rounds"),
            "hardware": (hw_summary(ab.hardware) + (f", vLLM device `{platform}`" if platform else "")) if ab.hardware
            else f"vLLM device `{platform}` (the engine's device_config in the server log; the machine is not recorded)" if platform
            else f"{NOT_MEASURED}: ab_live recorded no hardware",
            "turns": replay.turns, "replay_domains": ", ".join(replay.domains),
            "heldout": (replay.heldout.text if replay.heldout else None) or "built-in held-out split",
            "max_tokens": replay.max_tokens, "notes": [redact_local(n) for n in replay.notes],
            "lossless": (f"{lossless.identical}/{lossless.prompts} prompts identical at T=0 with and without "
                         f"speculation" if lossless else f"{NOT_MEASURED}: ab_live.lossless_prompts is 0"),
            "unsupported": {m: redact_local(r) for m, r in (ab.unsupported or {}).items()},
            "ratio": ratio, "ratio_reason": None if ratio else f"{NOT_MEASURED}: needs both live and offline τ at K={k}",
            "benchmarks": benchmark_markdown(ab, _benchmark_titles()).rstrip("\n"),
            "raw": {k2: v for k2, v in ab.raw.items() if k2 not in ("runs", "servers")}}


def _benchmark_titles() -> dict[str, str]:
    from drafter.data.benchmarks import BENCHMARKS

    return {n: b.title for n, b in BENCHMARKS.items()}


def _fp8(inputs) -> dict:
    """The FP8 drop-in's error report (``fp8/fp8-error.json``), the release it matches and the self-check."""
    from drafter.quant.dropin import ERROR_NAME  # torch: imported when a card is built, not with this module
    from drafter.quant.verify import VerifyResult

    err, why = read_json(inputs, "quantize_fp8", f"{FP8_DIR}/{ERROR_NAME}")
    if err is None:
        fp8: dict[str, Any] = {"ok": False, "reason": why}
    else:
        s = err["summary"]
        rels = [t["fp8_rel_error"] for t in err["tensors"].values() if t.get("fp8_rel_error") is not None]
        fp8 = {"ok": True, "rule": s["rule"], "block": "×".join(map(str, s["block"])), "tensors": s["tensors"],
               "fp8_tensors": s["fp8_tensors"], "kept": s["kept_tensors"], "cast": s["cast_tensors"],
               "max_rel": sci(s["max_fp8_rel_error"]), "max_rel_tensor": s["max_fp8_rel_error_tensor"],
               "mean_rel": sci(sum(rels) / len(rels)) if rels else "—", "moved": sci(s["max_moved_rel"]),
               "raw": {"summary": s, "mean_fp8_rel_error": sum(rels) / len(rels) if rels else None}}
        rel, _ = read_result(inputs, "quantize_fp8", FP8ReleaseInfo)
        fp8["release"] = rel.source if rel else "unknown"
    ver, vwhy = read_result(inputs, "verify_fp8", VerifyResult)
    if ver is None:
        fp8["verify"] = {"ok": False, "reason": vwhy}
    else:
        t, d = ver.self_check.totals, ver.dropin
        fp8["verify"] = {"ok": True, "identical": t.identical, "edge": t.edge, "differ": t.differ,
                         "total": t.total, "dropin_ok": d.ok if d else None,
                         "kept_equal": d.kept_hash_equal if d else None, "kept": d.kept if d else None,
                         "vllm_load": redact_local(str(ver.vllm_load))}
    return fp8


def quant_section(inputs) -> dict:
    fp8 = _fp8(inputs)
    exl3: dict[str, Any]
    why = stage_reason(inputs, "quantize_exl3")
    if why:
        exl3 = {"ok": False, "reason": why.replace(NOT_MEASURED, "not produced", 1)}
    else:
        m = inputs["quantize_exl3"].metrics
        exl3 = {"ok": True, "bits": m.get("bits"), "head_bits": m.get("head_bits"),
                "mean_rel": sci(m["mean_rel_error"]) if m.get("mean_rel_error") is not None else "—",
                "max_rel": sci(m["max_rel_error"]) if m.get("max_rel_error") is not None else "—",
                "size_mb": m.get("size_mb"), "exllamav3": m.get("exllamav3"), "raw": m}
    return {"fp8": fp8, "exl3": exl3}


def training_section(cfg, inputs, kind: str = "mtp") -> dict:
    from drafter.training.run import TrainResult  # torch: imported when a card is built, not with this module

    res, why = read_result(inputs, "train", TrainResult)
    if res is None:
        return {"ok": False, "reason": why}
    tc = _stage_config(inputs, "train", "train", cfg)
    boot = stage_reason(inputs, "bootstrap_drafter")
    if kind == "dspark":
        dc = _stage_config(inputs, "train", "dspark", cfg)
        init = ("the released DSpark draft: the `bootstrap_drafter` stage's (demo stand-in: a seeded random "
                "initialization trained with CE on the other half of the data)" if not dc.get("released")
                else f"the released DSpark draft `{redact_local(str(dc['released']))}`")
    elif kind == "eagle3":
        bc = _stage_config(inputs, "bootstrap_drafter", "bootstrap_drafter", cfg)
        init = (f"the released EAGLE-3 head `{redact_local(str(tc['init']))}`" if tc.get("init") else
                "the released EAGLE-3 head: the `bootstrap_drafter` stage's (demo stand-in: a head trained from scratch "
                f"with the `{bc.get('loss')}` loss, training-time test over K={bc.get('k_steps')}, on the "
                f"{bc.get('data_part')} part of the data)")
    else:
        init = ("the released drafter: the `bootstrap_drafter` stage's MTP layer (demo stand-in, next-next-token CE)"
                if boot is None else "the released drafter inside the target checkpoint")
    data, data_reasons = _training_data(inputs)
    world = res.world_size
    loss_params = {"lk_hybrid": f"η={tc.get('eta')}", "ce_l1": f"ce_w={tc.get('ce_w')}"}.get(tc["loss"], "")
    return {"ok": True, "init": init, "frozen": ", ".join(f"`{p}`" for p in tc["freeze"]),
            "trainable": res.trainable, "frozen_params": res.frozen, "loss": tc["loss"],
            "loss_params": ", ".join(x for x in (loss_params, f"position weights exp(−k/γ), γ={tc.get('gamma')}") if x),
            "steps": tc["max_steps"], "lr": tc["lr"], "warmup": tc["warmup_steps"], "micro_batch": tc["micro_batch"],
            "grad_accum": tc["grad_accum"], "world_size": world,
            "batch": tc["micro_batch"] * tc["grad_accum"] * world, "window": tc["window"], "k": tc["k_steps"],
            "dtype": _train_dtype(tc["dtype"], res.dtype), "tokens": res.tokens, "windows": res.train_windows,
            "seconds": f"{res.seconds:.1f}", "tokens_per_s": f"{res.tokens_per_s:.1f}",
            "hardware": (f"{world} process(es) on {hw_summary(res.hardware)}"
                         + (f", training device `{res.device}`" if res.device else "")) if res.hardware
            else f"{world} process(es); device {NOT_MEASURED}: the train stage records none",
            "data": data, "data_reasons": data_reasons, "draft_vocab": res.draft_vocab,
            "tau_before": f3(res.baseline.t0.tau), "tau_after": f3(res.final.t0.tau),
            "raw": {k: v for k, v in res.raw.items() if k != "weights_in"}}


def _train_dtype(setting: str, used: str | None) -> str:
    """The compute dtype on the card: what the run used (``result.json`` ``dtype``), ``auto`` said as resolved."""
    if used is None:
        return setting
    return f"{used} (train.dtype auto)" if setting == "auto" else used


def _training_data(inputs) -> tuple[dict, dict]:
    """What the drafter was trained on (generate, scrub, capture), and why a part is missing."""
    gen, gwhy = read_result(inputs, "generate", GenerateSummary)
    scrub, swhy = read_result(inputs, "scrub", ScrubReport)
    cap, cwhy = read_result(inputs, "capture", CaptureReport)
    data = {"generate": None, "scrub": None, "capture": None}
    if gen:
        data["generate"] = {"rows": gen.rows, "train_rows": gen.train_rows, "heldout_rows": gen.heldout_rows,
                            "domains": ", ".join(f"{k} {v}" for k, v in sorted(gen.domains.items())),
                            "engine": f"{gen.engine} {gen.engine_version or ''}".strip(),
                            "sampling": ", ".join(f"{k}={v}" for k, v in sorted(gen.sampling.items())),
                            "tokens": gen.tokens_generated}
    if scrub:
        data["scrub"] = {"rows_changed": scrub.rows_changed, "rows": scrub.rows,
                         "kinds": ", ".join(f"{k} {v}" for k, v in sorted(scrub.counts.items()))}
    if cap:
        data["capture"] = {"train_tokens": cap.split("train", "tokens"), "heldout_tokens": cap.split("heldout", "tokens"),
                           "train_sequences": cap.split("train", "sequences")}
    return data, {"generate": gwhy, "scrub": swhy, "capture": cwhy}


def gate_section(inputs) -> dict:
    g, why = read_result(inputs, "gate", GateResult)
    if g is None:
        return {"ok": False, "reason": why, "forced": False}

    def num(v) -> str:  # a check without live evidence has no value or threshold
        return "—" if v is None else f"{v:.4g}"

    checks = [{"name": c.name, "passed": "pass" if c.passed else "FAIL", "value": num(c.value),
               "threshold": num(c.threshold), "detail": redact_local(c.detail)} for c in g.checks]
    return {"ok": True, "verdict": g.verdict, "forced": bool(g.forced), "failed": g.failed,
            "checks": checks, "tolerances": g.tolerances, "raw": g.raw}


def dspark_section(cfg, inputs, ev: OfflineResult | None) -> dict:
    """The DSpark draft's shape and its confidence heads' calibration (eval_offline)."""
    dc = _stage_config(inputs, "train", "dspark", cfg)
    cal = ev.calibration if ev is not None else {}
    names = {"baseline": _baseline_name(cfg, inputs), "candidate": "fine-tuned"}
    return {"block_size": dc["block_size"], "markov_rank": dc["markov_rank"], "layers": dc["num_hidden_layers"],
            "target_layer_ids": dc["target_layer_ids"], "anchors": dc["anchors"], "confidence_head": dc["confidence_head"],
            "confidence_w": dc["confidence_w"],
            "calibration": [{"drafter": names.get(n, n), "ece": f"{r.ece:.4f}" if r.ece is not None else "—",
                             "mean_confidence": f3(r.mean_confidence), "accepted": f3(r.mean_outcome), "n": r.n}
                            for n, r in cal.items()],
            "recalibration": _recalibration(inputs)}


def _recalibration(inputs) -> str | None:
    """One line on the fine-tuned confidence head's Platt scaling (train stage metrics), or None (not done)."""
    art = inputs.get("train")
    m = (art.metrics if art is not None else None) or {}
    if m.get("calibration_skipped"):
        return f"The fine-tuned confidence head was not recalibrated: {m['calibration_skipped']}."
    if m.get("calibration_a") is None:
        return None
    return (f"After training, the fine-tuned confidence head was Platt-scaled (σ(a·logit c + b), a = {m['calibration_a']}, "
            f"b = {m['calibration_b']}, folded into `confidence_head.proj`) on {m['calibration_windows']} windows of the "
            f"fine-tune's data set aside from training: their ECE {m['calibration_ece_before']} → "
            f"{m['calibration_ece_after']}.")


def eagle3_section(cfg, inputs, ev: OfflineResult | None) -> dict:
    """The fine-tuned EAGLE-3 head as its ``config.json`` in the train output describes it (aux layers, draft
    vocabulary, layer shape, layout, the verifier and K its speculators config names) and the draft vocabulary
    each head was measured over (``eval_offline``)."""
    from drafter.models.eagle3 import EAGLE3_DIR, Eagle3Config  # torch: imported when a card is built

    doc, why = read_json(inputs, "train", f"{EAGLE3_DIR}/config.json")
    if doc is None:
        return {"ok": False, "reason": why}
    head, layout = Eagle3Config.from_hf(doc, source=str(Path(inputs["train"].path) / EAGLE3_DIR / "config.json"))
    spec = doc.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    measured = (ev.draft_vocab if ev is not None else None) or {}
    names = {"baseline": _baseline_name(cfg, inputs), "candidate": "fine-tuned"}
    verifier = str((spec.get("verifier") or {}).get("name_or_path") or "")
    return {"ok": True, "layout": layout, "aux_layer_ids": list(head.aux_layer_ids),
            "aux_count": len(head.aux_layer_ids),
            "draft_vocab_size": head.draft_vocab_size, "vocab_size": head.vocab_size,
            "hidden_size": head.hidden_size, "intermediate_size": head.intermediate_size,
            "heads": head.num_attention_heads, "kv_heads": head.num_key_value_heads,
            "target_hidden_size": head.target_hidden_size, "norm_before_residual": head.norm_before_residual,
            "speculative_tokens": methods[0].get("speculative_tokens"),
            "verifier": verifier if verifier and redact_local(verifier) == verifier else None,  # a local path: none
            "dtype": doc.get("torch_dtype"),
            "measured_vocab": [f"{names.get(n, n)} {v:,}" for n, v in measured.items() if v is not None],
            "raw": {"config": {k: v for k, v in doc.items() if k != "transformer_layer_config"} | {"layout": layout},
                    "measured_draft_vocab": measured}}
