"""A real MLflow tracking server in its own process, for the tests of what sdtrain logs and registers there."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from support.ray_head import free_ports


@contextlib.contextmanager
def mlflow_server(directory: Path) -> Iterator[str]:
    """A real ``mlflow server`` on loopback with a SQLite backend and local artifacts; yields its URI."""
    port = free_ports(1)[0]
    log = open(directory / "mlflow-server.log", "wb")
    process = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{directory / 'mlflow.db'}",
            "--artifacts-destination",
            str(directory / "mlflow-artifacts"),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its uvicorn workers go with it
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"mlflow server did not start: {(directory / 'mlflow-server.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.5)  # polling a server coming up, not dodging a race
        yield uri
    except BaseException:
        # A failure against the server shows the server's side (a crash's traceback, its exit code) in the report:
        # the test's tmp_path, where the log lies, is not kept on a CI machine.
        state = "running" if process.poll() is None else f"exited with code {process.returncode}"
        log.flush()
        tail = (directory / "mlflow-server.log").read_text(errors="replace")[-3000:]
        print(f"mlflow server at {uri} ({state}); the end of its log:\n{tail}")
        raise
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()
