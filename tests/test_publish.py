"""The `publish` stage on a finished store: dry run (folder + plan, nothing sent), a real send
through the release flow to the local Hub (tests/hub_server.py) with the real huggingface_hub
client, the retry and rerun paths, refusals, and a planted token that must appear nowhere: not in
the store, Prefect's result storage and database, the logs or the CLI output."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from drafter import __version__
from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError, is_permanent
from drafter.core.pipeline import run_stage
from drafter.core.stage import Artifact
from drafter.release.hub import folder_files
from drafter.stages.publish import ReleaseRefused, check_gate
from tests.hub_server import HubState, hub_client_settings, running_hub

TOKEN = "hf_PLANTED_publish_token_5eCr3t"
REPO = "acme/tiny-mtp"


@pytest.fixture(scope="module")
def hub():
    with hub_client_settings(), running_hub(HubState(token=TOKEN, read_token=None)) as h:
        yield h


def with_publish(cfg: ReleaseConfig, **publish) -> ReleaseConfig:
    data = cfg.model_dump(mode="json")
    data["publish"] = {**data["publish"], **publish}
    return ReleaseConfig.model_validate(data)


def files_containing(root: Path, needle: bytes) -> list[str]:
    hits = []
    for p in Path(root).rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                if needle in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                pass
    return hits


def test_dry_run_writes_the_release_folder_and_plan_and_sends_nothing(finished_store, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = with_publish(finished_store["cfg"], endpoint="http://127.0.0.1:9")  # nothing listens there
    r = run_stage(cfg, "publish")
    assert r.status == "computed", r
    out = Path(r.path)
    plan = json.loads((out / "publish-plan.json").read_text())
    result = json.loads((out / "publish.json").read_text())
    assert result["status"] == "dry_run" and r.metrics["status"] == "dry_run"
    on_disk = folder_files(out / "release")
    assert [(f["path"], f["size"], f["sha256"]) for f in plan["files"]] == [(f["path"], f["size"], f["sha256"]) for f in on_disk]
    assert plan["total_bytes"] == sum(f["size"] for f in on_disk) == r.metrics["bytes"]
    assert plan["release_id"] == r.metrics["release_id"] == json.loads((out / "release" / "release.json").read_text())["release_id"]
    assert f"[release {plan['release_id']}]" in plan["commit_message"]
    assert {"README.md", "release.json"} <= {f["path"] for f in on_disk}
    assert any(f["path"].startswith("fp8/") for f in on_disk)
    # the same config again: reused, not rebuilt
    assert run_stage(cfg, "publish").status == "reused"


def test_gate_refusal_and_missing_verdict_are_permanent_refusals(tmp_path):
    d = tmp_path / "gate"
    d.mkdir()
    (d / "gate.json").write_text(json.dumps({"verdict": "refused", "failed": ["live_tau@1"]}))
    with pytest.raises(ReleaseRefused, match="the gate refused.*live_tau@1.*gate.force") as e:
        check_gate(Artifact("gate", "k", d, {"status": "done"}))
    assert is_permanent(e.value)
    with pytest.raises(ReleaseRefused, match="no gate verdict.*needs CUDA"):
        check_gate(Artifact("gate", "k", d, {"status": "skipped", "reason": "needs CUDA"}))
    (d / "gate.json").write_text(json.dumps({"verdict": "forced", "failed": ["live_tau@1"]}))
    assert check_gate(Artifact("gate", "k", d, {"status": "done"}))["verdict"] == "forced"


def test_no_token_fails_before_any_stage_and_names_the_variable(finished_store, monkeypatch):
    from drafter.data.preflight import preflight

    monkeypatch.delenv("MY_HUB_TOKEN", raising=False)
    cfg = with_publish(finished_store["cfg"], dry_run=False, repo_id=REPO, token_env="MY_HUB_TOKEN")
    with pytest.raises(BadInputError, match="MY_HUB_TOKEN.*publish.token_env"):
        preflight(cfg, ["publish"], check_lengths=False)


@pytest.mark.slow
def test_publish_through_the_flow_sends_once_and_leaks_the_token_nowhere(prefect_harness, finished_store, hub, tmp_path,
                                                                        monkeypatch, capfd):
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_HOME

    from drafter.cli import app

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    cfg = with_publish(finished_store["cfg"], dry_run=False, repo_id=REPO, endpoint=hub.url, retries=2,
                       retry_backoff_s=0.01, tag="v{version}-{key}")
    cfg_path = tmp_path / "release.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    def ours():  # release commits on main (the Hub's own "initial commit" of a new repo left out)
        return [c for c in hub.state.log(REPO) if "[release " in c.title]

    # one lost response on the way: the server commits, then answers 500; the retried attempt finds it
    hub.state.drop_next_commit_response()
    res = CliRunner().invoke(app, ["publish", "-c", str(cfg_path), "--repo-id", REPO])
    assert res.exit_code == 0, res.output
    assert "model card" in res.output and "published" in res.output
    store_root = Path(cfg.store.root)
    (out,) = [p for p in (store_root / "publish").iterdir()
              if not p.name.startswith(".") and json.loads((p / "publish.json").read_text()).get("status") != "dry_run"]
    result = json.loads((out / "publish.json").read_text())
    commits = ours()
    assert len(commits) == 1, [c.title for c in hub.state.log(REPO)]
    # the commit's response was lost: the retried attempt found it by its release id and sent nothing again
    assert result["status"] == "already_published" and result["commit_sha"] == commits[0].sha
    assert f"[release {result['release_id']}]" in commits[0].title
    remote = {p: hashlib.sha256(data).hexdigest() for p, data in commits[0].tree.items() if p != ".gitattributes"}
    assert remote == {f["path"]: f["sha256"] for f in folder_files(out / "release")}
    tag = result["tag"]
    assert hub.state.repos[REPO].tags[tag] == result["commit_sha"]

    # the flow again: the stage is reused, nothing sent; a forced recompute finds the release on the Hub
    res = CliRunner().invoke(app, ["publish", "-c", str(cfg_path), "--repo-id", REPO])
    assert res.exit_code == 0, res.output
    assert len(ours()) == 1
    from drafter.stages.publish import run as publish_run
    from drafter.core.pipeline import load_inputs, open_store, plan

    p = next(p for p in plan(cfg, ["publish"]) if p.stage.name == "publish")
    again = publish_run(cfg, load_inputs(open_store(cfg), p), tmp_path / ".k.partial")
    assert again["status"] == "already_published" and again["commit"] == result["commit_sha"]
    assert len(ours()) == 1 and hub.state.count("POST", "/commit/") == 1  # the dropped response, never a second one

    # the card is the run's `model-card` artifact (the rendered README.md, as published)
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def artifacts(key):
        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    cards = asyncio.run(artifacts("model-card"))
    assert cards and all(a.data == (out / "release" / "README.md").read_text() for a in cards)
    assert all(TOKEN not in str(a.data) for key in ("model-card", "publish-metrics", "release-summary")
               for a in asyncio.run(artifacts(key)))

    # the planted token: only ever in the Authorization header of requests to the Hub
    needle = TOKEN.encode()
    assert files_containing(store_root, needle) == []
    assert files_containing(Path(PREFECT_HOME.value()), needle) == []
    db = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
    if db.startswith("sqlite"):
        db_file = Path(db.split("///", 1)[1])
        assert files_containing(db_file.parent, needle) == [], "the token is in Prefect's database (logs / parameters)"
    captured = capfd.readouterr()
    assert TOKEN not in res.output and TOKEN not in captured.out and TOKEN not in captured.err
    seen = [r for r in hub.state.requests if TOKEN in json.dumps(r.headers)]
    assert seen and all(TOKEN in r.headers.get("authorization", "") for r in seen)
    assert all(TOKEN not in r.path and TOKEN not in json.dumps(r.query) for r in hub.state.requests)
    assert os.environ["HF_TOKEN"] == TOKEN  # (the env is the only place it lives)


@pytest.mark.slow
def test_publish_reads_the_token_from_a_prefect_secret_block_and_opens_one_pr(prefect_harness, finished_store,
                                                                             monkeypatch):
    """Deployments: no HF_TOKEN on the worker, the token in a Prefect Secret block named by
    publish.token_block; PR mode: refs/pr/1 holds the release, main keeps only the Hub's initial commit."""
    from prefect.blocks.system import Secret

    from drafter_prefect.release import release

    block_token = "hf_BLOCK_token_for_pr_mode_7e1a"
    Secret(value=block_token).save("hub-token-test", overwrite=True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    repo = "acme/tiny-mtp-review"
    with hub_client_settings(), running_hub(HubState(token=block_token, read_token=None)) as h:
        cfg = with_publish(finished_store["cfg"], dry_run=False, repo_id=repo, endpoint=h.url, mode="pr",
                           token_block="hub-token-test", retries=1, retry_backoff_s=0.01, tag="v{version}-review")
        s = release(config=cfg, stages=["publish"])
        (pub,) = [x for x in s["stages"] if x["stage"] == "publish"]
        result = json.loads((Path(pub["path"]) / "publish.json").read_text())
        r = h.state.repos[repo]
        assert result["status"] == "published" and result["pr_num"] == 1 and result["pr_url"].endswith("/discussions/1")
        assert [p.head for p in r.prs] == [result["commit_sha"]]
        assert [c.title for c in h.state.log(repo)] == ["initial commit"]  # main untouched
        # no tag on refs/pr/1 (not on main): it waits for the merge; the plan and the result say how
        tag = f"v{__version__}-review"
        plan = json.loads((Path(pub["path"]) / "publish-plan.json").read_text())
        assert r.tags == {} and result["tag"] is None and result["tag_pending"] == tag
        assert plan["tag_at"] == "merge" and plan["tag_command"] == result["tag_command"]
        assert f"--release-id {result['release_id']} --tag {tag}" in result["tag_command"]
    assert "HF_TOKEN" not in os.environ  # the block's value was put in the environment for the stage only
    assert files_containing(Path(cfg.store.root), block_token.encode()) == []


def test_cli_publish_output_says_the_pr_mode_tag_waits_for_the_merge(tmp_path, capsys):
    """`drafter publish` in PR mode prints, for a dry run and after sending, that the tag is not on
    refs/pr/N and the exact command that tags the merge commit once the PR is merged (one line)."""
    from drafter.core.config import PublishConfig
    from drafter.release.hub import make_plan, tag_command, tag_note
    from drafter.cli.render import print_publish as _print_publish

    out = tmp_path / "publish" / "k"
    (out / "release").mkdir(parents=True)
    (out / "release" / "README.md").write_text("# card\n")
    pc = PublishConfig(repo_id=REPO, mode="pr", dry_run=False, tag="v0.1.0", endpoint="http://127.0.0.1:9")
    plan = make_plan(out / "release", pc, message="Release demo 0.1.0", tag="v0.1.0", release_id="1a2b3c4d")
    (out / "publish-plan.json").write_text(json.dumps(plan))
    cmd = tag_command(pc, tag="v0.1.0", release_id="1a2b3c4d")
    assert cmd == f"python -m drafter.release.hub tag-merged --repo-id {REPO} --release-id 1a2b3c4d --tag v0.1.0 " \
                  "--endpoint http://127.0.0.1:9"
    summary = {"stages": [{"stage": "publish", "status": "computed", "path": str(out)}]}
    runs = {"dry_run": {"status": "dry_run", "send": "drafter publish"},
            "published": {"status": "published", "repo_id": REPO, "pr_num": 3, "pr_url": "http://h/acme/discussions/3",
                          "tag": None, "tag_pending": "v0.1.0", "tag_command": cmd,
                          "tag_note": tag_note(pc, tag="v0.1.0", release_id="1a2b3c4d", pr_num=3)}}
    for status, result in runs.items():
        (out / "publish.json").write_text(json.dumps(result))
        _print_publish(summary, None)
        printed = capsys.readouterr().out
        assert "tag v0.1.0 at merge" in " ".join(printed.split()), printed
        (line,) = [ln for ln in printed.splitlines() if "tag-merged" in ln]  # the whole command on one line
        assert cmd in line and "refs/pr/N is not on main" in line, printed
        assert ("pull request #3" in line) == (status == "published")
        assert "(tag v0.1.0)" not in printed  # never claims a tag that does not exist
