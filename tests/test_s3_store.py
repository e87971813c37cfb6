"""The store on S3 (s3fs) against a local S3-compatible server (moto's server mode on 127.0.0.1, started
here): a full tiny release, reused by a second machine and matching a local store; a writer killed
(SIGKILL) mid-upload leaves no readable output; two machines writing the same key at once commit one
output; a tampered object is detected."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from drafter.core.config import load_config
from drafter.core.errors import StoreError
from drafter.core.pipeline import run_all
from drafter.core.store import Store
from tests.helpers.s3 import moto_s3

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "drafter-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3(tmp_path_factory.mktemp("moto"), BUCKET) as s:
        yield s


def s3fs_fresh():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def data_hashes(store_root: Path | None, manifest: dict, patterns=("shards/", "features/")) -> dict:
    return {f: v["sha256"] for f, v in manifest["files"].items() if f.startswith(patterns)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_tiny_release_on_s3_is_reused_by_another_machine_and_matches_a_local_store(s3, tiny_target, tmp_path):
    from tests.test_release_e2e import write_config

    root = f"s3://{BUCKET}/release"
    cfg = load_config(write_config(tmp_path, tiny_target, tmp_path / "s3-a"))
    cfg.store.root, cfg.store.cache_dir = root, str(tmp_path / "cache-a")
    t0 = time.monotonic()
    first = run_all(cfg, echo=lambda *_: None)
    print(f"\nfull tiny release on S3: {time.monotonic() - t0:.1f} s")
    assert first["status"] == "completed"
    statuses = {s["stage"]: s["status"] for s in first["stages"]}
    assert statuses["publish"] == "computed" and statuses["ab_live"] == "skipped"
    fs = s3fs_fresh()
    for s in first["stages"]:  # every output committed: a manifest naming a complete upload directory
        m = json.loads(fs.cat_file(f"{BUCKET}/release/{s['stage']}/{s['key']}/manifest.json"))
        up = f"{BUCKET}/release/{s['stage']}/{m['upload']}"
        assert {p[len(up) + 1:] for p in fs.find(up)} == set(m["files"]), s["stage"]
    assert fs.exists(f"{BUCKET}/release/runs/{first['run_id']}.json")

    # another machine (its own empty cache) reuses every output, verified against the manifests
    cfg_b = cfg.model_copy(deep=True)
    cfg_b.store.cache_dir = str(tmp_path / "cache-b")
    second = run_all(cfg_b, echo=lambda *_: None)
    assert {s["stage"]: s["status"] for s in second["stages"]} == {s: "reused" for s in statuses}

    # the same release into a local store: the same keys, and the same bytes for the deterministic data
    cfg_l = load_config(write_config(tmp_path, tiny_target, tmp_path / "local"))
    local = run_all(cfg_l, only=["capture"], echo=lambda *_: None)
    keys = {s["stage"]: s["key"] for s in first["stages"]}
    for s in local["stages"]:
        assert s["key"] == keys[s["stage"]], s["stage"]
        lm = json.loads((tmp_path / "local" / s["stage"] / s["key"] / "manifest.json").read_text())
        rm = json.loads((tmp_path / "cache-b" / Path(Store(root, cache_dir=tmp_path / "cache-b").work).name
                         / s["stage"] / s["key"] / "manifest.json").read_text())
        assert data_hashes(None, lm) == data_hashes(None, rm), s["stage"]


WRITER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from drafter.core.store import Store

    mode, root, cache, tag, barrier = sys.argv[1:6]
    store = Store(root, cache_dir=cache)
    if mode == "kill-mid-upload":
        real, calls = store.fs.put_file, []
        def put_file(*a, **k):
            calls.append(a)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # the writer dies after its first file is uploaded
            return real(*a, **k)
        store.fs.put_file = put_file

    def write(out):
        for i in range(3):
            (out / f"part-{i}.txt").write_text(f"{tag} {i}\\n")
        if barrier != "-":  # wait until the other writer has its output ready too
            Path(barrier, tag).touch()
            while len(list(Path(barrier).iterdir())) < 2:
                time.sleep(0.01)
        return {"writer": tag}

    art, computed = store.produce("x", "k1", write, {"stage": "x"})
    print(json.dumps({"computed": computed, "writer": art.manifest["metrics"]["writer"],
                      "text": (art.path / "part-0.txt").read_text()}))
""")


