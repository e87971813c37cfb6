"""The release report: one table a person reads after a run — released vs fine-tuned drafter,
offline and live τ, tok/s at each concurrency against no speculation (the A/B's primary measurement,
then every temperature and draft sampling method it ran), eager or compiled servers, the FP8
self-check, the EXL3 form and the gate's verdict — assembled from the stage outputs in the store (no
recomputation).

Example::

    from drafter.evaluation.report import release_report
    print(release_report(summary))     # summary = the release flow's run summary
"""
from __future__ import annotations

from typing import Any

from drafter.evaluation.ab_live import (NO_ENTRY, AbLiveResult, as_ab_live, compile_mode, matrix, matrix_markdown,
                                        matrix_rows, primary, summary_of, sweep_markdown)
from drafter.evaluation.gate import GateResult, offline_rule
from drafter.evaluation.offline_result import OfflineResult
from drafter.core.results import ResultFile

LABELS = {"none": "no speculation", "baseline": "released", "candidate": "fine-tuned"}
RULE_NAMES = {"t0": "T=0", "t1_greedy": "T=1, greedy drafts", "t1_prob": "T=1, probabilistic drafts"}


def _skipped(stage: dict) -> bool:
    """Skipped now, or reused from an earlier run that skipped it (the reason stays recorded)."""
    return stage["status"] == "skipped" or (stage["status"] == "reused" and bool(stage.get("reason")))


def _done(stage: dict | None) -> bool:
    return bool(stage) and stage["status"] in ("computed", "reused") and not _skipped(stage)


def _load(stage: dict | None, model: type[ResultFile]):
    """The finished stage's result file as ``model``; None when the stage did not finish or has no such file."""
    if not _done(stage) or not model.exists(stage["path"]):
        return None
    return model.load(stage["path"])


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "–" if v is None else fmt.format(v)


def acceptance_table(ab: AbLiveResult | dict, ev: OfflineResult | dict | None) -> str:
    """Markdown: per drafter, offline τ (at the live K and rule), live τ, tok/s per concurrency and speedup, at the
    A/B's primary measurement (the lowest temperature, greedy drafts)."""
    ab, ev = as_ab_live(ab), OfflineResult.of(ev) if ev is not None else None
    k = ab.num_speculative_tokens
    t0, m0 = primary(ab)
    rule = offline_rule(t0, m0)
    summ = summary_of(ab)
    conc = sorted({key[3] for key in summ})

    def row(drafter: str) -> dict:
        method = "none" if drafter == "none" else m0
        return {c: summ.get((t0, drafter, method, c)) for c in conc}

    ref = row("none")
    head = ["drafter", f"offline τ ({RULE_NAMES[rule]}, K={k})", f"live τ (T={t0:g})"]
    head += [f"tok/s @{c} user{'s' if c > 1 else ''}" for c in conc] + [f"speedup @{c}" for c in conc]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in ("none", "baseline", "candidate"):
        r = row(d)
        if not any(r.values()):
            continue
        off = None
        if ev and d != "none":
            by_k = ev.drafters[d][rule].tau_by_k
            off = by_k[k - 1] if k <= len(by_k) else None
        first = r[conc[0]] or NO_ENTRY
        cells = [LABELS[d], _f(off), _f(first.tau)]
        cells += [_f((r[c] or NO_ENTRY).tok_s, "{:.1f}") for c in conc]
        cells += [_f(r[c].tok_s / ref[c].tok_s if r[c] and ref.get(c) and ref[c].tok_s else None, "{:.2f}×")
                  for c in conc]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def decode_line(ab: AbLiveResult | dict) -> str | None:
    """Decode speed at the smallest concurrency from vLLM's request histograms (prefill excluded), per
    drafter with its ratio to no speculation, and the mean time to first token; None without them."""
    ab = as_ab_live(ab)
    summ = summary_of(ab)
    t0, m0 = primary(ab)
    c = min(key[3] for key in summ)
    ref = summ.get((t0, "none", "none", c), NO_ENTRY).decode_tok_s
    if not ref:
        return None
    cells = [f"no speculation {ref:.1f} tok/s"]
    for d in ("baseline", "candidate"):
        x = summ.get((t0, d, m0, c), NO_ENTRY).decode_tok_s
        if x:
            cells.append(f"{LABELS[d]} {x:.1f} ({x / ref:.2f}×)")
    ttft = summ.get((t0, "none", "none", c), NO_ENTRY).ttft_mean_s
    users = f"{c} user{'s' if c > 1 else ''}"
    return (f"Decode only at {users} (vLLM's request histograms, the prompt's prefill excluded): " + "; ".join(cells)
            + (f"; mean time to first token {ttft:.2f} s" if ttft is not None else "") + ".\n")


