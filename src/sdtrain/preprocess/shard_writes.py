"""Shard files written by Ray tasks where the encoders' rows are, not on the job's driver.

The driver takes the encode stage's blocks as object references (Ray Data's ref bundles) and never their rows:
a small task beside each block counts the rows it holds of each shard (its census); once a shard's counts row and
as many rows as it counts are in, one task fetches the blocks holding them and writes the shard's file and record.
Every encoded row (~165 KB with SD 2 embeddings) used to cross the head node and wait for its cores: at 1e9 rows,
165 TB through one machine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdtrain.preprocess.outputs import PLACEMENT_COLUMNS, shard_table, write_shard
from sdtrain.storage.s3 import S3Settings, apply_s3_settings
from sdtrain.storage.uris import is_uri

Census = list[tuple[str, int, str | None]]
"""A block's shards: each one's name, how many of its rows the block holds, and its counts row (JSON) if there."""


@dataclass(frozen=True)
class Piece:
    """Rows ``start`` to ``end`` of one block of the encode stage (None: to its end)."""

    ref: Any  # ray.ObjectRef of a Ray Data block
    start: int
    end: int | None


def census(batch: dict[str, np.ndarray]) -> Census:
    """Each shard of the batch (the shard, valid and stats columns): its valid rows, and its counts row if there."""
    found: dict[str, list[Any]] = {}
    for i in range(len(batch["valid"])):
        entry = found.setdefault(str(batch["shard"][i]), [0, None])
        if batch["valid"][i]:
            entry[0] += 1
        else:
            entry[1] = str(batch["stats"][i])
    return [(name, rows, stats) for name, (rows, stats) in found.items()]


def shard_rows(batch: dict[str, np.ndarray], name: str, columns: dict[str, str]) -> list[dict[str, Any]]:
    """The valid rows of shard ``name`` in an encoded batch, as shard_table takes them."""
    return [
        {
            "index": int(batch["index"][i]),
            "key": str(batch["key"][i]),
            "caption": str(batch["caption_text"][i]),
            **{value: batch[value][i] for value in columns},
            **{placement: int(batch[placement][i]) for placement in PLACEMENT_COLUMNS},
        }
        for i in range(len(batch["valid"]))
        if batch["valid"][i] and str(batch["shard"][i]) == name
    ]


class ShardGathering:
    """Where each pending shard's rows are, from the blocks' censuses: a shard is ready once its counts row has come
    and as many rows as it counts."""

    def __init__(self, names: list[str]):
        self.pieces: dict[str, list[Piece]] = {name: [] for name in names}
        self.rows = dict.fromkeys(names, 0)
        self.stats: dict[str, dict[str, Any]] = {}

    def add(self, piece: Piece, found: Census) -> list[str]:
        """Adds a block's census; returns the shards it made ready."""
        ready = []
        for name, rows, stats in found:
            if rows:
                self.rows[name] += rows
                self.pieces[name].append(piece)
            if stats is not None:
                self.stats[name] = json.loads(stats)
            if name in self.stats and self.rows[name] >= self.stats[name]["rows_written"]:
                ready.append(name)
        return ready

    def take(self, name: str) -> tuple[dict[str, Any], list[Piece]]:
        """A ready shard's counts and the pieces holding its rows, no longer held here."""
        del self.rows[name]
        return self.stats.pop(name), self.pieces.pop(name)

    def waiting(self) -> list[str]:
        """The shards not ready (after the last block: rows lost on the way)."""
        return sorted(self.rows)

    def lost(self) -> dict[str, str]:
        """After the last block: each shard not ready, with what came of it (its failure, for the job's report)."""
        lost = {}
        for name in self.waiting():
            counted = self.stats.get(name)
            arrived = f"{self.rows[name]} of {counted['rows_written']}" if counted else f"{self.rows[name]} (no counts)"
            lost[name] = f"rows lost in the pipeline: {arrived} arrived"
        return lost


def _batch(block: Any, start: int, end: int | None, columns: list[str | None] | None = None) -> dict[str, np.ndarray]:
    from ray.data.block import BlockAccessor

    accessor = BlockAccessor.for_block(block)
    if columns is not None:
        accessor = BlockAccessor.for_block(accessor.select(columns))
    rows = accessor.num_rows()
    part = accessor.slice(start, rows if end is None else end, copy=False)
    return BlockAccessor.for_block(part).to_batch_format("numpy")


def census_task(start: int, end: int | None, block: Any) -> Census:
    """A Ray task's body (run beside the block: its argument): the block's census."""
    return census(_batch(block, start, end, ["shard", "valid", "stats"]))


@dataclass(frozen=True)
class ShardFiles:
    """What a write task needs to write any shard: where, which columns, the schema's metadata."""

    output: str
    columns: dict[str, str]
    metadata: dict[str, str]
    row_group_rows: int
    s3: S3Settings


