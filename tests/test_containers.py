"""Every stage in its own container (`runner: containers`), with the real parts: a `prefect server start`,
a docker-type worker (prefect-docker) started here, podman as the engine (its Docker-compatible socket,
deployments/podman-setup.sh) and the images `make images` built (deployments/Dockerfile.project and
.serving).

* A tiny release on an S3 store (moto's server on 127.0.0.1), the S3 credentials given to the containers
  as Secret block references in the job variables: every stage runs as its own flow run in its own
  container — each manifest names the container (its id, which podman knows as that stage's flow run) and
  the image of its deployment —; the keys are those of `runner: local`, and the data files the same bytes.
  A rerun starts no container.
* A stage container killed (`podman kill`) mid-train, on a folder store mounted into the containers:
  the release fails naming the child flow run and its state; the rerun resumes from the store and leaves
  nothing partial.
* The docker pool's GPU deployment resolves to a container request with device_requests (no GPU here:
  up to the boundary).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from drafter.core import procs
from tests.helpers.prefect_server import PREFECT, ROOT, deployments, prefect_api, resolve_job_configuration

DRAFTER = str(Path(sys.executable).parent / "drafter")
PODMAN = shutil.which("podman")
IMAGES = {"project": "drafter-release:project", "serving": "drafter-release:serving"}
SERVING_STAGES = {"generate", "answer_heldout", "verify_fp8", "ab_live"}  # their deployments run the serving image
BUCKET = "drafter-containers"
# files that measure one run (times, speeds, a server's log) rather than compute a result
MEASUREMENTS = {"generate": ("server.log", "summary.json", "shard_stats/*"), "capture": ("report.json",),
                "train": ("result.json", "history.jsonl", "curves.png", "table.md"),
                "eval_offline": ("*",), "gate": ("*",), "publish": ("*",)}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PODMAN is None, reason="podman is not installed (`make system-deps` as root installs "
                                 "it; `make images` builds the images these tests run)")]


@pytest.fixture(scope="module")
def engine():
    """podman's Docker-compatible socket (started if needed) and its settings; the images must exist
    (`make test` builds them while the other tests run: wait for that build, DRAFTER_IMAGES_STATUS)."""
    status = os.environ.get("DRAFTER_IMAGES_STATUS")
    if status:
        deadline = time.monotonic() + 3600
        while not Path(status).is_file():
            if time.monotonic() > deadline:
                pytest.fail(f"the image build of `make test` did not finish within an hour ({status})")
            time.sleep(5)
        log = Path(status).with_name("make-test.log")
        if Path(status).read_text().strip() != "0":
            pytest.fail(f"`make images` failed (log {log}):\n" + log.read_text()[-3000:])
        print("\n" + "\n".join(log.read_text().strip().splitlines()[-3:]))  # the images' sizes and build times
    out = subprocess.run(["bash", str(ROOT / "deployments" / "podman-setup.sh")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    env = dict(re.findall(r"(\w+)=(\S+)", out.stdout.strip().removeprefix("export ")))
    assert set(env) == {"CONTAINERS_CONF", "DOCKER_HOST"}, out.stdout
    missing = [i for i in IMAGES.values() if subprocess.run([PODMAN, "image", "exists", i], env={**os.environ, **env}).returncode]
    if missing:
        pytest.fail(f"images {missing} are not built: run `make images` (make test builds them)")
    return env


def podman(engine: dict, *args: str) -> str:
    r = subprocess.run([PODMAN, *args], env={**os.environ, **engine}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def docker_worker(server, engine, tmp_path_factory):
    """`prefect worker start --pool docker --type docker` (prefect-docker), talking to podman; stopped by PID. With
    DOCKER_CLIENT_TIMEOUT as docs/containers.md says (a container silent for longer than prefect-docker's 60 s default
    lost its watch: killed then, its flow run stayed RUNNING)."""
    logdir = tmp_path_factory.mktemp("docker-worker")
    log = open(logdir / "worker.log", "wb")
    worker = procs.spawn([PREFECT, "worker", "start", "--pool", "docker", "--type", "docker", "--name", "test-docker"],
                         env={**server["env"], **engine, "DOCKER_CLIENT_TIMEOUT": "900"}, cwd=logdir, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        yield {"log": logdir / "worker.log", "proc": worker}
    finally:
        procs.stop(worker)
        log.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from tests.helpers.s3 import moto_s3

    with moto_s3(tmp_path_factory.mktemp("moto"), BUCKET) as s:
        yield s


def release(server: dict, cfg: Path, *extra: str, env: dict | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    """`drafter release -c CFG` against the test server (the parent flow runs in this subprocess)."""
    return subprocess.run([DRAFTER, "release", "-c", str(cfg), *extra], cwd=ROOT, capture_output=True, text=True,
                          env={**server["env"], **(env or {})}, timeout=timeout)


def flow_runs(api: str, **flt) -> list[dict]:
    return prefect_api.post(api + "/flow_runs/filter", json=flt, timeout=30).json()


def save_secret(server: dict, name: str, value: str) -> None:
    code = f"from prefect.blocks.system import Secret; Secret(value={value!r}).save({name!r}, overwrite=True)"
    r = subprocess.run([sys.executable, "-c", code], env=server["env"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def results(files: dict, stage: str) -> dict:
    """The manifest's files that are results (not measurements of the run), with their sha256."""
    return {f: v["sha256"] for f, v in files.items()
            if not any(fnmatch.fnmatch(f, p) for p in MEASUREMENTS.get(stage, ()))}


