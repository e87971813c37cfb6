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
* In PR mode the tag points at the PR's head commit (``refs/pr/N``), the branch is untouched.

The token is only handed to ``HfApi``; no message or log line contains it.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable

from drafter.core.config import PublishConfig
from drafter.core.errors import BadInputError, StageError

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
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return fn()
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


def _find_earlier(api, repo_id: str, cfg: PublishConfig, release_id: str, token: str) -> dict | None:
    """An earlier commit (commit mode) or open PR (PR mode) of this release, or None."""
    marker, trailer = release_marker(release_id), f"Release-Id: {release_id}"
    if cfg.mode == "pr":
        prs = _call("listing open pull requests", lambda: list(api.get_repo_discussions(
            repo_id, discussion_type="pull_request", discussion_status="open")), repo_id=repo_id, token=token)
        for pr in prs:
            if marker in pr.title or trailer in pr.title:
                refs = _call("listing refs", lambda: api.list_repo_refs(repo_id, include_pull_requests=True),
                             repo_id=repo_id, token=token)
                head = next((r.target_commit for r in refs.pull_requests or [] if r.ref == f"refs/pr/{pr.num}"), None)
                return {"commit_sha": head, "pr_num": pr.num, "pr_url": pr.url}
        return None
    try:
        commits = _call("listing commits", lambda: api.list_repo_commits(repo_id, revision=cfg.branch),
                        repo_id=repo_id, token=token)
    except PublishRefused as e:
        if "HTTP 404" in str(e):
            return None
        raise
    for c in commits:
        if marker in (c.title or "") or trailer in (c.message or ""):
            return {"commit_sha": c.commit_id, "pr_num": None, "pr_url": None}
    return None


def _ensure_tag(api, repo_id: str, tag: str | None, sha: str, token: str, log) -> None:
    """Tag ``sha`` (idempotent); the tag on another commit ⇒ :class:`PublishRefused`."""
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
              "endpoint": endpoint, "pr_url": None, "pr_num": None}
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
        _ensure_tag(api, repo_id, tag, earlier["commit_sha"], token, log)
        sha = earlier["commit_sha"]
        return {**result, **earlier, "status": "already_published", "commit_url": f"{endpoint}/{repo_id}/commit/{sha}"}
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

    if not cfg.repo_id:
        raise BadInputError("publish.repo_id is not set: give the Hub repo as ORG/NAME (e.g. --repo-id ORG/NAME).")
    if not token:
        raise BadInputError(f"No Hub token given (looked in {cfg.token_env}).")
    folder = Path(folder)
    files = folder_files(folder)
    if not files:
        raise BadInputError(f"Release folder {folder} is empty: nothing to publish.")
    endpoint = endpoint_of(cfg)
    api = HfApi(endpoint=endpoint, token=token)
    delay, last = cfg.retry_backoff_s, None
    for attempt in range(cfg.retries + 1):
        try:
            return _publish_once(api, folder, files, cfg, token=token, message=message, tag=tag,
                                 release_id=release_id, endpoint=endpoint, log=log)
        except _Transient as e:
            last = e
            if attempt < cfg.retries:
                log(f"{e.what} failed at {endpoint} ({e.status}); retry {attempt + 1}/{cfg.retries} in {delay:g} s")
                time.sleep(delay)
                delay *= 2
    raise PublishError(f"The Hub at {endpoint} kept failing while {last.what} for {cfg.repo_id} "
                       f"({cfg.retries + 1} attempts, last: {last.status}). Check the endpoint / "
                       "https://status.huggingface.co and publish again: a retry will not duplicate the release.")