def write_task(files: ShardFiles, name: str, stats: dict[str, Any], spans: list, *blocks: Any) -> str:
    """A Ray task's body: shard ``name``'s rows gathered from its blocks (``spans``: each one's start and end),
    its file and record written (sdtrain.preprocess.outputs.write_shard)."""
    apply_s3_settings(files.s3)
    rows = [
        row
        for block, (start, end) in zip(blocks, spans, strict=True)
        for row in shard_rows(_batch(block, start, end), name, files.columns)
    ]
    table = shard_table(sorted(rows, key=lambda r: r["index"]), files.columns, files.metadata)
    write_shard(files.output, name, table, stats, files.row_group_rows)
    return name


def write_limit(local: bool, cluster_cpus: float) -> int:
    """Shard writes in flight at once (the driver waits beyond it, which holds the pipeline back): a local output's
    on the driver's machine, by its cores; a bucket's on the cluster, a quarter of its CPUs (the writes ask for
    none: Ray Data holds every CPU while the pipeline runs, and a write waiting for one would stall it)."""
    if local:
        return max(2, min(8, (os.cpu_count() or 2) // 2))
    return max(4, min(256, int(cluster_cpus) // 4))


def write_shards(
    dataset: Any,
    names: list[str],
    files: ShardFiles,
    written: Callable[[str, dict[str, Any]], None],
    failed: Callable[[str, str], None],
) -> None:
    """Runs ``dataset`` (the encode stage's output) to its end, each of shards ``names`` written by a task once its
    rows are in.

    Args:
        written: called with a shard's name and counts once its file and record are written.
        failed: called with a shard's name and error when its input could not be read, or when the dataset ended
            without all its rows (it is not marked done: a re-run tries it again).
    """
    import ray

    gathering = ShardGathering(names)
    writes = _Writes(files, written)
    count = ray.remote(census_task).options(num_cpus=0)  # beside its block: Ray schedules a task where its data is
    counting: dict[Any, Piece] = {}

    def settle(refs: list[Any]) -> None:
        for ref in refs:
            piece = counting.pop(ref)
            for name in gathering.add(piece, ray.get(ref)):
                stats, pieces = gathering.take(name)
                if stats.get("error"):
                    failed(name, stats["error"])
                else:
                    writes.submit(name, stats, pieces)

    try:
        for bundle in dataset.iter_internal_ref_bundles():
            for entry, part in zip(bundle.blocks, bundle.slices, strict=True):
                start, end = (part.start_offset, part.end_offset) if part is not None else (0, None)
                counting[count.remote(start, end, entry.ref)] = Piece(entry.ref, start, end)
            if counting:  # the censuses done so far, without waiting for the rest
                settle(ray.wait(list(counting), num_returns=len(counting), timeout=0)[0])
        settle(list(counting))
        writes.wait(keep=0)
    finally:
        writes.drain()
    # Only warned of, they were neither written nor failed: the job exited 0 with shards missing.
    for name, error in gathering.lost().items():
        failed(name, error)


LIMIT_REFRESH_S = 60.0
"""Seconds between two reads of the cluster's CPUs for the writes' limit."""


class _Writes:
    """The write tasks in flight, at most write_limit of them."""

    def __init__(self, files: ShardFiles, written: Callable[[str, dict[str, Any]], None]):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        local = self.local = not is_uri(files.output)
        self.limit, self.limit_at = write_limit(local, ray.cluster_resources().get("CPU", 0)), time.monotonic()
        # A local output is on the driver's machine: its writes run there (with no CPU asked, as on a head node
        # that runs no tasks); a bucket's run where their blocks are.
        where = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False) if local else None
        self.task = ray.remote(write_task).options(num_cpus=0, scheduling_strategy=where or "DEFAULT")
        self.files = ray.put(files)  # once, not pickled into every task
        self.written = written
        self.in_flight: dict[Any, tuple[str, dict[str, Any]]] = {}

    def submit(self, name: str, stats: dict[str, Any], pieces: list[Piece]) -> None:
        if time.monotonic() - self.limit_at > LIMIT_REFRESH_S:  # an autoscaling cluster grows after the job starts
            import ray

            self.limit, self.limit_at = write_limit(self.local, ray.cluster_resources().get("CPU", 0)), time.monotonic()
        self.wait(keep=self.limit - 1)
        spans = [(piece.start, piece.end) for piece in pieces]
        ref = self.task.remote(self.files, name, stats, spans, *[piece.ref for piece in pieces])
        self.in_flight[ref] = (name, stats)

    def wait(self, keep: int) -> None:
        """Waits for writes until ``keep`` are in flight (a failed write raises)."""
        import ray

        while len(self.in_flight) > keep:
            done, _ = ray.wait(list(self.in_flight), num_returns=1)
            name, stats = self.in_flight.pop(done[0])
            ray.get(done[0])
            self.written(name, stats)

    def drain(self) -> None:
        """After a failure: the writes already started are let finish (their rows are done work)."""
        import ray

        if self.in_flight:
            ray.wait(list(self.in_flight), num_returns=len(self.in_flight))
