"""The `generate` stage: request parameters, multi-turn, thinking modes, shard resume, retries and
failure accounting (against an in-process fake OpenAI server), the transformers backend and a real
vLLM server on the tiny target."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import httpx
import pytest

from drafter.core.config import GenerateConfig, config_from_dict
from drafter.core.files import iter_rows, list_shards
from drafter.core.errors import StageError
from drafter.data.generate import (
    OpenAIChatBackend,
    generate_dataset,
    request_seed,
    template_supports_thinking,
    thinking_modes,
)
from drafter.data.prompts import builtin_prompts
from drafter.core.stage import Artifact

TARGET = {"name": "fake/target", "revision": "abc123", "chat_template_sha256": "0" * 64}


class FakeServer:
    """An OpenAI-compatible chat endpoint: the reply is a function of (messages, seed); ``fail(body,
    attempt)`` returns an HTTP status to fail with, an exception to raise, or None."""

    def __init__(self, fail=None):
        self.fail = fail
        self.bodies: list[dict] = []
        self.attempts: Counter = Counter()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = (json.dumps(body["messages"]), body["seed"])
        self.attempts[key] += 1
        self.bodies.append(body)
        verdict = self.fail(body, self.attempts[key]) if self.fail else None
        if isinstance(verdict, Exception):
            raise verdict
        if verdict:
            return httpx.Response(verdict, json={"error": {"message": "injected failure"}})
        h = hashlib.sha256(f"{body['seed']}|{key[0]}|{body.get('chat_template_kwargs')}".encode()).digest()
        last = body["messages"][-1]["content"]
        return httpx.Response(200, json={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"reply-{h[:4].hex()} to {last[:16]!r}"},
                         "finish_reason": "stop", "token_ids": list(h[:6])}],
            "prompt_token_ids": list(h[6:9]), "usage": {"completion_tokens": 6},
        })

    def backend(self):
        return OpenAIChatBackend("http://fake", "fake-model", engine="fake-vllm", engine_version="9.9",
                                 transport=httpx.MockTransport(self))


def _cfg(**kw) -> GenerateConfig:
    base = dict(num_prompts=12, shard_size=4, concurrency=3, max_retries=2, retry_backoff_s=0.0,
                max_tokens=32, temperature=0.7, top_p=0.9, seed=5)
    return GenerateConfig(**(base | kw))


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in list_shards(out / "shards")}


def _seed_of(cfg, conv_id, turn):
    return request_seed(cfg.seed, conv_id, turn)


# --------------------------------------------------------------------------- unit


def test_request_seed_and_thinking_detection():
    assert request_seed(0, "a", 1) == request_seed(0, "a", 1)
    assert len({request_seed(s, r, t) for s in (0, 1) for r in ("a", "b") for t in (1, 3)}) == 8
    assert 0 <= request_seed(7, "x", 9) < 2**31
    assert template_supports_thinking("{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    assert not template_supports_thinking("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert thinking_modes("both", True) == ["non-thinking", "thinking"]
    assert thinking_modes("on", False) == ["default"]


# --------------------------------------------------------------------------- fake server


def test_rows_requests_and_multi_turn(tmp_path):
    cfg = _cfg()
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
    server = FakeServer()
    summary = generate_dataset(convs, server.backend(), tmp_path, cfg, target=TARGET)

    rows = list(iter_rows(tmp_path / "shards"))
    assert [p.name for p in list_shards(tmp_path / "shards")] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert [r["id"] for r in rows] == [c.id for c in convs]
    n_turns = sum(c.num_assistant_turns for c in convs)
    assert len(server.bodies) == n_turns == summary["requests"]
    assert summary | {"failures": []} == summary and summary["failed"] == 0
    assert (summary["rows"], summary["tokens_generated"], summary["engine"]) == (12, 6 * n_turns, "fake-vllm")
    assert summary["train_rows"] + summary["heldout_rows"] == 12

    for body in server.bodies:
        assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("fake-model", 0.7, 0.9, 32)
        assert body["return_token_ids"] is True and "chat_template_kwargs" not in body
        assert all(m["content"] is not None for m in body["messages"])
    for conv, row in zip(convs, rows):
        assert (row["split"], row["domain"], row["mode"], row["source"]) == (conv.split, conv.domain, "default", "builtin")
        assert row["target"] == TARGET and (row["engine"], row["engine_version"]) == ("fake-vllm", "9.9")
        assert row["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 32, "seed": 5}
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in conv.messages]
        for m_in, m_out in zip(conv.messages, row["messages"]):
            assert m_out["content"] == (m_in["content"] if m_in["role"] != "assistant" else m_out["content"])
        assert [t["message_index"] for t in row["turns"]] == [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        for t in row["turns"]:
            assert t["seed"] == _seed_of(cfg, conv.id, t["message_index"])
            assert len(t["token_ids"]) == 6 and len(t["prompt_token_ids"]) == 3 and t["finish_reason"] == "stop"
    # a later turn sees the regenerated earlier answer
    multi = next(r for r in rows if len(r["turns"]) >= 2)
    second = next(b for b in server.bodies if b["seed"] == multi["turns"][1]["seed"])
    assert second["messages"] == multi["messages"][: multi["turns"][1]["message_index"]]


def test_thinking_modes_send_template_kwargs(tmp_path):
    cfg = _cfg(num_prompts=4)
    convs = builtin_prompts(4, seed=cfg.seed)
    server = FakeServer()
    generate_dataset(convs, server.backend(), tmp_path, cfg, target=TARGET, modes=["non-thinking", "thinking"])
    rows = list(iter_rows(tmp_path / "shards"))
    assert [r["id"] for r in rows] == [f"{c.id}:{m}" for c in convs for m in ("non-thinking", "thinking")]
    assert {r["mode"]: r["chat_template_kwargs"] for r in rows} == {
        "non-thinking": {"enable_thinking": False}, "thinking": {"enable_thinking": True}}
    assert {json.dumps(b["chat_template_kwargs"]) for b in server.bodies} == {
        '{"enable_thinking": false}', '{"enable_thinking": true}'}
    # the two modes of one prompt get different seeds, hence their own sampling streams
    assert rows[0]["turns"][0]["seed"] != rows[1]["turns"][0]["seed"]


def test_resume_after_interruption_reuses_finished_shards(tmp_path):
    cfg = _cfg(num_prompts=20, shard_size=4)  # 5 shards
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
    generate_dataset(convs, FakeServer().backend(), tmp_path / "ref", cfg, target=TARGET)
    reference = _shard_bytes(tmp_path / "ref")

    out = tmp_path / "run"

    def kill_after_two(i):
        if i == 1:
            raise KeyboardInterrupt("simulated kill after 2 shards")

    with pytest.raises(KeyboardInterrupt):
        generate_dataset(convs, FakeServer().backend(), out, cfg, target=TARGET, on_shard_written=kill_after_two)
    assert sorted(_shard_bytes(out)) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]

    server = FakeServer()
    made = []
    summary = generate_dataset(convs, lambda: made.append(1) or server.backend(), out, cfg, target=TARGET)
    assert _shard_bytes(out) == reference  # identical result
    assert summary["shards_reused"] == 2 and summary["rows"] == 20
    assert len(server.bodies) == sum(c.num_assistant_turns for c in convs[8:])  # only the unfinished rows
    # a third run finds everything finished: the backend factory (engine start) is never called
    made.clear()
    summary = generate_dataset(convs, lambda: made.append(1) or server.backend(), out, cfg, target=TARGET)
    assert made == [] and summary["shards_reused"] == 5 and _shard_bytes(out) == reference


def test_failed_requests_are_retried_then_counted(tmp_path):
    cfg = _cfg(num_prompts=12, max_retries=2, max_failed_fraction=0.5)
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
    bad = {_seed_of(cfg, convs[1].id, 1), _seed_of(cfg, convs[6].id, 1)}  # first turn of two rows
    server = FakeServer(fail=lambda body, attempt: 500 if body["seed"] in bad else None)
    summary = generate_dataset(convs, server.backend(), tmp_path, cfg, target=TARGET)

    assert (summary["failed"], summary["failed_rows"], summary["rows"]) == (2, 2, 10)
    assert {f["id"] for f in summary["failures"]} == {convs[1].id, convs[6].id}
    assert all(f["attempts"] == 3 and "HTTP 500" in f["error"] for f in summary["failures"])
    assert sum(n for (m, s), n in server.attempts.items() if s in bad) == 2 * 3  # 1 try + 2 retries each
    ids = [r["id"] for r in iter_rows(tmp_path / "shards")]
    assert convs[1].id not in ids and convs[6].id not in ids
    # a rerun regenerates only the shards that had failures (shards 0 and 1), now successfully
    healthy = FakeServer()
    summary = generate_dataset(convs, healthy.backend(), tmp_path, cfg, target=TARGET)
    assert (summary["failed"], summary["rows"], summary["shards_reused"]) == (0, 12, 1)
    assert len(healthy.bodies) == sum(c.num_assistant_turns for c in convs[:8])


def test_transient_errors_succeed_after_retry_and_client_errors_are_not_retried(tmp_path):
    cfg = _cfg(num_prompts=8)
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
    generate_dataset(convs, FakeServer().backend(), tmp_path / "ref", cfg, target=TARGET)
    flaky = FakeServer(fail=lambda body, attempt: 503 if attempt == 1 else None)
    summary = generate_dataset(convs, flaky.backend(), tmp_path / "flaky", cfg, target=TARGET)
    assert summary["failed"] == 0 and summary["retries"] == summary["requests"]
    assert _shard_bytes(tmp_path / "flaky") == _shard_bytes(tmp_path / "ref")

    bad = _seed_of(cfg, convs[0].id, 1)
    four = FakeServer(fail=lambda body, attempt: 400 if body["seed"] == bad else None)
    summary = generate_dataset(convs, four.backend(), tmp_path / "400", _cfg(num_prompts=8, max_failed_fraction=0.5),
                               target=TARGET)
    assert summary["failures"][0]["attempts"] == 1 and "HTTP 400" in summary["failures"][0]["error"]


def test_stage_fails_when_too_many_requests_fail(tmp_path):
    cfg = _cfg(num_prompts=40, shard_size=4, concurrency=1, max_failed_fraction=0.05)
    convs = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
    planned = sum(c.num_assistant_turns for c in convs)
    down = FakeServer(fail=lambda body, attempt: httpx.ConnectError("connection refused"))
    with pytest.raises(StageError) as e:
        generate_dataset(convs, down.backend(), tmp_path, cfg, target=TARGET)
    msg = str(e.value)
    assert "max_failed_fraction=0.05" in msg and "connection error: ConnectError" in msg and convs[0].id in msg
    # it stops as soon as failure is certain, not after trying every request
    assert len(down.bodies) < planned * (cfg.max_retries + 1) / 2

    # at the end: exactly at the threshold passes, just over it fails
    convs = builtin_prompts(12, seed=5)
    first = {c.id: next(i for i, m in enumerate(c.messages) if m["role"] == "assistant") for c in convs}
    bad = {_seed_of(cfg, c.id, first[c.id]) for c in convs[:3]}
    requests = sum(c.num_assistant_turns for c in convs[3:]) + 3  # failed rows stop at their first turn
    for frac, fails in ((3 / requests, False), (3 / requests - 1e-3, True)):
        some = FakeServer(fail=lambda body, attempt: 502 if body["seed"] in bad else None)
        run = lambda: generate_dataset(convs, some.backend(), tmp_path / f"b{fails}", _cfg(num_prompts=12, max_failed_fraction=frac),
                                       target=TARGET)
        if fails:
            with pytest.raises(StageError, match=f"3 of the (planned )?{requests} requests failed"):
                run()
        else:
            assert run()["failed"] == 3


# --------------------------------------------------------------------------- stage, real engines


def _target_artifact(tmp_path: Path, model_dir: Path) -> Artifact:
    from drafter.models.target import write_target_json

    d = tmp_path / "prepare_target"
    d.mkdir()
    write_target_json(d, Path(model_dir).resolve(), source="path", name="tiny-target", revision="rev-1")
    return Artifact(stage="prepare_target", key="tiny", path=d)


def _stage_cfg(backend: str, **gen):
    return config_from_dict({
        "serving": {"backend": backend, "dtype": "float32"},
        "generate": {"num_prompts": 6, "max_tokens": 8, "shard_size": 4, "concurrency": 4, "retry_backoff_s": 0.1} | gen,
    })


def test_transformers_backend_stage_on_tiny_target(tmp_path, tiny_target):
    from transformers import AutoTokenizer

    from drafter.stages.generate import STAGE

    art = _target_artifact(tmp_path, tiny_target)
    cfg = _stage_cfg("transformers")
    metrics = STAGE.run(cfg, {"prepare_target": art}, tmp_path / "out")
    assert metrics["rows"] == 6 and metrics["failed"] == 0 and metrics["engine"] == "transformers"
    assert metrics["train_rows"] + metrics["heldout_rows"] == 6 and metrics["shards_reused"] == 0
    assert metrics["tokens_generated"] > 0 and metrics["tok_per_s"] > 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["target"]["name"] == "tiny-target" and summary["target"]["revision"] == "rev-1"
    assert len(summary["target"]["chat_template_sha256"]) == 64 and summary["modes"] == ["default"]

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    rows = list(iter_rows(tmp_path / "out" / "shards"))
    for row in rows:
        assert row["target"] == summary["target"] and row["engine_version"]
        for t in row["turns"]:
            assert 0 < len(t["token_ids"]) <= 8
            assert row["messages"][t["message_index"]]["content"] == tok.decode(t["token_ids"], skip_special_tokens=True)
            # the prompt tokens are the chat-template rendering of the conversation so far
            text = tok.apply_chat_template(row["messages"][: t["message_index"]], tokenize=False, add_generation_prompt=True)
            assert t["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    # deterministic: a second run into a fresh directory writes identical shards
    STAGE.run(cfg, {"prepare_target": art}, tmp_path / "again")
    assert _shard_bytes(tmp_path / "out") == _shard_bytes(tmp_path / "again")
    # a rerun into the same (in-progress) directory reuses every shard
    assert STAGE.run(cfg, {"prepare_target": art}, tmp_path / "out")["shards_reused"] == 2


def test_thinking_switch_detected_from_template_and_used(tmp_path, tiny_target):
    """A template that reads enable_thinking gets both modes (thinking=both); one without it gets 'default'."""
    import shutil

    from drafter.stages.generate import STAGE

    model = tmp_path / "thinking-model"
    shutil.copytree(tiny_target, model)
    jinja = model / "chat_template.jinja"
    jinja.write_text(jinja.read_text() + "{% if add_generation_prompt and enable_thinking is defined and enable_thinking %}"
                     "<think>\n{% endif %}")
    art = _target_artifact(tmp_path, model)
    metrics = STAGE.run(_stage_cfg("transformers", num_prompts=2, thinking="both"), {"prepare_target": art}, tmp_path / "o")
    rows = list(iter_rows(tmp_path / "o" / "shards"))
    assert metrics["rows"] == 4 and [r["mode"] for r in rows] == ["non-thinking", "thinking"] * 2
    by_mode = {r["mode"]: r for r in rows[:2]}
    on, off = by_mode["thinking"]["turns"][0]["prompt_token_ids"], by_mode["non-thinking"]["turns"][0]["prompt_token_ids"]
    assert len(on) > len(off) and on[: len(off)] == off  # the generation prompt gained "<think>\n"
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["thinking_supported"] is True

    (tmp_path / "plain").mkdir()
    art2 = _target_artifact(tmp_path / "plain", tiny_target)
    STAGE.run(_stage_cfg("transformers", num_prompts=2, thinking="both"), {"prepare_target": art2}, tmp_path / "p")
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary["modes"] == ["default"] and "no enable_thinking switch" in summary["note"]


@pytest.mark.slow
def test_vllm_serve_and_generate_on_tiny_target(tmp_path, tiny_target):
    """Real vLLM (serving env subprocess via drafter.serving.server) on the tiny target. In float32 its greedy
    turns, token ids and prompt token ids equal the transformers backend's, multi-turn included."""
    from drafter.serving.server import serving_python
    from drafter.stages.generate import STAGE

    if not Path(serving_python()).exists():
        pytest.fail(f"serving env python {serving_python()} is missing: run `make env` (the slow test needs vLLM)")
    art = _target_artifact(tmp_path, tiny_target)
    gen = {"num_prompts": 8, "temperature": 0.0}
    metrics = STAGE.run(_stage_cfg("vllm", **gen), {"prepare_target": art}, tmp_path / "vllm")
    assert metrics["engine"] == "vllm" and metrics["engine_version"] and metrics["failed"] == 0
    assert metrics["rows"] == 8 and metrics["tok_per_s"] > 0
    assert (tmp_path / "vllm" / "server.log").stat().st_size > 0
    STAGE.run(_stage_cfg("transformers", **gen), {"prepare_target": art}, tmp_path / "hf")

    v = {r["id"]: r for r in iter_rows(tmp_path / "vllm" / "shards")}
    h = {r["id"]: r for r in iter_rows(tmp_path / "hf" / "shards")}
    assert v.keys() == h.keys() and any(len(r["turns"]) > 1 for r in v.values())
    for rid in v:
        assert [t["prompt_token_ids"] for t in v[rid]["turns"]] == [t["prompt_token_ids"] for t in h[rid]["turns"]]
        assert [t["token_ids"] for t in v[rid]["turns"]] == [t["token_ids"] for t in h[rid]["turns"]], rid
        assert v[rid]["messages"] == h[rid]["messages"]
