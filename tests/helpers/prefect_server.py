"""A real Prefect server for the tests that need one (`prefect server start`, its own PREFECT_HOME and
SQLite database), with the work pools of deployments/work-pools.sh and every deployment of
deployments/prefect.yaml registered by `prefect deploy --all`; and workers started by the tests and
stopped by PID. The session fixture ``server`` (tests/conftest.py) starts one for the whole session."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


from drafter.core import procs
from tests.helpers.servers import start_server

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


@contextmanager
def prefect_server(home: Path) -> Iterator[dict]:
    """A real Prefect server (its own PREFECT_HOME and SQLite database), the pools and the deployments."""
    def command(port: int) -> tuple[list[str], dict]:
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               # the UI calls the API at these (not at --port): set them, or it calls 4200
               "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
        env.pop("PREFECT_API_URL", None)
        return [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env

    proc, port = start_server(command, home / "server.log", what="prefect server", timeout_s=180, health="/api/health")
    env = command(port)[1]
    api = f"http://127.0.0.1:{port}/api"
    try:
        client_env = {**env, "PREFECT_API_URL": api, "DRAFTER_HOME": str(ROOT), "PREFECT": PREFECT}
        # only for the two registering commands here: the workers pass their environment into the stage containers
        register_env = {**client_env, "PREFECT_API_SSL_CERT_FILE": str(_one_ca_file(home))}
        t0 = time.monotonic()
        subprocess.run(["bash", str(ROOT / "deployments" / "work-pools.sh")], env=register_env, cwd=ROOT, check=True,
                       capture_output=True, timeout=300)  # 6 CLI calls: 120 s was once too short on busy cores
        pools_s = time.monotonic() - t0
        t0 = time.monotonic()
        dep = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
                             env=register_env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert dep.returncode == 0, dep.stdout[-3000:] + dep.stderr[-3000:]
        print(f"\npools {pools_s:.1f} s, prefect deploy --all {time.monotonic() - t0:.1f} s")
        yield {"api": api, "ui": f"http://127.0.0.1:{port}", "env": client_env, "home": home}
    finally:
        procs.stop(proc)


def _one_ca_file(home: Path) -> Path:
    """A CA file of one certificate (the first of certifi's bundle) for PREFECT_API_SSL_CERT_FILE. The API
    here is plain http://127.0.0.1, so the CAs are never used, but every Prefect client (`get_client`, ~4 per
    deployment in `prefect deploy --all`, and each CLI call) builds an SSL context from that file, else from
    certifi's whole bundle: 177 contexts took 26.5 s of the deploy on 2 busy cores, against ~3 ms each from one
    certificate."""
    import re

    import certifi

    pem = re.search(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----\n", Path(certifi.where()).read_text(), re.S)
    path = home / "one-ca.pem"
    path.write_text(pem.group(0))
    return path


def run_worker_once(env: dict, cwd: Path) -> None:
    """``prefect worker start --pool process --run-once`` (log in ``cwd/worker.log``): runs what is
    scheduled now, then exits; stopped by PID (its process group) at the latest after 600 s."""
    with open(cwd / "worker.log", "wb") as log:
        worker = procs.spawn([PREFECT, "worker", "start", "--pool", "process", "--run-once"], env=env, cwd=cwd,
                             stdout=log, stderr=subprocess.STDOUT)
        try:
            worker.wait(timeout=600)
        finally:
            procs.stop(worker)


def _prefect_api():
    """An HTTP client for the Prefect REST API that retries what the server marks as retryable (429,
    502, 503 — its answer when, say, SQLite is busy on loaded cores; one such 503 on `create_flow_run`
    failed a fresh-clone CI run): Prefect's own httpx client, with status codes left to the tests."""
    from prefect.client.base import PrefectHttpxSyncClient

    return PrefectHttpxSyncClient(raise_on_all_errors=False)


prefect_api = _prefect_api()


def deployments(api: str) -> dict[str, dict]:
    flows = {f["id"]: f["name"] for f in prefect_api.post(api + "/flows/filter", json={}, timeout=30).json()}
    return {f"{flows[d['flow_id']]}/{d['name']}": d
            for d in prefect_api.post(api + "/deployments/filter", json={}, timeout=30).json()}




def resolve_job_configuration(api: str, flow_run_id: str, pool_name: str, configuration_class):
    """The job configuration a worker of ``pool_name`` would resolve for this flow run (the pool's base job
    template + the deployment's and the run's job variables), as ``configuration_class`` (e.g.
    prefect-kubernetes' or prefect-docker's); the flow run is then deleted (no worker picks it up)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def resolve():
        with temporary_settings({PREFECT_API_URL: api}):
            async with get_client() as client:
                flow_run = await client.read_flow_run(flow_run_id)
                pool = await client.read_work_pool(pool_name)
                cfg = await configuration_class.resolve_for_flow_run(flow_run, client=client, work_pool=pool,
                                                                     worker_name="test")
                await client.delete_flow_run(flow_run_id)
                return cfg

    return asyncio.run(resolve())
