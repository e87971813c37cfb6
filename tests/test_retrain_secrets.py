"""The scheduled retrain never persists a secret of its traffic (issue 33, class 1).

Traffic files carrying secrets of every built-in kind (tests/test_secrets.py's planted needles) go
through `drafter_prefect/retrain.py`: the snapshot it trains on, the ledger, every other file of the store, the
run's output and Prefect's database hold none of them; the ledger's hashes are of the scrubbed
conversations; the same raw traffic gives the same snapshot file. A malformed traffic file stops the
run naming its file:line and what to do, without quoting the row or writing anything.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from drafter.core.config import config_from_dict, load_config
from drafter.core.errors import BadInputError
from drafter.data.prompts import load_user_file
from drafter.data.scrub import BUILTIN_KINDS, scrubber_for
from drafter.data.traffic import conversation_hash, new_traffic, write_snapshot
from tests.test_release_e2e import write_config
from tests.test_secrets import (MALFORMED_SECRET, USER_SECRETS, files_under, flush_prefect_logs, hits, prefect_paths,
                                write_malformed, write_traffic)

NO_ID_KEY = "sk-proj-PLANTEDnoIDrowKEY0123456789abc"
NO_ID_PASSWORD = "PLANTEDhunter2horse9"
NEEDLES = [*USER_SECRETS.values(), NO_ID_KEY, NO_ID_PASSWORD, MALFORMED_SECRET]


def write_day(traffic_dir: Path) -> Path:
    """One day of traffic: every kind of secret (tests/test_secrets.py), a row without an id holding an API key
    and a password, a clean row, and a repeat of a secret row."""
    traffic_dir.mkdir(parents=True, exist_ok=True)
    f = write_traffic(traffic_dir / "day1.jsonl")
    rows = f.read_text().splitlines()
    extra = [{"messages": [{"role": "user", "content": f"why does {NO_ID_KEY} fail with password={NO_ID_PASSWORD} ?"}]},
             {"messages": [{"role": "user", "content": "What is 12 times 12?"}]}]
    f.write_text("\n".join(rows + [json.dumps(r) for r in extra] + rows[1:2]) + "\n")
    return f


def _raw_convs(path: Path) -> list:
    return load_user_file(path)


# --------------------------------------------------------------------------- the library


def test_new_traffic_is_scrubbed_before_it_is_hashed_or_written(tmp_path):
    day = write_day(tmp_path / "traffic")
    scrubber = scrubber_for(config_from_dict({}).scrub)
    t = new_traffic([str(tmp_path / "traffic" / "*.jsonl")], set(), scrubber)
    assert t.rows == 10 and len(t.new) == 9 and t.duplicates == 1 and t.scrubbed == 9
    for kind in BUILTIN_KINDS:
        assert t.secrets[kind] >= 1, (kind, t.secrets)
    assert hits([], {"new": json.dumps([c.messages for c in t.new] + [[c.id, c.domain] for c in t.new])},
                needles=NEEDLES) == []
    assert "secret(s) removed from 9 conversation(s)" in t.secrets_text()

    snap = write_snapshot(t.new, tmp_path / "out")
    assert hits([snap], {}, needles=NEEDLES) == []
    assert "[REDACTED:api_key]" in snap.read_text() and "[REDACTED:password]" in snap.read_text()
    # the hashes are the scrubbed conversations' (what generate reads back from the snapshot)
    back = load_user_file(snap)
    assert t.hashes == [conversation_hash(c) for c in back]
    raw = {c.id: c for c in _raw_convs(day)}
    secret_raw = [c for c in raw.values() if any(m["content"] and scrubber.find(m["content"]) for m in c.messages)]
    assert len(secret_raw) == 8 and not {conversation_hash(c) for c in secret_raw} & set(t.hashes)
    # a row without an id: its id is derived from the scrubbed content, not from the raw text
    (no_id,) = [c for c in back if c.messages[0]["content"].startswith("why does")]
    assert no_id.messages[0]["content"] == "why does [REDACTED:api_key] fail with password=[REDACTED:password] ?"
    assert no_id.id == "user-" + conversation_hash(no_id)[:16]
    raw_no_id = next(c for c in raw.values() if NO_ID_KEY in c.messages[0]["content"])
    assert raw_no_id.id != no_id.id

    # the same raw traffic: the same snapshot (name and bytes), so the same generate key
    t2 = new_traffic([str(day)], set(), scrubber)
    snap2 = write_snapshot(t2.new, tmp_path / "out2")
    assert snap2.name == snap.name and snap2.read_bytes() == snap.read_bytes()
    # seen again: all of it recognised from the ledger of scrubbed hashes
    t3 = new_traffic([str(day)], t.ledger(set()), scrubber)
    assert t3.new == [] and t3.seen_before == 10


def test_a_ledger_of_raw_hashes_still_recognises_its_traffic_and_sheds_them(tmp_path):
    """Ledgers written before the traffic was scrubbed hold raw hashes: still seen, replaced when recorded."""
    day = write_day(tmp_path / "traffic")
    scrubber = scrubber_for(config_from_dict({}).scrub)
    old_ledger = {conversation_hash(c) for c in _raw_convs(day)}
    t = new_traffic([str(day)], old_ledger, scrubber)
    assert t.new == [] and t.seen_before == 10 and len(t.legacy) == 8
    ledger = t.ledger(old_ledger)
    clean = new_traffic([str(day)], set(), scrubber)
    assert ledger == set(clean.hashes)  # every raw hash of a secret row replaced by its scrubbed one


def test_malformed_traffic_names_the_line_and_what_to_do(tmp_path):
    (tmp_path / "traffic").mkdir()
    bad = write_malformed(tmp_path / "traffic" / "bad.jsonl")
    with pytest.raises(BadInputError) as e:
        new_traffic([str(tmp_path / "traffic" / "*.jsonl")], set(), scrubber_for(config_from_dict({}).scrub))
    msg = str(e.value)
    assert f"{bad}:2" in msg and "messages[0].content" in msg
    assert "Fix or delete that row" in msg and "retrain.traffic" in msg and "run the retrain again" in msg
    assert MALFORMED_SECRET not in msg and MALFORMED_SECRET[:12] not in msg


# --------------------------------------------------------------------------- the flow


def _config(tmp_path: Path, tiny_target: Path, store: Path) -> Path:
    p = write_config(tmp_path, tiny_target, store, generate={"num_prompts": 2, "max_tokens": 6},
                     retrain={"min_new_rows": 3})
    data = yaml.safe_load(p.read_text())
    data["retries"] = 0
    data["stages"] = ["scrub"]  # prepare_target → generate → scrub: the traffic is read, sent and written
    p.write_text(yaml.safe_dump(data))
    return p


def test_retrain_leaves_no_secret_of_its_traffic_anywhere(prefect_harness, tmp_path, tiny_target, capfd, caplog):
    from drafter_prefect.retrain import retrain

    day = write_day(tmp_path / "traffic")
    store = tmp_path / "store"
    cfg_path = _config(tmp_path, tiny_target, store)
    outputs: dict[str, str | bytes] = {}

    result = retrain(config_path=str(cfg_path), traffic=[str(tmp_path / "traffic" / "*.jsonl")])
    outputs["result"] = json.dumps(result, default=str)
    assert result["status"] == "release completed" and result["new_rows"] == 9, result
    assert hits(files_under(store), {}, needles=NEEDLES) == []  # the snapshot, the ledger, every stage output
    assert result["conversations_scrubbed"] == 9 and set(result["secrets_removed"]) == set(BUILTIN_KINDS)

    # the snapshot is what generate trained on: scrubbed, and the ledger hashes its conversations
    (snap,) = (store / "records" / "traffic").glob("traffic-*.jsonl")
    assert snap.name == result["traffic_file"] and "[REDACTED:api_key]" in snap.read_text()
    ledger = set((store / "records" / "traffic-seen.txt").read_text().split())
    assert ledger == {conversation_hash(c) for c in load_user_file(snap)}
    cfg = load_config(cfg_path)
    assert cfg.generate.user_files == []  # the flow set it on its own copy
    (gen,) = (store / "generate").glob("*/summary.json")
    assert json.loads(gen.read_text())["input_secrets"] >= 1  # the replacement text `password = "[REDACTED…]"`

    # the same traffic again: recognised, nothing started
    again = retrain(config_path=str(cfg_path), traffic=[str(day)])
    outputs["again"] = json.dumps(again, default=str)
    assert again["status"].startswith("not enough new traffic") and again["seen_before"] == 10

    # a malformed traffic file (a secret in the bad row): the file:line and what to do; nothing written
    bad_dir = tmp_path / "bad-traffic"
    bad_dir.mkdir()
    bad = write_malformed(bad_dir / "bad.jsonl")
    bad_store = tmp_path / "store-bad"
    with pytest.raises(BadInputError) as e:
        retrain(config_path=str(_config(tmp_path, tiny_target, bad_store)), traffic=[str(bad_dir / "*.jsonl")])
    outputs["malformed error"] = str(e.value)
    assert f"{bad}:2" in str(e.value) and "Fix or delete that row" in str(e.value)
    assert not (bad_store / "records").exists()

    flush_prefect_logs()
    captured = capfd.readouterr()
    outputs |= {"stdout": captured.out, "stderr": captured.err,
                "log records": "\n".join(r.getMessage() for r in caplog.records)}
    searched = files_under(store, bad_store, *prefect_paths())
    assert len(files_under(store)) > 10 and any(p.name.endswith(".db") for p in searched)
    assert hits(searched, outputs, needles=NEEDLES) == []
    # the right database was searched: it holds this run's logs (the flow prints to them) and its artifact
    db = b"".join(p.read_bytes() for p in files_under(prefect_paths()[0]) if ".db" in p.name)
    assert b"secret(s) removed from 9 conversation(s)" in db and snap.name.encode() in db
    # and the search would have found them: the traffic holds every needle
    assert len(hits([day, bad], {}, needles=NEEDLES)) == len(NEEDLES)
