"""Publish a release folder to a Hugging Face Hub model repo: one atomic commit (or one PR), then a tag.

>>> files = folder_files(Path("store/release/demo"))            # doctest: +SKIP
>>> publish_folder(Path("store/release/demo"), cfg, token=read_token(cfg),
...                message="Release demo 0.1.0", tag="v0.1.0", release_id="1a2b3c4d")  # doctest: +SKIP
{'status': 'published', 'commit_sha': '…', ...}

Safety rules (see DESIGN.md "Release (card + Hub)"):

* the commit carries ``parent_commit`` = the head read: if someone committed since, the Hub
  answers 412 and nothing is overwritten (:class:`PublishRefused`);
* a remote tree identical to the folder ⇒ no commit (``already_published``);
* the release id is in the commit/PR title (``[release <id>]``) and description
  (``Release-Id: <id>`` trailer): before committing, an earlier commit (or open PR) of the same
  release is looked up, so a retry after a lost response never makes a duplicate;
* 5xx / connection errors are retried (``cfg.retries``, backoff doubling); each retry starts by
  re-reading the head and re-looking up the release id. 4xx are refusals (permanent).
* In PR mode the branch is untouched and the tag waits for the merge: ``refs/pr/N`` is not on the
  branch, so no tag is put on it. The plan and the result say so and give the exact command
  (:func:`tag_command`: ``python -m drafter.release.hub tag-merged …``) that tags the PR's merge
  commit once it is merged (:func:`tag_merged_release`); a later publish of the same release that
  finds its PR merged tags the merge commit by itself.

The token is only handed to ``HfApi``; no message or log line contains it.

The publish stage records the plan in ``publish-plan.json`` (:data:`PUBLISH_PLAN_JSON`, :class:`PublishPlan`)
and what happened in ``publish.json`` (:data:`PUBLISH_JSON`, :class:`PublishResult`).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from drafter.core.config import PublishConfig
from drafter.core.errors import BadInputError, StageError
from drafter.core.results import Part, ResultFile

PUBLISH_PLAN_JSON = "publish-plan.json"
PUBLISH_JSON = "publish.json"
DEFAULT_ENDPOINT = "https://huggingface.co"
_KEEP_REMOTE = {".gitattributes"}  # remote files a release never deletes
_CHUNK = 1 << 20


class PublishError(StageError):
    """The Hub upload failed for a reason a later retry may fix (5xx, connection errors)."""


class PublishRefused(PublishError):
    """The Hub refused the upload (auth, conflict, bad request): retrying cannot help."""

    permanent = True


class _Transient(Exception):
    """A 5xx / connection error inside one attempt (retried by :func:`publish_folder`)."""

    def __init__(self, what: str, status: str):
        super().__init__(f"{what}: {status}")
        self.what, self.status = what, status


# --- result files --------------------------------------------------------------------------------
class PlannedFile(Part):
    path: str
    size: int
    sha256: str


class PublishPlan(ResultFile):
    """``publish-plan.json``: :func:`make_plan`'s document (where and what would be sent)."""

    NAME: ClassVar[str] = PUBLISH_PLAN_JSON
    repo_id: str
    endpoint: str | None = None
    branch: str
    mode: str
    private: bool | None = None
    tag: str | None = None
    tag_at: str | None = None  # "commit", "merge" (PR mode), None without a tag
    tag_command: str | None = None
    tag_note: str | None = None
    commit_message: str | None = None
    commit_description: str | None = None
    release_id: str
    files: list[PlannedFile] = []
    total_bytes: int = 0


class PublishResult(ResultFile):
    """``publish.json``: what happened — ``status`` ``dry_run`` (with the command that sends it), ``published`` or
    ``already_published`` (:func:`publish_folder`'s result: commit, PR, tag or the tag waiting for the merge)."""

    NAME: ClassVar[str] = PUBLISH_JSON
    status: str
    release_id: str | None = None
    repo_id: str | None = None
    send: str | None = None  # dry run: the command that sends it
    branch: str | None = None
    mode: str | None = None
    endpoint: str | None = None
    commit_sha: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None
    pr_num: int | None = None
    tag: str | None = None
    tag_pending: str | None = None
    tag_command: str | None = None
    tag_note: str | None = None


