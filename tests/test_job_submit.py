"""`ray job submit` of the demo job against a head this test starts with `ray start --head`."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, REPO, free_ports


@pytest.fixture
def ray_head():
    """A head node on loopback with free ports, stopped by its own process id at the end."""
    gcs, dashboard, client, agent_grpc, agent_http, runtime_env, metrics = free_ports(7)
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Token auth is on by default in Ray 2.60; on a trusted loopback test cluster both sides turn it off.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [
            str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
            "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--dashboard-agent-listen-port={agent_http}",
            f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
            f"--temp-dir={temp_dir}",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 90
    while True:  # wait for the job server to answer (readiness, not a race)
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2) as response:
                json.load(response)
            break
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                head.kill()
                pytest.fail("ray start --head did not come up:\n" + Path(temp_dir, "head.log").read_text()[-3000:])
            time.sleep(1)
    try:
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.timeout(400)
def test_ray_job_submit_runs_the_demo_on_the_cluster(ray_head, tmp_path, monkeypatch):
    address, env = ray_head
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for this process's JobSubmissionClient
    submission_id = f"sdtrain-test-{os.getpid()}"
    job_args = [
        "python", "entrypoints/train.py", "train.max_steps=4", "run.log_every_n_steps=2",
        "run.checkpoint_every_n_steps=4", f"data.train={tmp_path}/data/train", f"data.val={tmp_path}/data/val",
        f"run.storage_path={tmp_path}/runs",
    ]
    ray = str(BIN / "ray")
    submit = subprocess.run(
        [ray, "job", "submit", "--address", address, "--submission-id", submission_id, "--no-wait",
         "--working-dir", str(REPO), "--runtime-env", str(REPO / "runtime_env" / "local.yaml"), "--", *job_args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert submit.returncode == 0, submit.stderr
    logs = subprocess.run(
        [ray, "job", "logs", "--address", address, "--follow", submission_id],
        env=env, capture_output=True, text=True, timeout=360,
    )
    from ray.job_submission import JobStatus, JobSubmissionClient

    status = JobSubmissionClient(address).get_job_status(submission_id)
    assert status == JobStatus.SUCCEEDED, logs.stdout[-4000:]
    # The job's ray.init() joined this cluster rather than starting one of its own.
    assert "Started a local Ray instance" not in logs.stdout
    assert "Connecting to existing Ray cluster" in logs.stdout
    checkpoint = tmp_path / "runs" / "demo" / "checkpoint_000000004" / "checkpoint.ckpt"
    assert checkpoint.is_file()
    assert f"final checkpoint: {checkpoint.parent}" in logs.stdout
