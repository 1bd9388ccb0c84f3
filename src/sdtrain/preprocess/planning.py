"""The driver's reads before any Ray work, many at a time, and what the parquet input's columns may hold.

Planning reads a request per parquet input (its footer: rows and schema) and per done shard (its _shards/<name>.json
marker); one after another they cost hours at 1e5-1e6 files on S3 (2e5 footers at 30 ms: 1.7 h), at every run and
retry. :func:`in_order` reads footers PLANNING_READS and markers MARKER_READS at a time (on connections enough:
:func:`sdtrain.storage.s3.s3_connections`), and :func:`parquet_row_counts` reads no footer of a file whose shards are
all recorded done.

The columns' types are checked where the footers are read, so a wrong column fails the job before Ray starts instead
of every row being skipped (:func:`check_columns`); :func:`image_bytes` reads each accepted image type.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.preprocess.config import InputConfig
from sdtrain.storage.filesystems import filesystems_for
from sdtrain.storage.s3 import DRIVER_READS, s3_connections

PLANNING_READS = DRIVER_READS
"""Footer reads in flight at once while planning (the inputs' footers: as training's, FOOTER_READS)."""
MARKER_READS = DRIVER_READS
"""Marker reads in flight at once (each a HEAD and a GET of a few hundred bytes): 2e6 markers at 30 ms a request
take ~16 min, not the 2 h of 16 at a time; and ~4,300 requests a second stay under S3's 5,500 GET/HEAD a second per
prefix (every marker is under _shards/), where 256 would be throttled."""

T = TypeVar("T")
R = TypeVar("R")


def in_order(read: Callable[[T], R], items: Iterable[T], threads: int = PLANNING_READS) -> Iterator[R]:
    """``read(item)`` of each item, ``threads`` at a time, yielded in the items' order; at most 2 x ``threads`` are
    read ahead of the one yielded (2e6 markers are never all submitted at once). The first failure (in order) is
    raised and the reads not yet started are cancelled."""
    upcoming = iter(items)
    with ThreadPoolExecutor(threads, thread_name_prefix="sdtrain-plan") as pool:
        pending: deque[Future[R]] = deque()
        try:
            for item in upcoming:
                pending.append(pool.submit(read, item))
                if len(pending) >= 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # a failure, or the caller stopped early: nothing more starts
            for future in pending:
                future.cancel()


def parquet_row_counts(
    files: Sequence[str],
    sizes: Sequence[int],
    versions: Sequence[str],
    config: InputConfig,
    done: Mapping[str, Mapping[str, Any]],
) -> list[int]:
    """The rows of each parquet file, in order: from its footer (its columns' types checked), or, for a file (same
    path, size and version) whose shards the ``done`` records hold all of, from those records, reading nothing."""
    known = done_row_counts(done, config.rows_per_shard)
    todo = [i for i in range(len(files)) if (files[i], sizes[i], versions[i]) not in known]
    with s3_connections(PLANNING_READS):  # one client per S3 bucket, with a connection per read in flight
        sources = dict(zip(todo, filesystems_for([files[i] for i in todo]), strict=True))
    large_groups: list[tuple[int, int]] = []  # (file, its largest row group's rows) over input.rows_per_shard

    def rows(i: int) -> int:
        if i not in sources:
            return known[files[i], sizes[i], versions[i]]
        fs, path = sources[i]
        try:
            metadata = pq.read_metadata(path, filesystem=fs)
        except (OSError, ValueError) as e:
            raise DataError(f"input.paths: cannot read {files[i]} as parquet: {e}") from None
        check_columns(files[i], metadata.schema.to_arrow_schema(), config)
        largest = max((metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)), default=0)
        if largest > config.rows_per_shard:
            large_groups.append((i, largest))
        return metadata.num_rows

    counts = list(in_order(rows, range(len(files)), PLANNING_READS))
    if large_groups:
        warn_of_large_row_groups([(files[i], rows) for i, rows in sorted(large_groups)], config.rows_per_shard)
    return counts


def warn_of_large_row_groups(files: list[tuple[str, int]], rows_per_shard: int) -> None:
    """One warning for the input files (file, its largest row group's rows) whose row groups hold more rows than a
    shard: each shard cut from such a group reads the group's bytes again, up to its last row (a group is the least
    a reader can find rows in), so the group is read about rows / input.rows_per_shard times."""
    file, rows = files[0]
    others = f"; {len(files) - 1} more input file(s) have row groups over input.rows_per_shard too" if files[1:] else ""
    log.warning(
        f"input.paths: {file} has a row group of {rows} rows, more than input.rows_per_shard ({rows_per_shard}): each "
        f"of its ~{-(-rows // rows_per_shard)} shards reads the group's bytes up to its last row again (a shard's "
        f"memory stays bounded){others}. Rewrite the files with row groups of at most {rows_per_shard} rows "
        "(pyarrow's row_group_size), or raise input.rows_per_shard"
    )


def done_row_counts(done: Mapping[str, Mapping[str, Any]], rows_per_shard: int) -> dict[tuple[str, int, str], int]:
    """The rows of each (path, size, version) whose shards the records hold all of: ranges from row 0 on, each
    ``rows_per_shard`` long but the last, which is shorter (a last range of full length may have more after it: the
    file's footer says)."""
    ranges: dict[tuple[str, int, str], list[tuple[int, int]]] = {}
    for record in done.values():
        identity = record.get("identity") or {}
        path, size, rows = identity.get("path"), identity.get("size"), identity.get("rows")
        if isinstance(path, str) and isinstance(size, int) and isinstance(rows, list) and "keys" not in identity:
            ranges.setdefault((path, size, str(identity.get("version"))), []).append((int(rows[0]), int(rows[1])))
    counts = {}
    for key, found in ranges.items():
        found.sort()
        expected = row_ranges(found[-1][1], rows_per_shard)
        if found == expected and found[-1][1] - found[-1][0] < rows_per_shard:
            counts[key] = found[-1][1]
    return counts


def row_ranges(total: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) of each shard of ``total`` rows (or keys), ``size`` a shard."""
    return [(start, min(start + size, total)) for start in range(0, total, size)]


IMAGE_TYPES = (
    "binary or large_binary (encoded image bytes), or a struct with a binary field 'bytes' (Hugging Face's Image)"
)
CAPTION_TYPES = "string or large_string"


def check_columns(file: str, schema: pa.Schema, config: InputConfig) -> None:
    """DataError naming the file, the key, the column and its type if the image column or the caption column is
    missing or of a type the CPU stage cannot read (every row would be skipped, and the shard marked done)."""
    for column, key in ((config.image_column, "input.image_column"), (config.caption_column, "input.caption_column")):
        if column not in schema.names:
            raise DataError(
                f"{key}: {file} has no column {column!r}; its columns are {', '.join(schema.names)}. Set {key} to the "
                "column that holds the " + ("image bytes" if key == "input.image_column" else "captions")
            )
    image = schema.field(config.image_column).type
    if not _is_binary(image) and not (pa.types.is_struct(image) and _is_binary(_bytes_field(image))):
        raise DataError(
            f"input.image_column: column {config.image_column!r} of {file} is {image}; expected {IMAGE_TYPES}. "
            "Set input.image_column to the column that holds the image files' bytes (an URL column is not read: "
            "download the images first, e.g. with img2dataset)"
        )
    caption = schema.field(config.caption_column).type
    if pa.types.is_dictionary(caption):
        caption = caption.value_type
    if not (pa.types.is_string(caption) or pa.types.is_large_string(caption)):
        raise DataError(
            f"input.caption_column: column {config.caption_column!r} of {file} is {caption}; expected {CAPTION_TYPES}"
        )


def image_bytes(value: object) -> bytes | None:
    """An image column's value as the image file's bytes: the value of a binary column, the ``bytes`` field of a
    struct (Hugging Face's Image: ``{"bytes": ..., "path": ...}``, with bytes null when the image was not
    embedded); else None (the row is skipped as missing_image)."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return value if isinstance(value, bytes) else None


def _is_binary(value_type: pa.DataType | None) -> bool:
    return value_type is not None and (pa.types.is_binary(value_type) or pa.types.is_large_binary(value_type))


def _bytes_field(struct: pa.StructType) -> pa.DataType | None:
    index = struct.get_field_index("bytes")
    return struct.field(index).type if index >= 0 else None
