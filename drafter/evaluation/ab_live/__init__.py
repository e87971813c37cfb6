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
* **Sweep and schedule** (:mod:`~drafter.evaluation.ab_live.sweep`): at the gate's temperature the fine-tuned
  drafter is also measured at the other Ks of ``ab_live.ks()`` (servers ``candidate-k<K>``); the schedule derived
  from the sweep is served on one more server (``schedule``) and is the released configuration the gate checks
  against no speculation at every concurrency.
* **Servers** (:func:`ab_serving`): every server of the A/B runs with the same settings, eager or
  compiled (``ab_live.compiled``; :func:`compile_mode` says which in the tables and the card).

Modules: :mod:`~drafter.evaluation.ab_live.plan` (replay, engine facts, the matrix and the servers),
:mod:`~drafter.evaluation.ab_live.measure` (one measurement, the counters, the lossless check),
:mod:`~drafter.evaluation.ab_live.rounds` (the rounds: one server per drafter in turn, and the document),
:mod:`~drafter.evaluation.ab_live.results` (``ab_live.json``: :class:`AbLiveResult`, summary keys, means, flat
metrics), :mod:`~drafter.evaluation.ab_live.tables` (Markdown).

Example::

    turns, notes = replay_turns(iter_rows(generate_dir / "shards"), num_turns=8)
    with serve(model_dir, cfg.serving, speculative_config=speculative_config(cfg.ab_live, "greedy")) as srv:
        run = measure(srv, turns, concurrency=1, max_tokens=64, temperature=0.0)
    run["tok_s"], run["tau"], run["accepted_per_pos"]
"""
from __future__ import annotations

from drafter.evaluation.ab_live.measure import counters_delta, lossless_check, measure, timing_delta
from drafter.evaluation.ab_live.plan import (DRAFTERS, REPLAY_DOMAIN, ReplayTurn, ab_servers, ab_serving, compile_mode,
                                             engine_draft_sample_methods, plan_draft_methods, plan_matrix, primary_of,
                                             replay_turns, speculative_config)
from drafter.evaluation.ab_live.results import (AB_LIVE_JSON, NO_ENTRY, AbLiveResult, Lossless, Replay, SummaryEntry,
                                                SummaryKey, as_ab_live, flat_metrics, load_ab_live, matrix,
                                                parse_summary, primary, run_key, save_ab_live, summarize, summary_of,
                                                temp_tag, temperatures)
from drafter.evaluation.ab_live.sweep import (SCHEDULE, ScheduleRecord, Speed, best_fixed, released_speeds,
                                              schedule_json, schedule_record, serve_limit, sweep_name,
                                              sweep_of)
from drafter.evaluation.ab_live.tables import (ab_table, benchmark_markdown, matrix_markdown, matrix_rows,
                                               sweep_markdown)

__all__ = [
    "AB_LIVE_JSON", "DRAFTERS", "NO_ENTRY", "REPLAY_DOMAIN", "AbLiveResult", "Lossless", "Replay", "ReplayTurn",
    "SummaryEntry", "SummaryKey", "ab_servers", "ab_serving", "ab_table", "as_ab_live", "compile_mode",
    "counters_delta", "engine_draft_sample_methods", "flat_metrics", "load_ab_live", "lossless_check", "matrix",
    "matrix_markdown", "matrix_rows", "measure", "parse_summary", "plan_draft_methods", "plan_matrix", "primary",
    "primary_of", "replay_turns", "run_key", "save_ab_live", "speculative_config", "summarize", "summary_of",
    "temp_tag", "temperatures", "timing_delta", "SCHEDULE", "ScheduleRecord", "Speed", "best_fixed",
    "released_speeds", "schedule_json", "serve_limit", "schedule_record", "sweep_name", "sweep_of", "sweep_markdown",
    "benchmark_markdown",
]
