"""`drafter release` as a process: its first start on a new machine, and what a signal leaves behind.

* From a brand-new PREFECT_HOME with both cores busy, the CLI starts (the local Prefect API server
  creates its database then); a start-up limit that is too short fails with an error that says
  what to set, and leaves no server behind.
* SIGKILL, SIGTERM and SIGINT during generate (served by vLLM), capture and train (SIGNAL_CASES): every process
  the run started (guards, vLLM and its engine, the Prefect API server) is gone, nothing partial is
  published, outputs finished before the signal are never modified, and the rerun finishes with
  the same bytes as a run that was never interrupted.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = str(Path(sys.executable).parent / "drafter")
# files whose content is a measurement of this run (times, speeds, a server's log), not a result
TIMING_FILES = {
    "generate": {"server.log", "summary.json", "shard_stats/*"},
    "capture": {"report.json"},
    "train": {"result.json", "history.jsonl", "curves.png", "table.md"},
}


# --------------------------------------------------------------------------- processes


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, start time) of every live, non-zombie process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f[0] != "Z":
                out[int(d.name)] = (int(f[1]), f[19])
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


class Watch:
    """Records every descendant of ``root`` (pid, start time, command line) while it runs."""

    def __init__(self, root: int):
        self.root, self.seen, self._stop = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            table = _proc_table()
            kids: dict[int, list[int]] = {}
            for pid, (ppid, _) in table.items():
                kids.setdefault(ppid, []).append(pid)
            todo = list(kids.get(self.root, []))
            while todo:
                pid = todo.pop()
                if pid not in self.seen and pid in table:
                    self.seen[pid] = (table[pid][1], _cmdline(pid))
                todo.extend(kids.get(pid, []))
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def alive(self) -> dict[int, str]:
        table = _proc_table()
        return {pid: cmd for pid, (start, cmd) in self.seen.items() if pid in table and table[pid][1] == start}

    def wait_all_gone(self, timeout: float = 60.0) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


# --------------------------------------------------------------------------- helpers


def _env(prefect_home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(prefect_home), "PYTHONUNBUFFERED": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1"} | extra
    return env


def _start(cfg: Path, env: dict, log: Path, stage: str = "train") -> subprocess.Popen:
    """`drafter release … --stage STAGE` in its own session, its output to ``log`` (a file, not a
    pipe: a pipe nobody reads fills up and blocks the run)."""
    with open(log, "ab") as f:
        return subprocess.Popen([DRAFTER, "release", "-c", str(cfg), "--stage", stage], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    proc.wait(timeout=timeout)
    return log.read_text(errors="replace")


def _published(store: Path) -> dict[str, str]:
    """relative path → sha256 of every file of every published stage output (manifests included)."""
    out = {}
    for stage_dir in sorted(p for p in store.iterdir() if p.is_dir() and p.name != "runs"):
        for out_dir in sorted(p for p in stage_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for f in sorted(out_dir.rglob("*")):
                if f.is_file():
                    out[f.relative_to(store).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _results(store: Path) -> dict[str, str]:
    """Like :func:`_published`, without manifests and the files that are measurements of one run."""
    import fnmatch

    out = {}
    for rel, digest in _published(store).items():
        stage, _key, inner = rel.split("/", 2)
        if inner == "manifest.json" or any(fnmatch.fnmatch(inner, p) for p in TIMING_FILES.get(stage, ())):
            continue
        out[rel] = digest
    return out


def _write_config(path: Path, target: Path, store: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "lifecycle",
        "store": {"root": str(store)},
        "prepare_target": {"source": "path", "path": str(target)},
        "serving": {"backend": "vllm", "dtype": "float32", "max_model_len": 1024},
        "generate": {"num_prompts": 32, "max_tokens": 16, "shard_size": 2, "concurrency": 2},
        "capture": {"shard_tokens": 128, "batch_tokens": 128, "layers": [0, 1, 2, 3]},
        "train": {"k_steps": 2, "window": 64, "micro_batch": 2, "max_steps": 12, "warmup_steps": 1,
                  "checkpoint_every": 2, "eval_every": 100, "eval_windows": 2},
        "retries": 0,
    }))
    return path


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """A target big enough for each stage to be caught mid-way, a shared PREFECT_HOME, and the
    reference: the same release run once without interruption."""
    from drafter.serving.server import serving_python
    from tests.helpers.targets import make_tiny_target

    if not Path(serving_python()).exists():
        pytest.fail(f"serving env python {serving_python()} is missing: run `make env` (these tests need vLLM)")
    base = tmp_path_factory.mktemp("lifecycle")
    target = make_tiny_target(base / "target", num_layers=4, hidden_size=512, intermediate_size=1024, num_heads=4,
                              num_kv_heads=2, head_dim=128)
    home = base / "prefect-home"
    cfg = _write_config(base / "reference.yaml", target, base / "reference")
    proc = _start(cfg, _env(home), base / "reference.log")
    out = _finish(proc, base / "reference.log", 1200)
    assert proc.returncode == 0, out[-4000:]
    return {"base": base, "target": target, "home": home, "reference": base / "reference"}


# --------------------------------------------------------------------------- first start


def _busy_cores(n: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
def test_first_run_on_a_new_prefect_home_with_busy_cores(tmp_path, tiny_target):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"root": str(tmp_path / "store")},
                                   "prepare_target": {"source": "path", "path": str(tiny_target)},
                                   "serving": {"backend": "transformers", "dtype": "float32"}}))
    home = tmp_path / "new-prefect-home"
    busy = _busy_cores()
    try:
        r = subprocess.run([DRAFTER, "release", "-c", str(cfg), "--stage", "prepare_target"], cwd=ROOT,
                           env=_env(home), capture_output=True, text=True, timeout=900)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "prepare_target" in r.stdout and "computed" in r.stdout
    assert (home / "prefect.db").is_file()  # the database was created by this run
    assert "Error logging to API" not in r.stdout + r.stderr  # logs were sent before the server stopped


@pytest.mark.parametrize("how", ["option", "env"])
def test_too_short_startup_limit_says_what_to_set_and_leaves_no_server(tmp_path, tiny_target, how):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"root": str(tmp_path / "store")},
                                   "prepare_target": {"source": "path", "path": str(tiny_target)}}))
    args = ["--prefect-startup-timeout", "0.2"] if how == "option" else []
    env = _env(tmp_path / "home", **({"DRAFTER_PREFECT_STARTUP_TIMEOUT": "0.2"} if how == "env" else {}))
    proc = subprocess.Popen([DRAFTER, "release", "-c", str(cfg), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = Watch(proc.pid)
    out, _ = proc.communicate(timeout=300)
    watch.stop()
    assert proc.returncode != 0
    assert "did not answer within 0 s" in out and "--prefect-startup-timeout" in out
    assert "DRAFTER_PREFECT_STARTUP_TIMEOUT" in out and "PREFECT_API_URL" in out
    assert "Traceback" not in out
    assert any("uvicorn" in c for _, c in watch.seen.values())  # a server was started …
    assert watch.wait_all_gone(30) == {}  # … and did not outlive the failed start
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("manifest.json"))


def test_bad_startup_limit_is_a_clear_error(tmp_path):
    r = subprocess.run([DRAFTER, "release", "-c", str(ROOT / "configs/demo.yaml"), "--stage", "prepare_target",
                        "--store", str(tmp_path / "s")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path / "home", DRAFTER_PREFECT_STARTUP_TIMEOUT="soon"))
    assert r.returncode != 0 and "DRAFTER_PREFECT_STARTUP_TIMEOUT='soon' is not a number of seconds" in r.stdout + r.stderr


# --------------------------------------------------------------------------- signals


def _partial(store: Path, stage: str) -> Path | None:
    found = list((store / stage).glob(".*.partial")) if (store / stage).is_dir() else []
    return found[0] if found else None


def _caught_mid_stage(stage: str, store: Path, watch: Watch) -> bool:
    part = _partial(store, stage)
    if part is None:
        return False
    if stage == "generate":  # vLLM up and at least one shard of conversations written
        return any("vllm.entrypoints" in c for c in watch.alive().values()) and any(part.glob("shards/shard-*.jsonl"))
    if stage == "capture":
        return any(part.glob("features/*/shard-*.safetensors"))
    return any(part.glob("work/ckpt/*"))  # train: a checkpoint written, steps still to go


# every signal and every stage once: generate (vLLM and its engine processes, the largest process tree) with
# SIGTERM, capture with SIGINT, train with SIGKILL (no handler runs: only the guards stop the children). SIGTERM,
# SIGINT and SIGHUP go through the same handler; what differs by stage is how it resumes, which each stage shows.
# (generate-SIGKILL and train-SIGTERM, the other two pairs, passed too; left out to keep CI under its time.)
SIGNAL_CASES = [("generate", signal.SIGTERM), ("capture", signal.SIGINT), ("train", signal.SIGKILL)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,sig", SIGNAL_CASES, ids=[f"{st}-{sg.name}" for st, sg in SIGNAL_CASES])
def test_signal_mid_stage_leaves_nothing_and_rerun_matches(lifecycle, tmp_path, stage, sig):
    ref = lifecycle["reference"]
    store = tmp_path / "store"
    cfg = _write_config(tmp_path / "c.yaml", lifecycle["target"], store)
    # the stages before `stage` as the reference computed them (stage keys do not depend on store.root)
    order = ["prepare_target", "generate", "scrub", "capture", "bootstrap_drafter", "train"]
    for before in order[: order.index(stage)]:
        shutil.copytree(ref / before, store / before)
    env = _env(lifecycle["home"])

    log = tmp_path / "release.log"
    proc = _start(cfg, env, log, stage)
    watch = Watch(proc.pid)
    deadline = time.monotonic() + 900
    while not _caught_mid_stage(stage, store, watch):
        if proc.poll() is not None:
            pytest.fail(f"the release ended before {stage} could be interrupted:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{stage} made no progress to interrupt")
        time.sleep(0.05)
    finished = _published(store)  # what was published before the signal
    part = _partial(store, stage)
    proc.send_signal(sig)
    out = _finish(proc, log, 120)
    assert proc.returncode in (-sig, 128 + sig), out[-3000:]
    if sig != signal.SIGKILL:
        assert f"stopped by {sig.name}" in out
    survivors = watch.wait_all_gone(60)
    watch.stop()
    assert survivors == {}, f"processes of the run survived {sig.name}: {survivors}"
    assert len(watch.seen) >= 2  # the watch saw the run's children (guards, servers)
    if stage == "generate":
        assert any("vllm.entrypoints" in c for _, c in watch.seen.values())
    assert any("uvicorn" in c for _, c in watch.seen.values())  # the local Prefect API server died too
    assert not any((store / stage).glob("[!.]*")), f"{stage} was published after {sig.name}"
    assert part.is_dir()  # kept: the rerun resumes from it
    time.sleep(2)
    assert _published(store) == finished  # nothing finished was modified after the signal

    log = tmp_path / "rerun.log"
    proc = _start(cfg, env, log, stage)
    out = _finish(proc, log, 1200)
    assert proc.returncode == 0, out[-4000:]
    after = _published(store)
    assert {k: after[k] for k in finished} == finished  # finished outputs still untouched
    assert not list(store.glob("*/.*.partial"))  # nothing partial left
    manifest = json.loads(next((store / stage).glob("[!.]*/manifest.json")).read_text())
    assert manifest["resumed"] is True
    if stage in ("generate", "capture"):  # the shards written before the signal were kept, not redone
        assert manifest["metrics"]["shards_reused"] >= 1, manifest["metrics"]
    ran = order[: order.index(stage) + 1]
    ours, theirs = _results(store), {k: v for k, v in _results(ref).items() if k.split("/")[0] in ran}
    assert {k.split("/")[0] for k in ours} == set(ran) - {"bootstrap_drafter"}  # skipped here: a manifest only
    assert ours.keys() == theirs.keys()
    assert ours == theirs  # byte-identical results, however they were reached
