"""A small local Hugging Face Hub for tests: the routes ``huggingface_hub`` 2.4 calls to create a
repo, commit (regular + LFS basic transfer), list commits / refs / pull requests, read and merge a
pull request (``get_discussion_details``, ``merge_pull_request``: the Hub squashes the PR into one
commit ``<title> (#N)`` on its base branch and reports it as ``changes.mergeCommitId``), tag, and
download, over an in-memory git-like model (repos, commits, branches, tags, ``refs/pr/N``).

Written for this project; it speaks just enough of the Hub protocol for ``drafter.release.hub``:

>>> with running_hub(token="hf_write") as hub:        # doctest: +SKIP
...     hub.state.fail_next("POST", "/api/repos/create", 503, times=2)
...     HfApi(endpoint=hub.url, token="hf_write").create_repo("org/demo")

Xet is never advertised (no ``X-Xet-*`` headers, LFS batch answers ``transfer: basic``); the
client picks Xet for uploads by itself whenever ``hf_xet`` is installed, so tests set
``huggingface_hub.constants.HF_HUB_DISABLE_XET = True`` (see :func:`hub_client_settings`).

Fault injection (all on :class:`HubState`): ``fail_next`` (the next N matching requests answer a
status), ``drop_next_commit_response`` (the commit is applied, then the answer is a 500), and
``foreign_commit_before_next_commit`` (someone else commits to the branch just before ours
arrives, so its ``parentCommit`` is stale ⇒ 412). Every request is recorded in ``state.requests``.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".png", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data``: ``sha1(b"blob <len>\\0" + data)``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    title: str
    message: str
    tree: dict[str, bytes]
    lfs: set[str]  # paths stored as LFS in this tree
    date: str


@dataclass
class PullRequest:
    num: int
    title: str
    description: str
    status: str
    head: str
    base: str = "main"  # the branch it targets
    merge_commit: str | None = None  # the commit on ``base`` that merged it


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prs: list[PullRequest] = field(default_factory=list)


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    status: int = 0


class HubState:
    """Everything the server holds; tests read and steer it (thread-safe enough: one lock)."""

    def __init__(self, token: str = "hf_test_write_token", read_token: str | None = "hf_test_read_token"):
        self.lock = threading.RLock()
        self.token = token
        self.read_token = read_token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[Recorded] = []
        self._faults: list[list] = []  # [method, path_substring, status, remaining]
        self.drop_commit_responses = 0
        self._foreign: list[tuple[str, dict[str, bytes]]] = []
        self._counter = itertools.count(1)

    # --- steering -------------------------------------------------------------------------------
    def fail_next(self, method: str, path_contains: str, status: int, times: int = 1) -> None:
        """The next ``times`` requests ``method`` whose path contains ``path_contains`` answer ``status``."""
        with self.lock:
            self._faults.append([method.upper(), path_contains, status, times])

    def drop_next_commit_response(self, times: int = 1) -> None:
        """Apply the next commit(s), then answer 500 as if the response was lost."""
        self.drop_commit_responses += times

    def foreign_commit_before_next_commit(self, branch: str = "main", files: dict[str, bytes] | None = None) -> None:
        """Right before the next commit request is handled, someone else commits ``files`` to ``branch``."""
        self._foreign.append((branch, files or {"someone-else.txt": b"not yours\n"}))

    def count(self, method: str, path_contains: str) -> int:
        """How many recorded requests match ``method`` and contain ``path_contains`` in their path."""
        return sum(1 for r in self.requests if r.method == method.upper() and path_contains in r.path)

    # --- model --------------------------------------------------------------------------------
    def new_sha(self, *parts: str) -> str:
        return hashlib.sha1(("|".join(parts) + f"|{next(self._counter)}").encode()).hexdigest()

    def add_commit(self, repo: Repo, parent: str | None, title: str, message: str,
                   tree: dict[str, bytes], lfs: set[str]) -> Commit:
        sha = self.new_sha(repo.repo_id, title, parent or "")
        c = Commit(sha, parent, title, message, tree, lfs, time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
        repo.commits[sha] = c
        return c

    def resolve(self, repo: Repo, rev: str) -> str | None:
        """Commit sha of a branch, tag, ``refs/pr/N`` or sha (None if unknown)."""
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.tags:
            return repo.tags[rev]
        if rev.startswith("refs/pr/"):
            num = rev.rsplit("/", 1)[-1]
            for pr in repo.prs:
                if str(pr.num) == num:
                    return pr.head
        if rev.startswith("refs/heads/") and rev[len("refs/heads/"):] in repo.branches:
            return repo.branches[rev[len("refs/heads/"):]]
        return rev if rev in repo.commits else None

    def log(self, repo_id: str, branch: str = "main") -> list[Commit]:
        """Commits of ``branch``, newest first (for assertions)."""
        repo = self.repos[repo_id]
        out, sha = [], repo.branches.get(branch)
        while sha:
            out.append(repo.commits[sha])
            sha = repo.commits[sha].parent
        return out


def _error(status: int, message: str, code: str | None = None, **extra) -> JSONResponse:
    headers = {"X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _get_pr(repo: Repo, num: int) -> PullRequest | JSONResponse:
    pr = next((p for p in repo.prs if p.num == num), None)
    return pr if pr is not None else _error(404, "Discussion not found", "DiscussionNotFound")


class _HubRoutes:
    """The routes of :func:`create_app` over one :class:`HubState`: one method per route, grouped as
    middleware, repos, commits (preupload, LFS, commit), refs / commits / tags, pull requests, files."""

    def __init__(self, state: HubState):
        self.state = state

    # --- middleware: record every request, inject faults, check the token -----------------------
    async def record_and_fault(self, request: Request, call_next):
        state = self.state
        rec = Recorded(request.method, request.url.path, request.url.query, dict(request.headers))
        with state.lock:
            state.requests.append(rec)
            for f in state._faults:
                if f[3] > 0 and f[0] == request.method and f[1] in request.url.path:
                    f[3] -= 1
                    rec.status = f[2]
                    return _error(f[2], f"injected fault {f[2]}")
        if not request.url.path.startswith("/lfs-upload/"):  # like a presigned S3 URL: no token
            denied = self._auth(request, write=request.method not in ("GET", "HEAD"))
            if denied is not None:
                rec.status = denied.status_code
                return denied
        response = await call_next(request)
        rec.status = response.status_code
        return response

    def _auth(self, request: Request, write: bool) -> JSONResponse | None:
        got = request.headers.get("authorization", "")
        token = got[len("Bearer "):] if got.startswith("Bearer ") else None
        if token == self.state.token:
            return None
        if token is not None and token == self.state.read_token:
            return _error(403, "You don't have the rights to write to this repo (read-only token).") if write else None
        return _error(401, "Invalid credentials in Authorization header")

    def _get_repo(self, ns: str, name: str) -> Repo | JSONResponse:
        repo = self.state.repos.get(f"{ns}/{name}")
        return repo if repo is not None else _error(404, "Repository not found", "RepoNotFound")

    # --- repos --------------------------------------------------------------------------------
    async def create_repo(self, request: Request):
        state = self.state
        body = await request.json()
        repo_id = f"{body.get('organization')}/{body['name']}"
        url = f"{_base(request)}/{repo_id}"
        with state.lock:
            if repo_id in state.repos:
                return _error(409, "You already created this model repo", url=url)
            repo = Repo(repo_id, private=body.get("visibility", "private") == "private")
            first = state.add_commit(repo, None, "initial commit", "",
                                     {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, set())
            repo.branches["main"] = first.sha
            state.repos[repo_id] = repo
        return {"url": url, "name": repo_id}

    async def validate_yaml(self, request: Request):
        body = await request.json()
        content = body.get("content", "")
        if content.startswith("---"):
            import yaml

            try:
                yaml.safe_load(content.split("---", 2)[1])
            except yaml.YAMLError as e:
                return JSONResponse({"errors": [{"message": f"invalid YAML: {e}"}]}, status_code=400)
        return {"errors": [], "warnings": []}

    # --- commits: preupload, LFS batch + upload, commit -----------------------------------------
    async def preupload(self, ns: str, name: str, rev: str, request: Request):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        body = await request.json()
        head = self.state.resolve(repo, rev)
        tree = repo.commits[head].tree if head else {}
        files = []
        for f in body["files"]:
            mode = "lfs" if f["path"].endswith(LFS_SUFFIXES) or f["size"] > 10_000_000 else "regular"
            old = tree.get(f["path"])
            oid = None
            if old is not None:
                oid = hashlib.sha256(old).hexdigest() if mode == "lfs" else git_blob_sha1(old)
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return {"files": files, "commitOid": head}

    async def lfs_batch(self, ns: str, repo_git: str, request: Request):
        repo = self._get_repo(ns, repo_git.removesuffix(".git"))
        if isinstance(repo, JSONResponse):
            return repo
        body = await request.json()
        objects = []
        for o in body["objects"]:
            if o["oid"] in self.state.lfs_objects:
                objects.append({"oid": o["oid"], "size": o["size"]})
            else:
                href = f"{_base(request)}/lfs-upload/{repo.repo_id}/{o['oid']}"
                objects.append({"oid": o["oid"], "size": o["size"], "authenticated": True,
                                "actions": {"upload": {"href": href, "header": {}}}})
        return JSONResponse({"transfer": "basic", "objects": objects}, media_type="application/vnd.git-lfs+json")

    async def lfs_put(self, ns: str, name: str, oid: str, request: Request):
        data = await request.body()
        if hashlib.sha256(data).hexdigest() != oid:
            return _error(400, "sha256 of the uploaded content does not match the oid")
        self.state.lfs_objects[oid] = data
        return Response(status_code=200)

    def _apply_foreign_commit(self, repo: Repo) -> None:
        """The commit someone else makes first (``foreign_commit_before_next_commit``), if one is due."""
        state = self.state
        if state._foreign:
            fbranch, ffiles = state._foreign.pop(0)
            fparent = repo.branches.get(fbranch)
            ftree = dict(repo.commits[fparent].tree) if fparent else {}
            ftree.update(ffiles)
            flfs = set(repo.commits[fparent].lfs) if fparent else set()
            repo.branches[fbranch] = state.add_commit(repo, fparent, "Someone else's commit", "", ftree, flfs).sha

    def _apply_operations(self, lines: list[dict], tree: dict[str, bytes], lfs: set[str]) -> JSONResponse | None:
        """Apply a commit's ``file`` / ``lfsFile`` / ``deletedFile`` lines to ``tree`` and ``lfs`` in
        place; an error response if one cannot be applied."""
        for item in lines:
            key, v = item["key"], item["value"]
            if key == "file":
                tree[v["path"]] = base64.b64decode(v["content"])
                lfs.discard(v["path"])
            elif key == "lfsFile":
                if v["oid"] not in self.state.lfs_objects:
                    return _error(422, f"LFS object {v['oid']} of {v['path']} was never uploaded")
                tree[v["path"]] = self.state.lfs_objects[v["oid"]]
                lfs.add(v["path"])
            elif key == "deletedFile":
                if v["path"] not in tree:
                    return _error(404, f"A file with this name doesn't exist: {v['path']}", "EntryNotFound")
                del tree[v["path"]]
                lfs.discard(v["path"])
        return None

    async def commit(self, ns: str, name: str, rev: str, request: Request):
        state = self.state
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        lines = [json.loads(x) for x in (await request.body()).splitlines() if x.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        create_pr = request.query_params.get("create_pr") == "1"
        with state.lock:
            self._apply_foreign_commit(repo)
            head = state.resolve(repo, rev)
            parent = header.get("parentCommit")
            if parent is not None and parent != head:
                return _error(412, f"A commit has happened since. Please refresh and try again. "
                                   f"(expected parent {parent}, head is {head})")
            tree = dict(repo.commits[head].tree) if head else {}
            lfs = set(repo.commits[head].lfs) if head else set()
            failed = self._apply_operations(lines, tree, lfs)
            if failed is not None:
                return failed
            c = state.add_commit(repo, head, header["summary"], header.get("description", ""), tree, lfs)
            pr_url = None
            if create_pr:
                num = len(repo.prs) + 1
                base_branch = rev[len("refs/heads/"):] if rev.startswith("refs/heads/") else rev
                repo.prs.append(PullRequest(num, header["summary"], header.get("description", ""), "open", c.sha,
                                            base=base_branch))
                pr_url = f"{_base(request)}/{repo.repo_id}/discussions/{num}"
            else:
                branch = rev[len("refs/heads/"):] if rev.startswith("refs/heads/") else rev
                repo.branches[branch] = c.sha
            if state.drop_commit_responses > 0:
                state.drop_commit_responses -= 1
                return _error(500, "Internal Error (the commit was applied, the answer lost)")
        return {"success": True, "commitOid": c.sha, "commitUrl": f"{_base(request)}/{repo.repo_id}/commit/{c.sha}",
                "commitMessage": c.title, "hookOutput": "", "pullRequestUrl": pr_url}

    # --- revision, refs, commit log, tags -------------------------------------------------------
    async def revision(self, ns: str, name: str, rev: str, request: Request):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        c = repo.commits[sha]
        blobs = request.query_params.get("blobs") in ("True", "true", "1")
        siblings = []
        for path in sorted(c.tree):
            s: dict = {"rfilename": path}
            if blobs:
                data = c.tree[path]
                s["size"] = len(data)
                s["blobId"] = git_blob_sha1(data)
                if path in c.lfs:
                    s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(s)
        return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": sha, "private": repo.private,
                "siblings": siblings, "lastModified": c.date, "tags": []}

    async def refs(self, ns: str, name: str, request: Request):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        def ref(kind, n, sha):
            return {"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": sha}
        out = {"branches": [ref("heads", b, s) for b, s in repo.branches.items()], "converts": [],
               "tags": [ref("tags", t, s) for t, s in repo.tags.items()]}
        if request.query_params.get("include_prs"):
            out["pullRequests"] = [{"name": f"refs/pr/{p.num}", "ref": f"refs/pr/{p.num}", "targetCommit": p.head}
                                   for p in repo.prs]
        return out

    async def commits(self, ns: str, name: str, rev: str):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        out = []
        while sha:
            c = repo.commits[sha]
            msg = c.title + ("\n\n" + c.message if c.message else "")
            out.append({"id": c.sha, "title": c.title, "message": msg, "authors": [{"user": "tester"}], "date": c.date})
            sha = c.parent
        return out

    async def tag(self, ns: str, name: str, rev: str, request: Request):
        state = self.state
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        body = await request.json()
        with state.lock:
            sha = state.resolve(repo, rev)
            if sha is None:
                return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            if body["tag"] in repo.tags:
                return _error(409, f"Tag {body['tag']} already exists")
            repo.tags[body["tag"]] = sha
        return {"success": True}

    # --- pull requests / discussions ------------------------------------------------------------
    async def discussions(self, ns: str, name: str, request: Request):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        q = request.query_params
        items = [p for p in repo.prs if q.get("status") in (None, "all", p.status)]
        if q.get("type") == "discussion":
            items = []
        ds = [{"num": p.num, "title": p.title, "status": p.status, "isPullRequest": True,
               "author": {"name": "tester"}, "createdAt": "2024-01-01T00:00:00.000Z",
               "repo": {"name": repo.repo_id, "type": "model"}} for p in items]
        return {"discussions": ds, "count": len(ds), "start": 0, "numClosedDiscussions": 0}

    async def discussion_details(self, ns: str, name: str, num: int):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        pr = _get_pr(repo, num)
        if isinstance(pr, JSONResponse):
            return pr
        changes: dict = {"base": f"refs/heads/{pr.base}"}
        if pr.merge_commit:
            changes["mergeCommitId"] = pr.merge_commit
        events = [{"id": f"c{pr.num}", "type": "commit", "createdAt": "2024-01-01T00:00:00.000Z",
                   "author": {"name": "tester"}, "data": {"subject": pr.title, "oid": pr.head}}]
        if pr.status != "open":
            events.append({"id": f"s{pr.num}", "type": "status-change", "createdAt": "2024-01-01T00:00:00.000Z",
                           "author": {"name": "tester"}, "data": {"status": pr.status}})
        return {"num": pr.num, "title": pr.title, "status": pr.status, "isPullRequest": True,
                "author": {"name": "tester"}, "createdAt": "2024-01-01T00:00:00.000Z",
                "repo": {"name": repo.repo_id, "type": "model"}, "events": events, "changes": changes,
                "filesWithConflicts": [], "diff": ""}

    async def merge(self, ns: str, name: str, num: int):
        """Squash-merge: the PR's changes (its head against its parent) applied to the base branch's
        head as one new commit ``<title> (#N)``."""
        state = self.state
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        with state.lock:
            pr = _get_pr(repo, num)
            if isinstance(pr, JSONResponse):
                return pr
            if pr.status != "open":
                return _error(400, f"This pull request is {pr.status}, it cannot be merged")
            head_c = repo.commits[pr.head]
            parent = repo.commits[head_c.parent] if head_c.parent else None
            old = parent.tree if parent else {}
            base_sha = repo.branches.get(pr.base)
            tree = dict(repo.commits[base_sha].tree) if base_sha else {}
            lfs = set(repo.commits[base_sha].lfs) if base_sha else set()
            for path, data in head_c.tree.items():
                if old.get(path) != data:
                    tree[path] = data
                    lfs.discard(path)
                    if path in head_c.lfs:
                        lfs.add(path)
            for path in set(old) - set(head_c.tree):
                tree.pop(path, None)
                lfs.discard(path)
            c = state.add_commit(repo, base_sha, f"{pr.title} (#{pr.num})", pr.description, tree, lfs)
            repo.branches[pr.base] = c.sha
            pr.status, pr.merge_commit = "merged", c.sha
        return {"success": True}

    # --- files --------------------------------------------------------------------------------
    async def resolve(self, ns: str, name: str, rest: str, request: Request):
        repo = self._get_repo(ns, name)
        if isinstance(repo, JSONResponse):
            return repo
        parts = rest.split("/")
        n = 3 if rest.startswith("refs/pr/") else 1
        rev, path = "/".join(parts[:n]), "/".join(parts[n:])
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        c = repo.commits[sha]
        if path not in c.tree:
            return _error(404, f"Entry not found: {path}", "EntryNotFound")
        data = c.tree[path]
        etag = hashlib.sha256(data).hexdigest() if path in c.lfs else git_blob_sha1(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Length": str(len(data))}
        if path in c.lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        if request.method == "HEAD":
            return Response(status_code=200, headers=headers)
        return Response(content=data, status_code=200, headers=headers, media_type="application/octet-stream")


def create_app(state: HubState) -> FastAPI:
    """The FastAPI app serving ``state``; the base URL is taken from each request."""
    app = FastAPI()
    routes = _HubRoutes(state)
    app.middleware("http")(routes.record_and_fault)
    # registered in this order on purpose: FastAPI tries routes in order (``/{ns}/...`` patterns last)
    app.post("/api/repos/create")(routes.create_repo)
    app.post("/api/validate-yaml")(routes.validate_yaml)
    app.post("/api/models/{ns}/{name}/preupload/{rev:path}")(routes.preupload)
    app.post("/{ns}/{repo_git}/info/lfs/objects/batch")(routes.lfs_batch)
    app.put("/lfs-upload/{ns}/{name}/{oid}")(routes.lfs_put)
    app.post("/api/models/{ns}/{name}/commit/{rev:path}")(routes.commit)
    app.get("/api/models/{ns}/{name}/revision/{rev:path}")(routes.revision)
    app.get("/api/models/{ns}/{name}/refs")(routes.refs)
    app.get("/api/models/{ns}/{name}/commits/{rev:path}")(routes.commits)
    app.get("/api/models/{ns}/{name}/discussions")(routes.discussions)
    app.get("/api/models/{ns}/{name}/discussions/{num}")(routes.discussion_details)
    app.post("/api/models/{ns}/{name}/discussions/{num}/merge")(routes.merge)
    app.post("/api/models/{ns}/{name}/tag/{rev:path}")(routes.tag)
    app.api_route("/{ns}/{name}/resolve/{rest:path}", methods=["GET", "HEAD"])(routes.resolve)
    return app


@dataclass
class RunningHub:
    url: str
    state: HubState


@contextlib.contextmanager
def running_hub(state: HubState | None = None):
    """Serve a :class:`HubState` with uvicorn on 127.0.0.1 (free port) in a thread; stopped on exit."""
    import uvicorn

    state = state or HubState()
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name="local-hub")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the local Hub server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningHub(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def hub_client_settings():
    """huggingface_hub settings for talking to the local Hub: online (conftest sets HF_HUB_OFFLINE=1),
    no Xet (this server speaks the LFS basic transfer only), no update check."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = False, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = saved

