"""Aspect-ratio buckets end to end: the buckets and where an image goes (pure), bucketed files as preprocessing writes
them checked, indexed and read back one bucket a block, a real Ray run stopped mid-epoch and resumed on another number
of workers reading exactly the global steps the plan names. A compiled UNet over three buckets is trained with the
shipped GPU configs' options in tests/test_options.py (one compiled fit for both)."""

import csv
import json
import os

import numpy as np
import pytest
from conftest import tiny_config

from sdtrain.config.learning import Columns
from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.dataset_index import index_dataset
from sdtrain.data.index_format import read_index, run_index_uri
from sdtrain.data.metadata import BUCKET_SHAPES
from sdtrain.data.read_order import DataState
from sdtrain.data.rows import RowReader
from sdtrain.errors import DataError
from sdtrain.preprocess.buckets import aspect_buckets, place
from sdtrain.preprocess.outputs import parquet_bytes, shard_table

COLUMNS = Columns("image_latents_256", "caption_latents")
SHAPES = [[4, 16, 16], [4, 12, 20], [4, 20, 12]]  # the tiny UNet halves a side once: every side even


def test_buckets_are_about_the_area_in_multiples_of_the_step_and_an_image_goes_to_its_ratio():
    for resolution, step in ((1024, 64), (512, 64), (256, 32), (32, 8)):
        buckets = aspect_buckets(resolution, step, 2.0)
        assert (resolution, resolution) in buckets and len(buckets) >= 3
        assert all(h % step == 0 and w % step == 0 for h, w in buckets)
        assert all(0.9 * resolution**2 <= h * w <= resolution**2 for h, w in buckets)
        assert all(max(h, w) / min(h, w) <= 2.0 for h, w in buckets)
        assert sorted(buckets) == sorted((w, h) for h, w in buckets)  # every bucket's transpose too
    buckets = aspect_buckets(1024, 64, 2.0)
    assert len(buckets) == 11 and buckets[0] == (1408, 704) and buckets[-1] == (704, 1408)
    tall, resized = place(3000, 1000, buckets)  # 3:1, past max_aspect: the tallest bucket, cropped to it
    assert tall.bucket == 0 and resized == (2112, 704) and tall.crop_top_left == (352, 0) and not tall.upscaled
    square, _ = place(800, 800, buckets)
    assert buckets[square.bucket] == (1024, 1024) and square.upscaled and square.original_size == (800, 800)
    wide, _ = place(900, 1600, buckets)  # 16:9: the bucket nearest in log ratio
    assert buckets[wide.bucket] == (768, 1344)


# Every setting the review checked: image.resolution 256-2048, image.bucket_step 8-64, image.max_aspect 1.5-4.
SETTINGS = [(r, s, a) for s in (8, 16, 32, 64) for a in (1.5, 2.0, 3.0, 4.0) for r in range(256, 2049, 64)]
IMAGES = [(1000, w) for w in (200, 333, 499, 500, 501, 577, 666, 700, 750, 800, 875, 950, 999, 1000)]


def test_every_bucket_has_its_transpose_and_a_ratio_of_its_own_and_an_image_and_its_transpose_go_to_transposes():
    """The tall and the wide shapes were thinned each by height on their own: one could lose its height to another
    while its transpose kept its own (229 of these settings; at 1024 px, step 32, a 1:2 image had a 1:2 bucket and a
    2:1 image only 1.91:1), and with small steps buckets of one ratio were kept, the larger never chosen."""
    from sdtrain.preprocess.buckets import nearest_bucket

    for resolution, step, max_aspect in SETTINGS:
        setting = (resolution, step, max_aspect)
        buckets = aspect_buckets(resolution, step, max_aspect)
        assert (resolution, resolution) in buckets and set(buckets) == {(w, h) for h, w in buckets}, setting
        ratios = [h / w for h, w in buckets]
        assert ratios == sorted(set(ratios), reverse=True), setting  # tallest to widest, no ratio twice
        assert all(h % step == 0 and w % step == 0 for h, w in buckets), setting
        assert all(0.9 * resolution**2 <= h * w <= resolution**2 for h, w in buckets), setting
        assert all(max(h, w) / min(h, w) <= max_aspect + 1e-9 for h, w in buckets), setting
        for h, w in IMAGES:
            tall, wide = buckets[nearest_bucket(h, w, buckets)], buckets[nearest_bucket(w, h, buckets)]
            assert tall == wide[::-1], (setting, (h, w), tall, wide)
    assert aspect_buckets(1024, 32, 2.0)[-1] == (736, 1408)  # 1408 x 736's transpose; 704 x 1408 was kept alone
    assert aspect_buckets(512, 8, 2.0)[-1] == (360, 720)  # of 344 x 688, 352 x 704 and 360 x 720, the largest


