"""moto's S3 server on 127.0.0.1 (a local S3-compatible server) for the store's S3 tests."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from drafter.core import procs
from drafter.serving.server import free_port


@contextmanager
def moto_s3(log_dir: Path, bucket: str) -> Iterator[dict]:
    """moto's S3 server on 127.0.0.1 with ``bucket``; while it runs, the AWS variables of this process point
    every client (s3fs here and in child processes) at it. Yields ``{"url", "fs", "env"}``."""
    moto = str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    log_path = log_dir / "moto.log"
    log = open(log_path, "wb")
    proc = procs.spawn([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("moto_server did not start:\n" + log_path.read_text()[-2000:])
                time.sleep(0.3)
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(bucket)
        yield {"url": url, "fs": fs, "env": env}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        procs.stop(proc)
        log.close()
