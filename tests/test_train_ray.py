"""The whole job on a real local Ray cluster: 2 workers, checkpoints, reload from a checkpoint, resume."""

import csv
import json
import math
import os
import shutil
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray._private.state
import torch
from conftest import corrupt_row_group, rows_by_step, tiny_config, write_latents
from support.tiny_models import write_tiny_dinov2, write_tiny_sd_model

from sdtrain.artifacts.loading import load_model, read_checkpoint
from sdtrain.config.learning import Columns
from sdtrain.data.horizons import HORIZON_READS_VAR
from sdtrain.data.rows import RowReader
from sdtrain.driver.run import check_run, train
from sdtrain.errors import ConfigError, DataError, TrainingFailed
from sdtrain.model.validation import validation_loss
from sdtrain.storage.run_layout import CHECKPOINT_FILE, DATA_STATE_FILE, HISTORY_FILE, MODEL_FILE, SAMPLES_FILE
from sdtrain.train.checkpointing import run_scratch

pytestmark = pytest.mark.slow  # each test runs Ray Train on a local Ray cluster

LR, WARMUP = 1e-3, 20


def _read_val(path, caption_column, caption_shape, further_ids=()):
    """The validation file's rows, decoded as training decodes them (``further_ids``: SDXL's second tokenizer's)."""
    reader = RowReader(Columns("image_latents_256", caption_column, further_ids), (4, 16, 16), caption_shape)
    (batch,) = reader.batches([str(path)], "data.val")
    return {"latents": batch.latents, "captions": batch.captions}


def _config(tmp_path, max_steps, extra=()):
    return tiny_config(
        *extra,
        f"data.train=[{tmp_path}/train/a.parquet, {tmp_path}/train/b.parquet]",
        f"data.val={tmp_path}/val",
        f"train.lr={LR}",
        f"train.warmup_steps={WARMUP}",
        "scaling.use_gpu=false",
        "checkpoint.every_n_steps=3",
        "run.log_every_n_steps=2",
        "checkpoint.num_to_keep=null",
        "sample_grid.columns=2",  # a grid with each checkpoint: drawn, at a tenth of the default's cost
        "sample_grid.steps=4",
        "run.gpu_hour_cost=3.0",  # a CPU worker's hour, priced: the cost is shown, MFU is not
        f"export.base_model={tmp_path}/tiny-sd",  # the test writes it: the VAE and text encoder of the export
        tmp_path=tmp_path,
        name="two-workers",
        steps=max_steps,
        batch=8,
        workers="[1,2]",  # elastic: starts with what the cluster gives (2 here)
    )


def _checkpoints(run_dir):
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_") and p.is_dir())


