"""The A/B in Markdown: the stage's table (``ab_live.md``) and the per temperature and draft sampling matrix
the gate, the report and the card show (see :mod:`drafter.evaluation.ab_live`)."""
from __future__ import annotations

from statistics import fmean

from drafter.evaluation.ab_live.plan import compile_mode
from drafter.evaluation.ab_live.results import (NO_ENTRY, AbLiveResult, SummaryEntry, SummaryKey, _ratio, as_ab_live,
                                                matrix, primary, summary_of, temperatures)
from drafter.evaluation.ab_live.sweep import (SCHEDULE, best_fixed, drafter_order, limit_sentence,
                                              released_configuration, released_speeds, schedule_json)


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _x(x: float | None) -> str:
    return _f(x, ".2f") + ("×" if x is not None else "")


def _rows(s: dict[SummaryKey, SummaryEntry]) -> list[tuple[float, str, str]]:
    """(temperature, drafter, method) of a parsed summary in table order."""
    return sorted({k[:3] for k in s}, key=lambda r: (r[0], drafter_order(r[1]), r[2]))


def _speed_table(s: dict[SummaryKey, SummaryEntry], rows: list[tuple[float, str, str]], concurrency: list[int]) -> list[str]:
    head = ["T", "drafter", "draft sampling", "live τ"]
    for c in concurrency:
        head += [f"tok/s c{c}", f"speedup c{c}", f"latency p50 c{c} (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, d, m in rows:
        c1 = s.get((t, d, m, min(concurrency)), NO_ENTRY)
        cells = [f"{t:g}", d, "—" if m == "none" else m, _f(c1.tau, ".3f")]
        for c in concurrency:
            e, ref = s.get((t, d, m, c), NO_ENTRY), s.get((t, "none", "none", c), NO_ENTRY)
            cells += [_f(e.tok_s, ".1f"), _x(_ratio(e.tok_s, ref.tok_s)), _f(e.latency_p50_s, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _server_table(s: dict[SummaryKey, SummaryEntry], rows: list[tuple[float, str, str]], concurrency: list[int]) -> list[str]:
    if not any(e.decode_tok_s for e in s.values()):
        return []
    head = ["T", "drafter", "draft sampling"]
    for c in concurrency:
        head += [f"TTFT c{c} (s)", f"decode tok/s per user c{c}", f"decode speedup c{c}"]
    lines = ["", "Server side (vLLM's request histograms; decode = the tokens after the first, prefill excluded):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, d, m in rows:
        cells = [f"{t:g}", d, "—" if m == "none" else m]
        for c in concurrency:
            e, ref = s.get((t, d, m, c), NO_ENTRY), s.get((t, "none", "none", c), NO_ENTRY)
            cells += [_f(e.ttft_mean_s, ".3f"), _f(e.decode_tok_s, ".1f"), _x(_ratio(e.decode_tok_s, ref.decode_tok_s))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _notes(ab: AbLiveResult, s: dict[SummaryKey, SummaryEntry], rows: list[tuple[float, str, str]]) -> list[str]:
    rounds = max((e.rounds for e in s.values()), default=0)
    temps = temperatures(ab)
    lines = [f"K = {ab.num_speculative_tokens} ({ab.method}), temperature{'s' if len(temps) > 1 else ''} "
             f"{', '.join(f'{t:g}' for t in temps)}, vLLM {ab.engine_version}, servers "
             f"{compile_mode(ab.compiled)}, {rounds} round(s) interleaved; τ and tok/s are means over rounds."
             + (f" Every server ran with `{' '.join(ab.server_args)}`." if ab.server_args else "")]
    if ab.method == "eagle3" and (ab.draft_vocab or {}).get("candidate"):
        dv = ab.draft_vocab
        lines.append(f"The EAGLE-3 heads draft over their own vocabularies (`draft_vocab_size` of each head's config): "
                     f"the fine-tuned one over {dv['candidate']} tokens, the released one over "
                     f"{dv.get('baseline') or 'the whole vocabulary'}" + (" tokens." if dv.get("baseline") else "."))
    elif (dv := (ab.draft_vocab or {}).get("candidate")):
        lines.append(f"The fine-tuned drafter drafts over {dv} tokens (its draft vocabulary, `train.draft_vocab_size`); "
                     f"the released one over the whole vocabulary.")
    replay = ab.replay
    if replay is not None and replay.heldout:
        lines.append(f"Replayed: {replay.turns} turns of {replay.conversations} conversations of the "
                     f"{replay.heldout.text}.")
    ll = ab.lossless
    if ll:
        verdict = "identical" if ll.ok else "DIFFERENT"
        lines.append(f"Lossless at T=0: {ll.identical}/{ll.prompts} prompts {verdict} with and without speculation"
                     + (f" (first mismatches: {ll.mismatches[:3]})" if ll.mismatches else "") + ".")
    for m, why in (ab.unsupported or {}).items():
        lines.append(f"Not measured: draft sampling `{m}`: {why}.")
    if ab.baseline_at == "gate" and any(d == "candidate" and (t, "baseline", m) not in rows for t, d, m in rows):
        t0, m0 = primary(ab)
        lines.append(f"The released drafter ran at the gate's measurement only (T={t0:g}, {m0} drafts; "
                     "`ab_live.baseline_at: gate`).")
    return lines


def sweep_markdown(result: AbLiveResult | dict) -> str:
    """Markdown of the sweep and the schedule: per measured concurrency no speculation's tok/s, the fine-tuned
    drafter's at each K, the scheduled K, the served schedule's tok/s, the released configuration's tok/s and its
    speedup (:func:`released_speeds`), then the served ``--speculative-config``, where speculation pays and, where a
    server with the drafter is slower even with speculation off, the users above which the release serves without
    it. Empty for an A/B without a sweep."""
    ab = as_ab_live(result)
    sc = ab.schedule
    if sc is None:
        return ""
    speeds, s = released_speeds(ab), summary_of(ab)
    head = ["users", "no speculation tok/s", *[f"K={k} tok/s" for k in sc.ks], "scheduled K", "served schedule tok/s",
            "released tok/s", "× no speculation", "best fixed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ch in sc.choices:
        by_k = sc.sweep.get(ch.concurrency, {})
        sp = speeds.get(ch.concurrency)
        best = best_fixed(ab, ch.concurrency)
        served = s.get((sc.temperature, SCHEDULE, sc.method, ch.concurrency), NO_ENTRY).tok_s
        cells = [str(ch.concurrency), _f(fmean(by_k[0]) if by_k.get(0) else None, ".1f"),
                 *[_f(fmean(by_k[k]) if by_k.get(k) else None, ".1f") for k in sc.ks], str(ch.k), _f(served, ".1f"),
                 _f(sp.tok_s if sp else None, ".1f"), _x(sp.speedup if sp else None),
                 "—" if best is None else ("no speculation" if best[0] == 0 else f"K={best[0]}")]
        lines.append("| " + " | ".join(cells) + " |")
    spec = schedule_json(sc.speculative_config)
    lines += ["", f"Schedule (T={sc.temperature:g}, {sc.method} drafts; a K counts only if it beats no speculation by "
              f"more than {sc.tolerance:.0%}): " + ("speculation off everywhere" if spec is None else f"`{spec}`") + "."]
    if sc.served:
        lines.append("The schedule was served by vLLM itself and measured (served schedule tok/s above).")
    else:
        lines.append(f"The schedule was not served here ({sc.refusal}); released tok/s are the fixed-K servers' for the "
                     "scheduled K.")
    rel = released_configuration(ab)
    lines.append(f"Speculation pays up to {rel.pays_up_to} concurrent user{'s' if rel.pays_up_to != 1 else ''} on "
                 "this hardware." if rel.pays_up_to else
                 "Speculation pays at no measured concurrency on this hardware: serve without it.")
    lines.append(f"Released configuration: {rel.why}.")
    if limit := limit_sentence(ab):
        lines.append(limit)
    return "\n".join(lines) + "\n"


def benchmark_markdown(result: AbLiveResult | dict, names: dict[str, str] | None = None) -> str:
    """Markdown: each benchmark's own replay set at 1 user (``benchmarks``): turns, no speculation's tok/s, the
    released and the fine-tuned drafter's live τ and tok/s (× no speculation); ``names``: a benchmark's title.
    Empty without benchmarks."""
    ab = as_ab_live(result)
    if not ab.benchmarks:
        return ""
    by: dict[str, dict[str, dict]] = {}
    for r in ab.benchmarks:
        by.setdefault(r["benchmark"], {})[r["drafter"]] = r
    t, k = ab.benchmarks[0]["temperature"], ab.num_speculative_tokens
    lines = [f"Live, each benchmark's own replay set at 1 user (T={t:g}, K={k}):", "",
             "| benchmark | turns | no speculation tok/s | released τ | released tok/s | fine-tuned τ | fine-tuned tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, d in by.items():
        none = (d.get("none") or {}).get("tok_s")
        cells = [(names or {}).get(name, name), str((d.get("candidate") or d.get("none") or {}).get("requests", "—")),
                 _f(none, ".1f")]
        for who in ("baseline", "candidate"):
            r = d.get(who) or {}
            tok = r.get("tok_s")
            cells += [_f(r.get("tau"), ".3f"), _f(tok, ".1f") + (f" ({tok / none:.2f}×)" if tok and none else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ab_table(result: AbLiveResult | dict, concurrency: list[int]) -> str:
    """Markdown: per temperature, drafter and draft sampling, live τ, tok/s and speedup vs no speculation (at the
    same temperature) at each concurrency, per-request latency p50; then the lossless check and what was not
    measured."""
    ab = as_ab_live(result)
    s = summary_of(ab)
    rows = _rows(s)
    lines = _speed_table(s, rows, concurrency) + _server_table(s, rows, concurrency)
    sweep = sweep_markdown(ab)
    lines += (["", "The sweep and the released schedule:", "", sweep.rstrip("\n")] if sweep else [])
    bench = benchmark_markdown(ab)
    lines += (["", bench.rstrip("\n")] if bench else [])
    return "\n".join(lines + [""] + _notes(ab, s, rows)) + "\n"


def matrix_rows(ab: AbLiveResult | dict) -> list[dict]:
    """The A/B per temperature and draft sampling: for each temperature a no-speculation row, then per method
    the released and the fine-tuned drafter — ``{"temperature", "draft_sample_method" (None without
    speculation), "drafter", "tau" (smallest concurrency), "by_concurrency": [{"concurrency", "tok_s",
    "speedup"}]}``, the speedup against no speculation at the same temperature and concurrency."""
    s = summary_of(ab)
    conc = sorted({k[3] for k in s})
    out = []
    for t, methods in matrix(ab).items():
        for d, m in [("none", "none")] + [(d, m) for m in methods for d in ("baseline", "candidate")]:
            if not any((t, d, m, c) in s for c in conc):
                continue
            ref = {c: s.get((t, "none", "none", c), NO_ENTRY).tok_s for c in conc}
            out.append({"temperature": t, "draft_sample_method": None if d == "none" else m, "drafter": d,
                        "tau": s.get((t, d, m, conc[0]), NO_ENTRY).tau,
                        "by_concurrency": [{"concurrency": c, "tok_s": s.get((t, d, m, c), NO_ENTRY).tok_s,
                                            "speedup": _ratio(s.get((t, d, m, c), NO_ENTRY).tok_s, ref[c])}
                                           for c in conc]})
    return out


def matrix_markdown(rows: list[dict], labels: dict[str, str] | None = None) -> str:
    """Markdown of :func:`matrix_rows`: one row per temperature, draft sampling and drafter (``labels`` names the
    drafters), live τ at the smallest concurrency, tok/s and speedup vs no speculation at each concurrency."""
    if not rows:
        return ""
    conc = [e["concurrency"] for e in rows[0]["by_concurrency"]]
    head = ["T", "draft sampling", "drafter", f"live τ (c{conc[0]})"]
    head += [f"tok/s c{c}" for c in conc] + [f"speedup c{c}" for c in conc]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['temperature']:g}", r["draft_sample_method"] or "—", (labels or {}).get(r["drafter"], r["drafter"]),
                 _f(r["tau"], ".3f")]
        cells += [_f(e["tok_s"], ".1f") for e in r["by_concurrency"]] + [_x(e["speedup"]) for e in r["by_concurrency"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
