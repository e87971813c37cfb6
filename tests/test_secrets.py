"""No secret reaches disk, logs, manifests, run summaries, Prefect's database or error messages.

Secrets of every built-in kind are planted in a user file of conversations, a token in
`serving.env`, a password in `serving.url` and a secret inside a malformed row; the release flow
runs (and fails where it must), then every byte of the store, of Prefect's database (WAL files
included) and result storage, and every captured output is searched: no planted secret anywhere.
Operational settings and secrets never change a stage key.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from drafter.core.config import ReleaseConfig, ServingConfig, config_from_dict, load_config
from drafter.core.errors import ConfigError, DrafterError, StageError, describe_value
from drafter.core.pipeline import plan
from drafter.data.scrub import BUILTIN_KINDS, redact_url, url_has_credentials
from tests.test_release_e2e import write_config

# --------------------------------------------------------------------------- planted secrets

# one needle per built-in kind: the part that must never be found again (searched as raw bytes)
PEM_BODY = "MIIEpAIBAAKCAQEAplantedPEMbody0123456789abcdefXYZ"
USER_SECRETS = {
    "private_key": PEM_BODY,
    "api_key": "sk-proj-PLANTEDa1b2c3d4e5f6g7h8i9j0kLmN",
    "token": "PLANTEDbearer0123456789abcdefTOKEN",
    "url_password": "PLANTEDurlPw0rd42",
    "password": "PLANTEDpassw0rd-horse",
    "email": "planted.person@example-secret.com",
}
ENV_SECRET = "hf_PLANTEDenvTOKENabcdefghijklmnopqrstuv"
URL_PASSWORD = "PLANTEDserverPW77"
MALFORMED_SECRET = "sk-proj-PLANTEDmalformedROWkey123456789"
ALL_NEEDLES = [*USER_SECRETS.values(), ENV_SECRET, URL_PASSWORD, MALFORMED_SECRET]

USER_TEXTS = {
    "private_key": f"my deploy key:\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----\nwhy is it rejected?",
    "api_key": f"the client fails with OPENAI key {USER_SECRETS['api_key']} — what is wrong?",
    "token": f"curl -H 'Authorization: Bearer {USER_SECRETS['token']}' returns 401",
    "url_password": f"connect to postgres://admin:{USER_SECRETS['url_password']}@db.internal:5432/app please",
    "password": f'my config has password = "{USER_SECRETS["password"]}" is that safe?',
    "email": f"write to {USER_SECRETS['email']} about the invoice",
}


def write_traffic(path: Path) -> Path:
    """Conversations with every kind of secret (one multi-turn) in a user JSONL file."""
    rows = [{"id": f"traffic-{kind}", "messages": [{"role": "user", "content": text}]}
            for kind, text in USER_TEXTS.items()]
    rows.append({"id": "traffic-multi", "split": "train", "messages": [
        {"role": "system", "content": f"You help {USER_SECRETS['email']}."},
        {"role": "user", "content": USER_TEXTS["api_key"]},
        {"role": "assistant", "content": "an old answer (regenerated)"},
        {"role": "user", "content": USER_TEXTS["password"]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_malformed(path: Path) -> Path:
    """A good row, then a row whose user content is an object holding a secret (line 2)."""
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": {"text": f"key {MALFORMED_SECRET}"}}]}) + "\n")
    return path


def config_file(tmp_path: Path, tiny_target: Path, store: Path, user_files: list[Path], **serving) -> Path:
    p = write_config(tmp_path, tiny_target, store,
                     generate={"num_prompts": 4, "max_tokens": 8, "user_files": [str(f) for f in user_files]},
                     serving={"env": {"HF_TOKEN": ENV_SECRET}} | serving)
    data = yaml.safe_load(p.read_text())
    data["retries"] = 0  # a failing stage fails once
    data["stages"] = ["capture"]  # prepare_target → generate → scrub → capture
    p.write_text(yaml.safe_dump(data))
    return p


# --------------------------------------------------------------------------- searching


def files_under(*roots: Path) -> list[Path]:
    out = []
    for root in roots:
        root = Path(root)
        if root.is_file():
            out.append(root)
        elif root.is_dir():
            out += [p for p in root.rglob("*") if p.is_file()]
    return out


def hits(paths: list[Path], texts: dict[str, str | bytes], needles=ALL_NEEDLES) -> list[str]:
    found = []
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:  # a file removed while searching (e.g. a WAL checkpoint)
            continue
        found += [f"{p}: {n[:12]}…" for n in needles if n.encode() in data]
    for name, t in texts.items():
        b = t if isinstance(t, bytes) else t.encode()
        squashed = b"".join(b.split())  # a terminal may fold a long word across lines
        found += [f"{name}: {n[:12]}…" for n in needles if n.encode() in b or n.encode() in squashed]
    return found


def prefect_paths() -> list[Path]:
    """Prefect's database (with -wal/-shm files), result storage and home of the running harness."""
    from prefect.settings import get_current_settings

    s = get_current_settings()
    url = s.server.database.connection_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url)
    assert url.startswith("sqlite"), url
    db = Path(url.split(":///", 1)[1])
    assert db.is_file(), db
    return [db.parent, Path(s.results.local_storage_path), Path(s.home)]