def _ray_train_runs(name: str) -> int:
    """How many trainers named ``name`` Ray Train has started in this Ray session, from its own state actor
    (recording while RAY_TRAIN_ENABLE_STATE_TRACKING=1 when a trainer is built)."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    return 0 if actor is None else sum(run.name == name for run in ray.get(actor.get_train_runs.remote()).values())


@pytest.mark.timeout(400)
def test_two_worker_run_checkpoints_reloads_and_resumes(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # Ray Train records each trainer it starts
    trainers_before = _ray_train_runs("two-workers")
    # Ray tensor columns for training (the Anyscale template's), flat float32 lists for validation.
    write_latents(tmp_path / "train/a.parquet", rows=24, encoding="tensor", seed=1)
    write_latents(tmp_path / "train/b.parquet", rows=24, encoding="tensor", seed=2)
    write_latents(tmp_path / "val/v.parquet", rows=12, encoding="list", dtype="float32", seed=3)
    run_dir = tmp_path / "runs" / "two-workers"
    # Checkpoint evaluation with a DINOv2 model whose weights are broken: each evaluation fails in its own task,
    # says why, and training is not disturbed.
    broken = write_tiny_dinov2(str(tmp_path / "broken-dinov2"))
    for weights in (tmp_path / "broken-dinov2").glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    sd = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    evaluation = [f"eval.dinov2={broken}", f"eval.vae={sd}", "eval.num_samples=2", "eval.num_cpus=0"]

    launched = time.time()
    summary = train(_config(tmp_path, max_steps=6, extra=evaluation))
    run_seconds = time.time() - launched

    assert summary.final_step == 6
    assert summary.checkpoint_path == str(run_dir / "checkpoint_000000006")
    assert _checkpoints(run_dir) == ["checkpoint_000000003", "checkpoint_000000006"]
    for name in _checkpoints(run_dir):
        files = [CHECKPOINT_FILE, DATA_STATE_FILE, HISTORY_FILE, MODEL_FILE]
        assert sorted(p.name for p in (run_dir / name).iterdir()) == sorted(files)
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 3, 4, 6]  # a row per report: logs at 2, 4, 6; checkpoint at 3
    assert all(float(r["loss"]) > 0 for r in rows)
    assert [bool(r["val_loss"]) for r in rows] == [False, True, False, True]  # validation with each checkpoint
    assert [r["eval_failed"] for r in rows] == ["", "1.0", "", "1.0"]  # both checkpoints' evaluations failed
    assert "Error" in json.loads((run_dir / "evaluation" / "step_3.json").read_text())["error"]
    assert all(0 <= float(r["data_wait_fraction"]) < 1 for r in rows)
    assert all(0 < float(r["grad_norm"]) <= float(r["grad_norm_max"]) < float("inf") for r in rows)
    # One worker group: the same launch-to-first-step time in every row, within the run's duration.
    assert (
        len({r["time_to_first_step_s"] for r in rows}) == 1 and 0 < float(rows[0]["time_to_first_step_s"]) < run_seconds
    )
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # CPU workers: their hours, named worker_hours, and the cost of a million images at each window's rate on 2
    # workers at 3.0 an hour; no MFU column, never a made-up one. The summary totals the same rows.
    hours = [float(r["worker_hours"]) for r in rows]
    assert 0 < hours[0] < hours[1] < hours[2] < hours[3] < 2 * run_seconds / 3600
    assert "mfu" not in rows[0] and "gpu_hours" not in rows[0]
    for r in rows:
        assert float(r["cost_per_million_images"]) == pytest.approx(2 * 3.0 / (float(r["samples_per_s"]) * 3600) * 1e6)
    totals = summary.totals
    assert (totals.images, totals.hours, totals.on_gpu, totals.mfu) == (48, hours[-1], False, None)
    assert totals.cost == pytest.approx(3.0 * hours[-1])

    # The model comes back from the checkpoint alone and reproduces the validation loss the
    # worker computed with the trained weights: same weights, same outputs.
    loaded = load_model(str(run_dir / "checkpoint_000000006"))
    unet, scheduler, meta = loaded.unet, loaded.noise_scheduler, loaded.meta
    assert loaded.global_step == 6 and meta.latent_shape == (4, 16, 16) and meta.caption_shape == (77, 32)
    assert meta.config["run"]["name"] == "two-workers"
    val = _read_val(tmp_path / "val/v.parquet", "caption_latents", (77, 32))
    batches = [{k: torch.from_numpy(v[i : i + 4]) for k, v in val.items()} for i in range(0, 12, 4)]
    assert validation_loss(unet, scheduler, batches, seed=0) == pytest.approx(float(rows[-1]["val_loss"]), rel=1e-5)

    # A checkpoint directory whose write was interrupted (never committed by Ray Train) is
    # ignored, even though its step is the highest on disk.
    (run_dir / "checkpoint_000000099").mkdir()
    (run_dir / "checkpoint_000000099" / CHECKPOINT_FILE).write_bytes(b"truncated")

    # Same name and storage: the run resumes from step 6 with its optimizer and LR schedule.
    summary = train(_config(tmp_path, max_steps=9))
    assert summary.final_step == 9
    assert _checkpoints(run_dir) == [
        "checkpoint_000000003",
        "checkpoint_000000006",
        "checkpoint_000000009",
        "checkpoint_000000099",
    ]
    history = json.loads((run_dir / "checkpoint_000000009" / HISTORY_FILE).read_text())
    assert [row["step"] for row in history] == [2, 3, 4, 6, 8, 9]
    assert history[4]["lr"] == pytest.approx(LR * 8 / WARMUP)  # warmup continued, not restarted
    assert history[4]["worker_hours"] > history[3]["worker_hours"] == hours[-1]  # so did the hours
    assert summary.totals.images == 72 and summary.totals.hours == history[-1]["worker_hours"]

    # Re-running the finished run (a retry after training ended), or with a lowered train.max_steps,
    # trains nothing and starts no worker: it names the final checkpoint, and writes the export only
    # if it is missing.
    export_info = run_dir / "export" / "sdtrain.json"
    written = export_info.stat().st_mtime_ns
    (run_dir / "metrics.csv").unlink()
    # Ray Train's own record of the trainers it started: the two above.
    assert _ray_train_runs("two-workers") == trainers_before + 2
    for max_steps in (9, 7):
        again = train(_config(tmp_path, max_steps=max_steps))
        assert (again.final_step, again.checkpoint_path) == (9, summary.checkpoint_path)
        assert again.totals == summary.totals  # from the final checkpoint's rows
    assert _checkpoints(run_dir)[-2:] == ["checkpoint_000000009", "checkpoint_000000099"]
    assert (run_dir / "metrics.csv").exists() and export_info.stat().st_mtime_ns == written
    # Trained on with another model (the EMA turned on, another UNet): refused before Ray starts, naming what changed
    # from the checkpoint's model.json, not in every worker after its download (a spent restart each, before).
    for extra, changed in (
        (["train.ema_decay=0.99"], r"its EMA \(train\.ema_decay was null, now 0\.99\)"),
        (["model.unet={layers_per_block: 2}"], r"its UNet \(model\.unet\)"),
    ):
        with pytest.raises(ConfigError, match=rf"checkpoint_000000009: the run's latest checkpoint .*: {changed}"):
            check_run(_config(tmp_path, max_steps=12, extra=extra))
    assert _ray_train_runs("two-workers") == trainers_before + 2
    shutil.rmtree(run_dir / "export")
    train(_config(tmp_path, max_steps=9))
    assert json.loads(export_info.read_text())["source_checkpoint"] == summary.checkpoint_path
    # Latents made elsewhere, their VAE and text encoder named by export.base_model: the export is a pipeline.
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(run_dir / "export"))
    assert type(pipeline).__name__ == "StableDiffusionPipeline" and (run_dir / "export" / "README.md").is_file()
    assert pipeline("a red fox", num_inference_steps=2, height=32, width=32).images[0].size == (32, 32)
    assert _ray_train_runs("two-workers") == trainers_before + 2  # the finished run started no trainer, no worker

    # A file that grew since the checkpoint: its data position would be replayed against other rows
    # (some twice, some never). Refused before Ray Train starts, saying what changed and what to do.
    write_latents(tmp_path / "train/b.parquet", rows=36, encoding="tensor", seed=5)
    with pytest.raises(DataError, match=r"checkpoint_000000009 \(step 9, epoch 1\) .* data.train has 60 rows, the "):
        train(_config(tmp_path, max_steps=12))
    # Finished, too: a retry that finds other data must not pass the old run off as trained on it.
    with pytest.raises(DataError, match=r"checkpoint_000000009 \(step 9, epoch 1\) .* data.train has 60 rows, the "):
        train(_config(tmp_path, max_steps=9))
    assert _checkpoints(run_dir)[-2:] == ["checkpoint_000000009", "checkpoint_000000099"]


@pytest.mark.timeout(60)
def test_cpu_workers_share_their_cpus_with_their_reads(ray_cluster):
    """Reads take no CPU of their own, so workers may reserve every CPU (2 CPUs: 2 workers at 1 each)."""
    from sdtrain.config.schema import ScalingConfig
    from sdtrain.driver.run import _cpus_per_worker

    assert _cpus_per_worker(ScalingConfig(num_workers=1), use_gpu=False) == 1.0
    assert _cpus_per_worker(ScalingConfig(num_workers=2), use_gpu=False) == 1.0
    assert _cpus_per_worker(ScalingConfig(num_workers=[1, 4]), use_gpu=False) == 0.5
    assert _cpus_per_worker(ScalingConfig(num_workers=2), use_gpu=True) == 1.0
    assert _cpus_per_worker(ScalingConfig(num_workers=2, cpus_per_worker=1.5), use_gpu=False) == 1.5


@pytest.mark.timeout(300)
def test_diverging_run_stops_with_a_clear_error(ray_cluster, tmp_path, run_attempts):
    """Every row but the first is NaN: each step is skipped, and after max_bad_steps the run stops."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import column

    latents = np.full((32, 4, 16, 16), np.nan, np.float32)
    latents[0] = 0.0  # the pre-flight check reads the first row
    captions = np.zeros((32, 77, 32), np.float32)
    pq.write_table(
        pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")}),
        tmp_path / "nan.parquet",
    )
    config = tiny_config(
        f"data.train={tmp_path}/nan.parquet",
        "train.max_nonfinite_steps=3",
        "run.log_every_n_steps=4",
        "failure.max_failures=2",
        "export.enabled=false",  # latents that name no VAE: no pipeline to export,
        tmp_path=tmp_path,
        name="nan",
        steps=20,
        batch=8,
        workers=1,
    )
    with pytest.raises(TrainingFailed) as failure:
        train(config)
    assert run_attempts("nan") == 1  # retries would diverge the same way: none are spent
    message = str(failure.value)
    assert (
        "4 consecutive optimizer steps up to step 4 had NaN/inf gradients and were skipped "
        "(train.max_nonfinite_steps=3)" in message
    )
    assert "no checkpoint was written" in message
    assert not os.path.exists(run_scratch(config, config.run.directory))  # a failed fit's staging goes too