def load_publish(stage_dir: str | Path) -> tuple[PublishPlan, PublishResult]:
    """The ``publish`` output's plan and result."""
    return PublishPlan.load(stage_dir), PublishResult.load(stage_dir)


# --- local folder --------------------------------------------------------------------------------
def _hash_file(path: Path) -> tuple[str, str, int]:
    size = path.stat().st_size
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest(), size


def folder_files(folder: Path) -> list[dict]:
    """Every file under ``folder``, sorted by POSIX path, with its size, sha256 and git blob id.

    >>> folder_files(Path("rel"))                           # doctest: +SKIP
    [{'path': 'README.md', 'size': 812, 'sha256': '…', 'git_sha1': '…'}, {'path': 'fp8/x.safetensors', ...}]
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInputError(f"Release folder {folder} does not exist or is not a directory; build it first "
                            "(the publish stage writes it).")
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            sha256, git_sha1, size = _hash_file(p)
            out.append({"path": p.relative_to(folder).as_posix(), "size": size, "sha256": sha256, "git_sha1": git_sha1})
    return sorted(out, key=lambda f: f["path"])


def read_token(cfg: PublishConfig, environ=os.environ) -> str:
    """The Hub token from ``environ[cfg.token_env]``; missing or empty ⇒ :class:`BadInputError`
    naming the variable (never the value).

    >>> read_token(PublishConfig(), {"HF_TOKEN": "hf_x"})
    'hf_x'
    """
    token = (environ.get(cfg.token_env) or "").strip()
    if not token:
        raise BadInputError(f"No Hub token: the environment variable {cfg.token_env} is not set or empty. "
                            f"Set {cfg.token_env} to a token with write access to "
                            f"{cfg.repo_id or 'the repo'}, or point publish.token_env at the variable holding it.")
    return token


def endpoint_of(cfg: PublishConfig, environ=os.environ) -> str:
    """``cfg.endpoint``, else ``HF_ENDPOINT``, else https://huggingface.co (no trailing slash)."""
    return (cfg.endpoint or environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def release_marker(release_id: str) -> str:
    """The title suffix that identifies a release: ``[release <id>]``."""
    return f"[release {release_id}]"


def commit_texts(message: str, release_id: str) -> tuple[str, str]:
    """Title and description of the release commit/PR.

    >>> commit_texts("Release demo 0.1.0", "1a2b")
    ('Release demo 0.1.0 [release 1a2b]', 'Release-Id: 1a2b')
    """
    return f"{message} {release_marker(release_id)}", f"Release-Id: {release_id}"


def tag_command(cfg: PublishConfig, *, tag: str, release_id: str) -> str:
    """The exact command that tags a PR-mode release once its pull request is merged.

    >>> tag_command(PublishConfig(repo_id="org/demo", mode="pr"), tag="v0.1.0", release_id="1a2b")
    'python -m drafter.release.hub tag-merged --repo-id org/demo --release-id 1a2b --tag v0.1.0'
    """
    args = ["python", "-m", "drafter.release.hub", "tag-merged", "--repo-id", cfg.repo_id or "ORG/NAME",
            "--release-id", release_id, "--tag", tag]
    if cfg.branch != "main":
        args += ["--branch", cfg.branch]
    if cfg.endpoint:
        args += ["--endpoint", cfg.endpoint]
    if cfg.token_env != "HF_TOKEN":
        args += ["--token-env", cfg.token_env]
    return shlex.join(args)


def tag_note(cfg: PublishConfig, *, tag: str, release_id: str, pr_num: int | None = None) -> str:
    """One paragraph: in PR mode the tag waits for the merge, and how to create it then."""
    pr = f"pull request #{pr_num}" if pr_num else "the pull request"
    return (f"The tag {tag} is not created with {pr}: refs/pr/N is not on {cfg.branch}. Once {pr} is merged "
            f"into {cfg.branch}, tag its merge commit with: {tag_command(cfg, tag=tag, release_id=release_id)} "
            f"(the token in ${cfg.token_env}; it refuses while the pull request is not merged).")


def make_plan(folder: Path, cfg: PublishConfig, *, message: str, tag: str | None, release_id: str) -> dict:
    """The content of ``publish-plan.json``: where and what would be sent (nothing is sent).

    >>> make_plan(Path("rel"), cfg, message="Release demo 0.1.0", tag="v0.1.0", release_id="1a2b")  # doctest: +SKIP
    {'repo_id': 'org/demo', 'endpoint': 'https://huggingface.co', 'branch': 'main', ..., 'total_bytes': 123}
    """
    files = folder_files(folder)
    title, description = commit_texts(message, release_id)
    return {
        "repo_id": cfg.repo_id or "<publish.repo_id not set>",
        "endpoint": endpoint_of(cfg),
        "branch": cfg.branch,
        "mode": cfg.mode,
        "private": cfg.private,
        "tag": tag,
        # commit mode: the tag goes on the release commit; PR mode: on the merge commit, once merged
        "tag_at": None if not tag else ("merge" if cfg.mode == "pr" else "commit"),
        "tag_command": tag_command(cfg, tag=tag, release_id=release_id) if tag and cfg.mode == "pr" else None,
        "tag_note": tag_note(cfg, tag=tag, release_id=release_id) if tag and cfg.mode == "pr" else None,
        "commit_message": title,
        "commit_description": description,
        "release_id": release_id,
        "files": [{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files],
        "total_bytes": sum(f["size"] for f in files),
    }


# --- Hub calls -----------------------------------------------------------------------------------
def _status_of(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def _call(what: str, fn: Callable[[], Any], *, repo_id: str, token: str) -> Any:
    """Run one Hub call; 5xx/429/connection errors ⇒ :class:`_Transient`, other HTTP errors ⇒
    :class:`PublishRefused` with a message that says what to do (never the token)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        return fn()
    except OfflineModeIsEnabled:  # a ConnectionError to huggingface_hub, but no retry can change it
        raise PublishRefused(offline_message(what)) from None
    except HfHubHTTPError as e:
        status = _status_of(e)
        if status is None or status >= 500 or status == 429:
            raise _Transient(what, f"HTTP {status}") from None
        if status == 401:
            raise PublishRefused(f"{what} on {repo_id}: HTTP 401, the Hub token was rejected (invalid or expired). "
                                 "Create a new token with write access and put it in the token variable.") from None
        if status == 403:
            raise PublishRefused(f"{what} on {repo_id}: HTTP 403, the token has no write access to {repo_id}. "
                                 "Use a token with the 'write' role (or a fine-grained token allowed to write "
                                 "this repo / create repos in its namespace).") from None
        detail = _scrub(getattr(e, "server_message", None) or "", token)
        raise PublishRefused(f"{what} on {repo_id}: HTTP {status}{': ' + detail if detail else ''}") from None
    except (OSError, ConnectionError) as e:
        raise _Transient(what, f"connection error ({type(e).__name__})") from None
    except Exception as e:  # httpx2 transport errors (not OSError subclasses)
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise _Transient(what, f"connection error ({type(e).__name__})") from None
        raise


def offline_message(what: str = "publishing") -> str:
    return (f"{what}: HF_HUB_OFFLINE is set in this environment, so huggingface_hub makes no request to the Hub. "
            "Unset HF_HUB_OFFLINE (or set it to 0) where the publish runs, or keep publish.dry_run: true.")


def check_online(what: str = "publishing") -> None:
    """Refuse at once (:class:`PublishRefused`, not retried) when huggingface_hub is in offline mode
    (``HF_HUB_OFFLINE``, read by huggingface_hub when it is imported)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise PublishRefused(offline_message(what))


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def _remote_tree(api, repo_id: str, branch: str, token: str) -> tuple[str | None, dict[str, str]]:
    """(head sha, {path: sha256 for LFS files / git blob id for regular files}) of ``branch``;
    (None, {}) when the branch does not exist yet."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        info = _call("reading the branch head", lambda: api.repo_info(repo_id, revision=branch, files_metadata=True),
                     repo_id=repo_id, token=token)
    except PublishRefused as e:
        if isinstance(e.__context__, RevisionNotFoundError) or "HTTP 404" in str(e):
            return None, {}
        raise
    files = {s.rfilename: (s.lfs.sha256 if s.lfs else s.blob_id) for s in (info.siblings or [])}
    return info.sha, files


def _same_tree(local: list[dict], remote: dict[str, str]) -> bool:
    remote = {p: oid for p, oid in remote.items() if p not in _KEEP_REMOTE or p in {f["path"] for f in local}}
    if set(remote) != {f["path"] for f in local}:
        return False
    return all(remote[f["path"]] in (f["sha256"], f["git_sha1"]) for f in local)


def _branch_commits(api, repo_id: str, branch: str, token: str) -> list:
    """The commits of ``branch``, newest first ([] when the branch does not exist)."""
    try:
        return _call("listing commits", lambda: api.list_repo_commits(repo_id, revision=branch),
                     repo_id=repo_id, token=token)
    except PublishRefused as e:
        if "HTTP 404" in str(e):
            return []
        raise


def _release_prs(api, repo_id: str, release_id: str, token: str) -> list:
    """The pull requests (any status) whose title carries this release's marker, newest first."""
    marker, trailer = release_marker(release_id), f"Release-Id: {release_id}"
    prs = _call("listing pull requests", lambda: list(api.get_repo_discussions(
        repo_id, discussion_type="pull_request")), repo_id=repo_id, token=token)
    return [pr for pr in prs if marker in pr.title or trailer in pr.title]


def _merged_commit(api, repo_id: str, pr, branch: str, release_id: str, token: str) -> str:
    """The commit on ``branch`` that merged ``pr`` (the Hub's ``mergeCommitId``, else the branch commit
    carrying the release marker); :class:`PublishRefused` when it is not on the branch."""
    details = _call(f"reading pull request #{pr.num}", lambda: api.get_discussion_details(repo_id, pr.num),
                    repo_id=repo_id, token=token)
    target = (details.target_branch or f"refs/heads/{branch}").removeprefix("refs/heads/")
    if target != branch:
        raise PublishRefused(f"Pull request #{pr.num} of {repo_id} was merged into {target}, not {branch}: "
                             f"the tag goes on {branch} only. Publish with publish.branch: {target}.")
    commits = _branch_commits(api, repo_id, branch, token)
    marker, trailer = release_marker(release_id), f"Release-Id: {release_id}"
    sha = details.merge_commit_oid or next(
        (c.commit_id for c in commits if marker in (c.title or "") or trailer in (c.message or "")), None)
    if sha is None or sha not in {c.commit_id for c in commits}:
        raise PublishRefused(f"Pull request #{pr.num} of {repo_id} is merged, but its merge commit "
                             f"{sha or '(not reported)'} is not on {branch}: no tag created. Tag the commit "
                             f"that holds the release by hand (hf repos tag create {repo_id} TAG --revision SHA).")
    return sha


def _find_earlier(api, repo_id: str, cfg: PublishConfig, release_id: str, token: str) -> dict | None:
    """An earlier commit (commit mode) or open / merged PR (PR mode) of this release, or None.

    PR mode: a merged PR gives its merge commit on the branch (``merged: True``), an open one its head
    ``refs/pr/N`` (``merged: False``); a closed (unmerged) one is ignored, the release is sent again."""
    marker, trailer = release_marker(release_id), f"Release-Id: {release_id}"
    if cfg.mode == "pr":
        prs = _release_prs(api, repo_id, release_id, token)
        merged = next((pr for pr in prs if pr.status == "merged"), None)
        if merged is not None:
            sha = _merged_commit(api, repo_id, merged, cfg.branch, release_id, token)
            return {"commit_sha": sha, "pr_num": merged.num, "pr_url": merged.url, "merged": True}
        for pr in prs:
            if pr.status in ("open", "draft"):
                refs = _call("listing refs", lambda: api.list_repo_refs(repo_id, include_pull_requests=True),
                             repo_id=repo_id, token=token)
                head = next((r.target_commit for r in refs.pull_requests or [] if r.ref == f"refs/pr/{pr.num}"), None)
                return {"commit_sha": head, "pr_num": pr.num, "pr_url": pr.url, "merged": False}
        return None
    for c in _branch_commits(api, repo_id, cfg.branch, token):
        if marker in (c.title or "") or trailer in (c.message or ""):
            return {"commit_sha": c.commit_id, "pr_num": None, "pr_url": None}
    return None


def _ensure_tag(api, repo_id: str, tag: str | None, sha: str, token: str, log) -> None:
    """Tag ``sha`` (idempotent); the tag on another commit ⇒ :class:`PublishRefused`. Callers pass a
    commit of the branch only (never a ``refs/pr/N`` head)."""
    if not tag or not sha:
        return
    refs = _call("listing tags", lambda: api.list_repo_refs(repo_id), repo_id=repo_id, token=token)
    existing = next((r.target_commit for r in refs.tags if r.name == tag), None)
    if existing is None:
        _call(f"creating tag {tag}", lambda: api.create_tag(repo_id, tag=tag, revision=sha, exist_ok=True),
              repo_id=repo_id, token=token)
        refs = _call("listing tags", lambda: api.list_repo_refs(repo_id), repo_id=repo_id, token=token)
        existing = next((r.target_commit for r in refs.tags if r.name == tag), None)
        log(f"tagged {sha[:12]} as {tag}")
    if existing != sha:
        raise PublishRefused(f"Tag {tag} of {repo_id} already points at commit {existing}, not at the release commit "
                             f"{sha}. Choose another publish.tag (e.g. bump the version) or delete the old tag.")


def _operations(folder: Path, files: list[dict], remote: dict[str, str]):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    local = {f["path"] for f in files}
    ops: list = [CommitOperationAdd(path_in_repo=f["path"], path_or_fileobj=str(folder / f["path"])) for f in files]
    ops += [CommitOperationDelete(path_in_repo=p) for p in sorted(remote) if p not in local and p not in _KEEP_REMOTE]
    return ops


def _publish_once(api, folder: Path, files: list[dict], cfg: PublishConfig, *, token: str, message: str,
                  tag: str | None, release_id: str, endpoint: str, log) -> dict:
    repo_id = cfg.repo_id
    result = {"repo_id": repo_id, "tag": tag, "branch": cfg.branch, "mode": cfg.mode, "release_id": release_id,
              "endpoint": endpoint, "pr_url": None, "pr_num": None, "tag_pending": None, "tag_command": None}

    def tag_waits(pr_num: int | None) -> dict:
        """PR mode, PR not merged: no tag; the result says it waits for the merge and how to create it."""
        if not tag:
            return {}
        note = tag_note(cfg, tag=tag, release_id=release_id, pr_num=pr_num)
        log(note)
        return {"tag": None, "tag_pending": tag, "tag_command": tag_command(cfg, tag=tag, release_id=release_id),
                "tag_note": note}

    _call("creating the repo", lambda: api.create_repo(repo_id, private=cfg.private, exist_ok=True),
          repo_id=repo_id, token=token)
    head, remote = _remote_tree(api, repo_id, cfg.branch, token)
    if head is not None and _same_tree(files, remote):
        log(f"{repo_id}@{cfg.branch} already holds exactly this release folder (head {head[:12]}): no commit")
        _ensure_tag(api, repo_id, tag, head, token, log)
        return {**result, "status": "already_published", "commit_sha": head, "commit_url": f"{endpoint}/{repo_id}/commit/{head}"}
    earlier = _find_earlier(api, repo_id, cfg, release_id, token)
    if earlier is not None:
        log(f"release {release_id} was already sent to {repo_id} (commit {str(earlier['commit_sha'])[:12]}"
            f"{', PR #' + str(earlier['pr_num']) if earlier['pr_num'] else ''}): not sending it again")
        sha = earlier["commit_sha"]
        if earlier.pop("merged", True):  # a commit of the branch (commit mode, or the PR's merge commit)
            _ensure_tag(api, repo_id, tag, sha, token, log)
            return {**result, **earlier, "status": "already_published", "commit_url": f"{endpoint}/{repo_id}/commit/{sha}"}
        return {**result, **earlier, **tag_waits(earlier["pr_num"]), "status": "already_published",
                "commit_url": f"{endpoint}/{repo_id}/commit/{sha}"}
    title, description = commit_texts(message, release_id)
    ops = _operations(folder, files, remote)
    n_del = sum(1 for o in ops if type(o).__name__ == "CommitOperationDelete")
    log(f"sending {len(files)} files ({sum(f['size'] for f in files)} bytes, {n_del} deletions) to {repo_id} "
        f"({'PR against' if cfg.mode == 'pr' else 'branch'} {cfg.branch}, parent {head[:12] if head else 'none'})")
    try:
        info = _call("committing", lambda: api.create_commit(
            repo_id, ops, commit_message=title, commit_description=description, revision=cfg.branch,
            parent_commit=head, create_pr=cfg.mode == "pr"), repo_id=repo_id, token=token)
    except PublishRefused as e:
        if "HTTP 412" in str(e):
            raise PublishRefused(
                f"{repo_id}@{cfg.branch} moved since it was read (head was {head}): someone else committed. "
                "Nothing was overwritten and nothing of this release was committed. Check the new commits, "
                "then publish again.") from None
        raise
    result.update(status="published", commit_sha=info.oid, commit_url=info.commit_url,
                  pr_url=info.pr_url, pr_num=info.pr_num)
    log(f"committed {info.oid[:12]} to {repo_id}" + (f" (PR #{info.pr_num}: {info.pr_url})" if info.pr_url else ""))
    if cfg.mode == "pr":  # refs/pr/N is not on the branch: the tag waits for the merge
        return {**result, **tag_waits(info.pr_num)}
    _ensure_tag(api, repo_id, tag, info.oid, token, log)
    return result


def publish_folder(folder: Path, cfg: PublishConfig, *, token: str, message: str, tag: str | None,
                   release_id: str, log=print) -> dict:
    """Send ``folder`` to ``cfg.repo_id`` as one commit (or one PR), then tag it; idempotent.

    >>> publish_folder(Path("rel"), cfg, token=tok, message="Release demo 0.1.0", tag="v0.1.0",
    ...                release_id="1a2b3c4d")                                    # doctest: +SKIP
    {'repo_id': 'org/demo', 'status': 'published', 'commit_sha': '…', 'pr_url': None, ...}
    """
    from huggingface_hub import HfApi

    _check_request(cfg, token, f"publishing to {cfg.repo_id or 'the Hub'}",
                   "publish.repo_id is not set: give the Hub repo as ORG/NAME (e.g. --repo-id ORG/NAME).")
    folder = Path(folder)
    files = folder_files(folder)
    if not files:
        raise BadInputError(f"Release folder {folder} is empty: nothing to publish.")
    endpoint = endpoint_of(cfg)
    api = HfApi(endpoint=endpoint, token=token)
    return _with_retries(cfg, endpoint, log, lambda: _publish_once(
        api, folder, files, cfg, token=token, message=message, tag=tag, release_id=release_id, endpoint=endpoint,
        log=log))


def _check_request(cfg: PublishConfig, token: str, what: str, no_repo: str) -> None:
    """Refusals before any request: offline mode, no repo id, no token."""
    check_online(what)
    if not cfg.repo_id:
        raise BadInputError(no_repo)
    if not token:
        raise BadInputError(f"No Hub token given (looked in {cfg.token_env}).")


def _with_retries(cfg: PublishConfig, endpoint: str, log, attempt_fn: Callable[[], dict]) -> dict:
    """``attempt_fn()``, again after a 5xx / connection error (``cfg.retries``, backoff doubling)."""
    delay, last = cfg.retry_backoff_s, None
    for attempt in range(cfg.retries + 1):
        try:
            return attempt_fn()
        except _Transient as e:
            last = e
            if attempt < cfg.retries:
                log(f"{e.what} failed at {endpoint} ({e.status}); retry {attempt + 1}/{cfg.retries} in {delay:g} s")
                time.sleep(delay)
                delay *= 2
    raise PublishError(f"The Hub at {endpoint} kept failing while {last.what} for {cfg.repo_id} "
                       f"({cfg.retries + 1} attempts, last: {last.status}). Check the endpoint / "
                       "https://status.huggingface.co and publish again: a retry will not duplicate the release.")


def tag_merged_release(cfg: PublishConfig, *, token: str, tag: str, release_id: str, log=print) -> dict:
    """Tag the merge commit of a PR-mode release (found by its release id) once its PR is merged; idempotent.

    Refuses (:class:`PublishRefused`) while the pull request is open or closed unmerged, when no pull
    request of the release exists, or when the tag already points at another commit.

    >>> tag_merged_release(PublishConfig(repo_id="org/demo", mode="pr"), token=tok, tag="v0.1.0",
    ...                    release_id="1a2b3c4d")                              # doctest: +SKIP
    {'repo_id': 'org/demo', 'tag': 'v0.1.0', 'commit_sha': '…', 'pr_num': 1, ...}
    """
    from huggingface_hub import HfApi

    _check_request(cfg, token, f"tagging the release on {cfg.repo_id or 'the Hub'}", "No repo given: pass --repo-id ORG/NAME.")
    endpoint = endpoint_of(cfg)
    api = HfApi(endpoint=endpoint, token=token)
    repo_id = cfg.repo_id

    def attempt() -> dict:
        prs = _release_prs(api, repo_id, release_id, token)
        if not prs:
            raise PublishRefused(f"{repo_id} has no pull request of release {release_id} (title "
                                 f"'… {release_marker(release_id)}'): nothing to tag. Check --repo-id / --release-id.")
        pr = next((p for p in prs if p.status == "merged"), None)
        if pr is None:
            p = prs[0]
            raise PublishRefused(f"Pull request #{p.num} of release {release_id} ({p.url}) is {p.status}, not merged: "
                                 f"the tag {tag} goes on {cfg.branch} only after the merge. Merge it (on its page, "
                                 f"or hf discussions merge {repo_id} {p.num}), then run this again.")
        sha = _merged_commit(api, repo_id, pr, cfg.branch, release_id, token)
        _ensure_tag(api, repo_id, tag, sha, token, log)
        return {"repo_id": repo_id, "branch": cfg.branch, "tag": tag, "commit_sha": sha, "pr_num": pr.num,
                "pr_url": pr.url, "commit_url": f"{endpoint}/{repo_id}/commit/{sha}"}

    return _with_retries(cfg, endpoint, log, attempt)


def main(argv: list[str] | None = None) -> int:
    """``python -m drafter.release.hub tag-merged --repo-id ORG/NAME --release-id ID --tag TAG``: the
    command a PR-mode publish prints (:func:`tag_command`). Exit 0 when tagged (or already tagged)."""
    parser = argparse.ArgumentParser(prog="python -m drafter.release.hub")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tag-merged", help="tag the merge commit of a release's pull request, once it is merged")
    t.add_argument("--repo-id", required=True, metavar="ORG/NAME")
    t.add_argument("--release-id", required=True)
    t.add_argument("--tag", required=True)
    t.add_argument("--branch", default="main")
    t.add_argument("--endpoint", default=None, help="default: HF_ENDPOINT, else https://huggingface.co")
    t.add_argument("--token-env", default="HF_TOKEN", help="environment variable holding the token")
    a = parser.parse_args(argv)
    try:
        cfg = PublishConfig(repo_id=a.repo_id, branch=a.branch, mode="pr", endpoint=a.endpoint, token_env=a.token_env,
                            tag=None)
        res = tag_merged_release(cfg, token=read_token(cfg), tag=a.tag, release_id=a.release_id,
                                 log=lambda m: print(m, file=sys.stderr))
    except (StageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{res['repo_id']}: tag {res['tag']} on {res['commit_sha']} (the merge of PR #{res['pr_num']} into "
          f"{res['branch']}): {res['commit_url']}")
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through main() in the tests
    sys.exit(main())
