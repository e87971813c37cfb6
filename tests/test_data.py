"""JSONL shards (atomic writes, errors naming file:line) and chat tokenization with the
assistant-only loss mask."""
from __future__ import annotations

import json

import pytest

from drafter.core.files import (
    atomic_path, iter_jsonl, iter_rows, list_shards, read_jsonl, remove_partial_files, shard_index, shard_name,
    tokenize_conversation, write_jsonl_atomic,
)
from drafter.core.errors import StageError


def test_shard_names_roundtrip(tmp_path):
    assert shard_name(3) == "shard-00003.jsonl"
    assert shard_name(12, "safetensors") == "shard-00012.safetensors"
    assert shard_index(tmp_path / "shard-00042.jsonl") == 42
    with pytest.raises(ValueError):
        shard_index("rows.jsonl")


def test_jsonl_write_read_and_listing(tmp_path):
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"héllo {i}\nline"}]} for i in range(5)]
    assert write_jsonl_atomic(tmp_path / shard_name(1), rows[3:]) == 2
    assert write_jsonl_atomic(tmp_path / shard_name(0), rows[:3]) == 3
    (tmp_path / ".shard-00002.jsonl.deadbeef.tmp").write_text("{partial")
    assert [p.name for p in list_shards(tmp_path)] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert list(iter_rows(tmp_path)) == rows
    assert read_jsonl(tmp_path / shard_name(0)) == rows[:3]
    assert remove_partial_files(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.jsonl", "shard-00001.jsonl"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "sub" / "x.jsonl"

    def rows():
        yield {"a": 1}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(target, rows())
    assert not target.exists()
    assert list((tmp_path / "sub").iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_text("ok")
        assert not target.exists()
    assert target.read_text() == "ok"


def test_bad_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "shard-00000.jsonl"
    p.write_text(json.dumps({"id": 1}) + "\n\n{not json\n")
    with pytest.raises(StageError, match=r"shard-00000\.jsonl:3: not valid JSON"):
        list(iter_jsonl(p))
    p.write_text("[1, 2]\n")
    with pytest.raises(StageError, match=r":1: expected a JSON object, got list"):
        list(iter_jsonl(p))


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target))


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]


def test_loss_mask_is_exactly_the_assistant_turns(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONV)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    full_text = tokenizer.apply_chat_template(CONV, tokenize=False)
    assert ids == tokenizer(full_text, add_special_tokens=False)["input_ids"]
    # the masked tokens, span by span, are the two assistant turns with their end-of-turn marker
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [tokenizer.decode(s) for s in spans] == ["It is 4.<|im_end|>\n", "6, of course.<|im_end|>\n"]
    # nothing of the system/user turns or of the "<|im_start|>assistant\n" headers is in the mask
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    for text in ("Be brief.", "What is 2+2?", "And 3+3?", "<|im_start|>assistant\n"):
        assert text in unmasked
    assert "It is 4." not in unmasked and "of course" not in unmasked


def test_no_assistant_turn_gives_empty_mask(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONV[:2])
    assert len(ids) > 5 and sum(mask) == 0


def test_template_breaking_prefix_property_names_the_row(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    # a template that rewrites history: it starts with the number of messages
    tok.chat_template = (
        "{{ messages|length }} turns\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(StageError, match=r"row 'conv-7'.*prefix property at assistant turn 2"):
        tokenize_conversation(tok, CONV, row_id="conv-7")


def test_bad_messages_name_the_row(tokenizer):
    with pytest.raises(StageError, match=r"row 'r1': no messages"):
        tokenize_conversation(tokenizer, [], row_id="r1")
    with pytest.raises(StageError, match=r"row 'r2': message 1 has no 'role'"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "x"}, {"content": "y"}], row_id="r2")


def test_save_safetensors_gives_the_same_bytes_in_every_process(tmp_path):
    """safetensors' own save_file writes its metadata map in a per-process random order (so a
    resumed training wrote a different file than an uninterrupted one); save_safetensors sorts it."""
    import subprocess
    import sys

    import torch

    code = ("import sys, torch; from drafter.core.files import save_safetensors; from safetensors.torch import save_file; "
            "t = {'w': torch.arange(12, dtype=torch.float32).reshape(3, 4), 'b': torch.ones(2, dtype=torch.bfloat16)}; "
            "meta = {k: str(i) for i, k in enumerate(['format', 'layout', 'step', 'loss', 'seed', 'zeta'])}; "
            "save_safetensors(t, sys.argv[1] + '.ours', metadata=meta); save_file(t, sys.argv[1] + '.plain', metadata=meta)")
    outs = [tmp_path / f"run{i}" for i in range(4)]
    for o in outs:
        subprocess.run([sys.executable, "-c", code, str(o)], check=True)
    ours = {(tmp_path / f"run{i}.ours").read_bytes() for i in range(4)}
    plain = {(tmp_path / f"run{i}.plain").read_bytes() for i in range(4)}
    assert len(ours) == 1
    assert len(plain) > 1  # what the fix is for: 6 metadata keys, 720 orders — 4 processes all alike is 1 in 3.7e8
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "run0.ours"), load_file(tmp_path / "run0.plain")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