def _ids_config(tmp_path, name, max_steps, workers, *extra):
    return tiny_config(
        f"data.train={tmp_path}/train",
        "train.micro_batch_size=2",
        "data.shuffle_chunk_rows=5",
        "data.shuffle_window_rows=12",
        "checkpoint.every_n_steps=3",
        "run.log_every_n_steps=3",
        "checkpoint.num_to_keep=null",
        "checkpoint.record_rows=true",
        "export.enabled=false",  # latents that name no VAE: no pipeline to export,
        *extra,
        tmp_path=tmp_path,
        name=name,
        steps=max_steps,
        batch=8,
        workers=workers,
    )


def _trained_ids(run_dir):
    """The rows of every optimizer step in step order (global batch 8), each step's ranks in rank order."""
    recorded = [np.load(run_dir / name / SAMPLES_FILE) for name in _checkpoints(run_dir)]
    return np.concatenate(rows_by_step(recorded, global_batch=8))


@pytest.mark.timeout(900)
def test_every_sample_once_per_epoch_across_a_restart_and_bitwise_resume(
    ray_cluster, tmp_path, monkeypatch, run_attempts, capfd
):
    """96 rows, 8 per step: one epoch = 12 steps, micro-batches of 2 accumulated 2 on each of 2 workers.

    A: 12 steps straight, one dataset a rank. B: 5 steps (stopping inside a shuffle window), then resumed to 12, each
    rank's stream a chain of datasets of 3 steps each (sdtrain.data.horizons; after the resume they cut windows): the
    same rows in the same order as A, and bitwise the same weights. A resume mid-epoch at another world size, every
    row once, is test_elastic's (2 workers, 1, 2 again) and test_buckets' (bucketed data).
    """
    write_latents(tmp_path / "train/a.parquet", rows=40, seed=1, row_group_size=8)
    write_latents(tmp_path / "train/b.parquet", rows=56, seed=2, row_group_size=8)
    every_row = list(range(96))

    train(_ids_config(tmp_path, "a", 12, 2))
    # Once fit ended, the run's staging went from every node (sdtrain.driver.staging_cleanup): here, its workers'
    # emptied directories.
    straight_config = _ids_config(tmp_path, "a", 12, 2)
    assert not os.path.exists(run_scratch(straight_config, straight_config.run.directory))
    # One thread a 1-CPU worker, as Ray sets it: an in-process fit of an earlier test left OMP_NUM_THREADS=2 to the
    # session's cluster (conftest.THREAD_ENV), and two workers on 2 cores trained 3-4x slower.
    assert "; 1 torch thread(s) per worker" in capfd.readouterr().err
    straight = _trained_ids(tmp_path / "runs/a")
    assert sorted(straight) == every_row
    assert not np.array_equal(straight, every_row)  # shuffled

    monkeypatch.setenv(HORIZON_READS_VAR, "1")  # a read task a horizon: 12-row windows, 4 rows a rank a step
    train(_ids_config(tmp_path, "b", 5, 2))
    saved = json.loads((tmp_path / "runs/b/checkpoint_000000005" / DATA_STATE_FILE).read_text())
    assert (saved["step"], saved["data"]) == (5, {"epoch": 0, "segments": [[2, 20]]})
    # What the position refers to, checked when the run resumes (at another world size: not part of it).
    assert (saved["plan"]["files"], saved["plan"]["rows"], saved["plan"]["chunk_rows"]) == (2, 96, 5)

    summary = train(_ids_config(tmp_path, "b", 12, 2))
    assert summary.final_step == 12
    assert run_attempts("b") == 1  # each rank went on to its next horizon itself: no restart did
    resumed = _trained_ids(tmp_path / "runs/b")
    assert np.array_equal(resumed, straight)  # the same rows in the same order
    weights_a = read_checkpoint(str(tmp_path / "runs/a/checkpoint_000000012"))["state_dict"]
    weights_b = read_checkpoint(str(tmp_path / "runs/b/checkpoint_000000012"))["state_dict"]
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)  # bitwise
    assert json.loads((tmp_path / "runs/b/checkpoint_000000012" / DATA_STATE_FILE).read_text())["data"] == {
        "epoch": 1,
        "segments": [],
    }
    # Every run's placement-group cleaner was sdtrain's (test_placement_group_guard), never Ray's own: Ray's took
    # an empty state-API answer for a dead controller and removed this test's live workers' group in a CI run.
    cleaners = [a["ActorClassName"] for a in ray._private.state.actors().values() if "Cleaner" in a["ActorClassName"]]
    assert len(cleaners) >= 3 and set(cleaners) == {"GuardedPlacementGroupCleaner"}, cleaners


