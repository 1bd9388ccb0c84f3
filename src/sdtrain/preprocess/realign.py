"""A copy of parquet latents with a row group starting at each bucket run, as preprocessing writes them since
2026-12-01. An earlier preprocessing counted row groups from the file's start, so a chunk training cuts from a run most
often takes parts of two row groups and is read ~2x (docs/data.md, Aspect-ratio buckets). Nothing is encoded again:
each file's rows, their order, its schema and metadata are kept, and only its row groups are cut anew (up to its
largest row group's rows: the output.row_group_rows it was written with).

A copy, never in place: runs in progress read the source, and a file rewritten under them changes its size and ETag
(their next resume refuses the data as changed). Files already aligned, and one-shape ones, are copied as they are
(server-side on S3); every other file (a preprocessing output's markers, digest, settings, manifest, the empty prompt's
embedding) is copied too, so a later preprocessing run into the copy resumes as it would have into the source; and each
directory index is written again for the new files. The rewrites are Ray tasks, a CPU each; a re-run does what a killed
one had not (a file in the target is done: every write is whole or absent).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import tempfile
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.data.footer_counts import runs_start_row_groups
from sdtrain.data.index_format import read_index
from sdtrain.data.listing import DIRECTORY_INDEX
from sdtrain.data.metadata import BUCKET_SHAPES, bucket_runs
from sdtrain.errors import DataError, StorageUnavailable
from sdtrain.logs import log
from sdtrain.preprocess.outputs import SHARDS_DIGEST, join, parquet_writer, run_row_groups
from sdtrain.storage.filesystems import copy_file, delete_file, filesystem_for, put_file, write_bytes
from sdtrain.storage.s3 import S3Settings, apply_s3_settings, resolved_s3_settings
from sdtrain.storage.uris import absolute, has_userinfo, is_uri, redact

RECORD_FILE = "_realigned.json"
"""Written in the target's root when every file is there: the source, when, and what was done to how many files."""

COPY_THREADS = 64
"""Side files copied at a time from the driver (each one request on S3: a server-side copy)."""

TASKS_AHEAD = 64
"""Rewrites submitted at least, whatever the CPUs the cluster has now: an autoscaling cluster adds nodes for those
waiting."""

_TEMPORARY = re.compile(r"(^|/)\.[^/]+\.[0-9a-f]{32}\.tmp$")
"""A local write's temporary name (sdtrain.storage.filesystems.write_bytes), left by a kill."""


class FileResult(NamedTuple):
    """What :func:`realign_file` did to a file."""

    rewritten: bool
    """False: copied as it was (its runs already start row groups, or it holds one shape)."""
    rows: int
    row_groups: tuple[int, int]
    """Before and after."""


@dataclass
class RealignSummary:
    """What a run did: parquet files rewritten, copied as they were and found done; other files copied; rows and row
    groups (before, after) of the parquet files it wrote; the indexes written again."""

    source: str
    target: str
    rewritten: int = 0
    copied: int = 0
    done_before: int = 0
    side_files: int = 0
    rows: int = 0
    row_groups: list[int] = field(default_factory=lambda: [0, 0])
    indexes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def realign_file(source: str, target: str, s3: S3Settings | None) -> FileResult:
    """Write ``source``'s rows to ``target`` with a row group starting at each of its bucket runs (or copy it as it is
    where they already do, or where it is not bucketed); a Ray task's body. The new file is written to the node's disk
    and sent from there: the task holds the input row groups the output row group being written takes (one or two),
    not the table nor the file (a shard may be 4 GiB)."""
    if s3 is not None:
        apply_s3_settings(s3)
    fs, path = filesystem_for(source)
    with fs.open_input_file(path) as f:
        try:
            parquet = pq.ParquetFile(f)
        except pa.ArrowInvalid as error:  # not an unavailable store (OSError, retried): the file itself
            raise DataError(f"realign: {redact(source)}: cannot be read as parquet ({error})") from None
        meta, schema = parquet.metadata, parquet.schema_arrow
        groups = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], np.int64)
        shapes = (schema.metadata or {}).get(BUCKET_SHAPES.encode())
        runs = None if shapes is None else bucket_runs(schema.metadata, source, meta.num_rows, len(json.loads(shapes)))
        if runs is None or not meta.num_rows or runs_start_row_groups(runs, groups):
            copy_file(source, target, f.size())
            return FileResult(False, int(meta.num_rows), (len(groups), len(groups)))
        with tempfile.TemporaryDirectory(prefix="sdtrain-realign-") as scratch:
            local = os.path.join(scratch, "realigned.parquet")
            with parquet_writer(local, schema) as writer:
                for table in _realigned(parquet, groups, [rows for _, rows in runs]):
                    writer.write_table(table)
            put_file(local, target)
            after = pq.read_metadata(local).num_row_groups
    return FileResult(True, int(meta.num_rows), (len(groups), int(after)))


