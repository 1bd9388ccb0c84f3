"""What a dataset holds (files, rows, tensor shapes), read from parquet footers and one row.

Runs on the driver before Ray starts any worker, so that a wrong column, shape or file fails
in seconds with an error that names the file and the column, instead of on every worker.
A run's later starts take the footers from the dataset index instead (sdtrain.data.dataset_index).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

# Registers Ray's tensor extension types with pyarrow, so their shapes are read from footers.
import ray.data  # noqa: F401

from sdtrain.config.learning import Columns
from sdtrain.data.added_columns import AddedColumns
from sdtrain.data.decode import ColumnLayout, column_layout
from sdtrain.data.footer import read_footer
from sdtrain.data.footer_counts import FooterCounts
from sdtrain.data.metadata import (
    BUCKET_SHAPES,
    LATENT_SCALING_FACTOR,
    TEXT_ENCODER_SOURCE,
    TOKEN_ID_COLUMNS,
    TokenIds,
    bucket_runs,
    bucket_shapes,
    describe_scaling,
    latent_scaling,
    token_id_columns,
    token_ids,
)
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import DRIVER_READS, raise_if_unavailable, s3_connections
from sdtrain.storage.uris import split_s3

# Footers read at once: a bounded number of requests in flight, whatever the number of files; on as many S3
# connections (pyarrow's client keeps 25 by default).
FOOTER_READS = DRIVER_READS


@dataclass(frozen=True)
class DatasetSpec:
    files: tuple[str, ...]
    rows_per_file: tuple[int, ...]
    latent_shape: tuple[int, int, int]
    caption_shape: tuple[int, ...]
    """What a row of the caption column holds: L x D embeddings, or L token ids (``token_ids`` set)."""
    content_digest: str = ""
    """sha256 (16 hex) of each file's (path, size, version = ETag or mtime_ns), in file order: a file
    rewritten in place changes it (sdtrain.data.dataset_index). Empty where sizes and versions are unknown."""
    token_ids: TokenIds | None = None
    """The caption column holds token ids, encoded in the training step by this text encoder; None: embeddings."""
    bucket_shapes: tuple[tuple[int, int, int], ...] | None = None
    """Aspect-ratio buckets: each bucket's latent shape (``latent_shape`` is then the one most rows have); None: every
    row has ``latent_shape``."""
    runs: np.ndarray | None = field(default=None, compare=False)
    """Bucketed data: (file, bucket, rows) of each file's runs, in file and row order (sdtrain.data.bucket_order)."""
    added: AddedColumns | None = None
    """For an SDXL-shaped UNet: the added conditioning's columns, read beside the others (the driver's data check
    sets it from the UNet and the schema: sdtrain.data.added_columns)."""
    vae_downsampling: int = 8
    """Pixels per latent side of the VAE the latents were made with (the files' sdtrain.vae_downsampling)."""

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_file)

    @property
    def largest_latent_shape(self) -> tuple[int, int, int]:
        """The latent shape of the most pixels: what a step's memory is sized for."""
        if self.bucket_shapes is None:
            return self.latent_shape
        return max(self.bucket_shapes, key=lambda shape: shape[1] * shape[2])

    def embedding_shape(self, cross_attention_dim: int) -> tuple[int, int]:
        """L x D of the captions the UNet sees: as stored, or the text encoder's output for token ids (whose width
        the data check found equal to the UNet's ``cross_attention_dim``)."""
        if self.token_ids is None:
            return (self.caption_shape[0], self.caption_shape[1])
        return (self.caption_shape[0] // self.token_ids.sequences, cross_attention_dim)

    def read_columns(self, columns: Columns) -> Columns:
        """``columns`` (data.latent_column, data.caption_column) with the further tokenizers' id columns the files
        record: what a reader reads."""
        if self.token_ids is None:
            return columns
        return dataclasses.replace(columns, further_ids=self.token_ids.columns[1:])


@dataclass(frozen=True)
class CheckedSchema:
    """The schema a dataset's columns were checked with: the footer of ``file``."""

    file: str
    schema: pa.Schema
    columns: Columns

    def layouts(self, key: str) -> tuple[ColumnLayout, ColumnLayout]:
        return column_layouts(key, self.file, self.schema, self.columns)

    def row_columns(self, key: str) -> list[str]:
        """The columns a first row is read with: the latents and captions (each tokenizer's ids), and a bucketed
        file's bucket."""
        return [self.columns.latent, *self.caption_columns(key), *(["bucket"] if self.buckets is not None else [])]

    def caption_columns(self, key: str) -> tuple[str, ...]:
        """data.caption_column, and for token ids of several tokenizers the further tokenizers' id columns."""
        ids = self.token_ids(key)
        return ids.columns if ids is not None else (self.columns.caption,)

    def counted_columns(self, key: str) -> dict[str, str]:
        """The columns whose values per row the footers are checked for (sdtrain.data.footer_counts), each with the
        key that names it: the latents, unless bucketed (rows differ by bucket), and the captions (each tokenizer's
        ids)."""
        captions = self.caption_columns(key)
        latent = {self.columns.latent: "data.latent_column"} if self.buckets is None else {}
        return {**latent, captions[0]: "data.caption_column", **{c: TOKEN_ID_COLUMNS for c in captions[1:]}}

    def row_shapes(
        self, key: str, latent_shape: tuple[int, ...], caption_shape: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        """The shape of a row of each counted column, for the data's latent and caption shapes (token ids of T
        tokenizers: T x L in ``caption_shape``, L in each column)."""
        captions = self.caption_columns(key)
        per_column = (math.prod(caption_shape) // len(captions),) if len(captions) > 1 else caption_shape
        return {c: latent_shape if c == self.columns.latent else per_column for c in self.counted_columns(key)}

    @property
    def buckets(self) -> tuple[tuple[int, int, int], ...] | None:
        """The latent shapes of the file's aspect-ratio buckets (its metadata), or None: one shape."""
        return bucket_shapes(self.schema.metadata, self.file)

    @functools.cached_property
    def further_id_columns(self) -> tuple[str, ...]:
        """For token ids of several tokenizers, the columns after data.caption_column's (parsed once: each file's
        footer is held to them)."""
        return token_id_columns(self.schema.metadata, self.file, self.columns.caption)[1:]

    def token_ids(self, key: str) -> TokenIds | None:
        """What the caption column's token ids are for (its file's metadata); None for embeddings."""
        caption = self.layouts(key)[1]
        if not caption.token_ids:
            return None
        where = f"{key}: {self.file}, column {self.columns.caption!r}"
        ids = token_ids(self.schema.metadata, where, self.columns.caption)
        for column in ids.columns[1:]:  # each further tokenizer's ids stored as the first's are
            if column not in self.schema.names:
                raise DataError(
                    f"{where}: the file records token ids in the columns {list(ids.columns)} ({TOKEN_ID_COLUMNS}) but "
                    f"has no column {column!r}; its columns are {', '.join(self.schema.names)}"
                )
            try:
                layout = column_layout(self.schema.field(column))
            except DataError as e:
                raise DataError(f"{key}: {self.file}, column {column!r} ({TOKEN_ID_COLUMNS}) {e}") from None
            if layout != caption:
                raise DataError(
                    f"{key}: {self.file}, column {column!r} ({TOKEN_ID_COLUMNS}) is a {layout.describe()} but "
                    f"{self.columns.caption!r} a {caption.describe()}; every tokenizer's ids must be stored alike"
                )
        return ids


def column_layouts(key: str, file: str, schema: pa.Schema, columns: Columns) -> tuple[ColumnLayout, ColumnLayout]:
    """The layouts of the latent and caption columns in ``file``'s ``schema``, or the DataError naming both."""
    layouts = []
    for column, role in ((columns.latent, "data.latent_column"), (columns.caption, "data.caption_column")):
        if column not in schema.names:
            raise DataError(
                f"{key}: {file} has no column {column!r} ({role}); its columns are "
                f"{', '.join(schema.names)}. Set {role} to the column that holds the data."
            )
        try:
            layouts.append(column_layout(schema.field(column)))
        except DataError as e:
            raise DataError(f"{key}: {file}, column {column!r} ({role}) {e}") from None
    if layouts[0].token_ids:
        raise DataError(
            f"{key}: {file}, column {columns.latent!r} (data.latent_column) holds {layouts[0].value_type} values; "
            "expected float16 or float32 (integers are read as caption token ids only)"
        )
    return layouts[0], layouts[1]


def check_same_layouts(key: str, file: str, schema: pa.Schema, reference: CheckedSchema) -> None:
    """``file`` stores both columns as ``reference`` does, else the DataError naming both files."""
    mine = column_layouts(key, file, schema, reference.columns)
    for column, layout, first in zip(reference.columns.names(), mine, reference.layouts(key), strict=True):
        if layout != first:
            raise DataError(
                f"{key}: column {column!r} is a {layout.describe()} in {file} but a "
                f"{first.describe()} in {reference.file}; every file must store it the same way"
            )
    if mine[1].token_ids:
        _check_same_token_ids(key, file, schema, reference, mine[1])
    where = f"{key}: {file}"
    if bucket_shapes(schema.metadata, where) != reference.buckets:
        raise DataError(
            f"{key}: {file} holds latents in the buckets {bucket_shapes(schema.metadata, where)} but {reference.file} "
            f"in {reference.buckets} ({BUCKET_SHAPES}); every file of a dataset must share one set of buckets"
        )
    scale, first_scale = latent_scaling(schema.metadata), latent_scaling(reference.schema.metadata)
    if scale != first_scale:
        # Training scales every row alike: a mixed dataset would train half its rows at the wrong scale.
        raise DataError(
            f"{key}: {file} records {describe_scaling(scale)} but {reference.file} records "
            f"{describe_scaling(first_scale)} (parquet metadata {LATENT_SCALING_FACTOR}); every file of a dataset "
            "must hold latents scaled the same way: re-encode one of them or train on them separately"
        )


def _check_same_token_ids(key: str, file: str, schema: pa.Schema, reference: CheckedSchema, ids: ColumnLayout) -> None:
    """``file``'s token ids (its caption column's layout ``ids``) are for the reference's tokenizers, in the same
    columns, each stored as its caption column is; else the DataError naming both files or the column."""
    for name in (TEXT_ENCODER_SOURCE, TOKEN_ID_COLUMNS):
        value, first_value = ((s.metadata or {}).get(name.encode(), b"").decode() for s in (schema, reference.schema))
        if value != first_value:
            # One text encoder encodes every row in the step: ids of another tokenizer would mean other words.
            raise DataError(
                f"{key}: {file} records {value or 'nothing'} ({name}) beside its token ids, but {reference.file} "
                f"{first_value or 'nothing'}; every file of a dataset must hold ids of the same tokenizers, in the "
                "same columns"
            )
    for column in reference.further_id_columns:  # the file records the same columns (above)
        try:
            stored = column_layout(schema.field(column)) if column in schema.names else None
        except DataError as e:
            raise DataError(f"{key}: {file}, column {column!r} ({TOKEN_ID_COLUMNS}) {e}") from None
        if stored != ids:
            what = f"stores it as a {stored.describe()}" if stored is not None else "has no such column"
            raise DataError(
                f"{key}: {file} records token ids in column {column!r} ({TOKEN_ID_COLUMNS}) but {what}; its first "
                f"tokenizer's ids are a {ids.describe()}, and every tokenizer's must be stored alike"
            )


def read_footers(
    files: Sequence[str],
    key: str,
    columns: Columns,
    reference: CheckedSchema | None = None,
    progress: Callable[[int, int], None] | None = None,
    runs: dict[int, list[tuple[int, int]]] | None = None,
    counts: FooterCounts | None = None,
) -> tuple[list[int], CheckedSchema | None]:
    """The rows of each of ``files`` from its footer, each footer's columns checked against ``reference`` (without
    one, the first file's), and each row group's values per row in them (:class:`FooterCounts`: ``counts``, else
    held to the first file's). At most FOOTER_READS requests in flight, one footer held at a time; ``progress(done,
    total)`` is called every 10 s and at every tenth of the files. ``runs``: for bucketed data, filled with each
    file's runs by its position in ``files``.

    Returns the rows per file and the reference (None only when ``files`` is empty).
    """
    if not files:
        return [], reference
    sources = _Sources()
    rows = [0] * len(files)
    counts = counts if counts is not None else FooterCounts()
    start = 0
    if reference is None:
        footer = read_footer(files[0], key, sources)
        schema, rows[0] = footer.schema.to_arrow_schema(), footer.num_rows
        reference = CheckedSchema(files[0], schema, columns)
        reference.layouts(key)  # the first file's own errors: a missing column, an unreadable type
        start = 1
        if runs is not None and reference.buckets is not None:
            runs[0] = bucket_runs(schema.metadata, f"{key}: {files[0]}", rows[0], len(reference.buckets))
        counts.check(key, files[0], footer, reference.counted_columns(key), runs.get(0) if runs is not None else None)
    checked = reference
    buckets, counted = checked.buckets, checked.counted_columns(key)

    def read(index: int) -> tuple[int, int]:
        footer = read_footer(files[index], key, sources)
        schema, num_rows = footer.schema.to_arrow_schema(), footer.num_rows
        check_same_layouts(key, files[index], schema, checked)
        if runs is not None and buckets is not None:
            runs[index] = bucket_runs(schema.metadata, f"{key}: {files[index]}", num_rows, len(buckets))
        counts.check(key, files[index], footer, counted, runs.get(index) if runs is not None else None)
        return index, num_rows

    for index, num_rows in _concurrently(read, range(start, len(files)), len(files), progress):
        rows[index] = num_rows
    return rows, reference


_PROGRESS_S = 10.0


def _concurrently(
    read: Callable[[int], tuple[int, int]], indices: range, total: int, progress: Callable[[int, int], None] | None
) -> Iterator[tuple[int, int]]:
    """``read(i)`` for each of ``indices``, FOOTER_READS at a time, as they finish; ``progress(done, total)`` every
    10 s and at every tenth of ``total``. The first failure cancels the rest and is raised."""
    done = total - len(indices)
    last_report, next_tenth = time.monotonic(), total // 10
    with ThreadPoolExecutor(max_workers=FOOTER_READS) as pool:
        pending: set[Future] = set()
        upcoming = iter(indices)
        exhausted = False
        while not exhausted or pending:
            while not exhausted and len(pending) < 2 * FOOTER_READS:
                index = next(upcoming, None)
                if index is None:
                    exhausted = True
                else:
                    pending.add(pool.submit(read, index))
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    yield future.result()
                except BaseException:
                    for other in pending:
                        other.cancel()
                    raise
                done += 1
            if progress is not None and (time.monotonic() - last_report >= _PROGRESS_S or done >= next_tenth):
                progress(done, total)  # every 10 s, and every tenth of the files
                last_report = time.monotonic()
                next_tenth = (done * 10 // total + 1) * total // 10


class _Sources:
    """One filesystem per S3 bucket (making one per file would cost a client per footer)."""

    def __init__(self):
        self._buckets: dict[str, pafs.FileSystem] = {}
        self._lock = threading.Lock()  # the reads' threads ask for them

    def __call__(self, file: str) -> tuple[pafs.FileSystem, str]:
        if not file.startswith("s3://"):
            return filesystem_for(file)
        bucket, key = split_s3(file)
        with self._lock:
            if bucket not in self._buckets:
                with s3_connections(FOOTER_READS):  # a connection per read in flight
                    self._buckets[bucket] = filesystem_for(file)[0]
        return self._buckets[bucket], f"{bucket}/{key}"


def first_row(file: str, key: str, columns: list[str]) -> pa.Table:
    """The first row of ``file``'s ``columns``; a DataError naming ``key`` and the file if it cannot be read (missing,
    denied, damaged pages under a footer that reads), a StorageUnavailable naming both if storage failed past its
    retries."""
    fs, path = filesystem_for(file)
    try:
        with fs.open_input_file(path) as handle:
            batch = next(pq.ParquetFile(handle).iter_batches(batch_size=1, columns=columns))
    except (OSError, pa.ArrowException, StopIteration) as e:  # a footer that reads, over damaged pages
        raise_if_unavailable(e, f"{key}: cannot read the first row of {file}")
        raise DataError(f"{key}: cannot read the first row of {file}: {type(e).__name__}: {e}") from None
    return pa.Table.from_batches([batch.slice(0, 1)])
