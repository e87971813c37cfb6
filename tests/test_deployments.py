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
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from drafter.core import procs

from tests.helpers.prefect_server import PREFECT, ROOT, deployments, prefect_api, resolve_job_configuration, run_worker_once

STAGE_FLOWS = ("prepare-target", "generate", "scrub", "answer-heldout", "capture", "bootstrap-drafter", "train", "eval-offline",
               "quantize-fp8", "verify-fp8", "ab-live", "gate", "publish")


@pytest.mark.slow
def test_deploy_all_registers_every_deployment_with_the_config_form_and_the_schedule(server):
    api = server["api"]
    deps = deployments(api)
    want = {"release/manual", "release/demo", "retrain/nightly", "stage-capture/gpu", "stage-train/gpu",
            "stage-quantize-exl3/exl3", "stage-train/docker-gpu", "stage-quantize-exl3/docker-gpu"} \
        | {f"stage-{s}/process" for s in STAGE_FLOWS} | {f"stage-{s}/docker" for s in STAGE_FLOWS + ("quantize-exl3",)}
    assert set(deps) == want
    # runner: containers — every stage's docker deployment in its image, run from the image's checkout (/app)
    for s in STAGE_FLOWS + ("quantize-exl3",):
        d = deps[f"stage-{s}/docker"]
        serving = s in ("generate", "answer-heldout", "verify-fp8", "ab-live")
        assert d["job_variables"]["image"] == ("drafter-release:serving" if serving else "drafter-release:project"), s
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}], s
        assert d["work_pool_name"] == "docker"
    pools = {p["name"]: p for p in prefect_api.post(api + "/work_pools/filter", json={}, timeout=30).json()}
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
    r = prefect_api.post(api + f"/deployments/{manual['id']}/create_flow_run",
                   json={"parameters": {"config": {"train": {"lr": -1}}}}, timeout=30)
    assert r.status_code == 409 and "config.train.lr" in r.text, r.text

    # the nightly retrain: its cron schedule and timezone
    (sched,) = prefect_api.get(api + f"/deployments/{deps['retrain/nightly']['id']}/schedules", timeout=30).json()
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
    (fr,) = [r for r in prefect_api.post(api + "/flow_runs/filter", json={}, timeout=30).json()
             if r["parameters"].get("config", {}).get("name") == "tiny-deployed"]
    assert fr["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    assert fr["parameters"]["stages"] == ["scrub"]
    arts = prefect_api.post(api + "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [fr["id"]]}}},
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
from drafter_prefect.release import release
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
            assert "FAILED ReleaseFailed" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]  # a RuntimeError
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
    r = prefect_api.patch(api + f"/deployments/{dep['id']}", json={"parameters": {"config": cfg, "stages": ["scrub"]}},
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
            # the UI creates the run, then navigates back; 60 s was once too short on 2 cores shared with other tests
            page.wait_for_url(re.compile(rf".*/deployments/deployment/{dep['id']}(\?.*)?$"), timeout=180_000)
        finally:
            browser.close()
    print(f"\nscreenshot of the run form: {shot}")
    (fr,) = [r for r in prefect_api.post(api + "/flow_runs/filter", json={}, timeout=30).json()
             if r["parameters"].get("config", {}).get("name") == "tiny-ui"]
    assert fr["parameters"]["config"]["generate"]["num_prompts"] == 16 and fr["parameters"]["stages"] == ["scrub"]
    run_worker_once(env, tmp_path)
    fr = prefect_api.get(api + f"/flow_runs/{fr['id']}", timeout=30).json()
    assert fr["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
    (gen,) = (tmp_path / "store" / "generate").glob("*/manifest.json")
    assert json.loads(gen.read_text())["config"]["generate"]["num_prompts"] == 16


NIGHTLY_PROMPTS = 32  # generate.num_prompts of the nightly config
NIGHTLY_STEPS = 40  # the candidate's fine-tune from the champion: enough to beat it on the held-out set
NIGHTLY_LR = 0.01


def _nightly_config(tiny_target: Path, store: Path, hub_url: str) -> dict:
    """The tiny release config of the nightly retrain, publishing to ``hub_url``."""
    return {"name": "tiny-nightly", "store": {"root": str(store), "cache_dir": str(store.parent / "cache")},
            "prepare_target": {"source": "path", "path": str(tiny_target)},
            "serving": {"backend": "transformers", "dtype": "float32"},
            "generate": {"num_prompts": NIGHTLY_PROMPTS, "max_tokens": 48, "shard_size": 8, "concurrency": 2},
            "capture": {"shard_tokens": 256, "batch_tokens": 256, "layers": [0]},
            "train": {"k_steps": 2, "window": 32, "micro_batch": 1, "max_steps": NIGHTLY_STEPS, "lr": NIGHTLY_LR,
                      "warmup_steps": 1, "eval_windows": 2, "eval_every": NIGHTLY_STEPS},
            "eval_offline": {"k_max": 3, "window": 32, "bootstrap_samples": 50, "cost_repeats": 1},
            "ab_live": {"num_speculative_tokens": 2},
            # no vLLM in this test (transformers backend): without live evidence the offline comparison decides
            "gate": {"force": True},
            "publish": {"repo_id": "org/tiny-nightly", "dry_run": False, "endpoint": hub_url, "tag": None,
                        "retries": 1, "retry_backoff_s": 0.1},
            "retrain": {"min_new_rows": 3}, "retries": 0}


def _decision_artifact(api: str, flow_run_id: str) -> str:
    (art,) = prefect_api.post(api + "/artifacts/filter", timeout=30, json={
        "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["retrain-decision"]}}}).json()
    return art["data"]


@pytest.fixture(scope="module")
def nightly(server, tiny_target, tmp_path_factory):
    """retrain/nightly of a tiny release, publishing to a local Hub (tests/hub_server.py), once for the module;
    the tests below assert on what it left.

    The Hub holds a champion: the target's released drafter, published by the library's publisher
    (tests/helpers/champion_release.py). Through the real process worker, a run of the deployment scheduled
    for now, on day 1's traffic (5 new conversations, one repeated): the champion is read from the Hub, a
    real 40-step fine-tune from it is measured against it on the same held-out set, and it is published.
    Then, below the worker, the `retrain` flow called directly against the same server
    (tests/helpers/retrain_steps.py, one process): the same traffic again, and one more conversation —
    not enough new traffic, both. (The other decisions: tests/test_champion.py — the rules, and the flow's
    "champion kept" branch; tests/test_retrain_secrets.py — a first release, no champion yet.)"""
    from huggingface_hub import HfApi

    from drafter.core.config import ReleaseConfig
    from tests.helpers.champion_release import publish_released_drafter_as_champion
    from tests.hub_server import HubState, hub_client_settings, running_hub

    api = server["api"]
    tmp = tmp_path_factory.mktemp("nightly")
    token = "hf_nightly_write"
    env = {**server["env"], "HF_TOKEN": token, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    traffic, store = tmp / "traffic", tmp / "store"
    traffic.mkdir()
    with hub_client_settings(), running_hub(HubState(token=token, read_token=None)) as hub:
        cfg = _nightly_config(tiny_target, store, hub.url)
        hub_api = HfApi(endpoint=hub.url, token=token)
        pattern = [str(traffic / "*.jsonl")]
        champion_id = publish_released_drafter_as_champion(tiny_target, ReleaseConfig.model_validate(cfg), token,
                                                           tmp / "champion")
        before = [c.commit_id for c in hub_api.list_repo_commits("org/tiny-nightly")]

        # the run through the worker: scheduled now, picked up by `prefect worker start --pool process --run-once`
        t0 = time.monotonic()
        rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]} for i in range(5)]
        (traffic / "day1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
        now = datetime.now(timezone.utc).isoformat()
        r = prefect_api.post(api + f"/deployments/{deployments(api)['retrain/nightly']['id']}/create_flow_run",
                             timeout=30, json={"parameters": {"config": cfg, "traffic": pattern},
                                               "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": now}}})
        assert r.status_code == 201, r.text
        run_worker_once(env, tmp)
        fr = prefect_api.get(api + f"/flow_runs/{r.json()['id']}", timeout=30).json()
        assert fr["state"]["type"] == "COMPLETED", (tmp / "worker.log").read_text()[-6000:]
        print(f"\nnightly retrain through the worker: {time.monotonic() - t0:.0f} s")
        (gen,) = (store / "generate").glob("*/manifest.json")
        worker_run = {"flow_run": fr, "artifact": _decision_artifact(api, fr["id"]),
                      "commits": [c.commit_id for c in hub_api.list_repo_commits("org/tiny-nightly")],
                      "generate_rows": json.loads(gen.read_text())["metrics"]["rows"],
                      "ledger": (store / "records" / "traffic-seen.txt").read_text().split(),
                      "runs": sorted(p.name for p in (store / "runs").glob("*.json")),
                      "decisions": [json.loads(x) for x in
                                    (store / "records" / "retrain-decisions.jsonl").read_text().splitlines()]}

        # below the worker: the flow's "not enough new traffic" on the same server
        t0 = time.monotonic()
        plan = {"config": cfg, "traffic": pattern, "repo_id": "org/tiny-nightly", "steps": [
            {"name": "again"},
            {"name": "one more", "files": {str(traffic / "day2.jsonl"): [
                {"messages": [{"role": "user", "content": "What is 7 times 7?"}]}]}}]}
        (tmp / "plan.json").write_text(json.dumps(plan))
        p = subprocess.run([sys.executable, "-m", "tests.helpers.retrain_steps", str(tmp / "plan.json"),
                            str(tmp / "steps.jsonl")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        steps = {s["name"]: s for s in map(json.loads, (tmp / "steps.jsonl").read_text().splitlines())}
        for s in steps.values():
            s["artifact"] = _decision_artifact(api, s["flow_run_id"])
        print(f"the flow without enough new traffic, twice: {time.monotonic() - t0:.0f} s")
        yield {"cfg": cfg, "champion_id": champion_id, "before": before, "worker_run": worker_run, "steps": steps,
               "hub_api": hub_api, "tmp": tmp}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_nightly_run_scheduled_now_retrains_on_new_traffic_through_a_worker(nightly):
    """A run of retrain/nightly scheduled for now, executed by a process worker: 5 new conversations of 6
    read (one repeated) → the release's stages run on them (generate's rows: the prompts + the 5), and the
    traffic is recorded as used."""
    w = nightly["worker_run"]
    assert w["flow_run"]["parameters"]["traffic"] == [str(nightly["tmp"] / "traffic" / "*.jsonl")]
    assert "5 new conversation(s) in 6 read from 1 file(s)" in w["artifact"], w["artifact"]
    assert "0 used by earlier retrains, 1 repeated in this traffic" in w["artifact"], w["artifact"]
    assert w["generate_rows"] == NIGHTLY_PROMPTS + 5
    assert len(w["ledger"]) == len(set(w["ledger"])) == 5


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_nightly_retrain_publishes_a_candidate_that_beats_the_champion(nightly):
    """The champion is read from the Hub (its branch head's release); the candidate, a real fine-tune
    from it, beats it on the same held-out set → the gate and publish run (a second release run, every
    measured stage reused) and it is published as the next commit, its card naming the champion it beat;
    the decision with both sets of numbers is in the store's record and the artifact."""
    w = nightly["worker_run"]
    (d,) = w["decisions"]
    assert d["decision"] == "champion replaced" and d["winner"] == "candidate", d
    assert d["champion"]["release_id"] == nightly["champion_id"]
    assert d["champion"]["source"] == f"hub org/tiny-nightly@{nightly['before'][0]}", d["champion"]
    assert d["candidate"]["tau_offline"] > d["champion"]["tau_offline"], d
    assert d["reasons"] and "offline comparison alone" in d["reasons"][0]  # no live A/B: gate.force, said so
    assert "# Retrain tiny-nightly: champion replaced" in w["artifact"]
    assert f"| champion `{nightly['champion_id']}` |" in w["artifact"] and "| candidate |" in w["artifact"]
    assert len(w["runs"]) == 2 and d["release_run"] != d["challenge_run"]  # the challenge, then gate + publish
    assert len(w["commits"]) == len(nightly["before"]) + 1 and w["commits"][1:] == nightly["before"]
    card = nightly["hub_api"].hf_hub_download("org/tiny-nightly", "README.md", revision=w["commits"][0],
                                              cache_dir=str(nightly["tmp"] / "dl"))
    assert f"champion {nightly['champion_id']}" in Path(card).read_text()
    print(f"\noffline τ: champion {d['champion']['tau_offline']:.3f}, candidate {d['candidate']['tau_offline']:.3f}")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_nightly_without_enough_new_traffic_starts_nothing(nightly):
    """The same traffic again: all of it used already, "not enough new traffic", nothing started; one more
    new conversation is still below retrain.min_new_rows."""
    w, again, more = nightly["worker_run"], nightly["steps"]["again"], nightly["steps"]["one more"]
    assert again["result"]["status"] == "not enough new traffic" and again["result"]["new_rows"] == 0
    assert "not enough new traffic: 0 new conversation(s) in 6 read" in again["artifact"], again["artifact"]
    assert "6 used by earlier" in again["artifact"]
    assert more["result"]["status"] == "not enough new traffic" and more["result"]["new_rows"] == 1
    assert "not enough new traffic: 1 new conversation(s) in 7 read" in more["artifact"], more["artifact"]
    assert "min_new_rows = 3" in more["artifact"]
    for s in (again, more):  # no release run, nothing published
        assert s["runs"] == w["runs"] and s["commits"] == w["commits"], s


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_worker_killed_mid_stage_then_a_rerun_finishes_from_the_store(server, small_target, tmp_path):
    """A process worker runs release/manual; in the middle of `generate` (shards already written in its
    in-progress directory) the worker and the flow run it started are killed with SIGKILL, as when a
    node dies. A new worker and a new run of the deployment: it finishes from the store — the target
    reused, generate resumed from its shards, nothing partial left, the outputs under the planned keys."""
    import signal

    from drafter.core.config import ReleaseConfig
    from drafter.core.pipeline import open_store, plan

    api, env = server["api"], server["env"]
    cfg = {"name": "killed-worker", "store": {"root": str(tmp_path / "store")},
           "prepare_target": {"source": "path", "path": str(small_target)},
           "serving": {"backend": "transformers", "dtype": "float32"},
           "generate": {"num_prompts": 32, "max_tokens": 16, "shard_size": 4, "concurrency": 2}, "retries": 0}
    params = json.dumps({"config": cfg, "stages": ["scrub"]})
    planned = {p.stage.name: p.key for p in plan(ReleaseConfig.model_validate(cfg), ["scrub"])}
    store = open_store(ReleaseConfig.model_validate(cfg))
    partial = store.partial_dir("generate", planned["generate"])

    def start_run() -> None:
        run = subprocess.run([PREFECT, "deployment", "run", "release/manual", "--params", params],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr

    start_run()
    t0 = time.monotonic()
    log = open(tmp_path / "worker-killed.log", "wb")
    worker = procs.spawn([PREFECT, "worker", "start", "--pool", "process"], env=env, cwd=tmp_path, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not list(partial.glob("shards/shard-*.jsonl")):
            assert worker.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "worker-killed.log").read_text()[-4000:]
            time.sleep(0.05)
        tree = [worker.pid, *descendants(worker.pid)]
        for pid in tree:  # the worker, the flow run it started (its own session) and what that started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.wait(30)
    finally:
        procs.stop(worker)
        log.close()
    time.sleep(1)
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                   for pid in tree[1:]), "a process of the killed worker is still running"
    killed_shards = len(list(partial.glob("shards/shard-*.jsonl")))
    assert killed_shards >= 1, (sorted(str(p) for p in (tmp_path / "store").rglob("*")),
                                (tmp_path / "worker-killed.log").read_text()[-4000:])
    assert not store.final_dir("generate", planned["generate"]).exists()
    print(f"\nkilled mid-generate with {killed_shards} of 8 shard(s) written, {time.monotonic() - t0:.1f} s after the start")

    start_run()
    t0 = time.monotonic()
    run_worker_once(env, tmp_path)
    print(f"rerun: {time.monotonic() - t0:.1f} s")
    runs = [r for r in prefect_api.post(api + "/flow_runs/filter", json={}, timeout=30).json()
            if r["parameters"].get("config", {}).get("name") == "killed-worker"]
    assert sorted(r["state"]["type"] for r in runs) == ["COMPLETED", "RUNNING"], \
        [(r["name"], r["state"]["type"]) for r in runs]  # the killed run never reported back
    (summary_path,) = (tmp_path / "store" / "runs").glob("*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed"
    assert {s["stage"]: s["key"] for s in summary["stages"]} == planned
    assert {s["stage"]: s["status"] for s in summary["stages"]} == {
        "prepare_target": "reused", "generate": "computed", "scrub": "computed"}
    gen = json.loads((store.final_dir("generate", planned["generate"]) / "manifest.json").read_text())
    assert gen["resumed"] is True and gen["metrics"]["shards_reused"] >= 1
    assert store.partials() == []
    for stage, key in planned.items():  # exactly the planned outputs, nothing else
        outs = [p.name for p in (tmp_path / "store" / stage).iterdir() if not p.name.endswith(".lock")]
        assert outs == [key], (stage, outs)


@pytest.mark.slow
def test_the_kubernetes_pool_turns_a_gpu_run_into_the_job_its_worker_would_submit(server, tmp_path):
    """Up to the cluster boundary (no Kubernetes here): `prefect deployment run stage-train/gpu
    --job-variable gpus=2` on the real server, then the job configuration prefect-kubernetes' worker
    resolves for that flow run (`resolve_for_flow_run`: the pool's base job template from
    deployments/k8s-gpu-job-template.json + the deployment's and the run's job variables) — the Job
    manifest it would submit, with the image, the GPU limit and Prefect's flow-run command."""
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    api, env = server["api"], server["env"]
    run = subprocess.run([PREFECT, "deployment", "run", "stage-train/gpu", "--job-variable", "gpus=2"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    (fr,) = [r for r in prefect_api.post(api + "/flow_runs/filter", json={}, timeout=30).json()
             if r["deployment_id"] == deployments(api)["stage-train/gpu"]["id"]]

    cfg = resolve_job_configuration(api, fr["id"], "kubernetes", KubernetesWorkerJobConfiguration)
    job = cfg.job_manifest
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert job["kind"] == "Job" and job["metadata"]["generateName"]
    assert c["image"] == "drafter-release:train"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # the run's job variable over the deployment's 1
    # the template runs Prefect's flow-run command whatever an image's entrypoint
    assert c["command"] == ["env"] and c["args"][:3] == ["prefect", "flow-run", "execute"], (c["command"], c["args"])
    envs = {e["name"]: e.get("value") for e in c["env"]}
    assert envs["PREFECT__FLOW_RUN_ID"] == fr["id"] and envs["PREFECT_API_URL"]