def _realigned(parquet: pq.ParquetFile, groups: np.ndarray, lengths: list[int]) -> Iterator[pa.Table]:
    """The file's rows as tables of its new row groups: up to its largest row group's rows within each run."""
    offsets = np.concatenate([[0], np.cumsum(groups)])
    held: dict[int, pa.Table] = {}
    for start, rows in run_row_groups(lengths, int(groups.max())):
        first = int(np.searchsorted(offsets, start, "right")) - 1
        last = int(np.searchsorted(offsets, start + rows, "left")) - 1
        for group in [g for g in held if g < first]:
            del held[group]  # the output moves forward only
        parts = []
        for group in range(first, last + 1):
            if group not in held:
                held[group] = parquet.read_row_group(group)
            lo = max(start, int(offsets[group])) - int(offsets[group])
            hi = min(start + rows, int(offsets[group + 1])) - int(offsets[group])
            parts.append(held[group].slice(lo, hi - lo))
        yield pa.concat_tables(parts)


class CopyPlan(NamedTuple):
    """What a realign run does, from the names under the source and those already under the target."""

    parquet: list[str]
    """The data files not under the target yet: rewritten (or copied) by Ray tasks."""
    done_before: int
    side: list[str]
    """Every other file not under the target yet, copied from the driver; a digest of markers last."""
    indexes: list[str]
    """The directories whose dataset index is written again."""
    strays: list[str]
    """Files under the target that the source does not hold: the target is refused."""


def plan_copy(files: Collection[str], there: Collection[str]) -> CopyPlan:
    """The :class:`CopyPlan` of names relative to the source (``files``) and to the target (``there``): sets and one
    pass each, so 2e6 names cost the driver seconds (bench/realign_cost.py)."""
    done = set(there)
    data = {r for r in files if r.endswith(".parquet") and posixpath.basename(r) != DIRECTORY_INDEX}
    indexes = sorted(posixpath.dirname(r) for r in files if posixpath.basename(r) == DIRECTORY_INDEX)
    side = sorted(r for r in files if r not in done and r not in data and posixpath.basename(r) != DIRECTORY_INDEX)
    # A preprocessing re-run takes the markers older than the digest from it: the digest is copied after them.
    side.sort(key=lambda r: posixpath.basename(r) == SHARDS_DIGEST)
    strays = sorted(done - set(files))
    return CopyPlan(sorted(data - done), len(data & done), side, indexes, strays)


