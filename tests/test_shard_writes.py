"""Shard files written by Ray tasks beside the encoded rows (sdtrain.preprocess.shard_writes): the driver sees block
references and each block's counts, never rows."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdtrain.preprocess.outputs import read_shard_stats
from sdtrain.preprocess.shard_writes import (
    Piece,
    ShardFiles,
    ShardGathering,
    census_task,
    write_limit,
    write_shards,
    write_task,
)
from sdtrain.storage.s3 import S3Settings

COLUMNS = {"latents": "image_latents_256", "embeddings": "caption_latents"}


def _stream() -> list[dict]:
    """What the encode stage sends, in the order it might: shards a (5 rows) and b (3 rows) interleaved, c of only
    skipped rows (its counts row alone), d unreadable (a row, then its counts row with an error)."""

    def row(shard: str, index: int, stats: dict | None = None) -> dict:
        return {
            "shard": shard,
            "index": index,
            "key": f"{shard}{index}",
            "caption_text": f"caption {shard}{index}",
            "valid": stats is None,
            "stats": json.dumps(stats) if stats else "",
            "latents": np.full(4, index, np.float32),
            "embeddings": np.full(6, -index, np.float32),
            "bucket": 0,
            "original_height": 100 + index,
            "original_width": 200,
            "crop_top": index,
            "crop_left": 0,
        }

    def counts(shard: str, rows: int, **more) -> dict:
        return row(shard, -1, {"shard": shard, "rows_written": rows, "inputs_read": rows, "skipped": {}, **more})

    return [
        row("a", 3),
        row("b", 0),
        row("a", 0),
        row("d", 0),
        row("a", 4),
        counts("c", 0),
        row("b", 2),
        row("a", 1),
        counts("a", 5),
        row("b", 1),
        counts("d", 1, error="ReadError: truncated"),
        row("a", 2),
        counts("b", 3),
    ]


def _blocks(stream: list[dict], size: int) -> list[pa.Table]:
    """The stream cut in blocks of ``size`` rows, as Ray Data's Arrow blocks."""
    return [pa.Table.from_pylist(stream[i : i + size]) for i in range(0, len(stream), size)]


def test_a_shard_is_written_once_its_counts_and_all_its_rows_are_in_from_every_block_that_holds_them(tmp_path):
    blocks = _blocks(_stream(), 4)
    gathering, order = ShardGathering(["a", "b", "c", "d"]), []
    for block in blocks:
        # In two slices, as a bundle may name part of a block: each slice's census counts only its rows.
        for start, end in ((0, 1), (1, None)):
            ready = gathering.add(Piece(block, start, end), census_task(start, end, block))
            order += [(name, *gathering.take(name)) for name in ready]
    assert [name for name, _, _ in order] == ["c", "d", "a", "b"]  # a: not at its counts, at its last row
    assert gathering.waiting() == []
    files = ShardFiles(str(tmp_path), COLUMNS, {"sdtrain.test": "kept"}, 2, S3Settings())
    for name, stats, pieces in order:
        if name == "d":
            assert stats["error"] == "ReadError: truncated"  # not written: the job counts it failed
            continue
        blocks_of = [piece.ref for piece in pieces]  # as Ray hands a task its arguments: the blocks themselves
        assert write_task(files, name, stats, [(p.start, p.end) for p in pieces], *blocks_of) == name
    table = pq.read_table(tmp_path / "a.parquet")
    assert table.column("key").to_pylist() == ["a0", "a1", "a2", "a3", "a4"]  # its rows alone, in input order
    assert table.column("image_latents_256").to_pylist()[3] == [3.0] * 4
    assert table.column("caption_latents").to_pylist()[2] == [-2.0] * 6
    assert table.column("original_height").to_pylist() == [100, 101, 102, 103, 104]
    assert table.column("crop_top").to_pylist() == [0, 1, 2, 3, 4]
    assert table.schema.metadata[b"sdtrain.test"] == b"kept"
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 3  # output.row_group_rows
    assert pq.read_table(tmp_path / "b.parquet").column("key").to_pylist() == ["b0", "b1", "b2"]
    assert not (tmp_path / "c.parquet").exists()  # a shard of only skipped rows: a record, no file
    assert [record["shard"] for record in read_shard_stats(str(tmp_path))] == ["a", "b", "c"]


def test_shards_whose_rows_did_not_all_arrive_are_failures_not_a_warning():
    """After the dataset's last block, a shard still waiting lost rows on the way: it was only warned of, so it was
    neither written nor failed and the job exited 0 with shards missing."""
    stream = _stream()
    short = [row for row in stream if not (row["shard"] == "a" and row["index"] == 2)]  # one of a's 5 rows lost
    gathering = ShardGathering(["a", "b", "c", "d", "e"])  # e: not even its counts row came
    for block in _blocks(short, 4):
        for name in gathering.add(Piece(block, 0, None), census_task(0, None, block)):
            gathering.take(name)
    assert gathering.lost() == {
        "a": "rows lost in the pipeline: 4 of 5 arrived",
        "e": "rows lost in the pipeline: 0 (no counts) arrived",
    }
    ready = ShardGathering(["a", "b", "c", "d"])
    for block in _blocks(stream, 4):
        for name in ready.add(Piece(block, 0, None), census_task(0, None, block)):
            ready.take(name)
    assert ready.lost() == {}


def test_writes_in_flight_scale_with_the_machine_that_writes():
    assert write_limit(local=False, cluster_cpus=2) == 4
    assert write_limit(local=False, cluster_cpus=512) == 128  # 128 GPU nodes' CPUs: a quarter write at once
    assert write_limit(local=False, cluster_cpus=1e5) == 256
    assert 2 <= write_limit(local=True, cluster_cpus=1e5) <= 8  # the driver's machine, whatever the cluster


@pytest.mark.slow
def test_ray_tasks_write_each_shard_from_the_blocks_that_hold_its_rows(tmp_path, ray_cluster, monkeypatch):
    """The encode stage's blocks each mix shards; the driver runs the dataset, and tasks write the shards (the
    writes' limit read again from the cluster at each shard here, as an autoscaling cluster grows)."""
    import ray.data

    from sdtrain.preprocess import shard_writes

    monkeypatch.setattr(shard_writes, "LIMIT_REFRESH_S", -1.0)

    stream = _stream()
    dataset = ray.data.from_items(stream, override_num_blocks=4).map_batches(lambda batch: batch, batch_size=3)
    files = ShardFiles(str(tmp_path), COLUMNS, {}, 100, S3Settings())
    written, failed = {}, {}
    write_shards(dataset, ["a", "b", "c", "d"], files, written.__setitem__, failed.__setitem__)
    assert sorted(written) == ["a", "b", "c"] and written["a"]["rows_written"] == 5
    assert failed == {"d": "ReadError: truncated"}
    assert [record["shard"] for record in read_shard_stats(str(tmp_path))] == ["a", "b", "c"]
    for shard, rows in (("a", 5), ("b", 3)):
        assert pq.read_table(tmp_path / f"{shard}.parquet").column("key").to_pylist() == [
            f"{shard}{i}" for i in range(rows)
        ]
