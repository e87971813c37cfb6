"""The model card of a drafter release: every number read from a stage output, never typed.

:func:`card_context` reads the finished stage outputs (``inputs``: stage name → :class:`Artifact`)
and returns the template context: display strings (at the precision the card shows) and, under
``"raw"``, the same values unformatted (what ``release.json`` records). A stage that is absent or
was skipped gives ``"not measured: <why>"`` wherever its numbers would be. :func:`render_card`
renders ``model_card_templates/<kind>.md`` (after the shared macros of ``_macros.md``) through
:meth:`huggingface_hub.ModelCard.from_template` with a :class:`~huggingface_hub.ModelCardData`
front matter (``model-index`` with acceptance-length :class:`~huggingface_hub.EvalResult` entries).

Example::

    ctx = card_context(cfg, inputs, files=files, repo_id="org/tiny-mtp", version="0.1.0", git_commit=None)
    card = render_card(ctx, kind="mtp")
    card.save(out / "README.md")
"""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shlex
import socket
from pathlib import Path
from typing import Any

from drafter.core.stage import Artifact, canonical_json
from drafter.core.hardware import summary as hw_summary

TEMPLATES = Path(__file__).resolve().parents[2] / "model_card_templates"
MACROS = "_macros.md"
NOT_MEASURED = "not measured"
UNKNOWN_REPO = "ORG/NAME"
# licenses of targets the pipeline builds itself (prepare_target does not record one)
EMBEDDED_LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0"}
RULES = {"t0": "T=0 (greedy target)", "t1_greedy": "T=1, greedy drafts (vLLM default)",
         "t1_prob": "T=1, probabilistic drafts"}
REQUIRED = ("prepare_target", "train", "gate")


# --------------------------------------------------------------------------- local paths


def _local_words() -> list[str]:
    words = [os.getcwd(), str(Path.home()), socket.gethostname()]
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name on some containers
        user = ""
    if len(user) > 2:
        words.append(user)
    return sorted({w for w in words if w and w != "/"}, key=len, reverse=True)


_ABS_PATH = re.compile(r"(?<![\w.~/])/(?:[^\s'\"(),;]+/)+[^\s'\"(),;]*")


