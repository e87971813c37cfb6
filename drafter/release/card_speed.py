"""The card's speed against concurrency: what the release serves, how fast, and up to how many users it pays.

Read from the live A/B (:class:`~drafter.evaluation.ab_live.AbLiveResult`):

* :func:`usage_spec` — the ``--speculative-config`` of the card's usage line, as one JSON string: the schedule the
  A/B derived from its concurrency × K sweep, exactly as ``schedule.speculative_config`` holds it (vLLM's
  ``num_speculative_tokens_per_batch_size``); None when that schedule turns speculation off everywhere (the card then
  serves the target without ``--speculative-config``); an A/B without a schedule (older outputs), DSpark or no live
  A/B: the fixed K, ``{"method": …, "num_speculative_tokens": K}``. A drafter vLLM loads from its own repo (EAGLE-3)
  gets ``"model": <the release repo>`` second, in place of the local folder the A/B served.
* :func:`speed_section` — per measured concurrency at the gate's temperature, tok/s of no speculation, of the
  released and the fine-tuned drafter at the fixed K and of the released configuration
  (:func:`~drafter.evaluation.ab_live.sweep.released_speeds`), each with × no speculation; where speculation pays;
  the advice for sampling (:func:`sampling_advice`).
* :func:`write_speed_plot` — the same curves as :data:`SPEED_PLOT` (the release folder writes it; no stage does).

Sampling rule (T > 0), one per measured temperature above 0: the draft sampling method whose fine-tuned drafter
(fixed K) has the best speedup over no speculation at the smallest measured concurrency is the one to serve if that
speedup exceeds 1 + the tolerance (the schedule's ``tolerance``; without a schedule, ``ab_live.schedule_tolerance``
of the A/B's config); otherwise speculation should stay off at that temperature on this hardware.

Example::

    usage_spec(ab, "mtp", 2)["speculative_config_json"]
    # '{"method": "mtp", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 1024, 0]]}'
    speed_section(cfg, inputs, ab, None)["pays"]   # 'Speculation pays up to 2 concurrent users on this hardware.'
"""
from __future__ import annotations

from pathlib import Path

from drafter.evaluation.ab_live import (NO_ENTRY, SCHEDULE, AbLiveResult, matrix, primary, released_speeds,
                                        schedule_json, summary_of, sweep_markdown, temperatures)
from drafter.evaluation.ab_live.sweep import limit_sentence, released_configuration, released_record
from drafter.release.card_sections import _baseline_name, _stage_config, read_result

SPEED_PLOT = "assets/tok_s_vs_concurrency.png"


def _users(c: int) -> str:
    return f"{c} concurrent user{'s' if c != 1 else ''}"


def ranges_text(ranges: list[list[int]]) -> str:
    """vLLM's ``[from, to, K]`` batch-size ranges in words: ``1–2 requests: K=3; 3–1024 requests: off``."""
    def one(a: int, b: int, k: int) -> str:
        n = f"{a} request" if a == b == 1 else f"{a} requests" if a == b else f"{a}–{b} requests"
        return f"{n}: " + ("off" if k == 0 else f"K={k}")
    return "; ".join(one(*r) for r in ranges)


def with_model(spec: dict | None, model: str | None) -> dict | None:
    """``spec`` with ``"model": model`` right after ``method`` (replacing the local folder an A/B served); unchanged
    when ``model`` is None (MTP: the drafter is inside the served checkpoint)."""
    if spec is None or model is None:
        return spec
    rest = {k: v for k, v in spec.items() if k not in ("method", "model")}
    return {"method": spec.get("method"), "model": model, **rest}


