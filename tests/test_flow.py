"""The Prefect release flow and the CLI, on toy stages (the real stages have their own tests)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_store import CALLS, FAIL_ONCE, toy  # noqa: F401 — the toy-stage fixture (retries off)


def test_release_flow_runs_then_reuses(prefect_harness, toy):
    from prefect.client.orchestration import get_client
    from drafter_prefect.release import release

    s1 = release(config=toy)
    assert [r["status"] for r in s1["stages"]] == ["computed", "computed", "skipped"]
    s2 = release(config=toy)
    assert [r["status"] for r in s2["stages"]] == ["reused", "reused", "reused"]
    assert s2["computed"] == [] and CALLS == {"a": 1, "b": 1, "c": 1}
    assert json.loads(open(s2["summary_path"]).read())["run_id"] == s2["run_id"]

    import asyncio

    async def artifacts():
        async with get_client() as c:
            return {a.key for a in await c.read_artifacts()}
    keys = asyncio.run(artifacts())
    assert {"a-metrics", "b-metrics", "c-metrics", "release-summary"} <= keys


def test_release_flow_retries_transient_failure(prefect_harness, toy):
    """A stage that dies mid-way is retried by Prefect and resumes from its partial output."""
    from drafter_prefect.release import release

    toy.retries = 1
    toy.retry_delay_s = 0
    FAIL_ONCE["on"] = True
    s = release(config=toy, stages=["b"])
    b = s["stages"][-1]
    assert b["status"] == "computed" and b["metrics"]["reused"] == 2 and CALLS["b"] == 2


def test_release_flow_failure_is_summarized(prefect_harness, toy):
    from drafter_prefect.release import release
    from drafter.core.pipeline import open_store

    FAIL_ONCE["on"] = True
    with pytest.raises(RuntimeError, match="failed at b"):
        release(config=toy, stages=["b"])
    last = open_store(toy).runs()[-1]
    assert last["status"] == "failed" and [s["status"] for s in last["stages"]] == ["computed", "failed"]


def test_cli_stage_plan_runs_json(toy, tmp_path):
    from drafter.cli import app

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"store: {{root: {toy.store.root}}}\n")
    r = CliRunner()
    res = r.invoke(app, ["stage", "b", "-c", str(cfg_path)])
    assert res.exit_code == 1 and "needs the output of a" in res.output
    assert r.invoke(app, ["stage", "a", "-c", str(cfg_path)]).exit_code == 0
    res = r.invoke(app, ["plan", "-c", str(cfg_path)])
    assert res.exit_code == 0 and "done" in res.output and "to compute" in res.output
    res = r.invoke(app, ["stage", "nope", "-c", str(cfg_path)])
    assert res.exit_code == 2 and "unknown stage" in res.output
    res = r.invoke(app, ["stage", "a", "-c", str(cfg_path), "--set", "generate.top_p=3"])
    assert res.exit_code == 2 and "generate.top_p" in res.output
    # runs --json prints the latest run's summary for automation
    from drafter.core.pipeline import run_all
    run_all(toy, echo=lambda *_: None)
    res = r.invoke(app, ["runs", "-c", str(cfg_path), "--json"])
    data = json.loads(res.stdout)
    assert [s["stage"] for s in data["stages"]] == ["a", "b", "c"]
    assert {"key", "status", "seconds", "metrics"} <= set(data["stages"][0])
    res = r.invoke(app, ["runs", "-c", str(cfg_path)])
    assert res.exit_code == 0 and "reused" in res.output and "computed" in res.output


def test_deployment_entrypoints_resolve_to_flows():
    """Every deployment in deployments/prefect.yaml points at a real flow with matching parameters."""
    import importlib
    import inspect
    from pathlib import Path

    import yaml
    from prefect import Flow

    root = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((root / "deployments/prefect.yaml").read_text())
    assert spec["deployments"]
    for d in spec["deployments"]:
        path, attr = d["entrypoint"].split(":")
        mod = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        fl = getattr(mod, attr)
        assert isinstance(fl, Flow), d["name"]
        params = inspect.signature(fl.fn).parameters
        assert set(d.get("parameters", {})) <= set(params), (d["name"], set(d["parameters"]) - set(params))
        cfg_path = d.get("parameters", {}).get("config_path")
        if cfg_path:
            assert (root / cfg_path).is_file(), cfg_path


@pytest.mark.slow
def test_release_flow_against_prefect_server(toy, tmp_path):
    """The flow also runs against a real `prefect server start` (not only the ephemeral API)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect_bin = Path(sys.executable).parent / "prefect"
    server = subprocess.Popen([str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("prefect server did not start in 120 s")
        script = (
            "import sys; from drafter.core import registry as r; from tests.test_store import TOY\n"
            "r.ORDER = tuple(TOY); r.get = lambda n: TOY[n]\n"
            "from drafter.core.config import ReleaseConfig; from drafter_prefect.release import release\n"
            f"s = release(config=ReleaseConfig(store={{'root': {str(tmp_path / 'st')!r}}}, retries=0))\n"
            "print('STATUS', ','.join(x['status'] for x in s['stages']))\n"
        )
        out = subprocess.run([sys.executable, "-c", script], env={**env, "PREFECT_API_URL": url},
                             cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
        assert "STATUS computed,computed,skipped" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
        runs = httpx.post(url + "/flow_runs/filter", json={}, timeout=10).json()
        assert any(r["state_type"] == "COMPLETED" for r in runs)
    finally:
        import signal
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_resolve_config_the_form_wins_over_a_default_path_and_overrides_apply_to_both(tmp_path):
    from drafter.core.config import ReleaseConfig
    from drafter_prefect.release import resolve_config

    p = tmp_path / "c.yaml"
    p.write_text("name: from-file\n")
    assert resolve_config(None, str(p), None, None).name == "from-file"
    # a deployment's default config_path must not hide what the run form filled in
    assert resolve_config({"name": "from-form"}, str(p), None, None).name == "from-form"
    c = resolve_config(ReleaseConfig(name="x", serving={"env": {"K": "v"}}), None, None, ["generate.num_prompts=16"])
    assert (c.name, c.generate.num_prompts, c.serving.env_values()) == ("x", 16, {"K": "v"})
    assert resolve_config(None, str(p), None, ["generate.num_prompts=16"]).generate.num_prompts == 16
    assert resolve_config(None, None, None, None) == ReleaseConfig()


def _run_after(fl, *states):
    """Run flow ``fl`` as a flow run that went through ``states`` first (as a worker and the release
    waiting for it would have set them), the way `prefect flow-run execute` in its container does."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(fl, parameters={}, state=states[0])
        for st in states[1:]:
            c.set_flow_run_state(fr.id, st, force=True)
        fr = c.read_flow_run(fr.id)
    return run_flow(fl, flow_run=fr, return_type="state")


def test_a_stage_flow_cancelled_while_pending_does_not_run_when_its_container_starts_late(prefect_harness):
    """The race of a fresh-clone CI run: the release's runner.timeout_s passed while the worker was
    still creating the container; the release cancelled the PENDING run; the container started
    seconds later and, as the server lets CANCELLED go to RUNNING, trained and published the stage."""
    from prefect import flow
    from prefect.states import Cancelled, Cancelling, Pending, Scheduled
    from drafter_prefect.stages import cancelled_before_start, stage_flow

    why = "runner.timeout_s=6 s passed"
    state = _run_after(stage_flow("train"), Pending(), Cancelled(message=why))
    assert state.is_cancelled() and why in state.message and "before it started" in state.message, state
    # a run still CANCELLING is not started by the engine at all (the worker finishes the cancellation)
    state = _run_after(stage_flow("capture"), Pending(), Cancelling(message=why))
    assert state.type.value == "CANCELLING", state

    @flow
    def probe():
        return cancelled_before_start()

    assert _run_after(probe, Pending()).result() is None  # the usual path
    # retried on purpose after a cancellation: through SCHEDULED and PENDING again, not refused
    assert _run_after(probe, Pending(), Cancelled(), Scheduled(), Pending()).result() is None
    assert "CANCELLED before it started" in _run_after(probe, Pending(), Cancelled(message=why)).result()
    assert probe.fn() is None  # outside a flow run: nothing to check


def test_cancelling_a_child_that_starts_meanwhile_still_stops_it(prefect_harness, monkeypatch):
    """drafter_prefect.containers._cancel: a run no worker started is set Cancelled; a running one Cancelling
    (its worker stops the container); a run read as PENDING that went RUNNING before the Cancelled
    landed (its engine would run on under that state) is sent Cancelling after all."""
    from prefect import flow
    from prefect.client.orchestration import SyncPrefectClient, get_client
    from prefect.states import Pending, Running
    from drafter_prefect.containers import _cancel

    @flow
    def child():
        return 1

    def make(*states):
        with get_client(sync_client=True) as c:
            fr = c.create_flow_run(child, state=states[0])
            for st in states[1:]:
                c.set_flow_run_state(fr.id, st, force=True)
            return fr.id

    def history(run_id):
        with get_client(sync_client=True) as c:
            return [st.type.value for st in sorted(c.read_flow_run_states(run_id), key=lambda st: st.timestamp)]

    pending = make(Pending())
    _cancel(pending, "timed out")
    assert history(pending) == ["PENDING", "CANCELLED"]
    running = make(Pending(), Running())
    _cancel(running, "timed out")
    assert history(running) == ["PENDING", "RUNNING", "CANCELLING"]

    raced = make(Pending())
    with get_client(sync_client=True) as c:
        stale = c.read_flow_run(raced)  # what _cancel reads ...
        c.set_flow_run_state(raced, Running(), force=True)  # ... just before the container's engine starts
    monkeypatch.setattr(SyncPrefectClient, "read_flow_run", lambda self, run_id: stale)
    _cancel(raced, "timed out")
    assert history(raced) == ["PENDING", "RUNNING", "CANCELLED", "CANCELLING"]


def test_a_stage_entry_point_makes_only_its_own_flow():
    """Prefect loads `flows/stages.py:scrub_flow` as a stage's container or worker does: that flow alone is made
    (each costs its parameter schema, ~0.3 s of CPU); every stage has its entry point; a wrong name is refused."""
    import subprocess
    import sys

    code = ("from prefect.utilities.importtools import import_object\n"
            "import drafter_prefect.stages as s\n"
            "f = import_object('flows/stages.py:scrub_flow')\n"
            "print(f.name, s.stage_flow.cache_info().currsize)\n"
            "import flows.stages as m\n"
            "print(m.__all__ == [n + '_flow' for n in s.ORDER], m.train_flow is s.stage_flow('train'))\n"
            "try:\n    m.nope_flow\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["stage-scrub 1", "True True", "module 'flows.stages' has no attribute 'nope_flow'"]