def realign(source: str, target: str) -> RealignSummary:
    """Copy every file under ``source`` to the same name under ``target``, the bucketed parquet files with a row group
    starting at each bucket run (:func:`realign_file`, as Ray tasks), then each directory index written again.

    Args:
        source: a local directory or s3:// prefix of parquet latents (a preprocessing output, or a tree of them).
        target: where the copy goes: empty, or an earlier run's copy of ``source`` (its files are not done again).
    """
    started = time.perf_counter()
    source, target = _checked(source, target)
    files = _files(source)
    there = _files(target)
    there.pop(RECORD_FILE, None)
    for name in [r for r in there if _TEMPORARY.search(r)]:
        delete_file(join(target, name))  # a write a kill interrupted
        del there[name]
    plan = plan_copy(files, there)
    if not plan.parquet and not plan.done_before:
        raise DataError(f"realign: {redact(source)} holds no parquet file")
    if plan.strays:
        raise DataError(
            f"realign: {redact(target)} holds {plan.strays[0]} ({len(plan.strays)} file(s) in all) that "
            f"{redact(source)} does not: the target must be empty or an earlier realign's copy of this source. Give "
            "another target"
        )
    summary = RealignSummary(source, target, done_before=plan.done_before)
    if plan.parquet:
        _rewrite(source, target, plan.parquet, summary)
    digests = [r for r in plan.side if posixpath.basename(r) == SHARDS_DIGEST]
    for batch in (plan.side[: len(plan.side) - len(digests)], digests):
        with ThreadPoolExecutor(COPY_THREADS) as pool:
            list(pool.map(lambda r: copy_file(join(source, r), join(target, r), files[r]), batch))
    summary.side_files = len(plan.side)
    summary.indexes = [_index_again(source, target, directory) for directory in plan.indexes]
    summary.seconds = time.perf_counter() - started
    record: dict[str, Any] = {"source": redact(source), "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record |= {"files_rewritten": summary.rewritten, "files_copied": summary.copied, "rows": summary.rows}
    write_bytes(join(target, RECORD_FILE), json.dumps(record, indent=2).encode())
    return summary


def _rewrite(source: str, target: str, pending: list[str], summary: RealignSummary) -> None:
    """Each of ``pending`` (names under both) by a Ray task of a CPU, up to twice as many at once as the cluster has
    CPUs, and at least TASKS_AHEAD (waiting tasks are what an autoscaling cluster adds nodes for)."""
    import ray

    if not ray.is_initialized():
        ray.init()  # a submitted job's cluster, RAY_ADDRESS, the one `ray start` runs here, else a new one
    limit = max(TASKS_AHEAD, 2 * int(ray.cluster_resources().get("CPU", 0)))
    task = ray.remote(realign_file).options(num_cpus=1, max_retries=3, retry_exceptions=[OSError])
    s3 = resolved_s3_settings()
    in_flight: dict[Any, str] = {}
    said = time.monotonic()
    names = iter(pending)
    while True:
        for name in names:
            in_flight[task.remote(join(source, name), join(target, name), s3)] = name
            if len(in_flight) >= limit:
                break
        if not in_flight:
            return
        (ready,), _ = ray.wait(list(in_flight), num_returns=1)
        name = in_flight.pop(ready)
        try:
            result: FileResult = ray.get(ready)
        except Exception as error:
            for ref in in_flight:  # a write cut short leaves nothing under its name (each is whole or absent)
                ray.cancel(ref)
            cause = getattr(error, "cause", error)  # a RayTaskError's: the file's own, without Ray's traceback
            if isinstance(cause, DataError):
                raise cause from None
            raise StorageUnavailable(
                f"realign: {redact(join(source, name))} failed after its retries ({type(cause).__name__}: {cause}); "
                f"{summary.rewritten + summary.copied} file(s) were written this run: run again to do the rest"
            ) from None
        summary.rewritten += result.rewritten
        summary.copied += not result.rewritten
        summary.rows += result.rows
        summary.row_groups = [a + b for a, b in zip(summary.row_groups, result.row_groups, strict=True)]
        if time.monotonic() - said > 30:
            said = time.monotonic()
            done = summary.rewritten + summary.copied
            log.info(f"realign: {done}/{len(pending)} files ({summary.rewritten} rewritten), {summary.rows} rows")


def _index_again(source: str, target: str, directory: str) -> str:
    """The target directory's index, for the columns the source's was written for (every footer read once)."""
    from sdtrain.data.directory_index import write_directory_index

    where = join(target, directory) if directory else target
    index = read_index(join(source, directory, DIRECTORY_INDEX) if directory else join(source, DIRECTORY_INDEX))
    if index is None:
        return f"{where}: none written (the source's index could not be read)"
    stats = write_directory_index(where, index.checked.columns, key="realign")
    return f"{where}/{DIRECTORY_INDEX}" + ("" if stats is not None and stats.written else " (unchanged)")


def _checked(source: str, target: str) -> tuple[str, str]:
    """Both as absolute paths or URIs, refused where either holds credentials or one holds the other."""
    for name, value in (("source", source), ("target", target)):
        if has_userinfo(value):
            raise DataError(f"realign: the {name} {redact(value)} holds a user name or password: use the AWS variables")
    source, target = (p.rstrip("/") if is_uri(p) else absolute(p).rstrip("/") for p in (source, target))
    if source == target or target.startswith(source + "/") or source.startswith(target + "/"):
        raise DataError(
            f"realign: the target {redact(target)} and the source {redact(source)} are one or hold each other: the "
            "copy goes beside the source, never in place (runs reading the source would see its files change)"
        )
    fs, path = filesystem_for(source)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise DataError(f"realign: the source {redact(source)} is not a directory")
    return source, target


def _files(root: str) -> dict[str, int]:
    """The names of every file under ``root`` (recursively, hidden names too), relative to it, with their bytes."""
    fs, path = filesystem_for(root)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return {}
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    base = path.rstrip("/") + "/"
    return {i.path[len(base) :]: i.size for i in found if i.type == pafs.FileType.File}
