"""The whole job on a real local Ray cluster: 2 workers, checkpoints, reload from a checkpoint, resume."""

import csv
import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import write_latents
from sdtrain.checkpoint import CHECKPOINT_FILE, HISTORY_FILE, load_model
from sdtrain.config import load_config
from sdtrain.decode import decode_batch
from sdtrain.launch import train
from sdtrain.validation import validation_loss

LR, WARMUP = 1e-3, 20


def _config(tmp_path, max_steps):
    return load_config(
        None,
        [
            f"data.train=[{tmp_path}/train/a.parquet, {tmp_path}/train/b.parquet]",
            f"data.val={tmp_path}/val",
            "model.preset=tiny",
            f"train.max_steps={max_steps}",
            "train.global_batch_size=8",
            f"train.lr={LR}",
            f"train.warmup_steps={WARMUP}",
            "scaling.num_workers=[1,2]",  # elastic: starts with what the cluster gives (2 here)
            "scaling.use_gpu=false",
            f"run.storage_path={tmp_path}/runs",
            "run.name=two-workers",
            "run.checkpoint_every_n_steps=3",
            "run.log_every_n_steps=2",
            "run.num_to_keep=null",
        ],
    )


def _checkpoints(run_dir):
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_") and p.is_dir())


@pytest.mark.timeout(400)
def test_two_worker_run_checkpoints_reloads_and_resumes(ray_cluster, tmp_path):
    # Ray tensor columns for training (the Anyscale template's), flat float32 lists for validation.
    write_latents(tmp_path / "train/a.parquet", rows=24, encoding="tensor", seed=1)
    write_latents(tmp_path / "train/b.parquet", rows=24, encoding="tensor", seed=2)
    write_latents(tmp_path / "val/v.parquet", rows=12, encoding="list", dtype="float32", seed=3)
    run_dir = tmp_path / "runs" / "two-workers"

    summary = train(_config(tmp_path, max_steps=6))

    assert summary.final_step == 6
    assert summary.checkpoint_path == str(run_dir / "checkpoint_000000006")
    assert _checkpoints(run_dir) == ["checkpoint_000000003", "checkpoint_000000006"]
    for name in _checkpoints(run_dir):
        assert sorted(p.name for p in (run_dir / name).iterdir()) == [CHECKPOINT_FILE, HISTORY_FILE]
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 3, 4, 6]  # a row per report: logs at 2, 4, 6; checkpoint at 3
    assert all(float(r["loss"]) > 0 for r in rows)
    assert [bool(r["val_loss"]) for r in rows] == [False, True, False, True]  # validation with each checkpoint
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The model comes back from the checkpoint alone and reproduces the validation loss the
    # worker computed with the trained weights: same weights, same outputs.
    unet, scheduler, meta = load_model(str(run_dir / "checkpoint_000000006"))
    assert meta["global_step"] == 6 and meta["latent_shape"] == [4, 16, 16] and meta["caption_shape"] == [77, 32]
    assert meta["config"]["run"]["name"] == "two-workers"
    val = decode_batch(pq.read_table(tmp_path / "val/v.parquet"), "image_latents_256", "caption_latents", (4, 16, 16), (77, 32))
    batches = [{k: torch.from_numpy(v[i : i + 4]) for k, v in val.items()} for i in range(0, 12, 4)]
    assert validation_loss(unet, scheduler, batches, seed=0) == pytest.approx(float(rows[-1]["val_loss"]), rel=1e-5)

    # Same name and storage: the run resumes from step 6 with its optimizer and LR schedule.
    summary = train(_config(tmp_path, max_steps=9))
    assert summary.final_step == 9
    assert _checkpoints(run_dir) == ["checkpoint_000000003", "checkpoint_000000006", "checkpoint_000000009"]
    history = json.loads((run_dir / "checkpoint_000000009" / HISTORY_FILE).read_text())
    assert [row["step"] for row in history] == [2, 3, 4, 6, 8, 9]
    assert history[4]["lr"] == pytest.approx(LR * 8 / WARMUP)  # warmup continued, not restarted