def usage_spec(ab: AbLiveResult | None, method: str, k: int, dspark: bool = False, model: str | None = None) -> dict:
    """The usage line's ``--speculative-config``: ``speculative_config_json`` (None: serve without speculation),
    ``fixed_config_json`` (the fixed K, what a vLLM that refuses the schedule or a person trying the drafter anyway
    serves) and ``k_note`` (one sentence on what the line serves). ``model``: the drafter's repo, for a drafter vLLM
    loads on its own (EAGLE-3)."""
    fixed = schedule_json(with_model({"method": method, "num_speculative_tokens": k}, model))
    sc = ab.schedule if ab is not None and not dspark else None
    out = {"speculative_config_json": fixed, "fixed_config_json": fixed, "schedule": sc is not None,
           "k_note": f"K={k} is the K the live A/B served."}
    if sc is None:
        return out
    rel = released_configuration(ab)
    spec = schedule_json(with_model(rel.speculative_config(sc), model))
    out["speculative_config_json"] = spec
    if spec is None:
        out["k_note"] = (f"K={k} is the fixed K the live A/B served; it beat no speculation at none of the "
                         "measured concurrencies (see *Speed vs concurrency*).")
        return out
    if rel.kind == "fixed":
        out["schedule"], out["fixed_config_json"] = False, spec
        out["k_note"] = (f"The `--speculative-config` serves the fixed K the live A/B's sweep found fastest — "
                         f"{rel.why} (see *Speed vs concurrency*).")
    else:
        out["k_note"] = ("The `--speculative-config` is the batch-size schedule derived from the live A/B's sweep "
                         "(vLLM's `num_speculative_tokens_per_batch_size`: `[from, to, K]` ranges of the number of "
                         f"requests in a batch, K = 0: no speculation): {ranges_text(sc.ranges)}; see *Speed vs "
                         "concurrency*.")
    out["k_note"] += _limit_sentence(ab)
    if rel.kind == "schedule" and not sc.served:
        out["k_note"] += (f" The A/B did not serve the schedule itself ({sc.refusal}); a vLLM that refuses "
                          f"`num_speculative_tokens_per_batch_size` serves the fixed K instead: "
                          f"`--speculative-config '{fixed}'`.")
    return out


def tolerance(cfg, inputs, ab: AbLiveResult) -> float:
    """A K (or a draft sampling method) pays where it beats no speculation by more than this fraction: the
    schedule's tolerance; without a schedule, ``ab_live.schedule_tolerance`` of the A/B's config."""
    if ab.schedule is not None:
        return ab.schedule.tolerance
    conf = _stage_config(inputs, "ab_live", "ab_live", cfg)  # the A/B's own config (its manifest), else cfg's
    return float(conf.get("schedule_tolerance", cfg.ab_live.schedule_tolerance))


