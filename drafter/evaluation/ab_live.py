"""Live A/B of drafters in vLLM: replayed agent turns, tok/s and latency, τ from vLLM's counters.

vLLM cannot swap drafters inside a running server, so one *round* starts a server for each drafter
in turn — ``none`` (no speculation: the speed reference), ``baseline`` (the released drafter),
``candidate`` (the fine-tuned one), the last two once per draft sampling method — measures every
temperature and concurrency on it and stops it. Rounds repeat the same order (A B A B …), so slow
drift of the machine hits every drafter alike.

* **Matrix** (:func:`plan_matrix`, :func:`ab_servers`): temperature × drafter × draft sampling method ×
  concurrency. The temperature is a request parameter, the draft sampling method a server setting: at
  T=0 only ``greedy`` runs (vLLM drafts greedily at T=0 whatever the method), at T>0 every configured
  method the engine accepts, each on its own server. Results are keyed ``t<T>/<drafter>/<method>/c<c>``
  (:func:`run_key`, read back with :func:`parse_summary`); the *primary* measurement (:func:`primary`:
  the lowest temperature, greedy drafts) is what the gate checks and what the plain metric names carry.

* **Replay** (:func:`replay_turns`): each assistant turn of the held-out multi-turn agent
  conversations, with the messages before it (the target's own earlier answers) as the prompt.
* **Measurement** (:func:`measure`): the turns are sent through :class:`drafter.data.generate.OpenAIChatBackend`
  with ``concurrency`` in flight; output tok/s = completion tokens / wall time, per-request latency,
  and the delta of vLLM's ``vllm:spec_decode_*`` counters over the run (:func:`counters_delta`):
  τ = 1 + accepted / drafts and accepted tokens per draft position; from vLLM's request histograms
  (:func:`timing_delta`) the mean time to first token and the decode speed a user sees with the
  prompt's prefill excluded — speculation speeds up decoding only, so a replay of long prompts and
  short answers shows a smaller end-to-end gain than its decode speedup.
* **Lossless** (:func:`lossless_check`): at T=0 the token ids with speculation must equal those
  without it.
* **Draft sampling** (:func:`engine_draft_sample_methods`): which ``draft_sample_method`` values the
  serving env's vLLM accepts, read from its source without importing it.
* **Servers** (:func:`ab_serving`): every server of the A/B runs with the same settings, eager or
  compiled (``ab_live.compiled``; :func:`compile_mode` says which in the tables and the card).

Example::

    turns, notes = replay_turns(iter_rows(generate_dir / "shards"), num_turns=8)
    with serve(model_dir, cfg.serving, speculative_config=speculative_config(cfg.ab_live, "greedy")) as srv:
        run = measure(srv, turns, concurrency=1, max_tokens=64, temperature=0.0)
    run["tok_s"], run["tau"], run["accepted_per_pos"]
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from drafter.core.errors import StageError
from drafter.data.generate import OpenAIChatBackend, RequestError, Sampling, request_seed
from drafter.serving.server import SPEC_COUNTERS, request_timing, spec_decode_counters

if TYPE_CHECKING:
    from drafter.core.config import AbLiveConfig, ServingConfig
    from drafter.serving.server import Server

DRAFTERS = ("none", "baseline", "candidate")
REPLAY_DOMAIN = "agent"


# --------------------------------------------------------------------------- replayed turns


@dataclass(frozen=True)
class ReplayTurn:
    """One request of the replay: an assistant turn of a held-out conversation and what came before it."""

    conv_id: str
    domain: str
    message_index: int  # index of the assistant message in the conversation
    messages: list[dict] = field(repr=False)  # the prompt: every message before it
    template_kwargs: dict = field(default_factory=dict, repr=False)


def _assistant_count(row: dict) -> int:
    return sum(1 for m in row.get("messages", []) if m.get("role") == "assistant")


def _turns_of(row: dict) -> list[ReplayTurn]:
    msgs = row["messages"]
    return [ReplayTurn(conv_id=row["id"], domain=row.get("domain", "?"), message_index=i,
                       messages=[{"role": m["role"], "content": m["content"]} for m in msgs[:i]],
                       template_kwargs=dict(row.get("chat_template_kwargs") or {}))
            for i, m in enumerate(msgs) if m.get("role") == "assistant" and i > 0]


def replay_turns(rows: Iterable[dict], num_turns: int, split: str = "heldout",
                 domain: str = REPLAY_DOMAIN) -> tuple[list[ReplayTurn], list[str]]:
    """The first ``num_turns`` assistant turns of the ``split`` conversations, multi-turn ``domain`` first.

    Conversations are taken whole, in id order: every turn of the first agent conversation, then
    the next one's, so later turns carry the earlier ones (as an agent's requests do). With fewer
    than ``num_turns`` such turns, other domains' multi-turn conversations of the split fill up,
    then (still short) the split's single-turn ones; each fallback is said in the returned notes.
    Raises :class:`StageError` when the split has no conversation at all.
    """
    held = sorted((r for r in rows if r.get("split") == split and r.get("messages")), key=lambda r: r["id"])
    if not held:
        raise StageError(f"no {split!r} conversations to replay (the generate output has none)")
    tiers = [
        (f"multi-turn {domain}", [r for r in held if r.get("domain") == domain and _assistant_count(r) > 1]),
        (f"other domains' multi-turn", [r for r in held if r.get("domain") != domain and _assistant_count(r) > 1]),
        ("single-turn", [r for r in held if _assistant_count(r) == 1]),
    ]
    turns: list[ReplayTurn] = []
    notes: list[str] = []
    for i, (what, tier) in enumerate(tiers):
        if len(turns) >= num_turns:
            break
        before = len(turns)
        for r in tier:
            turns += _turns_of(r)
            if len(turns) >= num_turns:
                break
        added = min(len(turns), num_turns) - before
        if i > 0 and added:
            notes.append(f"only {before} {split} turns from {tiers[0][0]} conversations; "
                         f"{added} more taken from {what} conversations")
    turns = turns[:num_turns]
    if len(turns) < num_turns:
        notes.append(f"ab_live.num_turns={num_turns} but the {split} split has only {len(turns)} assistant turns: "
                     f"replaying {len(turns)}")
    return turns, notes


# --------------------------------------------------------------------------- engine facts


def speculative_config(c: "AbLiveConfig", draft_sample_method: str | None, *, engine_has_field: bool = True) -> dict | None:
    """vLLM's ``--speculative-config`` for a drafter: None for no speculation.

    ``draft_sample_method`` is left out for an engine without that setting (it drafts greedily and
    would reject the unknown key).
    """
    if draft_sample_method is None:
        return None
    spec = {"method": c.method, "num_speculative_tokens": c.num_speculative_tokens}
    return spec | {"draft_sample_method": draft_sample_method} if engine_has_field else spec


_PROBE = r"""
import ast, importlib.util, json, os, sys
out = {"methods": None, "why": None}
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    out["why"] = "vllm is not installed in this environment"
else:
    src = os.path.join(list(spec.submodule_search_locations)[0], "config", "speculative.py")
    try:
        tree = ast.parse(open(src).read())
    except OSError as e:
        tree, out["why"] = None, f"cannot read {src}: {e}"
    if tree is not None:
        aliases = {}
        for n in tree.body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                aliases[n.targets[0].id] = n.value
        ann = None
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig":
                for b in n.body:
                    if isinstance(b, ast.AnnAssign) and getattr(b.target, "id", None) == "draft_sample_method":
                        ann = b.annotation
        if ann is None:
            out["why"] = f"SpeculativeConfig in {src} has no draft_sample_method field"
        else:
            if isinstance(ann, ast.Name):
                ann = aliases.get(ann.id, ann)
            vals = [c.value for c in ast.walk(ann) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            out["methods"] = vals or None
            if not vals:
                out["why"] = f"cannot read the values of draft_sample_method in {src}"
print(json.dumps(out))
"""


def engine_draft_sample_methods(python: str | Path, timeout: float = 60.0) -> tuple[list[str] | None, str | None]:
    """``(methods, why)``: the ``draft_sample_method`` values the serving env's vLLM accepts.

    Read from ``vllm/config/speculative.py`` (the ``SpeculativeConfig`` field and its ``Literal``)
    with ``ast``, without importing vLLM (that takes ~10 s). ``methods`` is None when the field is
    absent (such an engine drafts greedily only); ``why`` then says what was found.
    """
    r = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return None, f"probing vLLM with {python} failed: {(r.stderr or r.stdout).strip()[-300:]}"
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["methods"], d["why"]


def plan_draft_methods(wanted: list[str], engine_methods: list[str] | None, why: str | None,
                       temperature: float, engine_version: str) -> tuple[list[str], dict[str, str]]:
    """``(run, unsupported)``: the configured draft sampling methods to measure, and why the others are not.

    An engine without the ``draft_sample_method`` field drafts greedily: ``greedy`` runs, anything
    else is unsupported. At temperature 0 vLLM drafts greedily whatever the method (its proposer
    samples only when some request is not greedy), so ``probabilistic`` would repeat ``greedy``.
    """
    run: list[str] = []
    unsupported: dict[str, str] = {}
    for m in dict.fromkeys(wanted):
        if engine_methods is None:
            if m == "greedy":
                run.append(m)
            else:
                unsupported[m] = f"vLLM {engine_version} has no draft_sample_method setting ({why}); it drafts greedily"
        elif m not in engine_methods:
            unsupported[m] = (f"vLLM {engine_version} accepts draft_sample_method in {engine_methods}, not {m!r}")
        elif m != "greedy" and temperature == 0:
            unsupported[m] = (f"at temperature 0 vLLM {engine_version} drafts greedily with any draft_sample_method "
                              f"(the proposer samples only for non-greedy requests), so {m!r} equals 'greedy'; "
                              f"add a temperature > 0 to ab_live.temperature to measure it")
        else:
            run.append(m)
    if not run:
        raise StageError(f"ab_live.draft_sample_methods={wanted}: none can run on vLLM {engine_version} at temperature "
                         f"{temperature:g}: {unsupported}")
    return run, unsupported


def plan_matrix(wanted: list[str], engine_methods: list[str] | None, why: str | None, temperatures: list[float],
                engine_version: str) -> tuple[dict[float, list[str]], dict[str, str]]:
    """``(plan, unsupported)``: per temperature the draft sampling methods to measure there
    (:func:`plan_draft_methods` at each), and why the others are not — keyed by the method where it runs at
    no temperature, by ``<method> at T=<t>`` where it runs at some temperatures only.

    Example: temperatures [0, 1], methods [greedy, probabilistic] on vLLM 0.32 →
    ``({0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]}, {"probabilistic at T=0": "at temperature 0 …"})``.
    """
    plan: dict[float, list[str]] = {}
    why_not: dict[str, dict[float, str]] = {}
    for t in sorted(temperatures):
        plan[t], unsupported = plan_draft_methods(wanted, engine_methods, why, t, engine_version)
        for m, reason in unsupported.items():
            why_not.setdefault(m, {})[t] = reason
    out: dict[str, str] = {}
    for m, by_t in why_not.items():
        if len(by_t) == len(plan):  # measured at no temperature
            out[m] = "; ".join(dict.fromkeys(by_t.values()))
        else:
            out |= {f"{m} at T={t:g}": reason for t, reason in by_t.items()}
    return plan, out


def ab_servers(plan: dict[float, list[str]], drafts_first: bool = False,
               baseline_at: str = "all") -> list[tuple[str, str | None, list[float]]]:
    """One round: ``(drafter, draft sample method, temperatures)`` per server, in the fixed A B order.

    No speculation is one server, measured at every temperature; each drafter has one server per draft
    sampling method (a server setting), measured at the temperatures (a request parameter) where ``plan``
    runs that method. ``baseline_at="gate"`` (``ab_live.baseline_at``) keeps the baseline to the gate's
    measurement only (:func:`primary_of` the plan).
    ``drafts_first`` (DSpark) starts with the speculative servers, so an engine that refuses the method
    says so at once.
    """
    if baseline_at not in ("all", "gate"):
        raise ValueError(f"baseline_at={baseline_at!r}: expected 'all' or 'gate'")
    temps = sorted(plan)
    methods = list(dict.fromkeys(m for t in temps for m in plan[t]))
    spec = [(d, m, [t for t in temps if m in plan[t]]) for d in ("baseline", "candidate") for m in methods]
    if baseline_at == "gate" and temps:
        t0, m0 = primary_of(plan)
        spec = [(d, m, [t0] if d == "baseline" else ts) for d, m, ts in spec if d != "baseline" or m == m0]
    none = [("none", None, temps)]
    return spec + none if drafts_first else none + spec


def ab_serving(serving: "ServingConfig", server_args: list[str], compiled: bool | None = None) -> "ServingConfig":
    """The settings every server of an A/B runs with: ``serving`` plus ``server_args`` (``ab_live.server_args``),
    compiled or eager as ``compiled`` says (``ab_live.compiled``; None keeps ``serving.enforce_eager``). A vLLM CPU
    subprocess also gets :func:`drafter.serving.server.cpu_server_env` from ``serve`` itself, as every server does."""
    eager = serving.enforce_eager if compiled is None else not compiled
    return serving.model_copy(update={"extra_args": [*serving.extra_args, *server_args], "enforce_eager": eager})


def compile_mode(compiled: bool | None) -> str:
    """How the A/B's servers ran, in words (ab_live.json's ``compiled``; None: an output that did not record it)."""
    if compiled is None:
        return "eager or compiled: not recorded"
    return "compiled (CUDA graphs / torch.compile)" if compiled else "eager (--enforce-eager: no graph capture)"


# --------------------------------------------------------------------------- counters


def counters_delta(before: dict, after: dict, k: int | None = None) -> dict:
    """Counters of one measurement: ``after - before`` of :func:`drafter.serving.server.spec_decode_counters`.

    Returns ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens`` (ints), ``accepted_per_pos``
    (a list over positions 0..K-1; ``k`` fixes its length) and ``tau`` = 1 + accepted/drafts (None
    without drafts).
    """
    d = {key: int(round(after.get(key, 0) - before.get(key, 0))) for key in SPEC_COUNTERS}
    pa, pb = after.get("accepted_per_pos", {}), before.get("accepted_per_pos", {})
    n = k if k is not None else (max(pa) + 1 if pa else 0)
    d["accepted_per_pos"] = [int(round(pa.get(p, 0) - pb.get(p, 0))) for p in range(n)]
    if any(v < 0 for v in [d[key] for key in SPEC_COUNTERS] + d["accepted_per_pos"]):
        raise StageError(f"vLLM's spec-decode counters went down during a measurement (server restarted?): "
                         f"before {before}, after {after}")
    d["tau"] = round(1 + d["num_accepted_tokens"] / d["num_drafts"], 4) if d["num_drafts"] else None
    return d


def timing_delta(before: dict, after: dict) -> dict:
    """Server-side timing of one measurement from two :func:`drafter.serving.server.request_timing` readings.

    ``requests`` (finished, from the decode histogram's count), ``ttft_mean_s`` (mean time to first
    token), ``prefill_s`` and ``decode_s`` (summed over requests), ``prompt_tokens`` and
    ``decode_tok_s`` = (generation tokens − requests) / decode seconds: the speed of the tokens after
    the first, prefill excluded, per user. Values the engine does not export are None.
    """
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = int(round(d.get("decode_count", 0)))
    after_first = d.get("generation_tokens", 0) - n
    return {
        "requests": n,
        "ttft_mean_s": round(d["ttft_sum"] / d["ttft_count"], 4) if d.get("ttft_count") else None,
        "prefill_s": round(d["prefill_sum"], 3) if d.get("prefill_count") else None,
        "decode_s": round(d["decode_sum"], 3) if n else None,
        "prompt_tokens": int(round(d.get("prompt_tokens", 0))),
        "decode_tok_s": round(after_first / d["decode_sum"], 3) if n and d.get("decode_sum", 0) > 0 and after_first > 0 else None,
    }


# --------------------------------------------------------------------------- one measurement


def _latency_stats(lat: list[float]) -> dict:
    if not lat:
        return {"mean": None, "p50": None, "p90": None}
    qs = statistics.quantiles(lat, n=10, method="inclusive") if len(lat) > 1 else [lat[0]] * 9
    return {"mean": round(statistics.fmean(lat), 4), "p50": round(statistics.median(lat), 4), "p90": round(qs[8], 4)}


async def _replay(backend: OpenAIChatBackend, turns: list[ReplayTurn], concurrency: int, sampling: Sampling,
                  seed: int, on_done=None) -> list[tuple[list[int] | None, int, float]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(t: ReplayTurn):
        async with sem:
            t0 = time.monotonic()
            try:
                out = await backend.chat(t.messages, sampling=sampling, seed=request_seed(seed, t.conv_id, t.message_index),
                                         template_kwargs=t.template_kwargs)
            except RequestError as e:
                raise StageError(f"ab_live: request for {t.conv_id} (message {t.message_index}) failed: {e}") from None
            dt = time.monotonic() - t0
            if on_done is not None:
                on_done()
            n = len(out.token_ids) if out.token_ids is not None else out.completion_tokens
            return out.token_ids, n, dt

    tasks = [asyncio.create_task(one(t)) for t in turns]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await backend.aclose()


def measure(server: "Server", turns: list[ReplayTurn], *, concurrency: int, max_tokens: int, temperature: float,
            k: int | None = None, timeout_s: float = 300.0, seed: int = 0, on_done=None) -> dict:
    """Replay ``turns`` against ``server`` with ``concurrency`` requests in flight.

    Returns ``requests``, ``output_tokens``, ``seconds`` (wall), ``tok_s``, ``latency_s``
    (mean/p50/p90 per request), the spec-decode counter delta (:func:`counters_delta`), the
    server-side timing (``server``: :func:`timing_delta`) and ``token_ids`` (per turn, for the
    lossless check). A failed request raises :class:`StageError`:
    a timed benchmark does not retry.
    """
    if not turns:
        raise StageError("ab_live: nothing to replay")
    backend = OpenAIChatBackend(server.base_url, server.model, engine=server.engine,
                                engine_version=server.engine_version or "", timeout_s=timeout_s,
                                max_connections=max(concurrency, 1), api_key=server.api_key)
    sampling = Sampling(temperature=temperature, top_p=1.0, max_tokens=max_tokens)
    text = server.metrics_text()
    before, timing_before = spec_decode_counters(text), request_timing(text)
    t0 = time.monotonic()
    results = asyncio.run(_replay(backend, turns, concurrency, sampling, seed, on_done))
    seconds = time.monotonic() - t0
    text = server.metrics_text()
    after, timing_after = spec_decode_counters(text), request_timing(text)
    tokens = sum(n for _, n, _ in results)
    return {
        "concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "seconds": round(seconds, 3),
        "tok_s": round(tokens / seconds, 3) if seconds > 0 else None,
        "latency_s": _latency_stats([dt for _, _, dt in results]),
        **counters_delta(before, after, k),
        "server": timing_delta(timing_before, timing_after),
        "token_ids": [ids for ids, _, _ in results],
    }


# --------------------------------------------------------------------------- results


def lossless_check(reference: list[list[int] | None], speculative: list[list[int] | None], n: int) -> dict:
    """Compare the first ``n`` outputs (token ids) without and with speculation.

    ``{"prompts", "identical", "ok", "mismatches": [{"prompt": i, "first_diff_token": j}]}``; an output
    without token ids (the server did not return them) is a mismatch at token -1.
    """
    n = min(n, len(reference), len(speculative))
    mismatches = []
    for i in range(n):
        a, b = reference[i], speculative[i]
        if a is None or b is None:
            mismatches.append({"prompt": i, "first_diff_token": -1})
        elif a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"prompt": i, "first_diff_token": j})
    return {"prompts": n, "identical": n - len(mismatches), "ok": n > 0 and not mismatches, "mismatches": mismatches}


def temp_tag(temperature: float) -> str:
    """A temperature in result keys and metric names: ``t0``, ``t1``, ``t0.7``."""
    return f"t{temperature:g}"


def run_key(drafter: str, method: str | None, concurrency: int, temperature: float) -> str:
    """Summary key: ``t<T>/<drafter>/<method or none>/c<c>``, e.g. ``t0/candidate/greedy/c1``."""
    return f"{temp_tag(temperature)}/{drafter}/{method or 'none'}/c{concurrency}"


SummaryKey = tuple  # (temperature, drafter, method or "none", concurrency)


def temperatures(ab: dict) -> list[float]:
    """The temperatures of an ab_live.json (``temperatures``; an older output's one ``temperature``)."""
    if ab.get("temperatures"):
        return sorted(float(t) for t in ab["temperatures"])
    return [float(ab.get("temperature") or 0.0)]


def parse_summary(ab: dict) -> dict[SummaryKey, dict]:
    """An ab_live.json's ``summary`` by ``(temperature, drafter, method or "none", concurrency)``.

    Keys are ``t<T>/<drafter>/<method>/c<c>``; an older output's ``<drafter>/<method>/c<c>`` is read at its
    one temperature. A malformed key raises :class:`StageError` naming it.
    """
    if not isinstance(ab, dict) or "summary" not in ab:
        raise StageError("ab_live.json: missing key 'summary'")
    legacy_t = temperatures(ab)[0]
    out: dict[SummaryKey, dict] = {}
    for key, entry in ab["summary"].items():
        parts = key.split("/")
        if len(parts) == 3:
            parts = [temp_tag(legacy_t), *parts]
        try:
            if len(parts) != 4 or not parts[0].startswith("t") or not parts[3].startswith("c"):
                raise ValueError
            out[(float(parts[0][1:]), parts[1], parts[2], int(parts[3][1:]))] = entry
        except ValueError:
            raise StageError(f"ab_live.json: summary key {key!r} is not t<temperature>/<drafter>/<method>/c<concurrency>") from None
    return out


def matrix(ab: dict) -> dict[float, list[str]]:
    """Temperature → the draft sampling methods measured there (in the order they ran), from the summary."""
    out: dict[float, list[str]] = {}
    for t, d, m, _ in parse_summary(ab):
        out.setdefault(t, [])
        if d != "none" and m not in out[t]:
            out[t].append(m)
    return dict(sorted(out.items()))


def primary_of(plan: dict[float, list[str]]) -> tuple[float, str]:
    """``(temperature, method)`` of the primary measurement of a temperature → draft sampling methods plan: the
    lowest temperature, greedy drafts when planned there (else its first method)."""
    t = min(plan)
    methods = plan[t] or ["greedy"]
    return t, "greedy" if "greedy" in methods else methods[0]


def primary(ab: dict) -> tuple[float, str]:
    """:func:`primary_of` an A/B result's measured matrix. The gate checks it; the stage's plain metric names
    carry it."""
    return primary_of(matrix(ab) or {temperatures(ab)[0]: []})


def summarize(runs: list[dict]) -> dict:
    """Means over rounds per (temperature, drafter, draft sample method, concurrency), keyed by :func:`run_key`."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(run_key(r["drafter"], r["draft_sample_method"], r["concurrency"], r["temperature"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        drafts = sum(r["num_drafts"] for r in rs)
        k = max((len(r["accepted_per_pos"]) for r in rs), default=0)
        acc = [sum(r["accepted_per_pos"][p] for r in rs if p < len(r["accepted_per_pos"])) for p in range(k)]
        p50s = [r["latency_s"]["p50"] for r in rs if r["latency_s"]["p50"] is not None]
        ttfts = [r["server"]["ttft_mean_s"] for r in rs if (r.get("server") or {}).get("ttft_mean_s") is not None]
        dec = [r["server"]["decode_tok_s"] for r in rs if (r.get("server") or {}).get("decode_tok_s") is not None]
        out[key] = {
            "tau": round(statistics.fmean(taus), 4) if taus else None,
            "tok_s": round(statistics.fmean(r["tok_s"] for r in rs), 3),
            "latency_p50_s": round(statistics.fmean(p50s), 4) if p50s else None,
            "accept_rate_per_pos": [round(a / drafts, 4) for a in acc] if drafts else [],
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "decode_tok_s": round(statistics.fmean(dec), 3) if dec else None,
            "rounds": len(rs),
        }
    return out


def _ratio(x: float | None, ref: float | None, nd: int = 4) -> float | None:
    return round(x / ref, nd) if x and ref else None


def flat_metrics(result: dict, concurrency: list[int]) -> dict:
    """The stage's flat metrics.

    The primary measurement (:func:`primary`) keeps the plain names: ``tau_live_<drafter>`` (smallest
    concurrency), ``tok_s_c<c>_<drafter>``, ``speedup_c<c>_<drafter>`` (vs no speculation at the same
    temperature), ``decode_tok_s_c<c1>_<drafter>``, ``decode_speedup_c<c1>_<drafter>``; every other temperature
    and method adds ``_t<T>_<method>`` to the first three (no speculation: ``tok_s_c<c>_none_t<T>``), e.g.
    ``speedup_c1_candidate_t1_probabilistic``.
    """
    s = parse_summary(result)
    t0, m0 = primary(result)
    c1 = min(concurrency)
    out: dict = {}

    def speeds(field: str, t: float, m: str, c: int, prefix: str, sfx: str) -> None:
        ref = s.get((t, "none", "none", c), {}).get(field)
        for d in ("baseline", "candidate"):
            x = s.get((t, d, m, c), {}).get(field)
            out[f"{prefix}tok_s_c{c}_{d}{sfx}"] = x
            out[f"{prefix}speedup_c{c}_{d}{sfx}"] = _ratio(x, ref)

    combos = [(t0, m0)] + [(t, m) for t, ms in matrix(result).items() for m in ms if (t, m) != (t0, m0)]
    for i, (t, m) in enumerate(combos):
        sfx = "" if i == 0 else f"_{temp_tag(t)}_{m}"
        for d in ("baseline", "candidate"):
            out[f"tau_live_{d}{sfx}"] = s.get((t, d, m, c1), {}).get("tau")
        for c in concurrency:
            if all(t != tt for tt, _ in combos[:i]):  # no speculation: once per temperature
                none_sfx = "" if t == t0 else f"_{temp_tag(t)}"
                out[f"tok_s_c{c}_none{none_sfx}"] = s.get((t, "none", "none", c), {}).get("tok_s")
            speeds("tok_s", t, m, c, "", sfx)
    out[f"decode_tok_s_c{c1}_none"] = s.get((t0, "none", "none", c1), {}).get("decode_tok_s")
    speeds("decode_tok_s", t0, m0, c1, "decode_", "")  # server side, prefill excluded
    lossless = result.get("lossless") or {}
    out["lossless_ok"] = lossless.get("ok")
    out["lossless_identical"] = lossless.get("identical")
    out["temperature"] = t0
    out["draft_sample_method"] = m0
    out["temperatures"] = temperatures(result)
    out["compiled"] = result.get("compiled")
    out["num_speculative_tokens"] = result["num_speculative_tokens"]
    out["engine_version"] = result.get("engine_version")
    return out


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _x(x: float | None) -> str:
    return _f(x, ".2f") + ("×" if x is not None else "")


def _rows(s: dict[SummaryKey, dict]) -> list[tuple[float, str, str]]:
    """(temperature, drafter, method) of a parsed summary in table order."""
    return sorted({k[:3] for k in s}, key=lambda r: (r[0], DRAFTERS.index(r[1]), r[2]))


def ab_table(result: dict, concurrency: list[int]) -> str:
    """Markdown: per temperature, drafter and draft sampling, live τ, tok/s and speedup vs no speculation (at the
    same temperature) at each concurrency, per-request latency p50; then the lossless check and what was not
    measured."""
    s = parse_summary(result)
    rows = _rows(s)
    head = ["T", "drafter", "draft sampling", "live τ"]
    for c in concurrency:
        head += [f"tok/s c{c}", f"speedup c{c}", f"latency p50 c{c} (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, d, m in rows:
        c1 = s.get((t, d, m, min(concurrency)), {})
        cells = [f"{t:g}", d, "—" if m == "none" else m, _f(c1.get("tau"), ".3f")]
        for c in concurrency:
            e, ref = s.get((t, d, m, c), {}), s.get((t, "none", "none", c), {})
            cells += [_f(e.get("tok_s"), ".1f"), _x(_ratio(e.get("tok_s"), ref.get("tok_s"))),
                      _f(e.get("latency_p50_s"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    if any(e.get("decode_tok_s") for e in s.values()):
        head = ["T", "drafter", "draft sampling"]
        for c in concurrency:
            head += [f"TTFT c{c} (s)", f"decode tok/s per user c{c}", f"decode speedup c{c}"]
        lines += ["", "Server side (vLLM's request histograms; decode = the tokens after the first, prefill excluded):", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for t, d, m in rows:
            cells = [f"{t:g}", d, "—" if m == "none" else m]
            for c in concurrency:
                e, ref = s.get((t, d, m, c), {}), s.get((t, "none", "none", c), {})
                cells += [_f(e.get("ttft_mean_s"), ".3f"), _f(e.get("decode_tok_s"), ".1f"),
                          _x(_ratio(e.get("decode_tok_s"), ref.get("decode_tok_s")))]
            lines.append("| " + " | ".join(cells) + " |")
    rounds = max((e["rounds"] for e in s.values()), default=0)
    temps = temperatures(result)
    lines.append("")
    lines.append(f"K = {result['num_speculative_tokens']} ({result['method']}), temperature{'s' if len(temps) > 1 else ''} "
                 f"{', '.join(f'{t:g}' for t in temps)}, vLLM {result.get('engine_version')}, servers "
                 f"{compile_mode(result.get('compiled'))}, {rounds} round(s) interleaved; τ and tok/s are means over rounds."
                 + (f" Every server ran with `{' '.join(result['server_args'])}`." if result.get("server_args") else ""))
    if (dv := (result.get("draft_vocab") or {}).get("candidate")):
        lines.append(f"The fine-tuned drafter drafts over {dv} tokens (its draft vocabulary, `train.draft_vocab_size`); "
                     f"the released one over the whole vocabulary.")
    replay = result.get("replay") or {}
    if replay.get("heldout"):
        lines.append(f"Replayed: {replay['turns']} turns of {replay['conversations']} conversations of the "
                     f"{replay['heldout']['text']}.")
    ll = result.get("lossless")
    if ll:
        verdict = "identical" if ll["ok"] else "DIFFERENT"
        lines.append(f"Lossless at T=0: {ll['identical']}/{ll['prompts']} prompts {verdict} with and without speculation"
                     + (f" (first mismatches: {ll['mismatches'][:3]})" if ll["mismatches"] else "") + ".")
    for m, why in (result.get("unsupported") or {}).items():
        lines.append(f"Not measured: draft sampling `{m}`: {why}.")
    if result.get("baseline_at") == "gate" and any(d == "candidate" and (t, "baseline", m) not in rows
                                                   for t, d, m in rows):
        t0, m0 = primary(result)
        lines.append(f"The released drafter ran at the gate's measurement only (T={t0:g}, {m0} drafts; "
                     "`ab_live.baseline_at: gate`).")
    return "\n".join(lines) + "\n"


def matrix_rows(ab: dict) -> list[dict]:
    """The A/B per temperature and draft sampling: for each temperature a no-speculation row, then per method
    the released and the fine-tuned drafter — ``{"temperature", "draft_sample_method" (None without
    speculation), "drafter", "tau" (smallest concurrency), "by_concurrency": [{"concurrency", "tok_s",
    "speedup"}]}``, the speedup against no speculation at the same temperature and concurrency."""
    s = parse_summary(ab)
    conc = sorted({k[3] for k in s})
    out = []
    for t, methods in matrix(ab).items():
        for d, m in [("none", "none")] + [(d, m) for m in methods for d in ("baseline", "candidate")]:
            if not any((t, d, m, c) in s for c in conc):
                continue
            ref = {c: s.get((t, "none", "none", c), {}).get("tok_s") for c in conc}
            out.append({"temperature": t, "draft_sample_method": None if d == "none" else m, "drafter": d,
                        "tau": s.get((t, d, m, conc[0]), {}).get("tau"),
                        "by_concurrency": [{"concurrency": c, "tok_s": s.get((t, d, m, c), {}).get("tok_s"),
                                            "speedup": _ratio(s.get((t, d, m, c), {}).get("tok_s"), ref[c])}
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