def flush_prefect_logs() -> None:
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # logs reach the API (and the database) in batches


def decoded_token_ids(store: Path, tokenizer) -> str:
    """Every token id list of the generate output and every capture shard's input_ids, decoded."""
    from safetensors.torch import load_file

    from drafter.core.files import iter_rows

    parts = []
    for shards in (store / "generate").glob("*/shards"):
        for row in iter_rows(shards):
            for t in row["turns"]:
                for ids in (t.get("token_ids"), t.get("prompt_token_ids")):
                    if ids:
                        parts.append(tokenizer.decode(ids))
    for f in (store / "capture").glob("*/features/*/*.safetensors"):
        parts.append(tokenizer.decode(load_file(str(f))["input_ids"].tolist()))
    assert parts, "no token ids found to check"
    return "\n".join(parts)


# --------------------------------------------------------------------------- the flow, end to end


def test_release_flow_and_failures_leave_no_secret_anywhere(prefect_harness, tmp_path, tiny_target, capfd, caplog):
    from transformers import AutoTokenizer

    from drafter.cli import app
    from drafter_prefect.release import release

    traffic = write_traffic(tmp_path / "traffic.jsonl")
    store = tmp_path / "store"
    runner = CliRunner()
    outputs: dict[str, str | bytes] = {}

    # 1. the release flow through the CLI, up to capture: user secrets scrubbed, env token masked
    good = config_file(tmp_path, tiny_target, store, [traffic])
    res = runner.invoke(app, ["release", "-c", str(good)])
    outputs["cli release"] = res.output
    assert res.exit_code == 0, res.output
    cfg = load_config(good)
    keys = {p.stage.name: p.key for p in plan(cfg)}
    gen = json.loads((store / "generate" / keys["generate"] / "summary.json").read_text())
    for kind in BUILTIN_KINDS:
        assert gen["input_secrets_by_kind"][kind] >= 1, (kind, gen["input_secrets_by_kind"])
    gen_metrics = json.loads((store / "generate" / keys["generate"] / "manifest.json").read_text())["metrics"]
    assert gen_metrics["input_secrets"] == gen["input_secrets"] >= len(BUILTIN_KINDS)
    assert all(gen_metrics[f"input_secrets_{k}"] == gen["input_secrets_by_kind"][k] for k in BUILTIN_KINDS)
    report = json.loads((store / "scrub" / keys["scrub"] / "report.json").read_text())
    assert report["counts_input"] == gen["input_secrets_by_kind"]
    assert all(report["counts"][k] == report["counts_input"][k] + report["counts_generated"][k] for k in BUILTIN_KINDS)
    # the planted rows were generated, with the secrets replaced (not dropped)
    from drafter.core.files import iter_rows

    rows = {r["id"]: r for r in iter_rows(store / "generate" / keys["generate"] / "shards")}
    for kind in BUILTIN_KINDS:
        assert f"[REDACTED:{kind}]" in rows[f"traffic-{kind}"]["messages"][0]["content"], kind
    assert len(rows["traffic-multi"]["turns"]) == 2
    manifest = json.loads((store / "generate" / keys["generate"] / "manifest.json").read_text())
    assert "env" not in manifest["config"]["serving"] and "scrub" in manifest["config"]
    outputs["decoded token ids"] = decoded_token_ids(store, AutoTokenizer.from_pretrained(str(tiny_target)))

    # 2. a malformed row holding a secret: the CLI names file:line, key and the value's shape only
    bad = write_malformed(tmp_path / "bad.jsonl")
    bad_cfg = config_file(tmp_path, tiny_target, tmp_path / "store-bad", [bad])
    res = runner.invoke(app, ["release", "-c", str(bad_cfg)])
    outputs["cli malformed"] = res.output
    assert res.exit_code in (1, 2), res.output  # 2: refused by the preflight checks, 1: by the generate stage
    flat = "".join(res.output.split())  # rich folds long lines, also inside words
    assert "bad.jsonl:2" in flat and "messages[0].content" in flat and "anobjectwith1key" in flat, res.output
    # the same through `drafter stage` (the container entrypoint)
    res = runner.invoke(app, ["stage", "generate", "-c", str(bad_cfg)])
    outputs["cli stage malformed"] = res.output
    assert res.exit_code in (1, 2) and "bad.jsonl:2" in "".join(res.output.split()), res.output

    # 3. credentials in serving.url: refused at load, the password masked
    url = f"http://planted-user:{URL_PASSWORD}@127.0.0.1:9/v1"
    url_cfg = config_file(tmp_path, tiny_target, tmp_path / "store-url", [traffic], url=url, launcher="url")
    res = runner.invoke(app, ["release", "-c", str(url_cfg)])
    outputs["cli url"] = res.output
    assert res.exit_code == 2 and "planted-user:***@127.0.0.1" in "".join(res.output.split()), res.output
    assert "serving.api_key_env" in "".join(res.output.split())
    # ... also when the flow itself loads the config (the error lands in Prefect's database)
    with pytest.raises(ConfigError, match=r"planted-user:\*\*\*@") as e:
        release(config_path=str(url_cfg))
    outputs["flow url error"] = str(e.value)
    with pytest.raises((RuntimeError, DrafterError), match=r"bad\.jsonl:2") as e:
        release(config_path=str(bad_cfg))
    outputs["flow malformed error"] = str(e.value)

    flush_prefect_logs()
    captured = capfd.readouterr()
    outputs |= {"stdout": captured.out, "stderr": captured.err,
                "log records": "\n".join(r.getMessage() for r in caplog.records)}
    searched = files_under(store, tmp_path / "store-bad", tmp_path / "store-url", *prefect_paths())
    assert any(p.name.endswith(".db") for p in searched) and any("storage" in p.parts for p in searched)
    assert hits(searched, outputs) == []
    # the right database was searched: it holds the flow's config parameter (env masked) and the refusal
    db_files = [p for p in files_under(prefect_paths()[0]) if ".db" in p.name]
    db_bytes = b"".join(p.read_bytes() for p in db_files)
    assert b"HF_TOKEN" in db_bytes and b"**********" in db_bytes and b"planted-user:***@" in db_bytes
    # the search would have found them: the inputs do hold every needle
    assert len(hits([traffic, good], {})) == len(USER_SECRETS) + 1


