"""Regenerate every assistant turn of a set of conversations with the served target.

The target answers through its OpenAI-compatible chat API (:class:`OpenAIChatBackend`, vLLM), or
in-process (:class:`TransformersBackend`, the fallback where vLLM is unavailable). Both give rows in
the same format. Multi-turn conversations are generated turn by turn: each later turn sees the
target's own earlier answers.

* **Deterministic**: each request carries a seed derived from ``(cfg.seed, row id, turn)``, so a
  rerun gives the same text (greedy decoding is deterministic anyway).
* **Concurrent**: up to ``concurrency`` conversations (hence requests) are in flight.
* **Retries**: a failed request (connection error, timeout, HTTP 5xx/429/408) is retried with
  exponential backoff, ``max_retries`` times; then it is counted as failed and its conversation
  dropped. The run fails (:class:`StageError`) when more than ``max_failed_fraction`` of requests
  failed — and stops as soon as that is certain.
* **Sharded, resumable**: conversations are cut, in order, into shards of ``shard_size``;
  ``shards/shard-00000.jsonl`` … are written atomically (temporary file + rename), each after its
  statistics in ``shard_stats/shard-00000.json``. On a rerun into the same directory, finished
  shards without failures are kept and skipped.
* **Thinking modes**: ``chat_template_kwargs: {"enable_thinking": ...}`` is sent only when the chat
  template reads ``enable_thinking``; the mode is recorded per row (``default`` when the template
  has no switch).

Row format (one JSON object per line)::

    {"id": "math-s0-00003", "split": "train", "domain": "math", "source": "builtin",
     "mode": "default", "chat_template_kwargs": {},
     "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}],
     "turns": [{"message_index": 1, "seed": 123, "token_ids": [...], "prompt_token_ids": [...],
                "finish_reason": "stop", "completion_tokens": 57, "reasoning": null}],
     "target": {"name": "...", "revision": "...", "chat_template_sha256": "..."},
     "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 128, "seed": 0},
     "engine": "vllm", "engine_version": "0.32.0"}

``turns[i].token_ids`` are the generated token ids of that assistant turn as the engine returned
them (vLLM: ``return_token_ids``; they end with the end-of-turn token when the turn finished
with ``stop``), ``prompt_token_ids`` the tokens of the rendered prompt the engine saw; ``None``
when the server does not return them.

Example::

    backend = OpenAIChatBackend("http://127.0.0.1:8000", "target", engine="vllm", engine_version="0.32.0")
    summary = generate_dataset(build_prompts(cfg.generate), backend, out, cfg.generate,
                               target={"name": "t", "revision": None, "chat_template_sha256": "…"})
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from drafter.core.files import shard_name, write_json_atomic, write_jsonl_atomic
from drafter.core.errors import BadInputError, ConfigError, StageError
from drafter.core.progress import progress
from drafter.data.prompts import Conversation

if TYPE_CHECKING:
    from drafter.core.config import GenerateConfig


SHARDS_DIR = "shards"
STATS_DIR = "shard_stats"
MODE_KWARGS: dict[str, dict] = {
    "default": {},
    "non-thinking": {"enable_thinking": False},
    "thinking": {"enable_thinking": True},
}


# --------------------------------------------------------------------------------------------
# Modes, seeds, plan
# --------------------------------------------------------------------------------------------


def template_supports_thinking(template: str | None) -> bool:
    """Whether a chat template has a thinking switch (it reads ``enable_thinking``)."""
    return bool(template) and "enable_thinking" in template


def thinking_modes(setting: str, supported: bool) -> list[str]:
    """Modes to generate for config ``thinking`` (off/on/both); ``["default"]`` without a switch."""
    if not supported:
        return ["default"]
    return {"off": ["non-thinking"], "on": ["thinking"], "both": ["non-thinking", "thinking"]}[setting]


def request_seed(seed: int, row_id: str, turn: int) -> int:
    """Per-request sampling seed from ``(seed, row id, turn)``: stable across runs, in [0, 2**31)."""
    h = hashlib.sha256(f"{seed}\x1f{row_id}\x1f{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class RowPlan:
    """One row to generate: a conversation in one mode."""

    id: str
    conv: Conversation
    mode: str


def plan_rows(convs: list[Conversation], modes: list[str]) -> list[RowPlan]:
    """Rows in order: each conversation once per mode (ids get ``:<mode>`` only when there are several)."""
    many = len(modes) > 1
    return [RowPlan(id=f"{c.id}:{m}" if many else c.id, conv=c, mode=m) for c in convs for m in modes]


def plan_shards(rows: list[RowPlan], shard_size: int) -> list[list[RowPlan]]:
    return [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]


def _plan_digest(rows: list[RowPlan]) -> str:
    return hashlib.sha256(json.dumps([[r.id, r.mode] for r in rows]).encode()).hexdigest()


def shard_is_finished(out: Path, index: int, rows: list[RowPlan]) -> bool:
    """A shard is reused when it exists, its stats match the plan and it had no failed request."""
    shard, stats = out / SHARDS_DIR / shard_name(index), out / STATS_DIR / shard_name(index, "json")
    if not (shard.is_file() and stats.is_file()):
        return False
    try:
        st = json.loads(stats.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return st.get("plan_sha256") == _plan_digest(rows) and st.get("failed_requests") == 0


def prompt_token_limit(max_model_len: int, max_tokens: int) -> int:
    """The longest prompt the server accepts: vLLM refuses a request whose prompt plus ``max_tokens``
    exceed its context (``serving.max_model_len``)."""
    limit = max_model_len - max_tokens
    if limit < 1:
        raise ConfigError(
            f"generate.max_tokens={max_tokens} leaves no room for a prompt in serving.max_model_len={max_model_len}; "
            "lower generate.max_tokens or raise serving.max_model_len")
    return limit


def load_tokenizer(model_dir: str | Path):
    """The target's tokenizer (with its chat template), as the engines load it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def check_prompt_lengths(convs: list[Conversation], tokenizer, modes: list[str], *, max_model_len: int,
                         max_tokens: int) -> int:
    """Fail at once (:class:`BadInputError`, naming the row's file:line) on a conversation whose
    prompt cannot fit the server's context: ``serving.max_model_len − generate.max_tokens`` tokens.

    Each conversation's longest prompt — the one of its last assistant turn — is rendered with the
    target's chat template (``tokenizer.apply_chat_template``, in every thinking mode) and
    tokenized as the engine does (no extra special tokens). The target's earlier answers are not
    known yet, so they count as empty: a conversation refused here can never fit, and one that
    passes may still outgrow the context through long answers (then its request fails and is
    counted). Returns the longest prompt seen, in tokens.
    """
    limit = prompt_token_limit(max_model_len, max_tokens)
    longest = 0
    for c in convs:
        last = max(i for i, m in enumerate(c.messages) if m["role"] == "assistant")
        msgs = [{"role": m["role"], "content": m["content"] or ""} for m in c.messages[:last]]
        earlier = any(m["role"] == "assistant" for m in msgs)
        for mode in modes:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **MODE_KWARGS[mode])
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            longest = max(longest, n)
            if n > limit:
                where = c.origin or f"prompt {c.id}"
                size = f"at least {n} tokens (its earlier answers counted as empty)" if earlier else f"{n} tokens"
                raise BadInputError(
                    f"{where}: this conversation's prompt has {size} with the target's chat template, more than the "
                    f"{limit} the server accepts (serving.max_model_len={max_model_len} minus "
                    f"generate.max_tokens={max_tokens}); "
                    + ("shorten or drop the conversation, or raise serving.max_model_len" if c.origin else
                       "raise serving.max_model_len or lower generate.max_tokens (a built-in prompt: nothing to edit)"))
    return longest


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int


