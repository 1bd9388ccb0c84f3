"""moto's S3 server as a real process on loopback, for the tests' S3 fixtures and the checkpoint-stall
benchmark: the protocol spoken over a socket, as Ray's and s3fs's own suites test against it."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def moto_server(log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3/IAM server in its own process on a loopback port it binds itself; yields its endpoint URL.
    (bench/checkpoint_stall.py uses it too.)"""
    log = open(log_path, "w")
    # Port 0: the server binds a free port and logs it once it listens. A port picked here and released first could
    # be taken by another process before the server bound it, which a connect then found listening.
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 60
        while not (bound := re.search(r"Running on http://127\.0\.0\.1:(\d+)", Path(log_path).read_text())):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto_server did not start: " + Path(log_path).read_text()[-2000:])
            time.sleep(0.2)  # polls the log for the line werkzeug writes after it listens
        yield f"http://127.0.0.1:{bound.group(1)}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