@pytest.mark.timeout(60)
def test_cpu_workers_always_leave_ray_data_a_cpu(ray_cluster):
    """2 CPUs and 2 workers at 1 CPU each would starve Ray Data and hang: auto never does that."""
    from sdtrain.config import ScalingConfig
    from sdtrain.errors import ConfigError
    from sdtrain.launch import _cpus_per_worker

    assert _cpus_per_worker(ScalingConfig(num_workers=1), use_gpu=False) == 1.0
    assert _cpus_per_worker(ScalingConfig(num_workers=2), use_gpu=False) == 0.5
    assert _cpus_per_worker(ScalingConfig(num_workers=[1, 4]), use_gpu=False) == 0.25
    assert _cpus_per_worker(ScalingConfig(num_workers=2), use_gpu=True) == 1.0
    with pytest.raises(ConfigError, match=r"scaling\.cpus_per_worker: 1 x 2 worker\(s\) reserves more than 1 of the cluster's 2 CPUs, leaving Ray Data no CPU"):
        _cpus_per_worker(ScalingConfig(num_workers=2, cpus_per_worker=1.0), use_gpu=False)


@pytest.mark.timeout(300)
def test_diverging_run_stops_with_a_clear_error(ray_cluster, tmp_path):
    """Every row but the first is NaN: each step is skipped, and after max_bad_steps the run stops."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import column
    from sdtrain.errors import TrainingFailed

    latents = np.full((32, 4, 16, 16), np.nan, np.float32)
    latents[0] = 0.0  # the pre-flight check reads the first row
    captions = np.zeros((32, 77, 32), np.float32)
    pq.write_table(pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")}), tmp_path / "nan.parquet")
    config = load_config(None, [
        f"data.train={tmp_path}/nan.parquet", "model.preset=tiny", "train.max_steps=20", "train.global_batch_size=8",
        "train.max_bad_steps=3", "scaling.num_workers=1", f"run.storage_path={tmp_path}/runs", "run.name=nan",
        "run.log_every_n_steps=4", "failure.max_failures=0",
    ])
    with pytest.raises(TrainingFailed) as failure:
        train(config)
    message = str(failure.value)
    assert "4 consecutive optimizer steps up to step 4 had NaN/inf gradients and were skipped (train.max_bad_steps=3)" in message
    assert "no checkpoint was written" in message


@pytest.mark.timeout(400)
def test_a_killed_worker_is_restarted_and_the_run_ends_exactly_at_max_steps(ray_cluster, tmp_path):
    """SIGKILL (no polite exception) of a training worker once the first checkpoint is committed,
    with 20 steps still to go (tiny steps take well under a second: far fewer would finish first)."""
    import os
    import signal
    import threading
    import time

    import psutil

    write_latents(tmp_path / "train/a.parquet", rows=64, encoding="list", seed=4)
    run_dir = tmp_path / "runs" / "killed"
    config = load_config(None, [
        f"data.train={tmp_path}/train", "model.preset=tiny", "train.max_steps=24", "train.global_batch_size=8",
        "scaling.num_workers=2", f"run.storage_path={tmp_path}/runs", "run.name=killed",
        "run.checkpoint_every_n_steps=4", "run.log_every_n_steps=2", "run.num_to_keep=null", "failure.max_failures=2",
    ])
    killed = []

    def committed_checkpoints():
        # Ray Train's own record of committed checkpoints: files on disk alone may be a checkpoint
        # still being reported, which a restart rightly ignores.
        try:
            snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        except (OSError, ValueError):
            return []
        return [c["checkpoint_dir_name"] for c in snapshot["checkpoint_results"]]

    def kill_a_worker_after_the_first_checkpoint():
        deadline = time.monotonic() + 240
        while not committed_checkpoints():
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        for process in psutil.process_iter(["pid", "cmdline"]):
            if "RayTrainWorker" in " ".join(process.info["cmdline"] or []):
                os.kill(process.info["pid"], signal.SIGKILL)
                killed.append(process.info["pid"])
                return

    killer = threading.Thread(target=kill_a_worker_after_the_first_checkpoint)
    killer.start()
    summary = train(config)
    killer.join()

    assert killed, "no RayTrainWorker process was found to kill"
    assert not psutil.pid_exists(killed[0])
    assert summary.final_step == 24
    history = json.loads((run_dir / "checkpoint_000000024" / HISTORY_FILE).read_text())
    # Steps after the checkpoint the restart resumed from were dropped with the state they described.
    assert [row["step"] for row in history] == list(range(2, 25, 2))
    restarted = [row for row in history if row["start_step"] > 0]
    assert restarted and restarted[0]["start_step"] % 4 == 0 and restarted[0]["step"] == restarted[0]["start_step"] + 2
