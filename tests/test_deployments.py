"""deployments/prefect.yaml against a real `prefect server start` and a real process worker, both
started here and stopped by PID: the pools script and `prefect deploy --all` register every
deployment; the manual release's parameter schema is the ReleaseConfig form (sections,
descriptions, bounds) and the server refuses a bad value naming the field; the nightly schedule
carries its cron and timezone; `prefect deployment run release/manual` on a tiny config, executed
by `prefect worker start --pool process --run-once`, completes and its artifacts are readable
through the API."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from drafter.core import procs
from drafter.serving.server import free_port

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
STAGE_FLOWS = ("prepare-target", "generate", "scrub", "capture", "bootstrap-drafter", "train", "eval-offline",
               "quantize-fp8", "verify-fp8", "ab-live", "gate", "publish")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real Prefect server (its own PREFECT_HOME and SQLite database), the pools and the deployments."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           # the UI calls the API at these (not at --port): set them, or it calls 4200
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")
    proc = procs.spawn([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                       stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(api + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prefect server did not start:\n" + (home / "server.log").read_text()[-3000:])
            time.sleep(1)
        client_env = {**env, "PREFECT_API_URL": api, "DRAFTER_HOME": str(ROOT), "PREFECT": PREFECT}
        t0 = time.monotonic()
        subprocess.run(["bash", str(ROOT / "deployments" / "work-pools.sh")], env=client_env, cwd=ROOT, check=True,
                       capture_output=True, timeout=120)
        pools_s = time.monotonic() - t0
        t0 = time.monotonic()
        dep = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
                             env=client_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert dep.returncode == 0, dep.stdout[-3000:] + dep.stderr[-3000:]
        print(f"\npools {pools_s:.1f} s, prefect deploy --all {time.monotonic() - t0:.1f} s")
        yield {"api": api, "ui": f"http://127.0.0.1:{port}", "env": client_env, "home": home}
    finally:
        procs.stop(proc)
        log.close()


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


def deployments(api: str) -> dict[str, dict]:
    flows = {f["id"]: f["name"] for f in httpx.post(api + "/flows/filter", json={}, timeout=30).json()}
    return {f"{flows[d['flow_id']]}/{d['name']}": d
            for d in httpx.post(api + "/deployments/filter", json={}, timeout=30).json()}


@pytest.mark.slow
def test_deploy_all_registers_every_deployment_with_the_config_form_and_the_schedule(server):
    api = server["api"]
    deps = deployments(api)
    want = {"release/manual", "release/demo", "retrain/nightly", "stage-capture/gpu", "stage-train/gpu",
            "stage-quantize-exl3/exl3"} | {f"stage-{s}/process" for s in STAGE_FLOWS}
    assert set(deps) == want
    pools = {p["name"]: p for p in httpx.post(api + "/work_pools/filter", json={}, timeout=30).json()}
    assert {"process", "docker", "kubernetes"} <= set(pools)
    k8s = pools["kubernetes"]["base_job_template"]
    assert k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["nvidia.com/gpu"] == "{{ gpus }}" and "gpus" in k8s["variables"]["properties"]
    assert deps["stage-train/gpu"]["job_variables"]["gpus"] == 1

    # the manual release: the ReleaseConfig form, every section with its descriptions, defaults and bounds
    manual = deps["release/manual"]
    schema = manual["parameter_openapi_schema"]
    assert {"config", "config_path", "profile", "overrides", "stages"} <= set(schema["properties"])
    defs = schema["definitions"]
    from drafter.core.config import ReleaseConfig

    sections = {n: f.annotation.__name__ for n, f in ReleaseConfig.model_fields.items()
                if isinstance(f.annotation, type) and hasattr(f.annotation, "model_fields")}
    assert set(sections.values()) <= set(defs)
    lr = defs["TrainConfig"]["properties"]["lr"]
    assert lr["exclusiveMinimum"] == 0 and lr["default"] == 5e-4 and lr["description"]
    assert defs["TrainConfig"]["properties"]["loss"]["enum"] == ["kl", "tv", "lk_alpha", "lk_hybrid", "ce", "ce_l1"]
    assert manual["enforce_parameter_schema"] is True

    # a bad value is refused by the server, naming the field
    r = httpx.post(api + f"/deployments/{manual['id']}/create_flow_run",
                   json={"parameters": {"config": {"train": {"lr": -1}}}}, timeout=30)
    assert r.status_code == 409 and "config.train.lr" in r.text, r.text

    # the nightly retrain: its cron schedule and timezone
    (sched,) = httpx.get(api + f"/deployments/{deps['retrain/nightly']['id']}/schedules", timeout=30).json()
    assert sched["active"] and sched["schedule"]["cron"] == "0 3 * * *" and sched["schedule"]["timezone"] == "Europe/Berlin"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deployment_run_executed_by_a_process_worker_completes(server, tiny_target, tmp_path):
    api, env = server["api"], server["env"]
    cfg = {"name": "tiny-deployed", "store": {"root": str(tmp_path / "store")},
           "prepare_target": {"source": "path", "path": str(tiny_target)},
           "serving": {"backend": "transformers", "dtype": "float32"},
           "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 8, "concurrency": 2}, "retries": 0}
    run = subprocess.run([PREFECT, "deployment", "run", "release/manual", "--params",
                          json.dumps({"config": cfg, "stages": ["scrub"]})],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    t0 = time.monotonic()
    run_worker_once(env, tmp_path)
    print(f"worker run: {time.monotonic() - t0:.1f} s")
    (fr,) = [r for r in httpx.post(api + "/flow_runs/filter", json={}, timeout=30).json()
             if r["parameters"].get("config", {}).get("name") == "tiny-deployed"]
    assert fr["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    assert fr["parameters"]["stages"] == ["scrub"]
    arts = httpx.post(api + "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [fr["id"]]}}},
                      timeout=30).json()
    keys = {a["key"] for a in arts}
    assert {"prepare-target-metrics", "generate-metrics", "scrub-metrics", "release-summary"} <= keys, keys
    summary = next(a for a in arts if a["key"] == "release-summary")
    assert "completed" in summary["data"] and "| scrub |" in summary["data"]
    # the outputs are in the store the config named
    runs = sorted((tmp_path / "store" / "runs").glob("*.json"))
    assert runs and json.loads(runs[-1].read_text())["status"] == "completed"
    assert yaml.safe_load((tmp_path / "store" / "scrub").glob("*/manifest.json").__next__().read_text())["stage"] == "scrub"


NOTIFY_SCRIPT = """
import sys
from drafter.core import registry as r
from drafter.core.config import ReleaseConfig
from drafter.core.stage import Stage
from drafter.evaluation.gate import GateRefused