def block_table(ev: OfflineResult | dict) -> str:
    """Markdown: a block draft's (DSpark) offline τ per block at the full block, released vs fine-tuned
    with intervals and the paired difference, per rule; the confidence heads' ECE."""
    ev = OfflineResult.of(ev)
    k = ev.k_max
    pct = round(100 * ev.confidence)
    head = ["rule", f"released τ [{pct}% CI]", f"fine-tuned τ [{pct}% CI]", "ratio", f"difference [{pct}% CI]"]
    lines = [f"### Offline τ per block (block {k}, held-out: {ev.conversations} conversations, "
             f"{ev.positions} anchors)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule, name in RULE_NAMES.items():
        b, c = ev.drafters["baseline"][rule], ev.drafters["candidate"][rule]
        d = ev.difference[rule]
        lines.append(f"| {name} | {b.tau_by_k[k - 1]:.3f} [{b.tau_ci[k - 1][0]:.3f}, {b.tau_ci[k - 1][1]:.3f}] | "
                     f"{c.tau_by_k[k - 1]:.3f} [{c.tau_ci[k - 1][0]:.3f}, {c.tau_ci[k - 1][1]:.3f}] | "
                     f"{c.tau_by_k[k - 1] / b.tau_by_k[k - 1]:.3f}× | {d.tau_by_k[k - 1]:+.3f} "
                     f"[{d.tau_ci[k - 1][0]:+.3f}, {d.tau_ci[k - 1][1]:+.3f}] |")
    if ev.calibration:
        lines += ["", "Confidence head (expected calibration error, held-out, outcome = accepted at T=0): "
                  + "; ".join(f"{LABELS.get(n, n)} {r.ece:.4f}" for n, r in ev.calibration.items() if r.ece is not None)]
    return "\n".join(lines) + "\n"


def heldout_line(ev: OfflineResult | dict | None, ab: AbLiveResult | dict | None) -> str | None:
    """Which held-out set the offline τ and the live replay were measured on (``eval_offline.json`` /
    ``ab_live.json`` record it): the built-in split or the user's files; None when neither says."""
    ev, ab = OfflineResult.of(ev) if ev else None, as_ab_live(ab) if ab else None
    sets: dict[str, list[str]] = {}
    if ev and ev.heldout:
        sets.setdefault(ev.heldout.text, []).append("offline τ")
    if ab and ab.replay and ab.replay.heldout:
        sets.setdefault(ab.replay.heldout.text, []).append("live replay")
    if not sets:
        return None
    return "Held-out set: " + "; ".join(f"{text} ({' and '.join(what)})" for text, what in sets.items()) + ".\n"


def _quant_lines(st: dict) -> list[str]:
    """FP8 self-check counts and largest FP8 error; the EXL3 form or why it was not produced."""
    out = []
    q, v, e = st.get("quantize_fp8"), st.get("verify_fp8"), st.get("quantize_exl3")
    if v and _skipped(v):
        out.append(f"**FP8**: not produced — {v.get('reason')}\n")
    elif _done(v):
        m = v["metrics"]
        out.append(f"**FP8 self-check** of the release ({m.get('rule', '')}): {m.get('blocks_identical')} blocks "
                   f"byte-identical, {m.get('blocks_edge')} rounding-edge, {m.get('blocks_differ')} differ "
                   f"(of {m.get('blocks_total')}); drop-in keys/index/untouched bytes "
                   f"{'ok' if m.get('dropin_keys_ok') else 'FAILED'}; vLLM load: {m.get('vllm_load')}\n")
    if _done(q):
        m = q["metrics"]
        out.append(f"**FP8 drop-in**: {m.get('tensors')} tensors ({m.get('fp8_tensors')} re-quantized, "
                   f"{m.get('kept_tensors')} kept as the release's bytes); largest relative FP8 error "
                   f"{m.get('max_fp8_rel_error'):.4f} ({m.get('max_fp8_rel_error_tensor')})\n")
    if e and _skipped(e):
        out.append(f"**EXL3**: not produced — {e.get('reason')}\n")
    elif _done(e):
        out.append(f"**EXL3**: produced ({e['path']}/exl3)\n")
    return out


def _live_parts(st: dict, ab: AbLiveResult | None, ev: OfflineResult | None) -> list[str]:
    """The A/B's tables and lines, or why it was not measured."""
    parts: list[str] = []
    if ab:
        parts.append("### Acceptance and speed (vLLM)\n\n" + acceptance_table(ab, ev))
        if sum(len(ms) for ms in matrix(ab).values()) > 1:
            parts.append("Every temperature and draft sampling method of the A/B (speedup over no speculation at the "
                         "same temperature):\n\n" + matrix_markdown(matrix_rows(ab), LABELS))
        sweep = sweep_markdown(ab)
        if sweep:
            parts.append("### The sweep and the released schedule\n\n" + sweep)
        if "compiled" in ab.model_fields_set:
            parts.append(f"A/B servers: {compile_mode(ab.compiled)}.\n")
        ll = ab.lossless
        if ll:
            parts.append(f"Lossless at T=0: {ll.identical}/{ll.prompts} prompts identical with and "
                         f"without speculation ({'ok' if ll.ok else 'FAILED'}).\n")
        decode = decode_line(ab)
        if decode:
            parts.append(decode)
    if st.get("ab_live") and _skipped(st["ab_live"]):
        parts.append(f"**Live A/B**: not measured — {st['ab_live'].get('reason')}\n")
    return parts


def release_report(summary: dict) -> str:
    """Markdown report of a release run from its stage outputs (missing stages are left out)."""
    st = {s["stage"]: s for s in summary["stages"]}
    parts: list[str] = []
    ab = _load(st.get("ab_live"), AbLiveResult)
    ev = _load(st.get("eval_offline"), OfflineResult)
    heldout = heldout_line(ev, ab)
    if heldout:
        parts.append(heldout)
    parts += _live_parts(st, ab, ev)
    if ev and ev.drafting == "block":
        parts.append(block_table(ev))
    elif ev:
        rk = ev.recommended_k
        parts.append(f"Offline: recommended K = {rk.get('candidate')} for the fine-tuned drafter "
                     f"({rk.get('baseline')} for the released one) at draft cost {ev.draft_cost or 0:.3f} "
                     "of a target forward.\n")
    parts += _quant_lines(st)
    gate = _load(st.get("gate"), GateResult)
    if gate:
        forced = gate.forced and gate.verdict != "forced"
        parts.append(f"**gate**: {gate.verdict}" + (" (forced)" if forced else "") + "\n")
    return "\n".join(parts)