def run_writer(mode: str, root: str, cache: Path, tag: str, barrier: str = "-", wait=True):
    p = subprocess.Popen([sys.executable, "-c", WRITER, mode, root, str(cache), tag, barrier], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p.communicate(timeout=120) + (p.returncode,) if wait else p


def test_a_writer_killed_mid_upload_leaves_no_readable_output_and_a_rerun_commits(s3, tmp_path):
    root = f"s3://{BUCKET}/killed"
    out, err, rc = run_writer("kill-mid-upload", root, tmp_path / "cache-a", "A")
    assert rc == -signal.SIGKILL, err[-2000:]
    fs = s3fs_fresh()
    uploaded = fs.find(f"{BUCKET}/killed/x")
    assert len(uploaded) == 1 and ".k1.uploads/" in uploaded[0]  # one file reached S3 ...
    assert not fs.exists(f"{BUCKET}/killed/x/k1/manifest.json")  # ... but nothing was committed
    assert Store(root, cache_dir=tmp_path / "cache-b").find("x", "k1") is None
    out, err, rc = run_writer("plain", root, tmp_path / "cache-c", "C")
    assert rc == 0, err[-2000:]
    assert json.loads(out)["computed"] is True
    art = Store(root, cache_dir=tmp_path / "cache-d").find("x", "k1")
    assert art.metrics["writer"] == "C" and (art.path / "part-2.txt").read_text() == "C 2\n"


def test_two_machines_writing_the_same_key_at_once_commit_one_output(s3, tmp_path):
    root = f"s3://{BUCKET}/race"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs_ = [run_writer("plain", root, tmp_path / f"cache-{t}", t, str(barrier), wait=False) for t in ("A", "B")]
    results = []
    for p in procs_:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    assert sorted(r["computed"] for r in results) == [False, True], results
    winner = next(r["writer"] for r in results if r["computed"])
    # both processes end up with the winner's output; the loser's upload is gone
    assert [r["writer"] for r in results] == [winner, winner]
    assert [r["text"] for r in results] == [f"{winner} 0\n"] * 2
    fs = s3fs_fresh()
    m = json.loads(fs.cat_file(f"{BUCKET}/race/x/k1/manifest.json"))
    assert m["metrics"]["writer"] == winner
    attempts = {p.split(".k1.uploads/")[1].split("/")[0] for p in fs.find(f"{BUCKET}/race/x") if ".k1.uploads/" in p}
    assert attempts == {m["upload"].split("/")[1]}


def test_a_tampered_object_is_detected_by_name(s3, tmp_path):
    root = f"s3://{BUCKET}/tamper"
    store = Store(root, cache_dir=tmp_path / "cache-a")
    art, _ = store.produce("x", "k1", lambda out: (out / "weights.bin").write_bytes(b"\x00" * 64) and {}, {"stage": "x"})
    fs = s3fs_fresh()
    fs.pipe_file(f"{BUCKET}/tamper/x/{art.manifest['upload']}/weights.bin", b"\x01" * 64)
    with pytest.raises(StoreError, match="weights.bin"):
        Store(root, cache_dir=tmp_path / "cache-b").find("x", "k1")
    # a manifest that lists a file its upload lacks
    fs.rm(f"{BUCKET}/tamper/x/{art.manifest['upload']}/weights.bin")
    with pytest.raises(StoreError, match="weights.bin is listed in its manifest but missing"):
        Store(root, cache_dir=tmp_path / "cache-c").find("x", "k1")


# ------------------------------------------------------------------ preflight: a store that cannot be used (issue 33)

AWS_ENV_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CA_BUNDLE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
SECRET = "s3cr3t-never-printed"


@pytest.fixture
def no_aws(tmp_path, monkeypatch):
    """An environment with no AWS settings at all: no AWS_* variable and a HOME without ~/.aws."""
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")] + list(AWS_ENV_NAMES):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def s3_config(tmp_path: Path, root: str) -> Path:
    from tests.test_bad_input import write_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    return write_config(tmp_path, ckpt, store={"root": root, "cache_dir": str(tmp_path / "cache")})


def release_fails_in_preflight(tmp_path: Path, root: str, *needles: str) -> str:
    """`drafter release` on ``root``: exit 2 with one `error:` line (no traceback) naming the store and ``needles``;
    nothing of the secret; the store's local cache holds nothing of a stage."""
    from tests.test_bad_input import assert_bad, cli

    res = cli("release", "-c", s3_config(tmp_path, root))
    line = assert_bad(res, f"error: store.root {root}:", *needles, code=2)
    assert SECRET not in res.output
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()], list(cache.rglob("*"))
    return line


