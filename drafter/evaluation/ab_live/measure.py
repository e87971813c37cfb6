"""One A/B measurement: replay turns against a running server with ``concurrency`` requests in flight, read
vLLM's spec-decode counters and request histograms before and after; the lossless check (see
:mod:`drafter.evaluation.ab_live`)."""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING

from drafter.core.errors import StageError
from drafter.data.generate import OpenAIChatBackend, RequestError, Sampling, request_seed
from drafter.evaluation.ab_live.plan import ReplayTurn
from drafter.serving.server import SPEC_COUNTERS, request_timing, spec_decode_counters

if TYPE_CHECKING:
    from drafter.serving.server import Server


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