@pytest.mark.timeout(300)
def test_an_unreadable_file_fails_the_run_at_once_naming_it(ray_cluster, tmp_path, run_attempts):
    write_latents(tmp_path / "train/good.parquet", rows=32, seed=1)
    write_latents(tmp_path / "train/bad.parquet", rows=32, seed=2, row_group_size=16)
    corrupt_row_group(tmp_path / "train/bad.parquet", 1)  # the first row, read before the run, is fine
    config = tiny_config(
        f"data.train={tmp_path}/train",
        "failure.max_failures=3",
        "export.enabled=false",  # latents that name no VAE: no pipeline to export,
        tmp_path=tmp_path,
        name="corrupt",
        steps=8,
        batch=8,
        workers=1,
    )
    with pytest.raises(TrainingFailed) as failure:
        train(config)
    assert run_attempts("corrupt") == 1  # a damaged file stays damaged: no restart is spent on it
    message = str(failure.value)
    assert f"data.train: {tmp_path}/train/bad.parquet: rows " in message
    assert "cannot be read" in message and "data.on_read_error=skip" in message
    # Training on without the damaged rows (data.on_read_error=skip): the bf16 test's run, on 2 ranks.


def _rows_with_a_nan(path, rows, nan_row, seed, text_encoder=None):
    """``rows`` rows whose ``nan_row`` holds a NaN latent; ``text_encoder``: captions as its token ids (random, in its
    vocabulary, in caption_ids), else embeddings."""
    latents, captions = write_latents(path, rows=rows, dtype="float32", seed=seed)
    latents[nan_row, 0, 0, 0] = np.nan  # row 0 stays finite: the pre-flight check reads it
    import pyarrow as pa
    from conftest import column, token_id_table

    if text_encoder is not None:
        pq.write_table(token_id_table(latents, text_encoder, seed), path)
        return
    pq.write_table(
        pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")}), path
    )