# --------------------------------------------------------------------------- keys


BRIEF_OPERATIONAL = {
    "serving": {"env", "python", "startup_timeout_s", "host", "port", "api_key_env"},
    "generate": {"request_timeout_s", "max_retries", "retry_backoff_s"},
    "capture": {"min_free_margin"},
    "quantize_exl3": {"timeout_s"},  # its python is keyed: it decides whether the EXL3 form exists
    "ab_live": {"request_timeout_s"},
}


def _other_value(name: str, value):
    if name == "env":
        return {"HF_TOKEN": "another-value", "OTHER": "${SOMEWHERE}"}
    if name == "api_key_env":
        return "SOME_OTHER_KEY_VAR"
    if name == "kind":  # runner.kind
        return "containers" if value == "local" else "local"
    if name == "deployment":  # runner.deployment
        return "stage-{stage}/elsewhere"
    if name == "deployments":
        return {"train": "stage-train/docker-gpu"}
    if name == "job_variables":
        return {"volumes": ["/data:/data"]}
    if name == "docker_gpus":
        return None if value else "all"
    if name == "device":  # train/capture/eval_offline.device: auto, cpu, cuda, cuda:N
        return "cuda:1" if value != "cuda:1" else "cpu"
    if name == "experts":  # train/eval_offline.experts: auto, eager, grouped_mm
        return "eager" if value != "eager" else "grouped_mm"
    if name == "frozen_dtype":  # train.frozen_dtype: auto, float32, bfloat16
        return "float32" if value != "float32" else "auto"
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    return "/some/other/place"  # str or None: paths, host