def _assert_a_local_run_has_the_keys_and_result_bytes(tiny_target: Path, tmp_path: Path, planned: dict,
                                                      manifests: dict) -> None:
    """The same release in this process (runner: local) into a local store: the containers' keys and statuses, the
    same result bytes. torch on every core, as in the containers (a worker of `make test` computes on its share:
    tests/helpers/torch_threads.py)."""
    from drafter.core.config import load_config
    from drafter.core.pipeline import run_all
    from tests.helpers.torch_threads import all_cores
    from tests.test_release_e2e import write_config

    local = load_config(write_config(tmp_path, tiny_target, tmp_path / "local"))
    with all_cores():
        summary = run_all(local, echo=lambda *_: None)
    assert {s["stage"]: s["key"] for s in summary["stages"]} == planned
    for stage, key in planned.items():
        lm = json.loads((tmp_path / "local" / stage / key / "manifest.json").read_text())
        assert lm["status"] == manifests[stage]["status"], stage
        assert results(lm["files"], stage) == results(manifests[stage]["files"], stage), stage
        assert lm["container"] is None or lm["container"]["id"] != manifests[stage]["container"]["id"]


@pytest.mark.timeout(2400)
def test_every_stage_runs_in_its_own_container_with_the_keys_and_bytes_of_a_local_run(
        server, docker_worker, engine, s3, tiny_target, tmp_path):
    from drafter.core.config import load_config
    from tests.test_release_e2e import write_config

    api = server["api"]
    # the S3 credentials: Secret blocks, referenced by the job variables, resolved by the worker
    # (moto takes any credentials: these are distinct from this process's, to be found where they went)
    key_id, secret = "AKIACONTAINERS0001", "s3-secret-7Qx2-only-in-a-block"
    save_secret(server, "drafter-test-s3-key-id", key_id)
    save_secret(server, "drafter-test-s3-secret", secret)
    mount = str(tiny_target.parent)  # prepare_target.path: the target is read inside the containers
    runner = {"kind": "containers", "timeout_s": 900, "poll_s": 1,
              "job_variables": {"volumes": [f"{mount}:{mount}:ro"],
                                "env": {"AWS_ACCESS_KEY_ID": "{{ prefect.blocks.secret.drafter-test-s3-key-id }}",
                                        "AWS_SECRET_ACCESS_KEY": "{{ prefect.blocks.secret.drafter-test-s3-secret }}",
                                        "AWS_ENDPOINT_URL": s3["url"], "AWS_DEFAULT_REGION": "us-east-1"}}}
    cfg_path = write_config(tmp_path, tiny_target, tmp_path / "s3", runner=runner)
    data = yaml.safe_load(cfg_path.read_text())
    data["store"] = {"root": f"s3://{BUCKET}/release", "cache_dir": str(tmp_path / "parent-cache")}
    cfg_path.write_text(yaml.safe_dump(data))
    before = set(podman(engine, "ps", "-aq", "--no-trunc").split())

    t0 = time.monotonic()
    r = release(server, cfg_path, env=s3["env"])
    took = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:] + docker_worker["log"].read_text()[-3000:]
    print(f"\ntiny release, every stage in a container: {took:.0f} s")
    cfg = load_config(cfg_path)
    from drafter.core.pipeline import plan

    planned = {p.stage.name: p.key for p in plan(cfg)}
    fs = s3["fs"]
    manifests = {s: json.loads(fs.cat_file(f"{BUCKET}/release/{s}/{k}/manifest.json")) for s, k in planned.items()}

    # one container per stage: its id in the manifest, known to podman as that stage's flow run, in its image
    children = {fr["id"]: fr for fr in flow_runs(api, flows={"name": {"any_": [f"stage-{s.replace('_', '-')}"
                                                                            for s in planned]}})}
    ids = set()
    for stage, m in manifests.items():
        c = m["container"]
        assert c and re.fullmatch(r"[0-9a-f]{64}", c["id"] or ""), (stage, c)
        ids.add(c["id"])
        want = IMAGES["serving" if stage in SERVING_STAGES else "project"]
        assert c["image"] == want and c["engine"] == "podman", (stage, c)
        info = json.loads(podman(engine, "inspect", c["id"]))[0]
        assert info["ImageName"].removeprefix("localhost/") == want, (stage, info["ImageName"])
        # the worker resolved the block references into the container's environment
        assert f"AWS_SECRET_ACCESS_KEY={secret}" in info["Config"]["Env"], stage
        child = children[info["Config"]["Labels"]["io.prefect.flow-run-id"]]
        assert child["state"]["type"] == "COMPLETED" and child["parent_task_run_id"], (stage, child["state"])
        assert child["parameters"]["config"]["runner"] == {"kind": "local"}
        assert child["job_variables"]["env"]["AWS_SECRET_ACCESS_KEY"].startswith("{{ prefect.blocks.secret")
    assert len(ids) == len(planned) == 13  # every stage in its own container
    assert ids <= set(podman(engine, "ps", "-aq", "--no-trunc").split()) - before
    statuses = {s: m["status"] for s, m in manifests.items()}
    assert statuses["quantize_exl3"] == "skipped" and "CUDA" in manifests["quantize_exl3"]["reason"]
    assert statuses["train"] == "done" and statuses["publish"] == "done"
    # the secret values never went into the server's records of the runs
    for fr in children.values():
        assert secret not in json.dumps(fr["parameters"]) + json.dumps(fr["job_variables"])

    _assert_a_local_run_has_the_keys_and_result_bytes(tiny_target, tmp_path, planned, manifests)

    # a rerun reuses everything from the store: no container is started
    n = len(podman(engine, "ps", "-aq").split())
    r = release(server, cfg_path, env=s3["env"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert len(podman(engine, "ps", "-aq").split()) == n
    (last,) = [json.loads(fs.cat_file(p)) for p in sorted(fs.find(f"{BUCKET}/release/runs"))[-1:]]
    assert {s["status"] for s in last["stages"]} == {"reused"}


def _child(api: str, flow: str, states: tuple[str, ...], exclude: set[str] = frozenset()) -> dict | None:
    runs = flow_runs(api, flows={"name": {"any_": [flow]}}, flow_runs={"state": {"type": {"any_": list(states)}}})
    runs = [r for r in runs if r["id"] not in exclude]
    return runs[0] if runs else None


def _final_state(api: str, run_id: str, within: float = 120) -> str:
    deadline = time.monotonic() + within
    while True:
        state = prefect_api.get(api + f"/flow_runs/{run_id}", timeout=30).json()["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.monotonic() > deadline:
            return state
        time.sleep(1)


def _train_release_on_a_mounted_folder_store(tiny_target: Path, tmp_path: Path, store_dir: Path):
    """A release config whose `train` runs in a container on a folder store mounted into the containers,
    with train's inputs already computed here: (its path, the store, the planned keys)."""
    from drafter.core.config import load_config
    from drafter.core.pipeline import open_store, plan, run_all
    from tests.test_release_e2e import write_config

    mount = str(tiny_target.parent)
    runner = {"kind": "containers", "timeout_s": 900, "poll_s": 1,
              "job_variables": {"volumes": [f"{mount}:{mount}:ro", f"{tmp_path}:{tmp_path}"]}}
    # enough steps that the stage is still running when it is interrupted; a checkpoint every 10 steps
    cfg_path = write_config(tmp_path, tiny_target, store_dir, runner=runner,
                            train={"max_steps": 400, "checkpoint_every": 10, "eval_every": 400})
    cfg = load_config(cfg_path)
    planned = {p.stage.name: p.key for p in plan(cfg, ["train"])}
    store = open_store(cfg)
    # what train needs, computed here (runner: local — the same keys); only train runs in a container
    run_all(cfg.model_copy(update={"runner": cfg.runner.model_copy(update={"kind": "local"})}),
            only=["bootstrap_drafter"], echo=lambda *_: None)
    return cfg_path, store, planned


class _TrainInterruptions:
    """Starts `drafter release --stage train` and interrupts its container's flow run, four ways; each
    way returns the final state of the interrupted child flow run."""

    def __init__(self, api: str, env: dict, engine: dict, cfg_path: Path, latest: Path):
        self.api, self.env, self.engine, self.cfg_path, self.latest = api, env, engine, cfg_path, latest
        self.earlier: set[str] = set()  # the children of the earlier interruptions

    def start(self, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([DRAFTER, "release", "-c", str(self.cfg_path), "--stage", "train", *extra], cwd=ROOT,
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def running_child(self, proc: subprocess.Popen) -> dict:
        """The train flow run once it is RUNNING and has written a checkpoint since it started."""
        latest = self.latest
        before = latest.stat().st_mtime if latest.exists() else 0.0
        deadline = time.monotonic() + 600
        while True:
            child = _child(self.api, "stage-train", ("RUNNING",), exclude=self.earlier)
            if child and latest.exists() and latest.stat().st_mtime > before:
                self.earlier.add(child["id"])
                return child
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.2)

    def containers_of(self, run_id: str) -> list[str]:
        """The running containers of a flow run."""
        return podman(self.engine, "ps", "-q", "--filter", f"label=io.prefect.flow-run-id={run_id}").split()

    def stopped(self, run_id: str, within: float = 60) -> bool:
        deadline = time.monotonic() + within
        while self.containers_of(run_id):
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    def by_the_parents_timeout(self) -> str:
        """1. the parent's timeout: it cancels its child, whose container the worker stops."""
        proc = self.start("--set", "runner.timeout_s=6")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0 and "did not finish within runner.timeout_s=6 s" in out, out[-3000:]
        (child_id,) = set(re.findall(r"flow run '[\w-]+' \(([0-9a-f-]{36})\) of deployment stage-train/docker did not finish",
                                     out))
        # the timeout may come while the worker still creates the container: one that starts after its run
        # was cancelled must not train (it did once, and published train before the next release began)
        self.earlier.add(child_id)
        outcome = _final_state(self.api, child_id)
        assert self.stopped(child_id)  # nothing left running
        return outcome

    def by_killing_the_container(self) -> str:
        """2. the container killed."""
        proc = self.start()
        child = self.running_child(proc)
        (container,) = self.containers_of(child["id"])
        podman(self.engine, "kill", container)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0 and child["id"] in out and "stage-train/docker" in out and "ended CRASHED" in out, out[-3000:]
        return _final_state(self.api, child["id"])

    def by_cancelling_the_child(self) -> str:
        """3. the child cancelled from the API (as from the UI)."""
        proc = self.start()
        child = self.running_child(proc)
        r = subprocess.run([PREFECT, "flow-run", "cancel", child["id"]], env=self.env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0 and child["id"] in out and "ended CANCELLED" in out, out[-3000:]
        outcome = _final_state(self.api, child["id"])
        assert self.stopped(child["id"])
        return outcome

    def by_stopping_the_parent(self) -> str:
        """4. the parent stopped: `drafter release` gets SIGTERM while its child runs."""
        import signal

        proc = self.start()
        child = self.running_child(proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in out, out[-3000:]
        outcome = _final_state(self.api, child["id"])
        assert self.stopped(child["id"])
        return outcome


def _assert_the_rerun_resumes_and_leaves_nothing_partial(cfg_path: Path, env: dict, store, store_dir: Path,
                                                          planned: dict) -> None:
    t0 = time.monotonic()
    r = subprocess.run([DRAFTER, "release", "-c", str(cfg_path), "--stage", "train"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    print(f"\nrerun after four interruptions: {time.monotonic() - t0:.0f} s")
    m = json.loads((store.final_dir("train", planned["train"]) / "manifest.json").read_text())
    assert m["resumed"] is True and m["container"]["id"]  # resumed from an interrupted container's checkpoint
    assert store.partials() == []  # nothing partial left
    for stage, key in planned.items():  # exactly the planned outputs
        outs = [p.name for p in (store_dir / stage).iterdir() if not p.name.endswith(".lock") and not p.name.startswith(".")]
        assert outs == [key], (stage, outs)


@pytest.mark.timeout(2400)
def test_a_child_killed_cancelled_or_timed_out_or_a_stopped_parent_end_the_release_naming_it_and_a_rerun_resumes(
        server, docker_worker, engine, tiny_target, tmp_path):
    """`train` in its container, on a folder store mounted into the containers, interrupted four ways;
    each time the release fails naming the child flow run and its state and leaves the in-progress
    output for the rerun, which resumes from the last checkpoint and leaves nothing partial:
    the parent's runner.timeout_s passes (the parent cancels the child: its container is stopped); the
    container is killed (`podman kill`: CRASHED); the child is cancelled from the API (`prefect flow-run
    cancel`: CANCELLED); the parent `drafter release` gets SIGTERM (its child is cancelled too)."""
    store_dir = tmp_path / "store"
    cfg_path, store, planned = _train_release_on_a_mounted_folder_store(tiny_target, tmp_path, store_dir)
    latest = store.partial_dir("train", planned["train"]) / "work" / "ckpt" / "latest.pt"
    interrupt = _TrainInterruptions(server["api"], server["env"], engine, cfg_path, latest)
    outcomes = {}
    outcomes["timeout"] = interrupt.by_the_parents_timeout()
    outcomes["killed"] = interrupt.by_killing_the_container()
    outcomes["cancelled"] = interrupt.by_cancelling_the_child()
    outcomes["parent stopped"] = interrupt.by_stopping_the_parent()
    assert outcomes == {"timeout": "CANCELLED", "killed": "CRASHED", "cancelled": "CANCELLED",
                        "parent stopped": "CANCELLED"}, outcomes
    assert not store.final_dir("train", planned["train"]).exists()  # nothing published by an interrupted child
    assert latest.is_file()  # kept: the rerun resumes from it
    _assert_the_rerun_resumes_and_leaves_nothing_partial(cfg_path, server["env"], store, store_dir, planned)


def test_the_docker_pool_turns_a_gpu_stage_into_a_container_request_with_device_requests(server, engine, tmp_path):
    """Up to the boundary (no GPU here): for a run of `stage-train/docker-gpu`, the container settings
    prefect-docker's worker would create — its image and a device request for every GPU."""
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    api, env = server["api"], server["env"]
    dep = deployments(api)["stage-train/docker-gpu"]
    # scheduled an hour ahead: the docker worker of the other tests must not pick it up (no GPU here)
    run = subprocess.run([PREFECT, "deployment", "run", "stage-train/docker-gpu", "--param", "config_path=configs/demo.yaml",
                          "--start-in", "1 hour"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    (fr,) = [f for f in flow_runs(api, deployments={"id": {"any_": [dep["id"]]}})]

    config = resolve_job_configuration(api, fr["id"], "docker", DockerWorkerJobConfiguration)
    import docker

    settings = DockerWorker(work_pool_name="docker")._build_container_settings(
        docker.DockerClient(base_url=engine["DOCKER_HOST"]), config)
    assert settings["image"] == "drafter-release:train"
    assert settings["device_requests"] == [{"count": -1, "capabilities": [["gpu"]]}]
    # docker-py turns that into the engine's DeviceRequest (what `docker run --gpus all` sends)
    from docker.types import DeviceRequest

    (req,) = [DeviceRequest(**r) for r in settings["device_requests"]]
    assert req["Count"] == -1 and req["Capabilities"] == [["gpu"]]
    assert "flow-run execute" in str(settings["command"])
    assert settings["environment"]["PREFECT__FLOW_RUN_ID"] == fr["id"]


@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("docker") is None, reason="the docker CLI is not installed (serving.launcher: docker "
                    "runs `docker run`; here it talks to podman through DOCKER_HOST)")
def test_generate_served_from_the_serving_image_through_the_docker_launcher_matches_transformers(
        engine, tiny_target, tmp_path, monkeypatch):
    """`generate` with `serving.launcher: docker` and the serving image (vLLM CPU inside the container):
    in float32 its greedy turns and token ids equal the transformers backend's."""
    from drafter.core.config import config_from_dict
    from drafter.core.files import iter_rows
    from drafter.stages.generate import STAGE
    from tests.test_generate import _target_artifact

    for k, v in engine.items():
        monkeypatch.setenv(k, v)
    art = _target_artifact(tmp_path, tiny_target)
    gen = {"num_prompts": 6, "max_tokens": 8, "shard_size": 4, "concurrency": 4, "temperature": 0.0}
    docker = config_from_dict({"serving": {"backend": "vllm", "dtype": "float32", "launcher": "docker",
                                           "docker_image": IMAGES["serving"], "docker_gpus": None,
                                           "startup_timeout_s": 600, "max_model_len": 1024}, "generate": gen})
    m = STAGE.run(docker, {"prepare_target": art}, tmp_path / "docker")
    assert m["engine"] == "vllm" and m["engine_version"] == IMAGES["serving"] and m["failed"] == 0 and m["rows"] == 6
    log = (tmp_path / "docker" / "server.log").read_text()
    assert "docker run" in log.splitlines()[0] and IMAGES["serving"] in log.splitlines()[0]
    hf = config_from_dict({"serving": {"backend": "transformers", "dtype": "float32"}, "generate": gen})
    STAGE.run(hf, {"prepare_target": art}, tmp_path / "hf")
    v = {r["id"]: r for r in iter_rows(tmp_path / "docker" / "shards")}
    h = {r["id"]: r for r in iter_rows(tmp_path / "hf" / "shards")}
    assert v.keys() == h.keys()
    for rid in v:
        assert [t["token_ids"] for t in v[rid]["turns"]] == [t["token_ids"] for t in h[rid]["turns"]], rid
    assert not podman(engine, "ps", "-q", "--filter", "name=drafter-vllm-").split()  # the server container stopped
