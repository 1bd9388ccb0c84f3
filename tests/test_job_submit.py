"""`ray job submit` of a training job against a head this test starts with `ray start --head`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from conftest import BIN, REPO, S3_ENV, write_latents
from support.ray_head import start_head, stop_head
from support.tiny_models import write_tiny_sd_model

pytestmark = pytest.mark.slow  # a Ray head, ray job submit and an S3 server, in their own processes


@pytest.fixture
def ray_head():
    """A head node on loopback with free ports, stopped by its own process id at the end."""
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Token auth is on by default in Ray 2.60; on a trusted loopback test cluster both sides turn it off.
    # The cluster has S3 credentials (as from an instance role) but no S3 endpoint: a job names its own.
    env = {**os.environ, **S3_ENV, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for var in ("RAY_ADDRESS", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        env.pop(var, None)
    try:
        head, _, address = start_head(BIN / "ray", env, temp_dir, timeout_s=90)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield address, env
    finally:
        stop_head(head, grace_s=0)  # thrown away with its temp dir: nothing to end gracefully
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(address, env, submission_id, job_args):
    submit = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--submission-id",
            submission_id,
            "--no-wait",
            "--working-dir",
            str(REPO),
            "--runtime-env",
            str(REPO / "runtime_env" / "local.yaml"),
            "--",
            *job_args,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stderr


def _follow(address, env, submission_id) -> str:
    """The job's whole log, once it has ended."""
    logs = subprocess.run(
        [str(BIN / "ray"), "job", "logs", "--address", address, "--follow", submission_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    return logs.stdout


def _wait_until_its_trainer_is_gone(client, address: str, submission_id: str) -> None:
    """After ``ray job stop``: the job's driver has exited, but Ray ends the Ray Train controller and workers the
    driver owned only after that, and until then the controller may still commit a checkpoint. Wait until Ray's
    actor table has them dead: only then is the run's record of committed checkpoints final."""
    from ray.util.state import list_actors
    from ray.util.state.exception import RayStateApiException

    job_id = client.get_job_info(submission_id).job_id
    deadline = time.monotonic() + 120
    while True:
        # Seen DEAD, never merely unlisted: under load the state API fails, or answers empty, now and then
        # (sdtrain.driver.placement_group_guard).
        try:
            actors = list_actors(address=address, filters=[("job_id", "=", job_id)], limit=10_000)
        except RayStateApiException:
            actors = []
        trainer = {
            (a.actor_id, a.class_name, a.state) for a in actors if a.class_name in ("TrainController", "RayTrainWorker")
        }
        if trainer and all(state == "DEAD" for _, _, state in trainer):
            return
        assert time.monotonic() < deadline, f"not all seen dead 120 s after job {submission_id} stopped: {trainer}"
        time.sleep(0.2)  # polling Ray's actor table until it says they ended


def _committed(s3, run_key: str) -> list[str]:
    """The checkpoints Ray Train has committed for the run in the bucket (its own snapshot)."""
    try:
        body = s3.get_object(Bucket="sdtrain-test", Key=f"{run_key}/checkpoint_manager_snapshot.json")["Body"].read()
    except s3.exceptions.NoSuchKey:
        return []
    return [c["checkpoint_dir_name"] for c in json.loads(body)["checkpoint_results"]]


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_job_trains_from_a_bucket_into_a_bucket_is_stopped_and_resubmitted_and_resumes(
    s3_bucket, ray_head, tmp_path, monkeypatch
):
    """`ray job submit` against a cluster that knows the S3 credentials (as from an instance
    role) but not the endpoint: only the job's storage.endpoint_url names it, so it must reach
    Ray Train's controller and workers and Ray Data's read tasks from the driver. The job is
    stopped once a checkpoint is committed; the same command again resumes from the bucket,
    ends at max_steps and exports the model there; generate.py samples from the run's URI."""
    import boto3
    from ray.job_submission import JobStatus, JobSubmissionClient

    address, env = ray_head
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for this process's JobSubmissionClient
    s3 = boto3.client("s3")
    for name, rows, seed in (
        ("train/part-0.parquet", 96, 0),
        ("train/part-1.parquet", 96, 1),
        ("val/part-0.parquet", 16, 2),
    ):
        write_latents(tmp_path / name, rows=rows, seed=seed, row_group_size=32)
        s3.upload_file(str(tmp_path / name), "sdtrain-test", f"data/{name}")
    # The model whose VAE and text encoder the export takes (export.base_model), in the bucket too.
    sd = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    for path in sorted(p for p in (tmp_path / "tiny-sd").rglob("*") if p.is_file()):
        s3.upload_file(str(path), "sdtrain-test", f"models/tiny-sd/{path.relative_to(sd)}")
    run_uri = f"{s3_bucket}/runs/s3job"
    job_args = [
        "python",
        "entrypoints/train.py",
        "eval.class_agreement=false",
        f"data.train={s3_bucket}/data/train",
        f"data.val={s3_bucket}/data/val/",
        f"run.storage_path={s3_bucket}/runs",
        "run.name=s3job",
        f"storage.endpoint_url={os.environ['AWS_ENDPOINT_URL']}",
        "train.max_steps=40",
        "train.global_batch_size=16",
        "checkpoint.every_n_steps=10",
        "run.log_every_n_steps=10",
        "checkpoint.num_to_keep=null",
        "train.ema_start_step=0",
        "sample_grid.steps=4",  # a grid with each checkpoint: drawn, at a fifth of the default's cost
        f"export.base_model={s3_bucket}/models/tiny-sd",
    ]
    client = JobSubmissionClient(address)
    first = f"sdtrain-s3-{os.getpid()}-1"
    _submit(address, env, first, job_args)
    deadline = time.monotonic() + 300
    while not _committed(s3, "runs/s3job"):
        status = client.get_job_status(first)
        assert not status.is_terminal(), (
            f"the job ended ({status}) before a checkpoint was committed:\n" + client.get_job_logs(first)[-4000:]
        )
        assert time.monotonic() < deadline, "no checkpoint committed in 300 s"
        time.sleep(0.2)
    # What `ray job stop` does (ray/dashboard/modules/job/cli.py: stop_job, then the status until it is terminal), from
    # this process: the command's own start took ~10 s on a busy 2-core machine, in which the job trained from its
    # first checkpoint to its end (40 steps), so that there was nothing left to resume.
    assert client.stop_job(first), f"job {first} was no longer running when it was to be stopped"
    deadline = time.monotonic() + 120
    while not client.get_job_status(first).is_terminal():
        assert time.monotonic() < deadline, f"job {first} still running 120 s after it was stopped"
        time.sleep(0.2)  # polling the job's status, as `ray job stop` does
    assert client.get_job_status(first) == JobStatus.STOPPED
    _wait_until_its_trainer_is_gone(client, address, first)
    committed = _committed(s3, "runs/s3job")
    assert "checkpoint_000000040" not in committed, "the job finished before it could be stopped"
    resumed_from = int(committed[-1].split("_")[1])

    second = f"sdtrain-s3-{os.getpid()}-2"
    _submit(address, env, second, job_args)
    logs = _follow(address, env, second)
    assert client.get_job_status(second) == JobStatus.SUCCEEDED, logs[-4000:]
    # The job's ray.init() joined this cluster rather than starting one of its own.
    assert "Started a local Ray instance" not in logs and "Connecting to existing Ray cluster" in logs
    assert f"resumed from step {resumed_from}" in logs
    assert f"final checkpoint: {run_uri}/checkpoint_000000040" in logs
    history = json.loads(
        s3.get_object(Bucket="sdtrain-test", Key="runs/s3job/checkpoint_000000040/history.json")["Body"].read()
    )
    assert [row["step"] for row in history] == [10, 20, 30, 40]
    assert [row["start_step"] for row in history if row["step"] > resumed_from] == [resumed_from] * (
        (40 - resumed_from) // 10
    )
    exported = {o["Key"] for o in s3.list_objects_v2(Bucket="sdtrain-test", Prefix="runs/s3job/export/")["Contents"]}
    assert {
        "runs/s3job/export/unet/config.json",
        "runs/s3job/export/unet/diffusion_pytorch_model.safetensors",
        "runs/s3job/export/scheduler/scheduler_config.json",
        "runs/s3job/export/model_index.json",  # a pipeline, with the base model's VAE and text encoder
        "runs/s3job/export/vae/config.json",
        "runs/s3job/export/text_encoder/config.json",
    } <= exported

    # The export is the final checkpoint's EMA UNet, read back from the bucket.
    from sdtrain.artifacts.loading import load_model

    final, export = load_model(f"{run_uri}/checkpoint_000000040"), load_model(f"{run_uri}/export")
    assert final.weights == "ema"
    exported_state = export.unet.state_dict()
    assert all(torch.equal(tensor, exported_state[name]) for name, tensor in final.unet.state_dict().items())

    generate = subprocess.run(
        [
            sys.executable,
            str(REPO / "entrypoints" / "generate.py"),
            run_uri,
            "--captions",
            f"{s3_bucket}/data/val/",
            "--rows",
            "2",
            "--samples-per-caption",
            "2",
            "--steps",
            "4",
            "--out",
            str(tmp_path / "samples"),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert generate.returncode == 0, generate.stderr[-3000:]
    latents = np.load(tmp_path / "samples" / "latents.npy")
    assert latents.shape == (2, 2, 4, 16, 16) and np.isfinite(latents).all()