def _keys(cfg: ReleaseConfig) -> dict[str, str]:
    return {p.stage.name: p.key for p in plan(cfg)}


def test_secrets_and_operational_settings_never_change_a_stage_key(tmp_path, tiny_target):
    traffic = write_traffic(tmp_path / "traffic.jsonl")
    base = load_config(config_file(tmp_path, tiny_target, tmp_path / "store", [traffic]))
    base.stages = None  # every stage
    k0 = _keys(base)
    for section, names in BRIEF_OPERATIONAL.items():
        assert names <= type(getattr(base, section)).operational_fields(), section

    # a changed secret, a ${VAR} reference, no env at all
    for env in ({"HF_TOKEN": "changed"}, {"HF_TOKEN": "${HF_TOKEN_OF_WORKER}"}, {}):
        cfg = base.model_copy(deep=True)
        cfg.serving.env = env
        assert _keys(cfg) == k0, env

    changed = []
    for name in sorted(ReleaseConfig.operational_fields()):  # top level: Prefect retries
        cfg = base.model_copy(deep=True)
        setattr(cfg, name, _other_value(name, getattr(base, name)))
        assert _keys(cfg) == k0, name
    for section in ReleaseConfig.model_fields:
        sec = getattr(base, section)
        if not hasattr(sec, "operational_fields"):
            continue
        for name in sorted(sec.operational_fields()):
            cfg = base.model_copy(deep=True)
            setattr(getattr(cfg, section), name, _other_value(name, getattr(sec, name)))
            assert getattr(getattr(cfg, section), name) != getattr(sec, name)
            assert _keys(cfg) == k0, f"{section}.{name} changed a stage key"
            changed.append(f"{section}.{name}")
    assert len(changed) >= sum(len(v) for v in BRIEF_OPERATIONAL.values())

    # what a stage computes still re-keys it (the check above can fail)
    cfg = base.model_copy(deep=True)
    cfg.serving.max_model_len = 4096
    assert _keys(cfg)["generate"] != k0["generate"] and _keys(cfg)["prepare_target"] == k0["prepare_target"]
    cfg = base.model_copy(deep=True)
    cfg.scrub.kinds = ["email"]  # new scrub rules: generate scrubs its input with them
    assert _keys(cfg)["generate"] != k0["generate"]


# --------------------------------------------------------------------------- units