def redact_local(text: str) -> str:
    """``text`` without absolute local paths (each becomes ``<local path>/<its last part>``), the user name or
    the host name."""
    text = _ABS_PATH.sub(lambda m: "<local path>/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)
    for w in _local_words():
        if len(w) > 2 and w in text:
            text = text.replace(w, "<local>")
    return text


def redact_obj(obj: Any) -> Any:
    """:func:`redact_local` over every string of a JSON-like object."""
    if isinstance(obj, str):
        return redact_local(obj)
    if isinstance(obj, dict):
        return {redact_local(str(k)): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- reading stage outputs


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


# --------------------------------------------------------------------------- sections


def _target(cfg, inputs) -> dict:
    info, why = read_json(inputs, "prepare_target", "target.json")
    info = info or {}
    pt = cfg.prepare_target
    name = info.get("name") or pt.hub_id or (Path(pt.path).name if pt.path else "target")
    base_model = pt.hub_id if pt.source == "hub" and pt.hub_id else info.get("name") if info.get("source") == "embedded" else None
    license_ = cfg.publish.license or info.get("license") or EMBEDDED_LICENSES.get(name) or "other"
    source = info.get("source", pt.source)
    if source == "embedded":
        how = (f"built by the pipeline's `prepare_target` stage: {name} ({redact_local(str(info.get('revision')))}) "
               "re-expressed, weights unchanged, as GLM-4-MoE with one MTP layer")
    elif source == "hub":
        how = f"`hf download {pt.hub_id} --revision {info.get('revision') or pt.revision}`"
    else:
        how = f"the local checkpoint the release was built from (revision {redact_local(str(info.get('revision')))})"
    return {"name": name, "short": name.rsplit("/", 1)[-1], "base_model": base_model, "license": license_,
            "source": source, "revision": redact_local(str(info.get("revision"))) if info else why,
            "chat_template_sha256": info.get("chat_template_sha256") or why or "none",
            "how": how, "missing": why}


def _served_k(cfg, ab: dict | None) -> int:
    return int(ab["num_speculative_tokens"]) if ab else cfg.ab_live.num_speculative_tokens


def _offline(cfg, inputs, k: int) -> dict:
    ev, why = read_json(inputs, "eval_offline", "eval_offline.json")
    if ev is None:
        return {"ok": False, "reason": why}
    d, diff = ev["drafters"], ev.get("difference", {})
    k_max = ev["k_max"]
    heldout = ev.get("heldout") or {}
    out: dict[str, Any] = {"ok": True, "k": k, "k_max": k_max, "confidence": ev["confidence"],
                           "baseline_name": _baseline_name(cfg, inputs),
                           # outputs from before the record: the built-in split (the only set there was)
                           "heldout": heldout.get("text") or "built-in held-out split",
                           "heldout_files": [f["name"] for f in heldout.get("files", [])],
                           "windows": ev.get("windows"), "positions": ev["positions"],
                           "conversations": ev["conversations"], "bootstrap_samples": ev["bootstrap_samples"],
                           "bootstrap_unit": ev.get("bootstrap_unit", "conversation"),
                           "k_in_range": 1 <= k <= k_max,
                           "reason_k": None if 1 <= k <= k_max else
                           f"{NOT_MEASURED}: the served K={k} is beyond eval_offline.k_max={k_max}"}
    rules = [r for r in RULES if r in d["candidate"]]
    served = []
    if 1 <= k <= k_max:
        for r in rules:
            b, c = d["baseline"][r], d["candidate"][r]
            dd = diff.get(r)
            served.append({"rule": RULES[r], "released": f3(b["tau_by_k"][k - 1]), "released_ci": ci(b["tau_ci"][k - 1]),
                           "finetuned": f3(c["tau_by_k"][k - 1]), "finetuned_ci": ci(c["tau_ci"][k - 1]),
                           "delta": f"{dd['tau_by_k'][k - 1]:+.3f}" if dd else "—",
                           "delta_ci": ci(dd["tau_ci"][k - 1]) if dd else "—"})
    by_k = []
    for kk in range(1, k_max + 1):
        row = {"k": kk}
        for r in rules:
            row[r] = (f3(d["baseline"][r]["tau_by_k"][kk - 1]), f3(d["candidate"][r]["tau_by_k"][kk - 1]))
        by_k.append(row)
    domains = []
    kk = min(max(k, 1), k_max)
    for dom in sorted(d["candidate"]["t0"].get("by_domain", {})):
        row = {"domain": dom, "conversations": d["candidate"]["t0"]["by_domain"][dom]["conversations"],
               "positions": d["candidate"]["t0"]["by_domain"][dom]["positions"]}
        for r in rules:
            bd, cd = d["baseline"][r]["by_domain"].get(dom), d["candidate"][r]["by_domain"].get(dom)
            row[r] = (f3(bd["tau_by_k"][kk - 1]) if bd else "—", f3(cd["tau_by_k"][kk - 1]) if cd else "—")
        domains.append(row)
    out |= {"rules": [(r, RULES[r]) for r in rules], "served": served, "by_k": by_k, "domains": domains,
            "domain_k": kk, "recommended_k": ev.get("recommended_k", {}),
            "draft_cost": f3(ev.get("draft_cost")), "draft_cost_measured": ev.get("draft_cost_measured"),
            "raw": ev}
    return out


def _live(cfg, inputs, offline: dict) -> dict:
    from drafter.evaluation.ab_live import compile_mode, parse_summary, primary, temperatures
    from drafter.evaluation.gate import offline_rule

    ab, why = read_json(inputs, "ab_live", "ab_live.json")
    if ab is None:
        return {"ok": False, "reason": why}
    summ = parse_summary(ab)
    names = {"none": "no speculation", "baseline": _baseline_name(cfg, inputs), "candidate": "fine-tuned"}
    order = {"none": 0, "baseline": 1, "candidate": 2}
    rows = []
    for key in sorted(summ, key=lambda x: (x[0], x[3], order.get(x[1], 9), x[2])):
        t, drafter, method, c = key
        s = summ[key]
        none = (summ.get((t, "none", "none", c)) or {}).get("tok_s")
        rows.append({"temperature": f"{t:g}", "drafter": names.get(drafter, drafter),
                     "method": "—" if method == "none" else method, "users": c,
                     "tau": f3(s["tau"]), "tok_s": f2(s["tok_s"]), "speedup": f2(s["tok_s"] / none if none else None),
                     "decode_tok_s": f2(s.get("decode_tok_s")), "ttft_s": f3(s.get("ttft_mean_s")),
                     "p50_s": f3(s.get("latency_p50_s")), "rounds": s.get("rounds")})
    serving = _stage_config(inputs, "ab_live", "serving", cfg)
    ab_cfg = _stage_config(inputs, "ab_live", "ab_live", cfg)
    # an ab_live.json without ``compiled`` (older outputs) ran as serving.enforce_eager said
    compiled = ab["compiled"] if "compiled" in ab else not serving.get("enforce_eager")
    args = ["--dtype", serving["dtype"], "--max-model-len", str(serving["max_model_len"])]
    if not compiled:
        args.append("--enforce-eager")
    args += [redact_local(a) for a in ab.get("server_args") or []]
    platform = None
    logs = Path(inputs["ab_live"].path) / "logs"
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        m = re.search(r"device_config=(\w+)", log.read_text(errors="replace"))
        if m:
            platform = m.group(1)
            break
    # live τ over the offline prediction at the live K and the matching rule, at the primary measurement
    t0, m0 = primary(ab)
    c_min = min((key[3] for key in summ), default=None)
    live_tau = (summ.get((t0, "candidate", m0, c_min)) or {}).get("tau")
    rule = offline_rule(t0, m0)
    ratio = None
    k = ab["num_speculative_tokens"]
    if offline.get("ok") and live_tau is not None and 1 <= k <= offline["k_max"]:
        off = offline["raw"]["drafters"]["candidate"][rule]["tau_by_k"][k - 1]
        ratio = {"live": f3(live_tau), "offline": f3(off), "ratio": f3(live_tau / off), "rule": RULES[rule], "k": k,
                 "temperature": f"{t0:g}", "method": m0}
    lossless = ab.get("lossless")
    temps = temperatures(ab)
    return {"ok": True, "rows": rows, "k": k, "method": ab["method"], "temperatures": [f"{t:g}" for t in temps],
            "engine_version": ab.get("engine_version") or f"{NOT_MEASURED}: ab_live recorded no engine version",
            "compiled": compiled, "eager": compile_mode(compiled),
            "server_args": shlex.join(args), "args_list": args, "rounds": ab_cfg.get("rounds"),
            "hardware": (hw_summary(ab["hardware"]) + (f", vLLM device `{platform}`" if platform else "")) if ab.get("hardware")
            else f"vLLM device `{platform}` (the engine's device_config in the server log; the machine is not recorded)" if platform
            else f"{NOT_MEASURED}: ab_live recorded no hardware",
            "turns": ab["replay"]["turns"], "replay_domains": ", ".join(ab["replay"]["domains"]),
            "heldout": (ab["replay"].get("heldout") or {}).get("text") or "built-in held-out split",
            "max_tokens": ab["replay"]["max_tokens"], "notes": [redact_local(n) for n in ab["replay"].get("notes", [])],
            "lossless": (f"{lossless['identical']}/{lossless['prompts']} prompts identical at T=0 with and without "
                         f"speculation" if lossless else f"{NOT_MEASURED}: ab_live.lossless_prompts is 0"),
            "unsupported": {m: redact_local(r) for m, r in (ab.get("unsupported") or {}).items()},
            "ratio": ratio, "ratio_reason": None if ratio else f"{NOT_MEASURED}: needs both live and offline τ at K={k}",
            "raw": {k2: v for k2, v in ab.items() if k2 not in ("runs", "servers")}}


def _quant(inputs) -> dict:
    fp8: dict[str, Any] = {}
    err, why = read_json(inputs, "quantize_fp8", "fp8/fp8-error.json")
    if err is None:
        fp8 = {"ok": False, "reason": why}
    else:
        s = err["summary"]
        rels = [t["fp8_rel_error"] for t in err["tensors"].values() if t.get("fp8_rel_error") is not None]
        fp8 = {"ok": True, "rule": s["rule"], "block": "×".join(map(str, s["block"])), "tensors": s["tensors"],
               "fp8_tensors": s["fp8_tensors"], "kept": s["kept_tensors"], "cast": s["cast_tensors"],
               "max_rel": sci(s["max_fp8_rel_error"]), "max_rel_tensor": s["max_fp8_rel_error_tensor"],
               "mean_rel": sci(sum(rels) / len(rels)) if rels else "—", "moved": sci(s["max_moved_rel"]),
               "raw": {"summary": s, "mean_fp8_rel_error": sum(rels) / len(rels) if rels else None}}
        rel, _ = read_json(inputs, "quantize_fp8", "release.json")
        fp8["release"] = (rel or {}).get("source", "unknown")
    ver, vwhy = read_json(inputs, "verify_fp8", "verify.json")
    if ver is None:
        fp8["verify"] = {"ok": False, "reason": vwhy}
    else:
        t = ver["self_check"]["totals"]
        d = ver.get("dropin") or {}
        fp8["verify"] = {"ok": True, "identical": t["identical"], "edge": t["edge"], "differ": t["differ"],
                         "total": t["total"], "dropin_ok": d.get("ok"), "kept_equal": d.get("kept_hash_equal"),
                         "kept": d.get("kept"), "vllm_load": redact_local(str(ver.get("vllm_load")))}
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


def _training(cfg, inputs, kind: str = "mtp") -> dict:
    res, why = read_json(inputs, "train", "result.json")
    if res is None:
        return {"ok": False, "reason": why}
    tc = _stage_config(inputs, "train", "train", cfg)
    boot = stage_reason(inputs, "bootstrap_drafter")
    if kind == "dspark":
        dc = _stage_config(inputs, "train", "dspark", cfg)
        init = ("the released DSpark draft: the `bootstrap_drafter` stage's (demo stand-in: a seeded random "
                "initialization trained with CE on the other half of the data)" if not dc.get("released")
                else f"the released DSpark draft `{redact_local(str(dc['released']))}`")
    else:
        init = ("the released drafter: the `bootstrap_drafter` stage's MTP layer (demo stand-in, next-next-token CE)"
                if boot is None else "the released drafter inside the target checkpoint")
    gen, gwhy = read_json(inputs, "generate", "summary.json")
    scrub, swhy = read_json(inputs, "scrub", "report.json")
    cap, cwhy = read_json(inputs, "capture", "report.json")
    data = {"generate": None, "scrub": None, "capture": None}
    if gen:
        data["generate"] = {"rows": gen["rows"], "train_rows": gen["train_rows"], "heldout_rows": gen["heldout_rows"],
                            "domains": ", ".join(f"{k} {v}" for k, v in sorted(gen["domains"].items())),
                            "engine": f"{gen['engine']} {gen.get('engine_version') or ''}".strip(),
                            "sampling": ", ".join(f"{k}={v}" for k, v in sorted(gen["sampling"].items())),
                            "tokens": gen["tokens_generated"]}
    if scrub:
        data["scrub"] = {"rows_changed": scrub["rows_changed"], "rows": scrub["rows"],
                         "kinds": ", ".join(f"{k} {v}" for k, v in sorted(scrub["counts"].items()))}
    if cap:
        data["capture"] = {"train_tokens": cap["splits"].get("train", {}).get("tokens"),
                           "heldout_tokens": cap["splits"].get("heldout", {}).get("tokens"),
                           "train_sequences": cap["splits"].get("train", {}).get("sequences")}
    world = res.get("world_size", 1)
    loss_params = {"lk_hybrid": f"η={tc.get('eta')}", "ce_l1": f"ce_w={tc.get('ce_w')}"}.get(tc["loss"], "")
    return {"ok": True, "init": init, "frozen": ", ".join(f"`{p}`" for p in tc["freeze"]),
            "trainable": res["trainable"], "frozen_params": res["frozen"], "loss": tc["loss"],
            "loss_params": ", ".join(x for x in (loss_params, f"position weights exp(−k/γ), γ={tc.get('gamma')}") if x),
            "steps": tc["max_steps"], "lr": tc["lr"], "warmup": tc["warmup_steps"], "micro_batch": tc["micro_batch"],
            "grad_accum": tc["grad_accum"], "world_size": world,
            "batch": tc["micro_batch"] * tc["grad_accum"] * world, "window": tc["window"], "k": tc["k_steps"],
            "dtype": tc["dtype"], "tokens": res["tokens"], "windows": res["train_windows"],
            "seconds": f"{res['seconds']:.1f}", "tokens_per_s": f"{res['tokens_per_s']:.1f}",
            "hardware": (f"{world} process(es) on {hw_summary(res['hardware'])}"
                         + (f", training device `{res['device']}`" if res.get("device") else "")) if res.get("hardware")
            else f"{world} process(es); device {NOT_MEASURED}: the train stage records none",
            "data": data, "data_reasons": {"generate": gwhy, "scrub": swhy, "capture": cwhy},
            "draft_vocab": res.get("draft_vocab"),
            "tau_before": f3(res["baseline"]["t0"]["tau"]), "tau_after": f3(res["final"]["t0"]["tau"]),
            "raw": {k: v for k, v in res.items() if k != "weights_in"}}


def _gate(inputs) -> dict:
    g, why = read_json(inputs, "gate", "gate.json")
    if g is None:
        return {"ok": False, "reason": why, "forced": False}
    def num(v) -> str:  # a check without live evidence has no value or threshold
        return "—" if v is None else f"{v:.4g}"

    checks = [{"name": c["name"], "passed": "pass" if c["passed"] else "FAIL", "value": num(c.get("value")),
               "threshold": num(c.get("threshold")), "detail": redact_local(c.get("detail", ""))} for c in g["checks"]]
    return {"ok": True, "verdict": g["verdict"], "forced": bool(g.get("forced")), "failed": g.get("failed", []),
            "checks": checks, "tolerances": g.get("tolerances", {}), "raw": g}


def _summary(target, train, offline, k, dspark: dict | None = None) -> dict:
    if not train["ok"]:
        return {"what": train["reason"], "headline": offline.get("reason") or train["reason"]}
    if dspark:
        what = (f"A DSpark block drafter for {target['name']} (vLLM's `method: dspark`): {dspark['layers']} decoder "
                f"layer(s) over the target's layers {dspark['target_layer_ids']}, blocks of {dspark['block_size']} "
                f"tokens, a Markov head of rank {dspark['markov_rank']}"
                + (", a confidence head" if dspark["confidence_head"] else "")
                + f"; fine-tuned from {train['init']} with the `{train['loss']}` loss ({train['trainable']:,} "
                "trainable parameters). The embedding and the output head are the target's (not in this release).")
    else:
        what = (f"The MTP drafter of {target['name']}, fine-tuned from {train['init']} with the `{train['loss']}` loss "
                f"({train['trainable']:,} trainable parameters); frozen: {train['frozen']} "
                f"({train['frozen_params']:,} parameters, bytes identical to the release).")
    if offline["ok"] and offline["k_in_range"] and offline["served"]:
        s = offline["served"][0]
        headline = (f"Offline held-out τ at K={k}, {s['rule']}: {offline['baseline_name']} {s['released']} → "
                    f"fine-tuned {s['finetuned']} "
                    f"(Δ {s['delta']}, {offline['confidence']:.0%} CI {s['delta_ci']}, bootstrap over "
                    f"{offline['bootstrap_unit']}s).")
    else:
        headline = offline.get("reason_k") or offline.get("reason")
    return {"what": what, "headline": headline}


def _eval_results(offline: dict, model_name: str) -> list:
    from huggingface_hub import EvalResult

    if not offline.get("ok") or not offline["k_in_range"]:
        return []
    k, d = offline["k"], offline["raw"]["drafters"]["candidate"]
    files = offline["heldout_files"]
    dataset = f"user held-out files {', '.join(files)}" if files else "held-out split (regenerated)"
    out = []
    for rule, label in (("t0", "T=0"), ("t1_greedy", "T=1")):
        if rule not in d:
            continue
        doms = [("all", d[rule])] + sorted(d[rule].get("by_domain", {}).items())
        for dom, s in doms:
            out.append(EvalResult(
                task_type="text-generation", task_name="Speculative decoding (draft acceptance)",
                dataset_type="held-out", dataset_name=dataset, dataset_config=dom,
                dataset_split="heldout", metric_type="acceptance_length",
                metric_name=f"Acceptance length τ (K={k}, {label}, {dom})", metric_config=f"k{k}-{rule}-{dom}",
                metric_value=round(s["tau_by_k"][k - 1], 3), verified=False))
    return out


def config_dump(cfg) -> dict:
    """The config as each section's ``key_dump`` (operational fields and secrets left out), local paths redacted."""
    out = {}
    for name in type(cfg).model_fields:
        v = getattr(cfg, name)
        out[name] = v.key_dump() if hasattr(v, "key_dump") else v
    return redact_obj(json.loads(json.dumps(out, default=str)))


def _dspark(cfg, inputs, offline: dict) -> dict:
    """The DSpark draft's shape and its confidence heads' calibration (eval_offline)."""
    dc = _stage_config(inputs, "train", "dspark", cfg)
    cal = (offline.get("raw") or {}).get("calibration") or {}
    return {"block_size": dc["block_size"], "markov_rank": dc["markov_rank"], "layers": dc["num_hidden_layers"],
            "target_layer_ids": dc["target_layer_ids"], "anchors": dc["anchors"], "confidence_head": dc["confidence_head"],
            "confidence_w": dc["confidence_w"],
            "calibration": [{"drafter": {"baseline": _baseline_name(cfg, inputs), "candidate": "fine-tuned"}.get(n, n),
                             "ece": f"{r['ece']:.4f}" if r.get("ece") is not None else "—",
                             "mean_confidence": f3(r.get("mean_confidence")), "accepted": f3(r.get("mean_outcome")),
                             "n": r.get("n")} for n, r in cal.items()],
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


def card_context(cfg, inputs: dict[str, Artifact], *, files: list[dict], repo_id: str | None, version: str,
                 git_commit: str | None) -> dict:
    """Everything the card shows, read from the stage outputs (see the module docstring). The kind of
    drafter (``mtp``, or ``dspark`` with ``dspark.enabled``) picks the template."""
    from drafter.models import TRAINED_NAME
    from drafter.models.dspark import DSPARK_DIR

    kind = "dspark" if cfg.dspark.enabled else "mtp"
    ab, _ = read_json(inputs, "ab_live", "ab_live.json")
    k = _served_k(cfg, ab) if kind == "mtp" or ab else cfg.dspark.block_size
    target = _target(cfg, inputs)
    offline = _offline(cfg, inputs, k)
    live = _live(cfg, inputs, offline)
    quant = _quant(inputs)
    train = _training(cfg, inputs, kind)
    dspark = _dspark(cfg, inputs, offline) if kind == "dspark" else None
    gate = _gate(inputs)
    conf = config_dump(cfg)
    config_hash = hashlib.sha256(canonical_json(conf).encode()).hexdigest()[:16]
    keys = {name: a.key for name, a in sorted(inputs.items())}
    repo = repo_id or UNKNOWN_REPO
    model_name = repo.rsplit("/", 1)[-1] if repo_id else (cfg.name if kind in cfg.name.lower() else f"{cfg.name}-{kind}")
    forced_warning = None
    if gate.get("forced"):
        forced_warning = ("FORCED RELEASE: the release gate refused this drafter"
                          + (f" (failed checks: {', '.join(gate['failed'])})" if gate.get("failed") else "")
                          + " and it was published only because `gate.force` was set. Do not assume it is better "
                          "than the released drafter.")
    limitations = []
    if offline.get("ok"):
        limitations.append(f"Offline τ comes from {offline['positions']} positions in {offline['windows']} windows of "
                           f"{offline['conversations']} held-out conversations ({offline['heldout']}); intervals are "
                           "bootstrap intervals over conversations and are wide when there are few of them.")
    if live.get("ok"):
        limitations.append(f"Live numbers were measured with vLLM {live['engine_version']}, {live['eager']}, over "
                           f"{live['turns']} replayed turns (hardware: {live['hardware']}); other hardware, batch sizes "
                           "and prompt mixes give other speeds.")
    else:
        limitations.append(f"Live A/B: {live['reason']}.")
    if not quant["exl3"]["ok"]:
        limitations.append(f"EXL3 form: {quant['exl3']['reason']}.")
    if quant["fp8"].get("verify", {}).get("ok") and str(quant["fp8"]["verify"]["vllm_load"]).startswith("unsupported"):
        limitations.append("The FP8 drop-in was verified byte-wise, but vLLM could not run FP8 on the machine that "
                           "built this release: " + quant["fp8"]["verify"]["vllm_load"])
    if target["source"] == "embedded":
        limitations.append("The target is the pipeline's embedded demo (a small model re-expressed with an MTP layer "
                           f"and a stand-in released {'DSpark draft' if dspark else 'drafter'}): the numbers show the "
                           "pipeline working, not a production drafter's quality.")
    if forced_warning:
        limitations.append("The release gate did not pass (see the gate section).")

    drafter_file = DSPARK_DIR if dspark else TRAINED_NAME
    ctx = {
        "name": cfg.name, "kind": kind, "repo_id": repo, "model_name": model_name, "version": version,
        "git_commit": git_commit or f"{NOT_MEASURED}: not built from a git checkout",
        "forced_warning": forced_warning, "target": target, "k": k, "dspark": dspark,
        "summary": _summary(target, train, offline, k, dspark),
        "files": files, "offline": offline, "live": live, "quant": quant, "training": train, "gate": gate,
        "usage": {"repo_id": repo, "target_short": target["short"], "target_how": target["how"],
                  "drafter_file": drafter_file, "k": k,
                  "draft_vocab": (train.get("draft_vocab") or {}).get("size") if train.get("ok") and not dspark else None,
                  "method": "dspark" if dspark else (ab or {}).get("method", cfg.ab_live.method),
                  "server_args": live["server_args"] if live.get("ok") else shlex.join(
                      ["--dtype", cfg.serving.dtype, "--max-model-len", str(cfg.serving.max_model_len)]
                      + (["--enforce-eager"] if cfg.ab_live.eager(cfg.serving) else [])
                      + [redact_local(a) for a in cfg.ab_live.server_args])},
        "provenance": {"config_hash": config_hash, "stage_keys": keys, "version": version,
                       "git_commit": git_commit or f"{NOT_MEASURED}: not built from a git checkout",
                       "target_revision": target["revision"], "chat_template_sha256": target["chat_template_sha256"]},
        "limitations": limitations,
        "front": {"license": target["license"], "base_model": target["base_model"],
                  "tags": list(dict.fromkeys(["speculative-decoding", "draft-model", kind, "vllm", *cfg.publish.tags])),
                  "datasets": list(cfg.publish.datasets) or None},
        "config": conf,
    }
    ctx["raw"] = {"offline": offline.get("raw"), "live": live.get("raw"),
                  "fp8": {**(quant["fp8"].get("raw") or {}), "verify": quant["fp8"].get("verify")},
                  "exl3": quant["exl3"].get("raw") or quant["exl3"].get("reason"),
                  "training": train.get("raw"), "gate": gate.get("raw"),
                  "reasons": {s: stage_reason(inputs, s) for s in
                              ("prepare_target", "generate", "scrub", "capture", "bootstrap_drafter", "train",
                               "eval_offline", "quantize_fp8", "verify_fp8", "quantize_exl3", "ab_live", "gate")
                              if stage_reason(inputs, s)}}
    ctx["eval_results"] = _eval_results(offline, model_name)
    return redact_obj_keep(ctx)


def redact_obj_keep(ctx: dict) -> dict:
    """Redact strings of the context but keep non-JSON objects (EvalResult) as they are."""
    out = {}
    for k, v in ctx.items():
        out[k] = v if k == "eval_results" else redact_obj(v)
    return out


def required_missing(inputs: dict[str, Artifact]) -> list[str]:
    """Results the card requires that are missing or skipped: the publish stage refuses to publish then."""
    out = []
    for s in REQUIRED:
        why = stage_reason(inputs, s)
        if why:
            out.append(f"{s}: {why}")
    return out


def render_card(context: dict, kind: str = "mtp"):
    """The card (``huggingface_hub.ModelCard``) of ``kind`` rendered from ``model_card_templates/``."""
    from huggingface_hub import ModelCard, ModelCardData

    path = TEMPLATES / f"{kind}.md"
    if not path.is_file():
        kinds = sorted(p.stem for p in TEMPLATES.glob("*.md") if not p.name.startswith("_"))
        raise ValueError(f"no model card template for drafter kind {kind!r} ({path}); templates exist for {kinds}")
    f = context["front"]
    data = ModelCardData(
        license=f["license"], base_model=f["base_model"], base_model_relation="adapter" if f["base_model"] else None,
        library_name="vllm", pipeline_tag="text-generation", tags=f["tags"], datasets=f["datasets"],
        model_name=context["model_name"], eval_results=context["eval_results"] or None,
    )
    # jinja2.Template (what from_template uses) has no loader: the shared macros are prepended as text
    template = (TEMPLATES / MACROS).read_text(encoding="utf-8") + path.read_text(encoding="utf-8")
    ctx = {k: v for k, v in context.items() if k not in ("eval_results",)}
    return ModelCard.from_template(data, template_str=template, **ctx)
