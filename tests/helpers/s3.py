"""moto's S3 server on 127.0.0.1 (a local S3-compatible server) for the store's S3 tests."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from drafter.core import procs
from tests.helpers.servers import start_server


@contextmanager
def moto_s3(log_dir: Path, bucket: str) -> Iterator[dict]:
    """moto's S3 server on 127.0.0.1 with ``bucket``; while it runs, the AWS variables of this process point
    every client (s3fs here and in child processes) at it. Yields ``{"url", "fs", "env"}``."""
    moto = str(Path(sys.executable).parent / "moto_server")
    proc, port = start_server(lambda port: ([moto, "-H", "127.0.0.1", "-p", str(port)], None), log_dir / "moto.log",
                              what="moto_server", timeout_s=60)
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
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