def test_env_values_are_masked_in_every_dump():
    cfg = config_from_dict({"serving": {"env": {"HF_TOKEN": ENV_SECRET}}})
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), json.dumps(cfg.model_dump(mode="json")),
                 repr(cfg.serving.env), json.dumps(cfg.serving.key_dump())):
        assert ENV_SECRET not in text
    assert "env" not in cfg.serving.key_dump()
    assert cfg.serving.env_values() == {"HF_TOKEN": ENV_SECRET}
    # a bad env value's error shows neither the value nor its text
    with pytest.raises(ConfigError) as e:
        config_from_dict({"serving": {"env": {"HF_TOKEN": [ENV_SECRET]}}})
    assert "serving.env.HF_TOKEN" in str(e.value) and ENV_SECRET not in str(e.value)
    # `--set` with a value that is not YAML names the field, not the value
    from drafter.core.config import parse_override

    with pytest.raises(ConfigError) as e:
        parse_override(f"serving.env.HF_TOKEN=[{ENV_SECRET}")
    assert "serving.env.HF_TOKEN" in str(e.value) and ENV_SECRET not in str(e.value)


def test_url_credentials_are_refused_and_redacted():
    assert redact_url("see https://bob:hunter2@host.example/v1 and ftp://tok123@x.org") == \
        "see https://bob:***@host.example/v1 and ftp://***@x.org"
    assert redact_url("http://127.0.0.1:8000/v1/chat") == "http://127.0.0.1:8000/v1/chat"
    assert url_has_credentials("http://u:p@h") and not url_has_credentials("http://h:80/a@b")
    for url in (f"http://u:{URL_PASSWORD}@h:8000/v1", f"https://{URL_PASSWORD}@h/v1"):
        with pytest.raises(ConfigError, match=r"serving\.url.*refused.*serving\.api_key_env") as e:
            config_from_dict({"serving": {"launcher": "url", "url": url}})
        assert URL_PASSWORD not in str(e.value) and "***@h" in str(e.value)
        # the pydantic error itself (e.g. Prefect validating a parameter) does not carry the input either
        from pydantic import ValidationError

        with pytest.raises(ValidationError) as ve:
            ServingConfig(url=url)
        assert URL_PASSWORD not in str(ve.value)
    with pytest.raises(ConfigError, match="NAME of an environment variable"):
        config_from_dict({"serving": {"api_key_env": "sk-this-is-a-key"}})
    with pytest.raises(ConfigError, match=r"--api-key.*serving\.env"):
        config_from_dict({"serving": {"extra_args": ["--api-key", "abc"]}})
    with pytest.raises(ConfigError, match=r"ab_live\.server_args.*--api-key"):
        config_from_dict({"ab_live": {"server_args": ["--api-key=abc"]}})


def test_server_env_expands_references_only_at_start(tmp_path, monkeypatch):
    from drafter.serving.server import MASKED, ServingError, _server_env_overrides, docker_command, server_env

    monkeypatch.setenv("WORKER_TOKEN", ENV_SECRET)
    s = ServingConfig(env={"HF_TOKEN": "${WORKER_TOKEN}", "PLAIN": "x-${WORKER_TOKEN}-y", "LIT": "lit"})
    assert ENV_SECRET not in s.model_dump_json() and s.env_values()["HF_TOKEN"] == "${WORKER_TOKEN}"
    env = server_env(s)
    assert env["HF_TOKEN"] == ENV_SECRET and env["PLAIN"] == f"x-{ENV_SECRET}-y" and env["LIT"] == "lit"
    # docker: names only on the command line, values through the client's environment
    (tmp_path / "m").mkdir()
    cmd = docker_command(tmp_path / "m", s.model_copy(update={"launcher": "docker"}), port=1, served_model_name="t")
    assert ENV_SECRET not in " ".join(cmd) and cmd[cmd.index("HF_TOKEN") - 1] == "-e"
    monkeypatch.delenv("WORKER_TOKEN")
    with pytest.raises(ServingError, match=r"serving\.env\.HF_TOKEN refers to \$\{WORKER_TOKEN\}"):
        _server_env_overrides(s)
    # a config that went through a masking dump (Prefect parameters) says so instead of starting with the mask
    masked = ServingConfig.model_validate(json.loads(ServingConfig(env={"T": "secret"}).model_dump_json()))
    assert masked.env_values() == {"T": MASKED}
    with pytest.raises(ServingError, match=r"serving\.env\.T is the mask"):
        _server_env_overrides(masked)