def _bucketed(directory, files=((0, 14), (1, 9), (2, 7)), seed=0):
    """Parquet files as preprocessing writes bucketed output (its shard_table): rows sorted by bucket, each bucket's
    latents of its shape, the buckets and each file's runs in the schema metadata. ``files``: a file's rows by
    bucket, the n-th file's buckets rotated by n."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {BUCKET_SHAPES: json.dumps(SHAPES), "sdtrain.latent_scaling_factor": "1.0"}
    for n in range(3):
        rows = []
        for bucket, count in files[n:] + files[:n]:
            for _ in range(count):
                latents = rng.standard_normal(SHAPES[bucket]).astype(np.float16)
                rows.append({"latents": latents, "embeddings": rng.standard_normal((8, 32)), "bucket": bucket})
        for i, row in enumerate(rows):
            row |= {"caption": f"row {i}", "key": f"{n}-{i}"}
        rng.shuffle(rows)  # the writer sorts them by bucket
        table = shard_table(rows, {"latents": COLUMNS.latent, "embeddings": COLUMNS.caption}, metadata)
        (directory / f"part-{n}.parquet").write_bytes(parquet_bytes(table, 8))


def test_bucketed_files_are_checked_indexed_and_read_back_a_bucket_at_a_time(tmp_path):
    _bucketed(tmp_path / "data")
    run_index = run_index_uri(str(tmp_path / "run"), "data.train")
    first = index_dataset([str(tmp_path / "data")], "data.train", COLUMNS, 4, 32, run_index)
    spec = first.spec
    assert spec.bucket_shapes == tuple(tuple(s) for s in SHAPES) and spec.num_rows == 90
    assert spec.latent_shape == (4, 16, 16) and spec.largest_latent_shape == (4, 16, 16)
    by_bucket = np.bincount(spec.runs[:, 1], spec.runs[:, 2])
    assert by_bucket.tolist() == [42, 27, 21] and len(spec.runs) == 9  # a run a bucket a file
    # The run's index records the runs: a restart reads no footer and has them all.
    from sdtrain.data.index_format import write_index

    write_index(run_index, first.index)
    again = index_dataset([str(tmp_path / "data")], "data.train", COLUMNS, 4, 32, run_index)
    assert again.stats.footers_read == 0 and np.array_equal(again.spec.runs, spec.runs)
    assert read_index(run_index).runs is not None
    # Read in file order, a batch is one bucket's rows at its shape, whatever the batch size asked.
    reader = RowReader.of(spec, COLUMNS)
    shapes = [batch.latents.shape[1:] for batch in reader.batches(spec.files, "data.val", batch_size=8)]
    assert set(shapes) == {tuple(s) for s in SHAPES} and sum(1 for _ in shapes) >= 9


def test_bucketed_validation_data_is_checked_bucket_by_bucket_not_by_its_most_common_bucket(tmp_path):
    """A data.val of the training data's buckets in other proportions (its most common bucket another) was refused
    as not matching data.train; a bucket of it the UNet cannot take was not checked at all."""
    from sdtrain.driver.data_check import check_data

    _bucketed(tmp_path / "train")
    _bucketed(tmp_path / "val", files=((0, 2), (1, 9), (2, 3)))  # mostly 12 x 20 where training is mostly 16 x 16
    config = tiny_config(f"data.train={tmp_path}/train", f"data.val={tmp_path}/val", tmp_path=tmp_path, batch=8)
    train, val, _ = check_data(config, str(tmp_path / "run"))
    assert val is not None and val.spec.latent_shape != train.spec.latent_shape
    SHAPES.append([4, 15, 16])
    try:
        _bucketed(tmp_path / "odd", files=((0, 14), (1, 9), (3, 7)))
    finally:
        SHAPES.pop()
    odd = tiny_config(f"data.train={tmp_path}/train", f"data.val={tmp_path}/odd", tmp_path=tmp_path, batch=8)
    with pytest.raises(DataError, match=r"^data.val: .*part-0.parquet: bucket 3 holds latents of 15 x 16, which"):
        check_data(odd, str(tmp_path / "run-odd"))
    _bucketed(tmp_path / "wide", files=((1, 9),) * 3)  # one bucket in each file
    one_bucket = tiny_config(f"data.train={tmp_path}/train", f"data.val={tmp_path}/wide", tmp_path=tmp_path, batch=8)
    assert check_data(one_bucket, str(tmp_path / "run-wide"))[1] is not None


def test_a_bucketed_run_resumed_with_another_global_batch_is_refused_or_starts_a_new_epoch(tmp_path):
    """Bucketed data's order is cut in global batches: resumed with another train.global_batch_size, the rest of
    the epoch re-read rows the checkpoint had trained and skipped others, with no check noticing."""
    from sdtrain.data.position import DataPosition, plan_changes

    _bucketed(tmp_path / "data")
    spec = index_dataset([str(tmp_path / "data")], "data.train", COLUMNS, 4, 32).spec
    saved = DataPosition(6, DataState(), _plan(spec, global_batch=16).fingerprint())
    assert plan_changes(saved.plan, _plan(spec, global_batch=16).fingerprint()) == []
    assert plan_changes(saved.plan, _plan(spec, global_batch=32).fingerprint()) == [
        "train.global_batch_size is 32, was 16 (bucketed data's order is cut in global batches)"
    ]
    with pytest.raises(DataError, match=r"train.global_batch_size is 32, was 16"):
        saved.resume(_plan(spec, global_batch=32), "error", "checkpoint_000000006")
    assert saved.resume(_plan(spec, global_batch=32), "new_epoch", "checkpoint_000000006") == (6, DataState(1))


def test_a_run_checkpointed_in_read_order_buckets_1_resumes_in_it_after_the_upgrade(tmp_path):
    """buckets-1 cut a bucket's chunks from its runs laid end to end; buckets-2 cuts them within runs (whole row
    groups). A run whose committed checkpoint was written in buckets-1 resumes in it: the driver's plan, which the
    controller and the workers are sent, reads that order, where the refusal of an order change would have stopped
    it; where the seed changed too, the new epoch is read in the new order. The checkpoint is registered with Ray
    Train's own checkpoint manager, without a cluster (test_snapshot_scores); at train.max_steps, so the driver checks
    its position and loads no weights."""
    from support.log_lines import LogLines
    from test_snapshot_scores import _manager, _report

    from sdtrain.data.position import DataPosition
    from sdtrain.driver.run import check_run

    _bucketed(tmp_path / "data")
    options = [f"data.train={tmp_path}/data", "data.shuffle_chunk_rows=4", "export.enabled=false"]
    run = {"tmp_path": tmp_path, "name": "run", "steps": 3, "batch": 8}
    config = tiny_config(*options, **run)
    fresh = check_run(config)
    assert fresh.committed is None and fresh.plan.order == "buckets-2"
    old = fresh.plan.resumed_as({"order": "buckets-1"})
    _report(tmp_path / "runs", _manager(tmp_path / "runs", "loss"), 3, {"step": 3, "loss": 1.0})
    checkpoint = tmp_path / "runs" / "run" / "checkpoint_00000003"
    DataPosition(3, old.advance(DataState(), 1, 8, 3), old.fingerprint()).write(str(checkpoint))

    with LogLines() as lines:
        resumed = check_run(config)
    assert resumed.resume_step == 3 and resumed.plan.order == "buckets-1"
    assert resumed.plan.fingerprint() == old.fingerprint()
    assert [line for line in lines.messages if "read order" in line] == [
        f"data.train: resuming in read order buckets-1, the one {checkpoint} was written in; a new run reads "
        "buckets-2, whose chunks are whole row groups of the files preprocessing writes (docs/data.md)"
    ]
    # Where the rest changed too, the position does not resume as it was whichever the order: a new epoch, read in
    # the new order.
    reseeded = check_run(tiny_config(*options, "train.seed=1", "data.on_resume_change=new_epoch", **run))
    assert reseeded.plan.order == "buckets-2" and reseeded.resume_step == 3
    # The two orders differ on these files (runs of 14, 9 and 7 rows, 4-row chunks).
    windows = [old.rank_stretches(DataState(), 1, 8, 10)[0], fresh.plan.rank_stretches(DataState(), 1, 8, 10)[0]]
    rows = [[old.sample_indices(w) for s in windows[0] for w in old.windows(s)]]
    rows.append([fresh.plan.sample_indices(w) for s in windows[1] for w in fresh.plan.windows(s)])
    assert not all(np.array_equal(a, b) for a, b in zip(*rows, strict=True))


def test_a_run_on_auto_bucket_steps_keeps_its_checkpoints_turns_when_its_workers_change(tmp_path):
    """data.bucket_steps: auto picks the turns from the most workers (4 workers of 2 rows of 4-row chunks: turns of
    2 steps). Resumed with 1 worker, where auto would pick 1, the run keeps its checkpoint's turns and says so; set
    to 1, the change is refused as one of the read order (data.on_resume_change: fail). Without Ray, as above."""
    from support.log_lines import LogLines
    from test_snapshot_scores import _manager, _report

    from sdtrain.data.position import DataPosition
    from sdtrain.driver.run import check_run

    _bucketed(tmp_path / "data")
    options = [f"data.train={tmp_path}/data", "data.shuffle_chunk_rows=4", "export.enabled=false"]
    run = {"tmp_path": tmp_path, "name": "run", "steps": 3, "batch": 8}
    fresh = check_run(tiny_config(*options, **run, workers=4))
    assert fresh.committed is None and fresh.plan.bucket_steps == 2
    assert check_run(tiny_config(*options, **(run | {"name": "one"}), workers=1)).plan.bucket_steps == 1
    _report(tmp_path / "runs", _manager(tmp_path / "runs", "loss"), 3, {"step": 3, "loss": 1.0})
    checkpoint = tmp_path / "runs" / "run" / "checkpoint_00000003"
    DataPosition(3, fresh.plan.advance(DataState(), 4, 2, 3), fresh.plan.fingerprint()).write(str(checkpoint))

    with LogLines() as lines:
        resumed = check_run(tiny_config(*options, **run, workers=1))
    assert resumed.resume_step == 3 and resumed.plan.fingerprint() == fresh.plan.fingerprint()
    assert [line for line in lines.messages if "data.bucket_steps=auto: resuming" in line] == [
        f"data.bucket_steps=auto: resuming in turns of 2 step(s) of one bucket, the ones {checkpoint} was written "
        "in; a new run on these workers would take 1. To take them now, from the next epoch: data.bucket_steps=1 "
        "data.on_resume_change=new_epoch (the rest of this epoch's rows are not read)"
    ]
    with pytest.raises(DataError, match=r"data.bucket_steps is 1, was 2"):
        check_run(tiny_config(*options, "data.bucket_steps=1", **run, workers=1))
    # What the line says to do: the weights resume, the next epoch is read in the new turns.
    switched = check_run(
        tiny_config(*options, "data.bucket_steps=1", "data.on_resume_change=new_epoch", **run, workers=1)
    )
    assert switched.resume_step == 3 and switched.plan.bucket_steps == 1


def test_validation_splits_a_block_of_several_buckets_into_batches_of_one_shape(tmp_path):
    """Ray Data joins a validation read task's per-bucket batches into one block, whose latents are then an array of
    arrays: converted whole to tensors, the first validation of every bucketed run with data.val failed."""
    from sdtrain.train.worker import one_shape_batches

    _bucketed(tmp_path / "val")
    spec = index_dataset([str(tmp_path / "val")], "data.val", COLUMNS, 4, 32).spec
    runs = [batch.arrays() for batch in RowReader.of(spec, COLUMNS).file_batches(spec.files[0], "data.val")]
    ragged = np.empty(sum(len(run["latents"]) for run in runs), dtype=object)
    ragged[:] = [row for run in runs for row in run["latents"]]  # as a block of several shapes reaches numpy
    block = {"latents": ragged, "captions": np.concatenate([run["captions"] for run in runs])}
    batches = list(one_shape_batches(block, micro=4))
    assert [len(b["latents"]) for b in batches] == [4, 4, 4, 2, 4, 4, 1, 4, 3]  # 14, 9 and 7 rows, 4 at most
    assert all(b["latents"].ndim == 4 and b["captions"].shape == (len(b["latents"]), 8, 32) for b in batches)
    assert [tuple(batches[i]["latents"].shape[1:]) for i in (0, 4, 7)] == [tuple(s) for s in SHAPES]
    torch_rows = np.concatenate([b["latents"].reshape(len(b["latents"]), -1)[:, 0].numpy() for b in batches])
    np.testing.assert_array_equal(torch_rows, [row.reshape(-1)[0] for row in ragged])  # every row once, in order
    one_shape = {"latents": np.stack(ragged[:14]), "captions": block["captions"][:14]}  # one bucket: plain arrays
    assert [len(b["latents"]) for b in one_shape_batches(one_shape, micro=4)] == [4, 4, 4, 2]


def test_a_bucket_the_unet_cannot_take_is_refused_before_ray_naming_the_file_and_bucket(tmp_path):
    from sdtrain.driver.data_check import check_data

    _bucketed(tmp_path / "data")
    config = tiny_config(f"data.train={tmp_path}/data", tmp_path=tmp_path, batch=8)
    assert check_data(config, str(tmp_path / "run"))[0].spec.bucket_shapes is not None
    odd = tmp_path / "odd"
    SHAPES.append([4, 15, 16])
    try:
        _bucketed(odd, files=((0, 14), (1, 9), (3, 7)))
    finally:
        SHAPES.pop()
    config = tiny_config(f"data.train={odd}", tmp_path=tmp_path, batch=8, name="odd")
    with pytest.raises(DataError, match=r"data.train: .*part-0.parquet: bucket 3 holds latents of 15 x 16, which"):
        check_data(config, str(tmp_path / "run-odd"))


def _plan(spec, global_batch=8):
    return BucketPlan(spec.rows_per_file, spec.runs, spec.bucket_shapes, 0, 5, global_batch, 12)


@pytest.mark.slow  # two Ray Train runs
@pytest.mark.timeout(900)
def test_a_bucketed_run_killed_mid_epoch_and_resumed_on_another_number_of_workers_reads_the_uninterrupted_steps(
    ray_cluster, tmp_path
):
    """90 rows in three buckets, 8 a step, in turns of 2 steps of one bucket (data.bucket_steps, 4-row chunks: each
    step takes 2 rows of every lane of 4): an epoch is 2 + 1 + 1 turns, 8 steps, the buckets' remainders carried into
    the next. train.py on 2 workers (micro-batches of 2, accumulating 2) in a process of its own, SIGKILLed with the
    Ray it started once its checkpoint of step 5 is committed (mid-epoch, mid-turn), then resumed to 13 on 1 worker
    (accumulating 4): every step's rows are the ones the plan names for an uninterrupted run, each turn one
    bucket's."""
    import subprocess
    import sys

    from conftest import REPO, rows_by_step
    from support.deprecations import pythonwarnings
    from support.ray_processes import kill_at_first_checkpoint
    from test_train_ray import _checkpoints

    from sdtrain.driver.run import train
    from sdtrain.storage.run_layout import SAMPLES_FILE

    _bucketed(tmp_path / "train")
    keys = [
        f"data.train={tmp_path}/train",
        "train.micro_batch_size=2",
        "data.shuffle_chunk_rows=4",
        "data.bucket_steps=2",
        "data.shuffle_window_rows=12",
        "checkpoint.every_n_steps=5",
        "run.log_every_n_steps=5",
        "checkpoint.num_to_keep=null",
        "checkpoint.record_rows=true",
        "export.enabled=false",  # latents that name no VAE and text encoder: no pipeline to export
        "sample_grid.every_n_steps=1000",  # no grid to wait on between the checkpoint and the kill
    ]
    run_dir = tmp_path / "runs" / "buckets"
    (tmp_path / "tiny.yaml").write_text("model:\n  preset: tiny\n")  # the code's defaults, as tiny_config's
    command = [sys.executable, str(REPO / "entrypoints" / "train.py"), "--config", str(tmp_path / "tiny.yaml"), *keys]
    command += [f"run.storage_path={tmp_path}/runs", "run.name=buckets", "train.max_steps=13"]
    command += ["train.global_batch_size=8", "scaling.num_workers=2"]
    # RAY_ADDRESS=local: a Ray of its own, which the kill takes down with it (as when a job's head node dies).
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO / "src"), "PYTHONWARNINGS": pythonwarnings()}
    driver = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    committed, _, _ = kill_at_first_checkpoint(driver, run_dir, 240)
    assert committed == ["checkpoint_000000005"]  # killed mid-epoch (10 steps), ~5 steps before the next

    # Validated on bucketed data too, a block of several buckets at a time: that used to fail at the first validation.
    val = [f"data.val={tmp_path}/train", "run.val_every_n_steps=5"]
    summary = train(tiny_config(*keys, *val, tmp_path=tmp_path, name="buckets", steps=13, batch=8, workers=1))
    assert summary.final_step == 13
    with open(run_dir / "metrics.csv") as f:
        validated = [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r.get("val_loss")]
    assert [step for step, _ in validated] == [10, 13] and all(0 < loss < 10 for _, loss in validated)
    recorded = [np.load(run_dir / name / SAMPLES_FILE) for name in _checkpoints(run_dir)]
    steps = rows_by_step(recorded, global_batch=8)
    spec = index_dataset([str(tmp_path / "train")], "data.train", COLUMNS, 4, 32).spec
    plan = BucketPlan(spec.rows_per_file, spec.runs, spec.bucket_shapes, 0, 4, 8, 12, bucket_steps=2)
    assert plan.steps_in_epoch(0) == 8
    expected = []
    for stretch in plan.rank_stretches(DataState(), 1, 8, 13)[0]:
        expected += [plan.sample_indices(w) for w in plan.windows(stretch)]
    expected = [block for w in expected for block in np.split(w, len(w) // 8)]
    assert len(steps) == 13
    for got, want in zip(steps, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    bucket_of = np.repeat(spec.runs[:, 1], spec.runs[:, 2])  # rows of each file are its runs in order
    # One bucket a turn (steps 0-1, 2-3, ...; the second epoch's from step 8), so a step and a micro-batch.
    assert all(len(set(bucket_of[np.concatenate(steps[t : t + 2])])) == 1 for t in range(0, 13, 2))
    # The first epoch, across the resize: 64 of the 90 rows, none twice, none padded; each bucket's remainder (42 =
    # 2 x 16 + 10, 27 = 16 + 11, 21 = 16 + 5) is what it left for the next epoch.
    first_epoch = np.concatenate(steps[:8])
    assert len(np.unique(first_epoch)) == 64 and (first_epoch < 90).all()
    left = np.setdiff1d(np.arange(90), first_epoch)
    assert np.bincount(bucket_of[left], minlength=3).tolist() == [10, 11, 5]


@pytest.mark.slow  # the preprocessing job on Ray Data
@pytest.mark.timeout(600)
def test_photographs_of_every_aspect_ratio_are_preprocessed_into_their_buckets_and_read_back(tmp_path, ray_cluster):
    """scikit-learn's photographs cut to portrait, landscape and square, preprocessed with image.buckets: aspect
    (32 px of area, sides multiples of 8: the tiny VAE halves them): each lands in the bucket of its ratio, with its
    original size and crop; the files are sorted by bucket and name their runs; training's index and reader see the
    buckets."""

    import pyarrow as pa
    import pyarrow.parquet as pq
    from support.photographs import write_photograph_cuts
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.config.loader import load_config
    from sdtrain.data.metadata import BUCKET_RUNS
    from sdtrain.preprocess.config import PreprocessConfig
    from sdtrain.preprocess.job import run_preprocess

    model = str(tmp_path / "model")
    write_tiny_sd_model(model)
    captions, wanted = write_photograph_cuts(tmp_path / "input")
    config = load_config(
        None,
        [
            f"input.paths={tmp_path}/input",
            f"encode.model={model}",
            f"output.path={tmp_path}/latents",
            "image.resolution=32",
            "image.buckets=aspect",
            "image.bucket_step=8",
            "input.rows_per_shard=4",
            "encode.batch_size=4",
        ],
        PreprocessConfig,
    )
    buckets = config.image.shapes()
    assert buckets == [(40, 24), (32, 32), (24, 40)]
    summary = run_preprocess(config)
    assert summary.manifest["rows_written"] == 6 and not summary.shards_failed
    files = sorted(str(p) for p in (tmp_path / "latents").glob("[!_]*.parquet"))  # not the index beside them
    table = pa.concat_tables(pq.read_table(f) for f in files)
    by_caption = {row["caption"]: row for row in table.to_pylist()}
    for caption, (h, w) in zip(captions, wanted, strict=True):
        row = by_caption[caption]
        placed, _ = place(h, w, buckets)
        assert (row["bucket"], row["original_height"], row["original_width"]) == (placed.bucket, h, w), caption
        assert (row["crop_top"], row["crop_left"]) == placed.crop_top_left
        bucket_h, bucket_w = buckets[row["bucket"]]
        assert len(row["image_latents_256"]) == 4 * (bucket_h // 2) * (bucket_w // 2)  # its bucket's latents
    assert {row["bucket"] for row in by_caption.values()} == {0, 1, 2}  # tall, square and wide all present
    for file in files:
        parquet = pq.ParquetFile(file)
        metadata = parquet.schema_arrow.metadata
        assert json.loads(metadata[BUCKET_SHAPES.encode()]) == [[4, 20, 12], [4, 16, 16], [4, 12, 20]]
        order = parquet.read(columns=["bucket"]).column("bucket").to_pylist()
        assert order == sorted(order)  # sorted by bucket: one run each
        runs = json.loads(metadata[BUCKET_RUNS.encode()])
        assert [b for b, _ in runs] == sorted(set(order)) and sum(n for _, n in runs) == len(order)
        # A row group starts at each run (training reads a chunk of a run as whole row groups): one a run, under 64.
        groups = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
        assert groups == [n for _, n in runs]
    indexed = index_dataset([str(tmp_path / "latents")], "data.train", COLUMNS, 4, 32)
    assert indexed.stats.footers_read == 0  # the job's index records the runs too
    assert indexed.spec.bucket_shapes == ((4, 20, 12), (4, 16, 16), (4, 12, 20))
    shapes = {b.latents.shape[1:] for b in RowReader.of(indexed.spec, COLUMNS).batches(indexed.spec.files, "x")}
    assert shapes == {(4, 20, 12), (4, 16, 16), (4, 12, 20)}