@dataclass
class TurnOutput:
    text: str
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    completion_tokens: int
    reasoning: str | None = None


class RequestError(Exception):
    """A request that failed; ``retryable`` is False for errors a retry cannot fix (HTTP 400)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class ChatBackend(Protocol):
    engine: str
    engine_version: str

    async def chat(self, messages: list[dict], *, sampling: Sampling, seed: int, template_kwargs: dict) -> TurnOutput: ...

    async def aclose(self) -> None: ...


class OpenAIChatBackend:
    """Chat completions over HTTP (``POST {base_url}/v1/chat/completions``), asking vLLM for token ids.

    ``api_key`` (the value of ``serving.api_key_env``) is sent as ``Authorization: Bearer …``.
    ``transport`` (an ``httpx.AsyncBaseTransport``) is for tests, e.g. ``httpx.MockTransport``.
    """

    def __init__(self, base_url: str, model: str, *, engine: str = "openai", engine_version: str = "",
                 timeout_s: float = 300.0, transport=None, max_connections: int = 64, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model, self.engine, self.engine_version = model, engine, engine_version
        self.timeout_s, self._transport, self._max_conn = timeout_s, transport, max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = None

    def _get_client(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=httpx.Timeout(self.timeout_s), transport=self._transport,
                headers=self._headers,
                limits=httpx.Limits(max_connections=self._max_conn, max_keepalive_connections=self._max_conn))
        return self._client

    async def chat(self, messages, *, sampling, seed, template_kwargs):
        import httpx

        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens, "seed": seed, "return_token_ids": True,
        }
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        try:
            r = await self._get_client().post("/v1/chat/completions", json=body)
        except httpx.TimeoutException as e:
            raise RequestError(f"timed out after {self.timeout_s:g}s ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise RequestError(f"connection error: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            retryable = r.status_code >= 500 or r.status_code in (408, 409, 425, 429)
            raise RequestError(f"HTTP {r.status_code}: {r.text[:300]}", retryable=retryable)
        try:
            data = r.json()
            choice = data["choices"][0]
            msg = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestError(f"malformed response: {r.text[:300]}") from None
        token_ids = choice.get("token_ids")
        usage = data.get("usage") or {}
        completion_tokens = usage.get("completion_tokens")
        if completion_tokens is None:
            completion_tokens = len(token_ids) if token_ids is not None else 0
        return TurnOutput(
            text=msg.get("content") or "", token_ids=token_ids, prompt_token_ids=data.get("prompt_token_ids"),
            finish_reason=choice.get("finish_reason"), completion_tokens=int(completion_tokens),
            reasoning=msg.get("reasoning_content") or msg.get("reasoning"))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class TransformersBackend:
    """In-process generation with transformers (fallback where vLLM is unavailable).

    Prompts are rendered with the chat template and tokenized without extra special tokens (as
    vLLM does); sampling uses ``torch.manual_seed(seed)`` per request; greedy when temperature is 0.
    Requests run one at a time.
    """

    engine = "transformers"

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", threads: int | None = None):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if threads:
            torch.set_num_threads(threads)
        self.engine_version = transformers.__version__
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # e.g. MTP layers are "unexpected keys" for the causal-LM class
        hf_logging.disable_progress_bar()
        try:
            kw = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self._lock: asyncio.Lock | None = None  # created in the event loop that uses it

    def _generate(self, messages, sampling: Sampling, seed: int, template_kwargs: dict) -> TurnOutput:
        import torch

        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        if self.max_len and len(prompt) + 1 > self.max_len:
            raise RequestError(f"prompt has {len(prompt)} tokens; the model's context is {self.max_len}", retryable=False)
        max_new = sampling.max_tokens if not self.max_len else min(sampling.max_tokens, self.max_len - len(prompt))
        gc = copy.deepcopy(self.model.generation_config)
        greedy = sampling.temperature == 0
        gc.update(max_new_tokens=max_new, do_sample=not greedy, num_beams=1,
                  temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
                  top_k=None, min_p=None, repetition_penalty=None)
        if gc.pad_token_id is None:
            gc.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else gc.eos_token_id
        torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        new = [int(t) for t in out[0, len(prompt):].tolist()]
        eos = gc.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        finish = "stop" if new and new[-1] in eos else "length"
        return TurnOutput(text=tok.decode(new, skip_special_tokens=True), token_ids=new, prompt_token_ids=prompt,
                          finish_reason=finish, completion_tokens=len(new))

    async def chat(self, messages, *, sampling, seed, template_kwargs):
        # one request at a time (the seed is torch's global one), in a thread: the event loop stays free to
        # write each shard as soon as its rows are done — run inline, every row would finish before the first
        # shard is written, and a stage interrupted midway would have nothing to resume from
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:
                return await asyncio.to_thread(self._generate, messages, sampling, seed, template_kwargs)
        except RequestError:
            raise
        except (RuntimeError, ValueError) as e:
            raise RequestError(f"transformers generate failed: {type(e).__name__}: {e}", retryable=False) from None

    async def aclose(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@dataclass
class _Failure:
    id: str
    message_index: int  # the assistant turn whose request failed
    error: str
    attempts: int
    requests: int  # requests this row made, the failed one included
    origin: str = ""  # file:line of a user row ("" for built-in prompts)


@dataclass
class _Counts:
    retries: int = 0  # per-shard counts live in the shard stats; this one is for the whole run


async def _request_with_retries(backend: ChatBackend, messages, *, sampling, seed, template_kwargs,
                                max_retries: int, backoff_s: float, counts: _Counts) -> tuple[TurnOutput | None, str, int]:
    last = ""
    for attempt in range(max_retries + 1):
        try:
            return await backend.chat(messages, sampling=sampling, seed=seed, template_kwargs=template_kwargs), "", attempt + 1
        except RequestError as e:
            last = str(e)
            if not e.retryable or attempt == max_retries:
                return None, last, attempt + 1
            counts.retries += 1
            await asyncio.sleep(backoff_s * (2 ** attempt) * (1 + 0.25 * random.random()))
    return None, last, max_retries + 1  # pragma: no cover


async def _generate_row(plan: RowPlan, backend: ChatBackend, cfg: "GenerateConfig", sampling: Sampling,
                        sem: asyncio.Semaphore, counts: _Counts, meta: dict) -> dict | _Failure:
    kwargs = MODE_KWARGS[plan.mode]
    messages: list[dict] = []
    turns: list[dict] = []
    async with sem:
        for idx, m in enumerate(plan.conv.messages):
            if m["role"] != "assistant":
                messages.append({"role": m["role"], "content": m["content"]})
                continue
            seed = request_seed(cfg.seed, plan.id, idx)
            out, err, attempts = await _request_with_retries(
                backend, messages, sampling=sampling, seed=seed, template_kwargs=kwargs,
                max_retries=cfg.max_retries, backoff_s=cfg.retry_backoff_s, counts=counts)
            if out is None:
                return _Failure(plan.id, idx, err, attempts, requests=len(turns) + 1, origin=plan.conv.origin)
            n = len(out.token_ids) if out.token_ids is not None else out.completion_tokens
            messages.append({"role": "assistant", "content": out.text})
            turns.append({"message_index": idx, "seed": seed, "token_ids": out.token_ids,
                          "prompt_token_ids": out.prompt_token_ids, "finish_reason": out.finish_reason,
                          "completion_tokens": n, "reasoning": out.reasoning})
    c = plan.conv
    return {
        "id": plan.id, "split": c.split, "domain": c.domain, "source": c.source, "mode": plan.mode,
        "chat_template_kwargs": kwargs, "messages": messages, "turns": turns, **meta,
    }


NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"


def sampled_serving(serving, temperature: float):
    """``serving`` for seeded requests at ``temperature``. vLLM 0.32's CPU build cannot sample a seeded request
    whose prefill is split over steps: it rewinds the request's generator, which a CPU generator cannot do
    ("RuntimeError: CPU Generator does not use offset" in ``_bookkeeping_sync``, and the engine dies). At
    T > 0 with a vLLM CPU subprocess this adds ``--no-enable-chunked-prefill`` (each prompt is scheduled
    whole) unless ``serving.extra_args`` already decides chunked prefill; otherwise ``serving`` unchanged."""
    if not temperature > 0 or serving.backend != "vllm" or serving.launcher != "subprocess":
        return serving
    if any("chunked-prefill" in a for a in serving.extra_args):
        return serving
    from drafter.serving.server import is_cpu_engine, serving_python

    if not is_cpu_engine(serving_python(serving)):
        return serving
    return serving.model_copy(update={"extra_args": [*serving.extra_args, NO_CHUNKED_PREFILL]})


def backend_factory(stack, model_dir: str | Path, serving, cfg: "GenerateConfig", log_path: Path,
                    servers: list | None = None) -> Callable[[], ChatBackend]:
    """A factory of the chat backend ``serving`` names, for :func:`generate_dataset`: the transformers model
    in-process, or a vLLM server (:func:`drafter.serving.server.serve`, its log at ``log_path``) entered
    into the ``contextlib.ExitStack`` ``stack`` (stopped when it closes) and appended to ``servers``."""
    def make() -> ChatBackend:
        if serving.backend == "transformers":
            return TransformersBackend(model_dir, dtype=serving.dtype)
        from drafter.serving.server import serve

        srv = stack.enter_context(serve(Path(model_dir), sampled_serving(serving, cfg.temperature), log_path=log_path))
        if servers is not None:
            servers.append(srv)
        return OpenAIChatBackend(srv.base_url, srv.model, engine=srv.engine, engine_version=srv.engine_version or "",
                                 timeout_s=cfg.request_timeout_s, max_connections=cfg.concurrency, api_key=srv.api_key)
    return make


def generate_dataset(
    convs: list[Conversation],
    backend: ChatBackend | Callable[[], ChatBackend],
    out: str | Path,
    cfg: "GenerateConfig",
    *,
    target: dict,
    modes: list[str] | None = None,
    on_shard_written: Callable[[int], None] | None = None,
) -> dict:
    """Generate every row into ``out/shards`` (resuming from finished shards) and return a summary.

    ``backend`` may be a factory, called only when some shard still needs generating (so a fully
    finished directory does not start an engine). ``target`` is ``{"name", "revision",
    "chat_template_sha256"}``, recorded on every row. ``on_shard_written(index)`` is called after
    each new shard is in place. Raises :class:`StageError` when more than
    ``cfg.max_failed_fraction`` of the requests failed.
    """
    return asyncio.run(agenerate_dataset(convs, backend, out, cfg, target=target, modes=modes,
                                         on_shard_written=on_shard_written))


async def agenerate_dataset(convs, backend, out, cfg, *, target, modes=None, on_shard_written=None) -> dict:
    out = Path(out)
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    (out / STATS_DIR).mkdir(parents=True, exist_ok=True)
    rows = plan_rows(convs, modes or ["default"])
    shards = plan_shards(rows, cfg.shard_size)
    planned_requests = sum(r.conv.num_assistant_turns for r in rows)
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.max_tokens)
    reused = [i for i, s in enumerate(shards) if shard_is_finished(out, i, s)]
    todo = [i for i in range(len(shards)) if i not in set(reused)]
    counts = _Counts()
    stats_all: dict[int, dict] = {i: json.loads((out / STATS_DIR / shard_name(i, "json")).read_text()) for i in reused}
    engine: dict[str, str] = {}
    for st in stats_all.values():
        engine = {"engine": st.get("engine", ""), "engine_version": st.get("engine_version", "")}
    gen_seconds = 0.0
    if todo:
        if not hasattr(backend, "chat"):
            backend = backend()
        engine = {"engine": backend.engine, "engine_version": backend.engine_version}
        meta = {"target": {k: target.get(k) for k in ("name", "revision", "chat_template_sha256")},
                "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                             "seed": cfg.seed},
                **engine}
        sem = asyncio.Semaphore(cfg.concurrency)
        t0 = time.monotonic()
        tasks: dict[int, list[asyncio.Task]] = {}
        try:
            with progress("generate", total=len(rows), unit="rows") as bar:
                bar.advance(sum(len(shards[i]) for i in reused))
                for i in todo:  # created in row order; the semaphore admits them in that order
                    tasks[i] = [asyncio.create_task(_generate_row(p, backend, cfg, sampling, sem, counts, meta))
                                for p in shards[i]]
                for i in todo:
                    results = []
                    for t in tasks[i]:
                        results.append(await t)
                        bar.advance(1)
                    ok = [r for r in results if isinstance(r, dict)]
                    fails = [r for r in results if isinstance(r, _Failure)]
                    st = {
                        "index": i, "plan_sha256": _plan_digest(shards[i]), "rows": len(ok),
                        "train_rows": sum(r["split"] == "train" for r in ok),
                        "heldout_rows": sum(r["split"] == "heldout" for r in ok),
                        "requests": sum(len(r["turns"]) for r in ok) + sum(f.requests for f in fails),
                        "failed_requests": len(fails),
                        "tokens": sum(t["completion_tokens"] for r in ok for t in r["turns"]),
                        "failures": [vars(f) for f in fails], **engine,
                    }
                    write_json_atomic(out / STATS_DIR / shard_name(i, "json"), st)
                    write_jsonl_atomic(out / SHARDS_DIR / shard_name(i), ok)
                    stats_all[i] = st
                    if on_shard_written is not None:
                        on_shard_written(i)
                    failed_now = sum(s["failed_requests"] for s in stats_all.values())
                    if failed_now > cfg.max_failed_fraction * planned_requests:
                        _raise_failed(stats_all, cfg, planned_requests, certain=True)
        finally:
            gen_seconds = time.monotonic() - t0
            pending = [t for ts in tasks.values() for t in ts if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            await backend.aclose()
    summary = _summarize(stats_all, shards, reused, planned_requests, engine, gen_seconds, counts)
    if summary["requests"] and summary["failed"] > cfg.max_failed_fraction * summary["requests"]:
        _raise_failed(stats_all, cfg, summary["requests"], certain=False)
    return summary


def _raise_failed(stats_all: dict[int, dict], cfg, denom: int, certain: bool) -> None:
    failures = [f for i in sorted(stats_all) for f in stats_all[i]["failures"]]
    shown = "; ".join(f"{f.get('origin') or f['id']} (message {f['message_index']}, {f['attempts']} attempts): "
                      f"{f['error']}" for f in failures[:5])
    more = f" (+{len(failures) - 5} more)" if len(failures) > 5 else ""
    what = "of the planned" if certain else "of the"
    raise StageError(
        f"generate: {len(failures)} {what} {denom} requests failed after {cfg.max_retries} retries, more than "
        f"generate.max_failed_fraction={cfg.max_failed_fraction:g}. First failures: {shown}{more}. "
        "Check the server log (server.log), the endpoint and request_timeout_s; finished shards are kept for the rerun."
    )


def _summarize(stats_all, shards, reused, planned_requests, engine, gen_seconds, counts: _Counts) -> dict:
    sts = [stats_all[i] for i in sorted(stats_all)]
    new_tokens = sum(s["tokens"] for i, s in stats_all.items() if i not in set(reused))
    return {
        "rows": sum(s["rows"] for s in sts),
        "train_rows": sum(s["train_rows"] for s in sts),
        "heldout_rows": sum(s["heldout_rows"] for s in sts),
        "requests": sum(s["requests"] for s in sts),
        "planned_requests": planned_requests,
        "failed": sum(s["failed_requests"] for s in sts),
        "failed_rows": sum(len(s["failures"]) for s in sts),
        "retries": counts.retries,
        "tokens_generated": sum(s["tokens"] for s in sts),
        "tokens_generated_this_run": new_tokens,
        "generation_seconds": round(gen_seconds, 3),
        "tok_per_s": round(new_tokens / gen_seconds, 2) if gen_seconds > 0 and new_tokens else 0.0,
        "shards": len(shards),
        "shards_reused": len(reused),
        "failures": [f for s in sts for f in s["failures"]],
        **engine,
    }