def test_an_s3_store_without_credentials_fails_in_preflight_in_one_line(no_aws, tmp_path):
    line = release_fails_in_preflight(tmp_path, "s3://drafter-no-creds/store", "no AWS credentials found",
                                      "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")
    print(f"\n{line}")


def test_an_s3_store_on_an_unreachable_endpoint_fails_in_preflight_in_one_line(no_aws, tmp_path, monkeypatch):
    from drafter.core.ports import free_port

    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    line = release_fails_in_preflight(tmp_path, "s3://drafter-unreachable/store",
                                      f"S3 endpoint unreachable: 127.0.0.1:{port}", "AWS_ENDPOINT_URL")
    print(f"\n{line}")


def test_the_preflight_probe_makes_one_attempt_and_the_store_bounded_ones(no_aws, tmp_path, monkeypatch):
    """No timing assertion (DEVELOPERS.md): the probe's settings are bounded, and an endpoint that accepts a
    connection and closes it at once sees one attempt (unbounded: botocore's 5)."""
    import socket
    import threading

    from drafter.core.store import StoreAccessError, open_fs

    probe, _ = open_fs("s3://b/p", probe=True)
    assert probe.retries == 1
    assert probe.config_kwargs["retries"]["total_max_attempts"] == 1
    assert probe.config_kwargs["connect_timeout"] <= 5 and probe.config_kwargs["read_timeout"] <= 5
    store = Store("s3://b/p", cache_dir=tmp_path / "cache")
    assert store.fs.retries <= 3 and store.fs.config_kwargs["retries"]["total_max_attempts"] <= 3
    assert store.fs.config_kwargs["connect_timeout"] <= 5

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.close()  # an endpoint that hangs up: botocore would retry it

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    port = srv.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreAccessError, match=f"unreachable: 127.0.0.1:{port}") as ei:
            Store("s3://drafter-hangup/store", cache_dir=tmp_path / "cache").check_access()
        print(f"\nprobe of an endpoint that hangs up: {time.monotonic() - t0:.2f} s; {ei.value}")
    finally:
        stop.set()
        t.join(5)
        srv.close()
    # one attempt: aiohttp itself reconnects once when a fresh connection closes before any response, so one
    # attempt is 2 connections (unbounded, botocore's 5 attempts made 10)
    assert len(accepted) <= 2, len(accepted)
    assert ei.value.permanent is False  # an endpoint may come back: a stage's retry is not pointless


def test_an_s3_store_whose_bucket_does_not_exist_fails_in_one_line_and_an_existing_one_passes(s3, tmp_path):
    from drafter.core.store import StoreAccessError

    Store(f"s3://{BUCKET}/probe", cache_dir=tmp_path / "cache").check_access()  # no error
    with pytest.raises(StoreAccessError, match="the bucket 'no-such-bucket' does not exist at AWS_ENDPOINT_URL="):
        Store("s3://no-such-bucket/store", cache_dir=tmp_path / "cache").check_access()


@pytest.mark.parametrize("code,status,needle", [
    ("InvalidAccessKeyId", 403, "AWS credentials rejected by the S3 server (InvalidAccessKeyId)"),
    ("SignatureDoesNotMatch", 403, "AWS credentials rejected by the S3 server (SignatureDoesNotMatch)"),
    ("AccessDenied", 403, "access denied (AccessDenied)"),
    ("NoSuchBucket", 404, "the bucket 'b' does not exist"),
])
def test_s3_errors_as_s3fs_raises_them_become_one_line_without_the_secret(no_aws, monkeypatch, code, status, needle):
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from drafter.core.store import describe_access_error

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    boto = ClientError({"Error": {"Code": code, "Message": f"refused for {SECRET}"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "ListObjectsV2")
    err = describe_access_error("s3://b/p", translate_boto_error(boto))  # s3fs's OSError, the ClientError its cause
    assert err is not None and needle in str(err), err
    assert str(err).startswith("store.root s3://b/p: ") and "\n" not in str(err) and SECRET not in str(err)
    assert describe_access_error("s3://b/p", ValueError("something else")) is None