@pytest.mark.timeout(400)
def test_bf16_with_clipping_and_ema_skips_a_nan_step_on_both_ddp_ranks_and_trains_past_an_unreadable_row_group(
    ray_cluster, tmp_path
):
    """What train.precision: auto runs on every GPU (bf16-mixed, clipping at 1.0 by default, the fused AdamW), with an
    EMA, on 2 DDP workers, over 64 rows (one epoch of 8 steps): one NaN row, so one step is skipped on both ranks (the
    reporter checks that they agree); and a damaged row group of 16 rows in another file, trained on without under
    data.on_read_error=skip, each rank counting its own skipped rows (DDP no longer overwrites them with rank 0's).
    Resuming bf16 runs: the FSDP test. The same damage failing a run at once: the unreadable-file test."""
    _rows_with_a_nan(tmp_path / "train/a.parquet", rows=32, nan_row=13, seed=5)
    latents, captions = write_latents(tmp_path / "train/b.parquet", rows=32, dtype="float32", seed=6)
    import pyarrow as pa
    from conftest import column

    table = pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")})
    pq.write_table(table, tmp_path / "train/b.parquet", row_group_size=16)
    corrupt_row_group(tmp_path / "train/b.parquet", 1)  # the first row, read before the run, is fine
    config = tiny_config(
        f"data.train={tmp_path}/train",
        "train.precision=bf16-mixed",
        "train.ema_decay=0.9",
        "data.on_read_error=skip",
        "checkpoint.every_n_steps=4",
        "run.log_every_n_steps=1",
        "checkpoint.num_to_keep=null",
        "export.enabled=false",  # latents that name no VAE: no pipeline to export,
        tmp_path=tmp_path,
        name="bf16",
        steps=8,
        batch=8,
        workers=2,
    )
    assert train(config).final_step == 8
    history = json.loads((tmp_path / "runs/bf16/checkpoint_000000008" / HISTORY_FILE).read_text())
    assert [row["step"] for row in history] == list(range(1, 9))
    assert sum(row["skipped_steps"] for row in history) == 1  # the NaN row's, once in the epoch
    assert sum(row["skipped_samples"] for row in history) == 16  # the damaged row group, each row once
    # A report every step: the skipped step's window has only its NaN loss, every other a finite one.
    assert [math.isfinite(row["loss"]) for row in history] == [row["skipped_steps"] == 0 for row in history]
    state = read_checkpoint(str(tmp_path / "runs/bf16/checkpoint_000000008"))["state_dict"]
    assert any(k.startswith("ema_unet.") for k in state) and all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.timeout(400)