def ok(cfg, inputs, out):
    (out / "x.txt").write_text("x")
    return {}

def refuse(cfg, inputs, out):
    raise GateRefused("gate: refused (tau/greedy/c1)", result={"failed": ["tau/greedy/c1"], "checks": [
        {"name": "tau/greedy/c1", "passed": False, "value": 1.05, "reference": 1.2, "threshold": 1.176,
         "detail": "candidate live tau 1.05 vs baseline 1.2"}]})

def broken(cfg, inputs, out):
    raise ValueError("the drafter file is empty")

mode, store = sys.argv[1], sys.argv[2]
toy = {"a": Stage("a", "1", (), (), ok), "g": Stage("g", "1", ("a",), (), refuse if mode == "refuse" else broken)}
r.ORDER = tuple(toy)
r.get = lambda n: toy[n]
from flows.release import release
try:
    release(config=ReleaseConfig(name=f"notify-{mode}", store={"root": store}, retries=0))
except Exception as e:
    print("FAILED", type(e).__name__)
"""


@pytest.mark.slow
def test_a_failure_and_a_gate_refusal_each_send_one_webhook_notification(server, tmp_path):
    """deployments/automations.py installs the webhook block and deployments/automations.yaml; a run that
    fails and one whose gate refuses each emit their event, and the server's automation POSTs one
    notification each to a receiver on 127.0.0.1 with the reason."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        inst = subprocess.run([sys.executable, str(ROOT / "deployments" / "automations.py"), "--webhook-url",
                               f"http://127.0.0.1:{httpd.server_port}/hook", "--allow-private-urls"],
                              env=server["env"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert inst.returncode == 0 and "drafter-release-failed" in inst.stdout, inst.stdout + inst.stderr
        for mode in ("broken", "refuse"):
            out = subprocess.run([sys.executable, "-c", NOTIFY_SCRIPT, mode, str(tmp_path / f"store-{mode}")],
                                 env=server["env"], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert "FAILED RuntimeError" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
        deadline = time.monotonic() + 90
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)  # a duplicate would arrive within this
    finally:
        httpd.shutdown()
    by_subject = {m["subject"]: m["body"] for m in received}
    assert len(received) == 2, received
    assert by_subject["drafter release notify-broken failed"].startswith("stage g: ValueError: the drafter file is empty")
    assert by_subject["drafter release notify-refuse: the gate refused the candidate"].startswith(
        "failed checks: tau/greedy/c1 (run ")


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ui_run_form_in_a_real_browser_starts_a_run_the_worker_completes(server, tiny_target, tmp_path):
    """Headless Chromium (Debian's) on the server's UI: the custom run form of release/manual shows the
    config (here prefilled with a tiny one as the deployment's parameters), generate.num_prompts is
    changed from 24 to 16 and submitted; the worker runs it to completion with that value."""
    import re
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is required for the UI test (`.ci/run` installs it: apt-get install chromium)")
    api, ui, env = server["api"], server["ui"], server["env"]
    dep = deployments(api)["release/manual"]
    cfg = {"name": "tiny-ui", "store": {"root": str(tmp_path / "store")},
           "prepare_target": {"source": "path", "path": str(tiny_target)},
           "serving": {"backend": "transformers", "dtype": "float32"},
           "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 8, "concurrency": 2}, "retries": 0}
    r = httpx.patch(api + f"/deployments/{dep['id']}", json={"parameters": {"config": cfg, "stages": ["scrub"]}},
                    timeout=30)
    assert r.status_code == 204, r.text
    shot = tmp_path / "release-manual-run-form.png"
    with sync_playwright() as p:
        # launch() gives the browser a fresh temporary profile (its own --user-data-dir)
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(f"{ui}/deployments/deployment/{dep['id']}/run", wait_until="networkidle", timeout=120_000)
            # the config form: sections with the fields' descriptions from ReleaseConfig
            page.get_by_text("Regenerating training data with the target.").wait_for(timeout=60_000)
            label = page.locator("span.schema-form-property__label", has_text=re.compile(r"^Num Prompts"))
            field = label.locator("xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), "
                                  "' schema-form-property ')][1]").locator("input[type=number]")
            assert field.input_value() == "24"
            field.fill("16")
            field.scroll_into_view_if_needed()
            page.screenshot(path=str(shot))
            page.get_by_role("button", name="Submit").click()
            page.wait_for_url(re.compile(rf".*/deployments/deployment/{dep['id']}(\?.*)?$"), timeout=60_000)
        finally:
            browser.close()
    print(f"\nscreenshot of the run form: {shot}")
    (fr,) = [r for r in httpx.post(api + "/flow_runs/filter", json={}, timeout=30).json()
             if r["parameters"].get("config", {}).get("name") == "tiny-ui"]
    assert fr["parameters"]["config"]["generate"]["num_prompts"] == 16 and fr["parameters"]["stages"] == ["scrub"]
    run_worker_once(env, tmp_path)
    fr = httpx.get(api + f"/flow_runs/{fr['id']}", timeout=30).json()
    assert fr["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    (gen,) = (tmp_path / "store" / "generate").glob("*/manifest.json")
    assert json.loads(gen.read_text())["config"]["generate"]["num_prompts"] == 16


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nightly_run_scheduled_now_retrains_on_new_traffic_only(server, tiny_target, tmp_path):
    """Runs of retrain/nightly scheduled for now, picked up by the worker: with new traffic (5 new
    conversations, one repeated) the release runs and the traffic is recorded as used; the same traffic
    again ends "not enough new traffic" without starting anything; one more new conversation is still
    below retrain.min_new_rows."""
    from datetime import datetime, timezone

    api, env = server["api"], server["env"]
    nightly = deployments(api)["retrain/nightly"]
    traffic = tmp_path / "traffic"
    traffic.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]} for i in range(5)]
    (traffic / "day1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    cfg = {"name": "tiny-nightly", "store": {"root": str(tmp_path / "store")},
           "prepare_target": {"source": "path", "path": str(tiny_target)},
           "serving": {"backend": "transformers", "dtype": "float32"},
           "generate": {"num_prompts": 24, "max_tokens": 12, "shard_size": 8, "concurrency": 2},
           "retrain": {"min_new_rows": 3}, "stages": ["scrub"], "retries": 0}

    def run_scheduled_now() -> dict:
        now = datetime.now(timezone.utc).isoformat()
        r = httpx.post(api + f"/deployments/{nightly['id']}/create_flow_run", timeout=30, json={
            "parameters": {"config": cfg, "traffic": [str(traffic / "*.jsonl")]},
            "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": now}}})
        assert r.status_code == 201, r.text
        run_worker_once(env, tmp_path)
        fr = httpx.get(api + f"/flow_runs/{r.json()['id']}", timeout=30).json()
        assert fr["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        (art,) = httpx.post(api + "/artifacts/filter", timeout=30, json={
            "artifacts": {"flow_run_id": {"any_": [fr["id"]]}, "key": {"any_": ["retrain-decision"]}}}).json()
        return art

    def summaries() -> int:
        return len(list((tmp_path / "store" / "runs").glob("*.json")))

    art = run_scheduled_now()
    assert "release completed" in art["data"] and "5 new conversation(s) in 6 read" in art["data"], art["data"]
    assert "1 repeated" in art["data"] and summaries() == 1
    (gen,) = (tmp_path / "store" / "generate").glob("*/manifest.json")
    assert json.loads(gen.read_text())["metrics"]["rows"] == 24 + 5
    assert len((tmp_path / "store" / "records" / "traffic-seen.txt").read_text().split()) == 5

    art = run_scheduled_now()  # the same traffic: all of it used already
    assert "not enough new traffic: 0 new conversation(s) in 6 read" in art["data"] and "6 used by earlier" in art["data"]
    assert summaries() == 1, "a run without enough new traffic must not start the release"

    (traffic / "day2.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "What is 7 times 7?"}]}) + "\n")
    art = run_scheduled_now()
    assert "not enough new traffic: 1 new conversation(s) in 7 read" in art["data"] and "min_new_rows = 3" in art["data"]
    assert summaries() == 1
