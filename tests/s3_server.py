"""moto's S3 server as a real process on loopback, for the tests' S3 fixtures and the checkpoint-stall
benchmark: the protocol spoken over a socket, as Ray's and s3fs's own suites test against it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def moto_server(log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3/IAM server in its own process on a free loopback port; yields its endpoint URL.
    (bench/checkpoint_stall.py uses it too.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections (readiness, not a race); no request, so none is counted
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start: " + Path(log_path).read_text()[-2000:]) from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