def _cell(x: float | None, ref: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" + (f" ({x / ref:.2f}×)" if ref else "")


def _curves(ab: AbLiveResult) -> dict[int, dict]:
    """Per measured concurrency (gate's temperature): tok/s of no speculation, the released and the fine-tuned
    drafter at the fixed K, the released configuration, the K it serves there and where its number comes from."""
    s = summary_of(ab)
    t0, m0 = primary(ab)
    return {c: {"none": sp.no_spec, "baseline": s.get((t0, "baseline", m0, c), NO_ENTRY).tok_s,
                "candidate": s.get((t0, "candidate", m0, c), NO_ENTRY).tok_s, "released": sp.tok_s,
                "served": s.get((t0, SCHEDULE, m0, c), NO_ENTRY).tok_s,
                "k": ab.num_speculative_tokens if sp.k is None else sp.k, "source": sp.source}
            for c, sp in sorted(released_speeds(ab).items())}


def _pays(ab: AbLiveResult, curves: dict[int, dict], tol: float) -> tuple[str, str | None]:
    """Up to how many users speculation pays (the sentence, and a note on how it was decided without a schedule):
    the schedule's ``pays_up_to``; without a schedule, the largest concurrency where the fixed K beats no
    speculation by more than ``tol``."""
    sc = ab.schedule
    if sc is not None:
        n, note = released_configuration(ab).pays_up_to, None
    else:
        n = max((c for c, v in curves.items()
                 if v["released"] and v["none"] and v["released"] > v["none"] * (1 + tol)), default=0)
        note = (f"This A/B predates the concurrency sweep, so no schedule was derived: speculation counts as paying "
                f"where the fixed K={ab.num_speculative_tokens} beats no speculation by more than {tol:.0%}.")
    if n:
        return f"Speculation pays up to {_users(n)} on this hardware." + _limit_sentence(ab), note
    return "Speculation pays at no measured concurrency on this hardware: serve without it.", note


def _limit_sentence(ab: AbLiveResult) -> str:
    """Where a server with the drafter was slower than no speculation: the users above which the release is served
    without it (empty otherwise)."""
    s = limit_sentence(ab)
    return f" {s}" if s else ""


def _schedule_lines(ab: AbLiveResult, model: str | None = None) -> list[str]:
    sc = ab.schedule
    if sc is None:
        return []
    table = sweep_markdown(ab).split("\n\n", 1)[0]
    head = (f"The sweep behind it (T={sc.temperature:g}, {sc.method} drafts; the fine-tuned drafter at each K, "
            f"tok/s; a K counts at a concurrency only where it beats no speculation by more than {sc.tolerance:.0%}):")
    what = ("speculation off at every batch size" if sc.speculative_config is None
            else f"{ranges_text(sc.ranges)} (`{schedule_json(with_model(sc.speculative_config, model))}`)")
    rel = released_configuration(ab)
    if sc.speculative_config is None:
        served = "The released configuration's numbers are no speculation's."
    elif rel.kind == "fixed":
        served = (("vLLM served the schedule itself in the A/B" if sc.served else
                   f"The schedule was not served in the A/B ({sc.refusal})") +
                  f"; the release serves {rel.why}.")
    elif sc.served and (limit := rel.limit):
        served = (f"vLLM served the schedule itself in the A/B: the released configuration's numbers are its own up "
                  f"to {_users(limit)}, no speculation's above.")
    elif sc.served:
        served = "vLLM served the schedule itself in the A/B: the released configuration's numbers are its own."
    else:
        served = (f"The schedule was not served in the A/B ({sc.refusal}): the released configuration's numbers are "
                  "the fixed-K servers' at the scheduled K (no speculation's where K = 0).")
    return ["", head, "", table, "", f"Schedule: {what}. {served}"]


def _measured_config(ab: AbLiveResult, t: float, method: str, model: str | None = None) -> str | None:
    """The ``--speculative-config`` the A/B served the fine-tuned drafter with at ``t`` with ``method`` drafts
    (``model``: the drafter's repo in place of the folder the A/B served)."""
    for srv in ab.servers or []:
        if (srv.get("drafter") == "candidate" and srv.get("draft_sample_method") == method
                and t in (srv.get("temperatures") or []) and srv.get("speculative_config")):
            return schedule_json(with_model(srv["speculative_config"], model))
    return None


def sampling_advice(ab: AbLiveResult, tol: float, model: str | None = None) -> list[str]:
    """One sentence per measured temperature above 0 (the module's sampling rule), with the numbers; ``model``: as
    :func:`usage_spec`'s."""
    s = summary_of(ab)
    hot = [t for t in temperatures(ab) if t > 0]
    if not hot:
        temps = ", ".join(f"{t:g}" for t in temperatures(ab))
        return [f"T > 0 was not measured (the live A/B ran at T={temps} only): which draft sampling to serve at T=1, "
                "or whether speculation pays there, is not known."]
    out, k = [], ab.num_speculative_tokens

    def ratio(t: float, m: str, c: int) -> float | None:
        x, ref = s.get((t, "candidate", m, c), NO_ENTRY).tok_s, s.get((t, "none", "none", c), NO_ENTRY).tok_s
        return x / ref if x and ref else None

    for t in hot:
        conc = sorted(c for tt, d, _, c in s if tt == t and d == "none")
        ratios = {m: {c: r for c in conc if (r := ratio(t, m, c)) is not None} for m in matrix(ab).get(t, [])}
        ratios = {m: r for m, r in ratios.items() if r}
        if not conc or not ratios:
            out.append(f"At T={t:g}: not measured (no fine-tuned drafter beside no speculation).")
            continue
        c1 = conc[0]
        nums = "; ".join(f"{m} drafts " + ", ".join(f"{x:.2f}× at {c}" for c, x in r.items())
                         for m, r in ratios.items())
        where = (f"(the fine-tuned drafter at the fixed K={k}, × no speculation at {', '.join(map(str, conc))} users: "
                 f"{nums})")
        best = max(ratios, key=lambda m: ratios[m].get(c1, 0.0))
        b = ratios[best].get(c1)
        if b is None or b <= 1 + tol:
            out.append(f"At T={t:g}, keep speculation off on this hardware: no draft sampling method beats no "
                       f"speculation by more than {tol:.0%} at {_users(c1)} {where}.")
            continue
        upto = max(c for c, x in ratios[best].items() if x > 1 + tol)
        spec = _measured_config(ab, t, best, model)
        how = f" (`--speculative-config '{spec}'`, as the A/B served it)" if spec else ""
        out.append(f"At T={t:g}, serve {best} drafts{how}: {b:.2f}× no speculation at {_users(c1)}, more than "
                   f"{tol:.0%} faster up to {_users(upto)} {where}.")
    return out


def speed_section(cfg, inputs, ab: AbLiveResult | None, why: str | None, plot: bool = False,
                  model: str | None = None) -> dict:
    """The card's *Speed vs concurrency* (see the module docstring); ``plot``: the release folder holds
    :data:`SPEED_PLOT`; ``model``: as :func:`usage_spec`'s."""
    if ab is None:
        return {"ok": False, "reason": why}
    t0, m0 = primary(ab)
    tol = tolerance(cfg, inputs, ab)
    curves = _curves(ab)
    pays, pays_note = _pays(ab, curves, tol)
    rows = [{"users": c, "none": _cell(v["none"], None), "baseline": _cell(v["baseline"], v["none"]),
             "candidate": _cell(v["candidate"], v["none"]), "released": _cell(v["released"], v["none"]),
             "k": "off" if v["k"] == 0 else str(v["k"]), "source": v["source"]} for c, v in curves.items()]
    return {"ok": True, "temperature": f"{t0:g}", "method": m0, "k": ab.num_speculative_tokens,
            "baseline_name": _baseline_name(cfg, inputs), "rows": rows, "plot": plot and bool(rows),
            "pays": pays, "pays_note": pays_note, "schedule": _schedule_lines(ab, model),
            "sampling": sampling_advice(ab, tol, model),
            "raw": {"tolerance": tol, "by_concurrency": {str(c): v for c, v in curves.items()},
                    "schedule": ab.raw.get("schedule"),
                    "released": _released_raw(ab, model)}}


def _released_raw(ab: AbLiveResult, model: str | None) -> dict | None:
    """``release.json``'s ``released`` (:func:`released_record`; ``model``: the drafter's repo in its config)."""
    if ab.schedule is None:
        return None
    rec = released_record(ab)
    return {**rec, "speculative_config": with_model(rec["speculative_config"], model)}


def plot_speed(ab: AbLiveResult, path: Path, baseline_name: str = "released") -> Path | None:
    """tok/s against concurrent users (gate's temperature): no speculation, the released and the fine-tuned drafter
    at the fixed K and, with a schedule, the released configuration (dashed where derived, not served). None (and
    no file) when the A/B measured no concurrency."""
    curves = _curves(ab)
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = list(curves)
    k, sc = ab.num_speculative_tokens, ab.schedule
    lines = {"none": ("no speculation", "tab:gray", "-"),
             "baseline": (f"{baseline_name} drafter, K={k}", "tab:orange", "-"),
             "candidate": (f"fine-tuned, K={k}", "tab:blue", "-")}
    rel = released_configuration(ab) if sc is not None else None
    if rel is not None and rel.kind == "fixed":
        if sc.served:
            lines["served"] = ("schedule as served (drafter loaded)", "tab:red", ":")
        upto = f" up to {_users(rel.limit)}, no drafter above" if rel.limit else ""
        lines["released"] = (f"released configuration (fixed K={rel.k}{upto})", "tab:green", "-")
    elif sc is not None and (limit := rel.limit):
        lines["served"] = ("schedule as served (drafter loaded)", "tab:red", ":")
        lines["released"] = (f"released configuration (schedule up to {_users(limit)}, no drafter above)",
                             "tab:green", "-")
    elif sc is not None:
        lines["released"] = ("released configuration (schedule, " + ("served" if sc.served else "derived") + ")",
                             "tab:green", "-" if sc.served else "--")
    fig, ax = plt.subplots(figsize=(7, 5))
    for key, (label, color, style) in lines.items():
        ys = [curves[c][key] for c in conc]
        if any(y is not None for y in ys):
            ax.plot(conc, [float("nan") if y is None else y for y in ys], marker="o", linestyle=style, label=label,
                    color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc)
    ax.set_xticklabels([str(c) for c in conc])
    ax.minorticks_off()
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("tok/s (all users)")
    t0, m0 = primary(ab)
    ax.set_title(f"Live tok/s vs concurrent users (T={t0:g}, {m0} drafts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_speed_plot(cfg, inputs, out: Path) -> Path | None:
    """:data:`SPEED_PLOT` under the release folder ``out`` from the A/B's output; None without a live A/B."""
    ab, _ = read_result(inputs, "ab_live", AbLiveResult)
    if ab is None:
        return None
    return plot_speed(ab, Path(out) / SPEED_PLOT, _baseline_name(cfg, inputs))
