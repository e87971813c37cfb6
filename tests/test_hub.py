"""drafter.release.hub driven by the real huggingface_hub client against the local Hub
(tests/hub_server.py): one commit per release, idempotence, lost responses, concurrent commits,
PR mode, retries, auth errors, changed and removed files."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from drafter.core.config import PublishConfig
from drafter.core.errors import BadInputError, is_permanent
from drafter.release.hub import (PublishError, PublishRefused, folder_files, make_plan, publish_folder,
                                 read_token)
from tests.hub_server import HubState, hub_client_settings, running_hub

TOKEN = "hf_test_write_token_SECRET123"
REPO = "org/demo-drafter"
RID = "1a2b3c4d5e6f7a8b"


@pytest.fixture(scope="module")
def hub():
    state = HubState(token=TOKEN, read_token="hf_read_only_token")
    with hub_client_settings(), running_hub(state) as h:
        yield h


@pytest.fixture
def state(hub):
    """A fresh Hub for each test (same server)."""
    fresh = HubState(token=TOKEN, read_token="hf_read_only_token")
    hub.state.__dict__.update(fresh.__dict__)
    return hub.state


def make_release(root: Path) -> Path:
    """A tiny release folder: card with front matter, two safetensors (one in fp8/), json, png."""
    from safetensors.numpy import save_file
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("---\nlibrary_name: transformers\ntags: [speculative-decoding]\n---\n# demo\n")
    save_file({"w": np.arange(64, dtype=np.float32)}, str(root / "model.safetensors"))
    (root / "fp8").mkdir(exist_ok=True)
    save_file({"w": np.arange(16, dtype=np.uint8)}, str(root / "fp8" / "model.safetensors"))
    (root / "release.json").write_text(json.dumps({"name": "demo", "acceptance_length": 2.5}))
    (root / "assets").mkdir(exist_ok=True)
    (root / "assets" / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(200)))
    return root


def cfg_for(hub, **kw) -> PublishConfig:
    return PublishConfig(repo_id=REPO, endpoint=hub.url, retries=kw.pop("retries", 3), retry_backoff_s=0.01,
                         dry_run=False, **kw)


def publish(folder, cfg, logs=None, release_id=RID, tag="v0.1.0"):
    return publish_folder(folder, cfg, token=TOKEN, message="Release demo 0.1.0", tag=tag, release_id=release_id,
                          log=(logs.append if logs is not None else (lambda s: None)))


def commits_posted(state) -> int:
    return state.count("POST", "/commit/")


def test_first_publish_one_commit_and_download(hub, state, tmp_path):
    from huggingface_hub import hf_hub_download

    folder = make_release(tmp_path / "rel")
    logs: list[str] = []
    res = publish(folder, cfg_for(hub), logs)
    assert res["status"] == "published" and res["tag"] == "v0.1.0" and res["pr_url"] is None
    log = state.log(REPO)
    assert len(log) == 2 and log[0].sha == res["commit_sha"] and log[0].parent == log[1].sha  # initial + ours
    assert f"Release-Id: {RID}" in log[0].message and f"[release {RID}]" in log[0].title
    assert set(log[0].tree) == {".gitattributes"} | {f["path"] for f in folder_files(folder)}
    assert "model.safetensors" in log[0].lfs and "fp8/model.safetensors" in log[0].lfs
    assert commits_posted(state) == 1 and state.count("PUT", "/lfs-upload/") == 3  # 2 safetensors + png
    assert state.repos[REPO].tags["v0.1.0"] == res["commit_sha"]
    for f in folder_files(folder):
        p = hf_hub_download(REPO, f["path"], revision="v0.1.0", endpoint=hub.url, token=TOKEN,
                            cache_dir=tmp_path / "cache")
        assert hashlib.sha256(Path(p).read_bytes()).hexdigest() == f["sha256"], f["path"]
    # the token never travels outside the Authorization header, nor in any log line
    for r in state.requests:
        assert TOKEN not in r.path + r.query
        assert all(TOKEN not in v for k, v in r.headers.items() if k != "authorization")
    assert not [line for line in logs if TOKEN in line]
    assert not [r for r in state.requests if "xet" in r.path.lower()]  # LFS basic transfer, never Xet
    assert not [r for r in state.requests if r.path.startswith("/lfs-upload/") and "authorization" in r.headers]


def test_same_release_again_is_a_no_op(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    first = publish(folder, cfg_for(hub))
    again = publish(folder, cfg_for(hub))
    assert again["status"] == "already_published" and again["commit_sha"] == first["commit_sha"]
    assert commits_posted(state) == 1 and len(state.log(REPO)) == 2


def test_lost_commit_response_no_duplicate(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    state.drop_next_commit_response()
    with pytest.raises(PublishError) as ei:
        publish(folder, cfg_for(hub, retries=0))
    assert hub.url in str(ei.value) and "HTTP 500" in str(ei.value) and not is_permanent(ei.value)
    applied = state.log(REPO)[0]
    res = publish(folder, cfg_for(hub, retries=0))  # the pipeline's retry of the stage
    assert res["status"] == "already_published" and res["commit_sha"] == applied.sha
    assert commits_posted(state) == 1 and state.repos[REPO].tags["v0.1.0"] == applied.sha


def test_lost_commit_response_found_by_release_id(hub, state, tmp_path):
    """Within one call (internal retry), and later when the branch has moved on since the lost
    commit (the tree differs): the release id finds the earlier commit, no second one."""
    folder = make_release(tmp_path / "rel")
    state.drop_next_commit_response()
    res = publish(folder, cfg_for(hub))  # internal retry after the 500
    ours = state.log(REPO)[0]
    assert res["status"] == "already_published" and res["commit_sha"] == ours.sha and commits_posted(state) == 1
    repo = state.repos[REPO]
    other = state.add_commit(repo, ours.sha, "Someone else's commit", "", {**ours.tree, "x.txt": b"x"}, set(ours.lfs))
    repo.branches["main"] = other.sha
    again = publish(folder, cfg_for(hub))
    assert again["status"] == "already_published" and again["commit_sha"] == ours.sha and commits_posted(state) == 1


def test_foreign_commit_between_read_and_commit(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    publish(folder, cfg_for(hub))
    (folder / "release.json").write_text('{"changed": true}')
    before = state.repos[REPO].branches["main"]
    state.foreign_commit_before_next_commit(files={"someone-else.txt": b"theirs\n"})
    with pytest.raises(PublishRefused) as ei:
        publish(folder, cfg_for(hub), release_id="ffff0000ffff0000", tag="v0.2.0")
    msg = str(ei.value)
    assert REPO in msg and "main" in msg and before in msg and "Nothing was overwritten" in msg
    assert is_permanent(ei.value)
    head = state.log(REPO)[0]
    assert head.title == "Someone else's commit" and head.parent == before
    assert head.tree["someone-else.txt"] == b"theirs\n" and b"changed" not in head.tree["release.json"]
    assert "v0.2.0" not in state.repos[REPO].tags


def test_pr_mode_leaves_branch_untouched(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    cfg = cfg_for(hub, mode="pr")
    res = publish(folder, cfg)
    repo = state.repos[REPO]
    assert res["status"] == "published" and res["pr_num"] == 1 and res["pr_url"].endswith("/discussions/1")
    assert len(state.log(REPO)) == 1  # main still only has the initial commit
    assert repo.prs[0].head == res["commit_sha"] and repo.tags == {}  # no tag on refs/pr/1 (not on main)
    again = publish(folder, cfg)  # the open PR of this release is found: no second PR
    assert again["status"] == "already_published" and again["pr_num"] == 1 and len(repo.prs) == 1
    assert again["commit_sha"] == res["commit_sha"] and commits_posted(state) == 1


def test_5xx_retried_then_succeeds(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    state.fail_next("POST", "/api/repos/create", 503, times=1)
    state.fail_next("GET", "/revision/", 500, times=1)
    logs: list[str] = []
    res = publish(folder, cfg_for(hub), logs)
    assert res["status"] == "published" and commits_posted(state) == 1
    assert state.count("POST", "/api/repos/create") == 3 and sum("retry" in line for line in logs) == 2


def test_persistent_503_named_error(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    state.fail_next("POST", "/api/repos/create", 503, times=100)
    with pytest.raises(PublishError) as ei:
        publish(folder, cfg_for(hub, retries=2))
    assert hub.url in str(ei.value) and "503" in str(ei.value) and "creating the repo" in str(ei.value)
    assert state.count("POST", "/api/repos/create") == 3 and not is_permanent(ei.value)


def test_401_clear_error_without_token(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    bad = "hf_wrong_SECRET_987"
    with pytest.raises(PublishRefused) as ei:
        publish_folder(folder, cfg_for(hub), token=bad, message="m", tag=None, release_id=RID, log=lambda s: None)
    assert "401" in str(ei.value) and REPO in str(ei.value) and bad not in str(ei.value) and is_permanent(ei.value)
    assert bad not in repr(ei.value.__cause__) and state.count("POST", "/api/repos/create") == 1


def test_403_read_only_token(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    publish(folder, cfg_for(hub))  # the repo exists (created with the write token)
    (folder / "release.json").write_text("{}")
    with pytest.raises(PublishRefused) as ei:
        publish_folder(folder, cfg_for(hub), token="hf_read_only_token", message="m", tag=None, release_id="x1",
                       log=lambda s: None)
    assert "403" in str(ei.value) and "write access" in str(ei.value) and "hf_read_only_token" not in str(ei.value)


def test_missing_token_variable():
    cfg = PublishConfig(repo_id=REPO, token_env="MY_HUB_TOKEN")
    with pytest.raises(BadInputError, match="MY_HUB_TOKEN"):
        read_token(cfg, environ={})
    with pytest.raises(BadInputError, match="MY_HUB_TOKEN"):
        read_token(cfg, environ={"MY_HUB_TOKEN": "  "})
    assert read_token(cfg, environ={"MY_HUB_TOKEN": "hf_x"}) == "hf_x"


def test_changed_and_removed_files(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    first = publish(folder, cfg_for(hub))
    (folder / "release.json").write_text('{"acceptance_length": 2.7}')
    (folder / "assets" / "x.png").unlink()
    res = publish(folder, cfg_for(hub), release_id="2b2b2b2b2b2b2b2b", tag="v0.2.0")
    head = state.log(REPO)[0]
    assert res["status"] == "published" and head.sha == res["commit_sha"] and head.parent == first["commit_sha"]
    assert "assets/x.png" not in head.tree and head.tree["release.json"] == b'{"acceptance_length": 2.7}'
    assert ".gitattributes" in head.tree and commits_posted(state) == 2
    assert set(head.tree) - {".gitattributes"} == {f["path"] for f in folder_files(folder)}


def test_tag_on_other_commit_refused(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    publish(folder, cfg_for(hub))
    (folder / "release.json").write_text("{}")
    with pytest.raises(PublishRefused, match="already points at"):
        publish(folder, cfg_for(hub), release_id="3c3c3c3c3c3c3c3c", tag="v0.1.0")


def test_plan_and_folder_files(hub, tmp_path):
    folder = make_release(tmp_path / "rel")
    files = folder_files(folder)
    assert [f["path"] for f in files] == sorted(f["path"] for f in files)
    assert {"fp8/model.safetensors", "assets/x.png", "README.md"} <= {f["path"] for f in files}
    plan = make_plan(folder, PublishConfig(), message="Release demo 0.1.0", tag="v0.1.0", release_id=RID)
    assert plan["repo_id"] == "<publish.repo_id not set>" and plan["total_bytes"] == sum(f["size"] for f in files)
    assert plan["files"][0].keys() == {"path", "size", "sha256"} and RID in plan["commit_message"]


def test_pr_mode_lost_response_no_second_pr(hub, state, tmp_path):
    folder = make_release(tmp_path / "rel")
    state.drop_next_commit_response()
    res = publish(folder, cfg_for(hub, mode="pr"))  # internal retry finds the open PR by the release id
    repo = state.repos[REPO]
    assert len(repo.prs) == 1 and f"Release-Id: {RID}" in repo.prs[0].description
    assert res["status"] == "already_published" and res["pr_num"] == 1 and res["commit_sha"] == repo.prs[0].head
    assert commits_posted(state) == 1 and len(state.log(REPO)) == 1


def test_pr_mode_tag_waits_for_the_merge_then_tags_the_merge_commit(hub, state, tmp_path, monkeypatch, capsys):
    """Issue 33 (6): in PR mode the tag never points at refs/pr/N (not on the branch). The plan and the
    result say the tag waits for the merge and give the exact command; that command refuses while the PR
    is open and, after the merge, tags the merge commit on main (idempotent)."""
    import shlex

    from huggingface_hub import HfApi

    folder = make_release(tmp_path / "rel")
    cfg = cfg_for(hub, mode="pr")
    logs: list[str] = []
    res = publish(folder, cfg, logs)
    repo = state.repos[REPO]
    assert res["status"] == "published" and res["pr_num"] == 1
    assert repo.tags == {}, "a tag on the PR's commit points at a commit that is not on main"

    from drafter.release.hub import main, tag_merged_release

    plan = make_plan(folder, cfg, message="Release demo 0.1.0", tag="v0.1.0", release_id=RID)
    assert plan["tag_at"] == "merge" and plan["tag_command"] in plan["tag_note"]
    assert "refs/pr/N is not on main" in plan["tag_note"]
    assert res["tag"] is None and res["tag_pending"] == "v0.1.0" and res["tag_command"] == plan["tag_command"]
    assert "pull request #1" in res["tag_note"] and any(res["tag_command"] in line for line in logs)
    cmd = shlex.split(res["tag_command"])
    assert cmd[:4] == ["python", "-m", "drafter.release.hub", "tag-merged"]
    assert cmd[4:] == ["--repo-id", REPO, "--release-id", RID, "--tag", "v0.1.0", "--endpoint", hub.url]

    # before the merge: the command refuses, naming the PR and what to do; nothing is tagged
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(cmd[3:]) == 1
    err = capsys.readouterr().err
    assert "#1" in err and "open, not merged" in err and f"hf discussions merge {REPO} 1" in err and TOKEN not in err
    assert repo.tags == {}

    # the reviewer merges (the Hub squashes the PR into one commit on main); the command tags that commit
    HfApi(endpoint=hub.url, token=TOKEN).merge_pull_request(REPO, 1)
    merged = state.log(REPO)[0]
    assert merged.title.endswith("(#1)") and merged.sha != res["commit_sha"]
    assert main(cmd[3:]) == 0
    assert repo.tags["v0.1.0"] == merged.sha and merged.sha in capsys.readouterr().out
    assert main(cmd[3:]) == 0 and repo.tags["v0.1.0"] == merged.sha  # again: no change
    again = tag_merged_release(cfg, token=TOKEN, tag="v0.1.0", release_id=RID, log=lambda s: None)
    assert again["commit_sha"] == merged.sha and again["pr_num"] == 1


def test_pr_mode_publish_after_the_merge_tags_the_merge_commit(hub, state, tmp_path):
    """A later publish (retry / forced recompute) of the same release that finds its PR merged, with
    main moved on since, tags the merge commit and opens no second PR."""
    from huggingface_hub import HfApi

    folder = make_release(tmp_path / "rel")
    cfg = cfg_for(hub, mode="pr")
    first = publish(folder, cfg)
    repo = state.repos[REPO]
    assert repo.tags == {}
    HfApi(endpoint=hub.url, token=TOKEN).merge_pull_request(REPO, 1)
    merged = state.log(REPO)[0]
    later = state.add_commit(repo, merged.sha, "Someone else's commit", "", {**merged.tree, "x.txt": b"x"},
                             set(merged.lfs))
    repo.branches["main"] = later.sha
    again = publish(folder, cfg)
    assert again["status"] == "already_published" and again["pr_num"] == 1 and len(repo.prs) == 1
    assert again["commit_sha"] == merged.sha != first["commit_sha"] and again["tag"] == "v0.1.0"
    assert repo.tags["v0.1.0"] == merged.sha and commits_posted(state) == 1
    assert merged.sha in {c.sha for c in state.log(REPO)}


def test_offline_mode_is_refused_at_once_naming_hf_hub_offline(hub, state, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set: huggingface_hub raises OfflineModeIsEnabled (a ConnectionError) on every request, which
    was retried 9 times and then blamed the Hub's status page. Now: one refusal naming the variable, not retried,
    nothing sent."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = make_release(tmp_path / "rel")
    with pytest.raises(PublishRefused, match=r"HF_HUB_OFFLINE is set.*Unset HF_HUB_OFFLINE") as ei:
        publish(folder, cfg_for(hub))
    assert is_permanent(ei.value) and "status.huggingface.co" not in str(ei.value)
    assert commits_posted(state) == 0 and REPO not in state.repos


def test_offline_error_inside_a_call_is_a_refusal():
    from huggingface_hub.errors import OfflineModeIsEnabled

    from drafter.release.hub import _call

    def fn():
        raise OfflineModeIsEnabled("Cannot reach https://hub: offline mode is enabled.")

    with pytest.raises(PublishRefused, match="HF_HUB_OFFLINE") as ei:
        _call("reading the branch head", fn, repo_id=REPO, token="t")
    assert is_permanent(ei.value)


def test_offline_environment_variable_is_read(tmp_path):
    import subprocess
    import sys

    code = "from drafter.release.hub import check_online\ncheck_online('publishing to org/x')\n"
    p = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "publishing to org/x: HF_HUB_OFFLINE is set" in p.stderr
