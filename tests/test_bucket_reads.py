"""A bucketed read task run here (no Ray) on files as preprocessing writes them (rows sorted by bucket, 64-row row
groups from row 0): every step's block holds exactly the rows the plan names, and a task holds about one step's row
groups at a time, not its window's; the driver warns once of row groups larger than a worker's share of a step."""

import json
import weakref

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import tiny_config
from support.log_lines import LogLines

from sdtrain.config.learning import Columns
from sdtrain.config.schema import DataConfig
from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.dataset_index import index_dataset
from sdtrain.data.metadata import BUCKET_SHAPES
from sdtrain.data.read_order import DataState
from sdtrain.data.streams import WindowReader
from sdtrain.preprocess.outputs import parquet_bytes, shard_table

COLUMNS = Columns("image_latents_256", "caption_latents")
SHAPES = [[4, 8, 8], [4, 8, 12], [4, 12, 8], [4, 8, 16]]


def _bucketed(directory, shares=(0.2, 0.4, 0.38, 0.02), files=6, rows=400, values=True):
    """Rows in SHAPES' buckets (``shares`` of them each; random values, else zeros), written by preprocessing's writer:
    shard_table sorts a file's rows by bucket, parquet_bytes writes 64-row row groups."""
    rng = np.random.default_rng(0)
    draw = rng.standard_normal if values else np.zeros
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {BUCKET_SHAPES: json.dumps(SHAPES), "sdtrain.latent_scaling_factor": "1.0"}
    for n in range(files):
        buckets = rng.choice(len(SHAPES), size=rows, p=shares)
        written = [
            {
                "latents": draw(SHAPES[bucket]).astype(np.float16),
                "embeddings": draw((8, 32)).astype(np.float16),
                "bucket": int(bucket),
                "caption": f"row {i}",
                "key": f"{n}-{i}",
            }
            for i, bucket in enumerate(buckets)
        ]
        table = shard_table(written, {"latents": COLUMNS.latent, "embeddings": COLUMNS.caption}, metadata)
        (directory / f"part-{n}.parquet").write_bytes(parquet_bytes(table, 64))
    return index_dataset([str(directory)], "data.train", COLUMNS, 4, 32).spec


def _reader(spec, global_batch, bucket_steps=1):
    plan = BucketPlan(
        spec.rows_per_file, spec.runs, spec.bucket_shapes, 0, 64, global_batch, 512, bucket_steps=bucket_steps
    )
    return plan, WindowReader(spec, DataConfig(train=spec.files), plan)