def test_api_key_is_sent_as_bearer(monkeypatch):
    import asyncio

    import httpx

    from drafter.data.generate import OpenAIChatBackend, Sampling
    from drafter.serving.server import ServingError, api_key

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}})

    monkeypatch.setenv("MY_SERVER_KEY", "key-123")
    key = api_key(ServingConfig(api_key_env="MY_SERVER_KEY"))
    backend = OpenAIChatBackend("http://srv", "m", transport=httpx.MockTransport(handler), api_key=key)

    async def go():
        await backend.chat([{"role": "user", "content": "hi"}], sampling=Sampling(0.0, 1.0, 4), seed=0, template_kwargs={})
        await backend.aclose()
    asyncio.run(go())
    assert seen == ["Bearer key-123"]
    assert api_key(ServingConfig()) is None
    monkeypatch.delenv("MY_SERVER_KEY")
    with pytest.raises(ServingError, match="MY_SERVER_KEY, which is not set"):
        api_key(ServingConfig(api_key_env="MY_SERVER_KEY"))


@pytest.mark.parametrize("row,where", [
    ({"messages": [{"role": "user", "content": {"t": MALFORMED_SECRET}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [MALFORMED_SECRET]}]}, "messages[0].content"),
    ({"messages": [{"role": MALFORMED_SECRET, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": {"x": MALFORMED_SECRET}}]},
     "messages[1].content"),
    ({"messages": MALFORMED_SECRET}, "`messages`"),
    ({"messages": [MALFORMED_SECRET]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "id": {"k": MALFORMED_SECRET}}, "`id`"),
    ({"messages": [{"role": "user", "content": "hi"}], "split": MALFORMED_SECRET}, "`split`"),
    ({"messages": [{"role": "user", "content": "hi"}], "domain": [MALFORMED_SECRET]}, "`domain`"),
    ({MALFORMED_SECRET: 1}, "no `messages` field"),
    ([MALFORMED_SECRET], "each row must be an object"),
])
def test_bad_row_errors_describe_never_quote(tmp_path, row, where):
    from drafter.data.prompts import load_user_file

    f = tmp_path / "u.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "fine"}]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(StageError) as e:
        load_user_file(f)
    msg = str(e.value)
    assert f"u.jsonl:2" in msg and where in msg and MALFORMED_SECRET not in msg and MALFORMED_SECRET[:12] not in msg


def test_describe_value_and_other_row_errors():
    assert describe_value("abc") == "a string of 3 characters" and describe_value({"a": 1}) == "an object with 1 key"
    assert describe_value([1, 2]) == "a list of 2 items" and describe_value(None) == "null"
    from drafter.data.capture import tokenize_rows
    from drafter.core.files import tokenize_conversation

    with pytest.raises(StageError) as e:
        tokenize_conversation(None, [{"content": MALFORMED_SECRET}], row_id="r1")
    assert "message 0 has no 'role'" in str(e.value) and MALFORMED_SECRET not in str(e.value)
    with pytest.raises(StageError) as e:
        tokenize_rows(None, [{"id": "r", "split": MALFORMED_SECRET, "messages": []}], 16)
    assert "split must be one of" in str(e.value) and MALFORMED_SECRET not in str(e.value)


def test_generate_scrubs_user_conversations_before_sending(tmp_path, tiny_target, monkeypatch):
    """What the server receives holds no secret (checked on the requests themselves)."""
    import httpx

    from drafter.data.generate import OpenAIChatBackend
    from drafter.stages import generate as gen_stage
    from tests.test_generate import _target_artifact

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200, json={"choices": [{"message": {"content": "fine"}, "finish_reason": "stop",
                                                      "token_ids": [1, 2]}], "usage": {"completion_tokens": 2}})

    traffic = write_traffic(tmp_path / "traffic.jsonl")
    cfg = config_from_dict({"serving": {"backend": "vllm", "launcher": "url", "url": "http://fake"},
                            "generate": {"num_prompts": 0, "user_files": [str(traffic)], "max_tokens": 4}})
    backend = OpenAIChatBackend("http://fake", "m", transport=httpx.MockTransport(handler))

    class FakeServe:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            from drafter.serving.server import Server

            return Server(base_url="http://fake", model="m")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("drafter.serving.server.serve", FakeServe)
    monkeypatch.setattr("drafter.data.generate.OpenAIChatBackend", lambda *a, **kw: backend)  # the stage's backend_factory makes it
    metrics = gen_stage.run(cfg, {"prepare_target": _target_artifact(tmp_path, tiny_target)}, tmp_path / "out")
    assert metrics["rows"] == 7 and metrics["input_secrets"] >= len(BUILTIN_KINDS)
    assert bodies and hits([], {"requests": b"\n".join(bodies)}) == []
    assert hits(files_under(tmp_path / "out"), {}) == []
    assert any(b"[REDACTED:api_key]" in b for b in bodies)


# --------------------------------------------------------------------------- real vLLM


@pytest.mark.slow
def test_vllm_server_gets_env_secrets_that_nothing_records(tmp_path, tiny_target, monkeypatch):
    """vLLM (serving env) serves the tiny target with a literal and a ${VAR} secret in serving.env:
    the server process has both in its environment; its log and the generate output have neither."""
    import contextlib

    import drafter.serving.server as serving_mod
    from drafter.serving.server import serving_python
    from drafter.stages.generate import STAGE
    from tests.test_generate import _target_artifact

    if not Path(serving_python()).exists():
        pytest.fail(f"serving env python {serving_python()} is missing: run `make env` (the slow test needs vLLM)")
    ref_secret = "PLANTEDrefSECRETfromWORKERenv9876"
    monkeypatch.setenv("WORKER_SIDE_TOKEN", ref_secret)
    real_serve, seen = serving_mod.serve, {}

    @contextlib.contextmanager
    def spying_serve(*a, **kw):
        with real_serve(*a, **kw) as srv:
            seen["environ"] = Path(f"/proc/{srv.pid}/environ").read_bytes()
            seen["cmdline"] = Path(f"/proc/{srv.pid}/cmdline").read_bytes()
            yield srv

    monkeypatch.setattr(serving_mod, "serve", spying_serve)
    traffic = write_traffic(tmp_path / "traffic.jsonl")
    cfg = config_from_dict({
        "serving": {"backend": "vllm", "dtype": "float32",
                    "env": {"DRAFTER_TEST_SECRET": ENV_SECRET, "DRAFTER_TEST_REF": "${WORKER_SIDE_TOKEN}"}},
        "generate": {"num_prompts": 2, "max_tokens": 6, "user_files": [str(traffic)], "concurrency": 4},
    })
    out = tmp_path / "out"
    metrics = STAGE.run(cfg, {"prepare_target": _target_artifact(tmp_path, tiny_target)}, out)
    assert metrics["engine"] == "vllm" and metrics["failed"] == 0 and metrics["rows"] == 9
    environ = seen["environ"].split(b"\0")
    assert f"DRAFTER_TEST_SECRET={ENV_SECRET}".encode() in environ
    assert f"DRAFTER_TEST_REF={ref_secret}".encode() in environ
    assert ENV_SECRET.encode() not in seen["cmdline"] and ref_secret.encode() not in seen["cmdline"]
    log = out / "server.log"
    assert log.stat().st_size > 0
    assert hits(files_under(out), {}, needles=[*ALL_NEEDLES, ref_secret]) == []
