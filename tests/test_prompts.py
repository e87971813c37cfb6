"""Built-in prompt generator (determinism, fixed held-out split, domains) and user prompt files."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from drafter.core.config import ConfigError, GenerateConfig, config_from_dict
from drafter.core.errors import StageError
from drafter.data.prompts import DOMAINS, build_prompts, builtin_prompts, load_user_file


def _key(c):
    return (c.id, c.domain, c.split, c.messages)


def test_deterministic_for_a_seed_and_different_across_seeds():
    a, b = builtin_prompts(64, seed=3), builtin_prompts(64, seed=3)
    assert [_key(c) for c in a] == [_key(c) for c in b]
    other = builtin_prompts(64, seed=4)
    assert sum(x.messages == y.messages for x, y in zip(a, other)) < 8


def test_prefix_stable_and_heldout_split_fixed_when_num_prompts_grows():
    small, big = builtin_prompts(40, seed=0), builtin_prompts(400, seed=0)
    assert [_key(c) for c in small] == [_key(c) for c in big[:40]]
    # a held-out prompt stays held out (same id, same text) however many prompts are drawn
    held_small = {c.id: c.messages for c in small if c.split == "heldout"}
    held_big = {c.id: c.messages for c in big if c.split == "heldout"}
    assert held_small and all(held_big[i] == m for i, m in held_small.items())


def test_heldout_fraction_is_exact_per_domain():
    ps = builtin_prompts(400, seed=0, heldout_fraction=0.125)
    for d in DOMAINS:
        dom = [c for c in ps if c.domain == d]
        n_held = sum(c.split == "heldout" for c in dom)
        assert math.floor(len(dom) * 0.125) <= n_held <= math.ceil(len(dom) * 0.125), (d, n_held, len(dom))
    assert all(c.split == "train" for c in builtin_prompts(50, seed=0, heldout_fraction=0.0))


def test_all_domains_present_distinct_and_weighted():
    ps = builtin_prompts(400, seed=0)
    assert Counter(c.domain for c in ps) == {d: 100 for d in DOMAINS}
    assert len({json.dumps(c.messages) for c in ps}) == 400  # hundreds of distinct prompts
    assert len({c.id for c in ps}) == 400
    mix = Counter(c.domain for c in builtin_prompts(40, seed=0, domains={"code": 3, "math": 1, "agent": 0}))
    assert mix == {"code": 30, "math": 10}


def test_conversation_shape_and_agent_turns():
    ps = builtin_prompts(200, seed=1)
    for c in ps:
        roles = [m["role"] for m in c.messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert roles[-1] == "assistant" and "system" not in roles[1:]
        assert all(not (a == b == "assistant") for a, b in zip(roles, roles[1:]))
        assert all(m["content"] is None for m in c.messages if m["role"] == "assistant")
        assert all(isinstance(m["content"], str) and m["content"] for m in c.messages if m["role"] != "assistant")
    agents = [c for c in ps if c.domain == "agent"]
    assert all(c.messages[0]["role"] == "system" and "tools" in c.messages[0]["content"] for c in agents)
    multi = [c for c in agents if c.num_assistant_turns >= 2]
    assert len(multi) > len(agents) // 3
    for c in multi:  # later user turns carry tool output
        later_users = [m for m in c.messages[3:] if m["role"] == "user"]
        assert later_users and all(m["content"].startswith("TOOL RESULT") for m in later_users)


# --------------------------------------------------------------------------- user files


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_user_jsonl_loading(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]},
        {"id": "mine-1", "domain": "support", "split": "heldout",
         "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]},
    ]
    convs = load_user_file(_write_jsonl(tmp_path / "a.jsonl", rows))
    a, b = convs
    # assistant answers become placeholders and the last user turn gets one too
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] is None for m in a.messages if m["role"] == "assistant")
    assert a.id.startswith("user-") and a.domain == "user" and a.split in ("train", "heldout")
    assert (b.id, b.domain, b.split) == ("mine-1", "support", "heldout")
    # the default id depends on the conversation, not on the file name or the row order
    again = load_user_file(_write_jsonl(tmp_path / "other-name.jsonl", rows[::-1]))
    assert {c.id: c.split for c in again} == {c.id: c.split for c in convs}


def test_user_parquet_loading(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
            [{"role": "user", "content": "Say hi."}]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "structs.parquet")
    pq.write_table(pa.table({"messages": [json.dumps(m) for m in msgs], "id": ["x", "y"]}), tmp_path / "strings.parquet")
    a = load_user_file(tmp_path / "structs.parquet")
    b = load_user_file(tmp_path / "strings.parquet")
    assert [c.messages for c in a] == [c.messages for c in b]
    assert [c.id for c in b] == ["x", "y"]
    assert a[1].messages[-1] == {"role": "assistant", "content": None}


@pytest.mark.parametrize("line, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"prompt": "hi"}', "no `messages` field"),
    ('{"messages": []}', "must be a non-empty list"),
    ('{"messages": [{"role": "tool", "content": "42"}]}', "messages[0].role is 'tool'"),
    ('{"messages": [{"role": "user", "content": ""}]}', "messages[0].content (user) must be a non-empty string"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}', "only the first message"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "before any user message"),
    ('{"messages": [{"role": "user", "content": "a"}], "split": "test"}', "`split` must be one of"),
    ('[1, 2]', "each row must be an object"),
])
def test_bad_jsonl_rows_name_file_line_and_problem(tmp_path, line, problem):
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", line])
    with pytest.raises(StageError) as e:
        load_user_file(path)
    assert f"{path}:3" in str(e.value) and problem in str(e.value)


def test_bad_parquet_and_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [json.dumps([{"role": "user", "content": "ok"}]), "{not json"]}),
                   tmp_path / "bad.parquet")
    with pytest.raises(StageError, match=r"bad\.parquet row 1: `messages` is a string but not valid JSON"):
        load_user_file(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "nocol.parquet")
    with pytest.raises(StageError, match="no `messages` column"):
        load_user_file(tmp_path / "nocol.parquet")
    with pytest.raises(StageError, match="does not exist"):
        load_user_file(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(StageError, match="unknown format"):
        load_user_file(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(StageError, match="has no conversations"):
        load_user_file(tmp_path / "empty.jsonl")


def test_build_prompts_merges_files_and_rejects_duplicate_ids(tmp_path):
    f1 = _write_jsonl(tmp_path / "1.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "one"}]}])
    f2 = _write_jsonl(tmp_path / "2.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "two"}]}])
    convs = build_prompts(GenerateConfig(num_prompts=8, user_files=[str(f1)]))
    assert len(convs) == 9 and convs[-1].id == "a"
    assert [c.id for c in build_prompts(GenerateConfig(num_prompts=0, user_files=[str(f1)]))] == ["a"]
    with pytest.raises(StageError, match=r"prompt id 'a' appears twice: in .*1\.jsonl:1 and in .*2\.jsonl:1"):
        build_prompts(GenerateConfig(num_prompts=0, user_files=[str(f1), str(f2)]))


def test_config_rejects_unknown_domains_and_empty_runs():
    with pytest.raises(ConfigError, match=r"generate\.domains.*unknown prompt domain\(s\) \['poetry'\]"):
        config_from_dict({"generate": {"domains": {"poetry": 1.0}}})
    with pytest.raises(ConfigError, match="at least one domain"):
        config_from_dict({"generate": {"domains": {"code": 0}}})
    with pytest.raises(ConfigError, match="nothing to generate"):
        config_from_dict({"generate": {"num_prompts": 0}})