@pytest.mark.parametrize("bucket_steps", [1, 8])
def test_every_block_of_a_bucketed_read_task_holds_the_rows_the_plan_names_read_from_its_files(tmp_path, bucket_steps):
    """Each step's block against the files read whole: its latents of its bucket's shape and its captions, row by row,
    at 1, 4 and 32 workers, across epochs (a bucket of fewer rows than a step's carries them on: a window reads some
    rows twice, from spans that overlap, so a row group is used again after its other rows); with turns of 8 steps,
    whose lanes' 8-row parts 32 workers' 2-row shares cut."""
    spec = _bucketed(tmp_path / "data")
    tables = [pq.read_table(file, columns=[COLUMNS.latent, COLUMNS.caption]) for file in spec.files]
    latents = [row for table in tables for row in table.column(COLUMNS.latent).to_pylist()]
    captions = [row for table in tables for row in table.column(COLUMNS.caption).to_pylist()]
    repeated = 0
    for workers in (1, 4, 32):
        plan, reader = _reader(spec, 64, bucket_steps)
        for rank in (0, workers - 1):
            for stretch in plan.rank_stretches(DataState(), workers, 64 // workers, 120)[rank]:
                for window in plan.windows(stretch):
                    blocks, indices = reader.read_blocks(window), plan.sample_indices(window)
                    repeated += len(np.unique(indices)) < len(indices)
                    assert [block.num_rows for block in blocks] == [64 // workers] * len(window.blocks)
                    steps = zip(window.blocks, blocks, np.split(indices, len(blocks)), strict=True)
                    for (bucket, _), block, want in steps:
                        _check_block(block, want, SHAPES[bucket], latents, captions)
    assert repeated  # windows that read a row twice were among them


def _check_block(block, sample_index, shape, latents, captions):
    """``block`` holds rows ``sample_index`` of the files, bit for bit: latents of ``shape``, captions, all valid."""
    np.testing.assert_array_equal(block.column("sample_index").to_numpy(), sample_index)
    assert block.column("valid").to_numpy().all()
    got = block.column("latents").combine_chunks().to_numpy_ndarray()
    assert got.dtype == np.float16 and got.shape == (len(sample_index), *shape)
    assert got.tobytes() == np.array([latents[i] for i in sample_index], np.float16).reshape(got.shape).tobytes()
    got = block.column("captions").combine_chunks().to_numpy_ndarray()
    assert got.tobytes() == np.array([captions[i] for i in sample_index], got.dtype).reshape(got.shape).tobytes()


@pytest.fixture
def held_row_groups(monkeypatch):
    """The row groups pyarrow has read that are still alive (a read task's cache is what keeps them), and the most of
    them alive at once: pyarrow's own read of each, counted."""
    held = {"now": 0, "most": 0, "read": 0, "rows": 0}
    read = pq.ParquetFile.read_row_group

    def gone():
        held["now"] -= 1

    def counted(self, *args, **kwargs):
        table = read(self, *args, **kwargs)
        held["now"] += 1
        held["read"] += 1
        held["rows"] += table.num_rows
        held["most"] = max(held["most"], held["now"])
        weakref.finalize(table, gone)
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    return held


def test_a_bucketed_read_task_holds_about_one_steps_row_groups_not_its_windows(tmp_path, held_row_groups):
    """8 rows a worker a step (a global batch of 64 on 8 workers) make a read task of 64 steps, each reading the one or
    two 64-row groups its 8 rows are in: ~9x the rows it uses. The task held every row group it had read until it
    ended (~4,200 rows to return 512 at 256 workers, 1.9 GB of SDXL-1024 latents); it holds each only until the
    window's last rows of it. An epoch of ~600 steps: a window's steps seldom share a row group, as in a large
    dataset."""
    spec = _bucketed(tmp_path / "data", files=20, rows=2000, values=False)
    plan, reader = _reader(spec, 64)
    for rank in (0, 5):
        for window in plan.windows(plan.rank_stretches(DataState(), 8, 8, 128)[rank][0]):
            held_row_groups.update(most=0, read=0)
            blocks = reader.read_blocks(window)
            assert len(blocks) == 64 and sum(block.num_rows for block in blocks) == 512
            assert held_row_groups["read"] >= 60  # row groups the task read: 64 rows each, ~8x the 512 it returns
            assert held_row_groups["most"] <= 8, held_row_groups  # a step's one or two, and a few used again later
            assert held_row_groups["now"] == 0


def test_turns_of_8_steps_read_about_the_rows_they_use_where_8_row_shares_read_8x(tmp_path, held_row_groups):
    """The same files and workers as above: with data.bucket_steps=8 a rank's read task of 64 steps takes 8 lanes of 64
    consecutive positions of its buckets' orders, each one chunk of a run (one row group of the files preprocessing
    writes), not 64 shares of 8 rows each in another chunk."""
    spec = _bucketed(tmp_path / "data", files=20, rows=2000, values=False)
    read = {}
    for bucket_steps in (1, 8):
        plan, reader = _reader(spec, 64, bucket_steps)
        held_row_groups.update(rows=0)
        for rank in (0, 5):
            for window in plan.windows(plan.rank_stretches(DataState(), 8, 8, 128)[rank][0]):
                blocks = reader.read_blocks(window)
                assert len(blocks) == 64 and sum(block.num_rows for block in blocks) == 512
        read[bucket_steps] = held_row_groups["rows"] / (2 * 128 * 8)  # rows read over rows used
    # 8.9x and 1.08x when written. With turns a lane is one 64-row chunk of a run, and preprocessing starts a row
    # group at each run, so the chunk is one row group; the rest is the lanes cut from runs' last rows (7% of the
    # rows here). Before runs started row groups, and chunks were cut from runs laid end to end: 8.6x and 2.1x.
    assert read[1] > 6 and read[8] < 1.4 and read[1] / read[8] > 5, read


def _warnings(config, run_dir, about="rows of a step"):
    from sdtrain.driver.data_check import check_data

    with LogLines() as lines:
        check_data(config, run_dir)
    return [line for line in lines.messages if about in line]


def test_the_driver_warns_once_of_row_groups_larger_than_a_workers_share_of_a_step(tmp_path):
    """Bucketed data of 64-row groups trained at 8 rows a worker a step in turns of one step reads ~9x the rows it
    uses: the driver says so once, with what it costs and the two settings that fix it (turns of data.bucket_steps, or
    smaller row groups); with turns that read a row group's worth (auto's), nothing; elastic, at its most workers; at
    64 rows a worker, nothing."""
    _bucketed(tmp_path / "data", files=1)
    data, one = f"data.train={tmp_path}/data", "data.bucket_steps=1"
    (warning,) = _warnings(
        tiny_config(data, one, tmp_path=tmp_path, name="r", batch=64, workers=8), str(tmp_path / "a")
    )
    assert warning == (
        f"data.train: {tmp_path}/data/part-0.parquet has row groups of 64 rows, but on 8 workers (scaling.num_workers) "
        "each reads 8 rows of a step (train.global_batch_size=64 / 8), and every read of bucketed data reads the row "
        "groups its rows are in whole: about 9x the rows training uses, in object-storage reads and in each read "
        "task's memory. To read about what it uses, set data.bucket_steps=8 (steps of one bucket in a row), or "
        "rewrite the files with row groups of at most 8 rows (sdtrain's preprocessing: output.row_group_rows=8; "
        "pyarrow.parquet.write_table(..., row_group_size=8))"
    )
    # Turns of 8 steps, auto's here: each worker reads 64 consecutive rows, a row group's worth.
    for steps in ("data.bucket_steps=8", "data.bucket_steps=auto"):
        config = tiny_config(data, steps, tmp_path=tmp_path, name="t", batch=64, workers=8)
        assert _warnings(config, str(tmp_path / "t")) == []
        (described,) = _warnings(config, str(tmp_path / "t"), "data.train: 400 rows")  # the start says what it reads
        auto = " (data.bucket_steps=auto: each of up to 8 workers reads whole chunks)" * steps.endswith("auto")
        assert described.endswith(
            "in 1 file(s), latents in 4 aspect-ratio buckets, captions (8, 32); about 6 steps per epoch, in turns of "
            f"8 steps of one bucket{auto}"
        )
    (short,) = _warnings(
        tiny_config(data, "data.bucket_steps=4", tmp_path=tmp_path, batch=64, workers=8), str(tmp_path)
    )
    assert (
        "each reads 8 rows of a step (train.global_batch_size=64 / 8), 32 consecutive rows over data.bucket_steps=4"
        in short
    )
    assert "about 3x" in short and "set data.bucket_steps=8" in short and "row groups of at most 32 rows" in short
    elastic = tiny_config(data, one, "scaling.num_workers=[1, 2]", tmp_path=tmp_path, batch=64)
    (elastic,) = _warnings(elastic, str(tmp_path))
    assert "but on 2 workers (scaling.num_workers) each reads 32 rows of a step" in elastic and "about 3x" in elastic
    assert _warnings(tiny_config(data, tmp_path=tmp_path, batch=64, workers=1), str(tmp_path / "c")) == []


def test_the_driver_warns_once_of_bucketed_files_whose_row_groups_do_not_start_at_each_run(tmp_path):
    """Bucketed files written before preprocessing started a row group at each run (or by another writer) are read
    ~2x: a chunk of a run takes parts of two row groups. The start that reads their footers says so once, with how
    many; files written as preprocessing writes them now get no warning."""
    _bucketed(tmp_path / "data", files=3)
    config = tiny_config(f"data.train={tmp_path}/data", tmp_path=tmp_path, batch=64, workers=1)
    assert _warnings(config, str(tmp_path / "a"), "bucket run") == []
    for file in sorted((tmp_path / "data").glob("*.parquet")):
        pq.write_table(pq.read_table(file), file, row_group_size=64)  # row groups from the file's start
    (warning,) = _warnings(config, str(tmp_path / "b"), "bucket run")
    assert warning.startswith("data.train: 3 of the 3 file(s) whose footers this start read (one: "), warning
    assert "data.shuffle_chunk_rows=64 rows of a run then takes parts of two row groups of up to 64 rows" in warning
    assert "about 2.0x the rows training uses" in warning
    assert "python entrypoints/realign_row_groups.py <their directory> <a new one>" in warning, warning
