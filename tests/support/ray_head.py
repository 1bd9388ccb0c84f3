"""A Ray head node of its own on loopback (``ray start --head --block``), for the tests and benchmarks that submit
jobs to a cluster they start: free ports, readiness by the dashboard's answer, stopped by its own process id."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_head(ray: Path, env: dict[str, str], temp_dir: str, timeout_s: float) -> tuple[subprocess.Popen, int, str]:
    """(the head's process, its GCS port, its dashboard's address), once the dashboard answers.

    Args:
        ray: the ``ray`` command of the environment to run.
        env: the head's environment (token auth off on a trusted loopback cluster: ``RAY_AUTH_MODE=disabled``).
        temp_dir: Ray's temp dir and the head's log (``head.log``); short, as Ray's socket paths have a length limit.
        timeout_s: how long the head may take to answer; RuntimeError with its log's tail after that.
    """
    gcs, dashboard, client, agent_grpc, agent_http, runtime_env, metrics = free_ports(7)
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()  # the head writes through its own copy
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + timeout_s
    while True:  # the job server answers once the head is up (readiness, not a race)
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2) as response:
                json.load(response)
            return head, gcs, address
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                stop_head(head)
                raise RuntimeError(
                    "ray start --head did not come up:\n" + Path(temp_dir, "head.log").read_text()[-3000:]
                ) from None
            time.sleep(1)


def stop_head(head: subprocess.Popen, grace_s: float = 5) -> None:
    """SIGTERM to ``ray start --block``, which stops the processes it started; after ``grace_s`` SIGKILL to it and
    to every process it had started that is still there (by their ids, taken before the SIGTERM). A head whose jobs
    ran Ray Train and Ray Data waited ~30 s for its idle workers to end gracefully, and still had them after 5 s: a
    cluster that is thrown away with its temp dir needs no grace (``grace_s=0``: SIGKILL at once, no SIGTERM)."""
    import psutil

    try:
        started = psutil.Process(head.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    if grace_s > 0:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    head.kill()  # a no-op once it has ended
    head.wait()
    for process in started:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(started, timeout=30)