def test_fsdp_on_two_cpu_workers_validates_with_its_ema_and_resumes_on_one(ray_cluster, tmp_path):
    """The tiny SDXL layout (model.preset=tiny-sdxl: two text encoders, pooled text and size conditioning) under
    FSDP2 over gloo, bf16 with clipping: weights, optimizer state and EMA sharded over 2 workers,
    validation run by both, a NaN row's step skipped on both (their gradients are sharded: the norm
    is all-reduced), checkpoints in DDP's format (one full file); resumed at world size 1. The captions are
    both tokenizers' ids: each worker encodes them with its own whole copy of the two frozen text encoders, which
    FSDP leaves alone and no checkpoint holds. Evaluation and grids sample with the pooled embeddings; the export is
    a StableDiffusionXLPipeline that answers a prompt at a non-square size."""
    from diffusers import DiffusionPipeline, StableDiffusionXLPipeline
    from support.tiny_models import write_tiny_sdxl_model

    from sdtrain.model.conditioning import Conditioner
    from sdtrain.model.token_captions import CaptionEncoder

    text_encoder = write_tiny_sdxl_model(str(tmp_path / "tiny-sdxl"))
    dinov2 = write_tiny_dinov2(str(tmp_path / "dinov2"))
    _rows_with_a_nan(tmp_path / "train/a.parquet", rows=32, nan_row=13, seed=6, text_encoder=text_encoder)
    latents, _ = write_latents(tmp_path / "val/v.parquet", rows=8, dtype="float32", seed=7)
    from conftest import token_id_table

    pq.write_table(token_id_table(latents, text_encoder, seed=7), tmp_path / "val/v.parquet")
    run_dir = tmp_path / "runs" / "fsdp"

    def config(max_steps, workers):
        return tiny_config(
            "model.preset=tiny-sdxl",
            f"data.train={tmp_path}/train",
            f"data.val={tmp_path}/val",
            "data.caption_column=caption_ids",
            "train.strategy=fsdp",
            "train.precision=bf16-mixed",
            "train.ema_decay=0.9",
            "checkpoint.every_n_steps=2",
            "run.log_every_n_steps=2",
            "checkpoint.num_to_keep=null",
            # Every checkpoint evaluated beside training, in a Ray task that reserves no CPU (the workers hold both).
            f"eval.dinov2={dinov2}",
            f"eval.vae={text_encoder}",
            "eval.num_samples=4",
            "eval.num_cpus=0",
            "sample_grid.steps=2",
            f"export.base_model={text_encoder}",  # the data names the text encoder alone: the export needs the VAE
            tmp_path=tmp_path,
            name="fsdp",
            steps=max_steps,
            batch=8,
            workers=workers,
        )

    assert train(config(4, workers=2)).final_step == 4
    history = json.loads((run_dir / "checkpoint_000000004" / HISTORY_FILE).read_text())
    assert [row["step"] for row in history] == [2, 4] and all(math.isfinite(row["val_loss"]) for row in history)
    assert sum(row["skipped_steps"] for row in history) == 1  # one epoch, one NaN row
    # The EMA the ranks kept shard by shard, gathered, reproduces the validation loss they computed.
    loaded = load_model(str(run_dir / "checkpoint_000000004"))
    unet, scheduler = loaded.unet, loaded.noise_scheduler
    assert loaded.weights == "ema" and loaded.meta.config["train"]["strategy"] == "fsdp"
    assert loaded.meta.text_encoder == text_encoder
    saved = torch.load(run_dir / "checkpoint_000000004" / CHECKPOINT_FILE, weights_only=True)
    assert not any("text_model" in key for key in saved["state_dict"])
    val = _read_val(tmp_path / "val/v.parquet", "caption_ids", (154,), ("caption_ids_2",))
    assert val["captions"].dtype == np.int32
    batches = [{k: torch.from_numpy(v[i : i + 4]) for k, v in val.items()} for i in range(0, 8, 4)]
    condition = Conditioner(unet.config, encoder=CaptionEncoder.load(text_encoder, use_gpu=False))
    # Validated under the training step's bf16 autocast (sdtrain.train.device_settings.training_autocast), not in
    # float32 (1e-4 apart here).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = validation_loss(unet, scheduler, batches, seed=0, condition=condition)
    assert under_autocast == pytest.approx(history[-1]["val_loss"], rel=1e-5)
    float32 = validation_loss(unet, scheduler, batches, seed=0, condition=condition)
    assert float32 != pytest.approx(history[-1]["val_loss"], rel=1e-5)

    summary = train(config(8, workers=1))
    assert summary.final_step == 8
    history = json.loads((run_dir / "checkpoint_000000008" / HISTORY_FILE).read_text())
    assert [row["step"] for row in history] == [2, 4, 6, 8] and history[-1]["start_step"] == 4
    assert all(math.isfinite(row["val_loss"]) for row in history)
    assert sum(row["skipped_steps"] for row in history) == 2  # the second epoch's NaN step too

    # Each FSDP checkpoint was evaluated (its token-id captions encoded by the text encoder it names): fd_dinov2 at
    # the checkpoint's own step in metrics.csv, against data.val's reference statistics, computed once for the run
    # and reused by the resumed run's evaluations.
    with open(run_dir / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [2, 4, 6, 8]
    for step in (2, 4, 6, 8):
        assert math.isfinite(float(rows[step]["fd_dinov2"])) and float(rows[step]["fd_dinov2"]) > 0, rows[step]
        assert float(rows[step]["eval_s"]) > 0 and rows[step]["evaluation_asked"] == "1.0"
        result = json.loads((run_dir / "evaluation" / f"step_{step}.json").read_text())
        # ... in the evaluation task, at the lowest CPU priority (sdtrain.evaluation.eval_task)
        assert result["eval_samples"] == 4 and result["cpu_policy"] == "idle"
    assert len(list((run_dir / "evaluation").glob("reference-*.npz"))) == 1

    pipeline = DiffusionPipeline.from_pretrained(str(run_dir / "export"))
    assert isinstance(pipeline, StableDiffusionXLPipeline)
    image = pipeline("a red fox", num_inference_steps=2, height=16, width=24, output_type="np").images
    assert image.shape == (1, 16, 24, 3) and np.isfinite(image).all()
