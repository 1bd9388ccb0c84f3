"""The rows an evaluation samples and compares against: the first eval.num_samples rows of data.val (or of the set an
offline evaluation names), grouped by latent shape (aspect-ratio buckets), with their captions, texts and labels; all of
them, or only those one part of the set takes (an offline evaluation's Ray task: :func:`read_eval_rows`' ``part``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.config.schema import Config
from sdtrain.data.added_columns import BUCKET_COLUMN, AddedColumns
from sdtrain.data.decode import caption_array, column_layout, to_array
from sdtrain.data.footer import read_schema
from sdtrain.data.listing import list_dataset
from sdtrain.data.metadata import bucket_shapes, token_id_columns
from sdtrain.data.rows import RowBatch, RowReader
from sdtrain.errors import DataError
from sdtrain.evaluation.measures import part_range
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import raise_if_unavailable

READ_BATCH = 1024
"""Rows decoded at a time: a data.val file may hold gigabytes of caption embeddings."""


@dataclass
class ShapeGroup:
    """The rows of data.val's first eval.num_samples of one latent shape (an aspect-ratio bucket)."""

    shape: tuple[int, int, int]
    """(C, H, W) of their latents: what they are sampled at."""
    rows: np.ndarray
    """Their positions among the rows (EvalRows.captions, .texts, .labels), ascending."""
    latents: np.ndarray | None
    """(n, C, H, W) as stored; None for rows without images (prompts in words: no reference of their own)."""
    first: int = 0
    """Where the first of these rows is among the whole group's (rows read for one part: :func:`read_eval_rows`)."""
    size: int | None = None
    """The whole group's rows; None: these are all of them."""

    def share(self, part: tuple[int, int]) -> tuple[slice, tuple[int, int]]:
        """The rows here (a slice of ``rows`` and ``latents``) that part k of n = ``part`` of the whole group takes,
        and (where the first of them is in the whole group, the whole group's rows): what each row's noise is drawn
        by, so that it is the same in every part. Rows read for one part give that part only."""
        size = len(self.rows) if self.size is None else self.size
        first, stop = part_range(size, part)
        if first == stop:
            return slice(0, 0), (first, size)
        if not self.first <= first <= stop <= self.first + len(self.rows):
            raise ValueError(
                f"part {part[0]} of {part[1]} takes rows {first}-{stop - 1} of the group; these are its rows "
                f"{self.first}-{self.first + len(self.rows) - 1}"
            )
        return slice(first - self.first, stop - self.first), (first, size)


@dataclass
class EvalRows:
    """The first eval.num_samples rows of data.val: what every evaluation of a run samples and compares against."""

    groups: list[ShapeGroup]
    """The rows by latent shape: one group for data of one shape; a bucket each for aspect-ratio buckets (each sample
    is generated at its row's bucket and compared with the images of the same rows)."""
    captions: np.ndarray | None
    """(N, L, D) embeddings, or (N, L) token ids; None for prompts in words (texts), which each model's own text
    encoder encodes (:mod:`sdtrain.evaluation.offline`)."""
    texts: list[str] | None
    """eval.text_column's captions, when it is measured (clip_score); or the prompts."""
    labels: np.ndarray | None
    """data.val's label column, for class_agreement."""
    files: list[str]
    """The files the set's rows are in (part of the reference statistics' key)."""
    versions: list[tuple[int, str]]
    """Their (size, version) as listed (the S3 ETag, or the local mtime in ns): a file rewritten in place changes it."""
    pooled: np.ndarray | None = None
    """(N, P) pooled embeddings of caption embeddings, for an SDXL-shaped UNet (data.pooled_caption_column)."""

    def __len__(self) -> int:
        return sum(len(group.rows) for group in self.groups)


def read_eval_rows(
    config: Config,
    latent_shape: tuple[int, ...],
    caption_shape: tuple[int, ...],
    sources: Sequence[str] | None = None,
    key: str = "data.val",
    measured: bool = True,
    pooled_width: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> EvalRows:
    """The first eval.num_samples rows of data.val in file order (fewer if it holds fewer): their columns only, and
    no more of a file than they need. Bucketed files are read at each row's bucket (the buckets their footer names).

    Args:
        latent_shape: (C, H, W) of a row's latents (of data of one shape).
        caption_shape: (L, D) of a caption embedding; a column of token ids holds (L,) a row (each of SDXL's two).
        sources: the files (file, directory or glob; local or a storage URI), instead of data.val.
        key: what named them, in errors.
        measured: whether the rows are sampled (their texts for clip_score and labels for class_agreement are read),
            or only a reference's images.
        pooled_width: an SDXL-shaped UNet's pooled embedding width: caption embeddings are read with their pooled
            embeddings (data.pooled_caption_column).
        part: k of n: only the rows part k of n of each shape group takes (:meth:`ShapeGroup.share`: an offline
            evaluation's task's) are read, from the row groups that hold them; the rows' shapes first, from footers.
    """
    texts, labels = config.eval.clip is not None and measured, config.eval.class_agreement and measured
    extra = ([config.eval.text_column] if texts else []) + (["label"] if labels else [])
    listing = list_dataset(list(sources or config.data.val), key)
    schema = read_schema(listing.paths[0], key)
    buckets = bucket_shapes(schema.metadata, listing.paths[0])
    ids = (
        config.data.caption_column in schema.names and column_layout(schema.field(config.data.caption_column)).token_ids
    )
    columns = config.data.columns
    if ids:  # each tokenizer's ids (SDXL's two), joined: T x L a row
        where = f"{key}: {listing.paths[0]}, column {columns.caption!r}"
        captions = token_id_columns(schema.metadata, where, columns.caption)
        columns = dataclasses.replace(columns, further_ids=captions[1:])
        caption_shape = (caption_shape[0] * len(captions),)
    reader = RowReader(columns, tuple(latent_shape), tuple(caption_shape), extra=tuple(extra))
    added = AddedColumns(config.data.pooled_caption_column, pooled_width, False) if pooled_width and not ids else None
    reader = dataclasses.replace(reader, bucket_shapes=buckets, added=added)
    layout = _layout(reader, listing.paths, f"eval: {key}", config.eval.num_samples)
    chosen, selected = _part_rows(reader, [buckets for _, buckets, _ in layout], part)
    batches = _read(reader, layout, f"eval: {key}", selected)

    def extra_column(name: str) -> pa.ChunkedArray:
        chunks = [chunk for batch in batches for chunk in batch.extra[name].chunks]
        return pa.chunked_array(chunks) if chunks else pa.chunked_array([], pa.int64())  # a part may take no row

    used = [listing.paths.index(file) for file, _, _ in layout]
    return EvalRows(
        groups=_groups(chosen, selected, batches),
        captions=_joined([batch.captions for batch in batches], reader.caption_shape),
        texts=_texts(extra_column, layout, selected, config.eval.text_column) if texts else None,
        labels=extra_column("label").to_numpy() if labels else None,
        files=[listing.paths[i] for i in used],
        versions=[(listing.sizes[i], listing.versions[i]) for i in used],
        pooled=_joined([batch.added["pooled"] for batch in batches], (pooled_width or 0,)) if added else None,
    )


def _texts(column: Callable[[str], pa.ChunkedArray], layout: Layout, selected: np.ndarray, name: str) -> list[str]:
    """The caption texts of the rows at ``selected`` (in order) in ``column(name)``; a null refused naming its file
    and row, before any sample is made (str() would score it as the caption "None")."""
    texts = column(name).to_pylist()
    if None in texts:
        position, files = int(selected[texts.index(None)]), iter(layout)
        file, buckets, _ = next(files)
        while position >= len(buckets):  # to the file it is in, and its row there
            position -= len(buckets)
            file, buckets, _ = next(files)
        raise DataError(
            f"eval.text_column: {file}, column {name!r}, row {position} is null: clip_score scores each sample against "
            "its caption's text; fill it in, or leave out eval.clip"
        )
    return [str(t) for t in texts]


def _joined(arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The rows of ``arrays`` in one array; none: an empty one of rows of ``shape``."""
    return np.concatenate(arrays) if arrays else np.zeros((0, *shape), np.float16)


def _read(reader: RowReader, layout: Layout, where: str, selected: np.ndarray) -> list[RowBatch]:
    """The rows at ``selected`` (ascending positions in the set ``layout`` lays out), decoded; no other file opened."""
    batches: list[RowBatch] = []
    start = 0
    for file, buckets, footer in layout:
        wanted = selected[(selected >= start) & (selected < start + len(buckets))] - start
        if len(wanted):
            batches += _file_rows(reader, (file, footer), where, wanted)
        start += len(buckets)
    if sum(len(batch) for batch in batches) != len(selected):
        raise DataError(f"{where}: {', '.join(f for f, _, _ in layout)} changed while they were read: run again")
    return batches


def _groups(chosen: Chosen, selected: np.ndarray, batches: list[RowBatch]) -> list[ShapeGroup]:
    """The groups of the rows ``selected`` read as ``batches`` (each of one shape, in order of position)."""
    latents: dict[tuple[int, ...], list[np.ndarray]] = {}
    for batch in batches:
        assert batch.latents is not None
        latents.setdefault(tuple(batch.latents.shape[1:]), []).append(batch.latents)
    return [
        ShapeGroup(shape, np.searchsorted(selected, rows), np.concatenate(latents[shape]), first, size)
        for shape, rows, first, size in chosen
    ]


Chosen = list[tuple[tuple[int, int, int], np.ndarray, int, int]]
"""Each shape group's (shape, the rows a part takes as positions in the set, where the first of them is in the group,
the group's rows)."""


def _part_rows(reader: RowReader, buckets: list[np.ndarray], part: tuple[int, int]) -> tuple[Chosen, np.ndarray]:
    """The shape groups of the set's rows (``buckets``: each file's rows' buckets) in the order their shapes first
    come, each with the rows part k of n = ``part`` takes; and all those rows, ascending. A group the part takes no row
    of is left out."""
    codes = np.concatenate(buckets)
    kinds, firsts = np.unique(codes, return_index=True)
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for bucket in kinds[np.argsort(firsts)]:
        shape = reader.bucket_shapes[bucket] if reader.bucket_shapes else reader.latent_shape
        assert shape is not None and len(shape) == 3
        shapes.setdefault((int(shape[0]), int(shape[1]), int(shape[2])), []).append(int(bucket))
    chosen: Chosen = []
    for shape, of_shape in shapes.items():
        positions = np.flatnonzero(np.isin(codes, of_shape))
        first, stop = part_range(len(positions), part)
        if first < stop:
            chosen.append((shape, positions[first:stop], first, len(positions)))
    selected = np.sort(np.concatenate([rows for _, rows, _, _ in chosen])) if chosen else np.zeros(0, np.int64)
    return chosen, selected


Layout = list[tuple[str, np.ndarray, pq.FileMetaData]]
"""The files the set's rows are in, each with its rows' buckets and its footer."""


@contextlib.contextmanager
def _parquet(file: str, where: str, footer: pq.FileMetaData | None = None) -> Iterator[pq.ParquetFile]:
    """``file`` open as parquet (``footer``: its footer, read before); what fails in it a DataError naming ``where``
    and the file (a storage failure past its retries a StorageUnavailable: a retry may get through)."""
    fs, path = filesystem_for(file)
    try:
        with fs.open_input_file(path) as handle:
            yield pq.ParquetFile(handle, metadata=footer)
    except DataError as error:
        raise DataError(f"{where}: {file}: {error}") from None
    except (OSError, pa.ArrowException) as error:
        raise_if_unavailable(error, f"{where}: {file}")
        reason = " ".join(str(error).split())
        raise DataError(f"{where}: {file} cannot be read ({reason}): damaged, or changed since checked") from None


def _layout(reader: RowReader, files: Sequence[str], where: str, limit: int) -> Layout:
    """The files the first ``limit`` rows are in, each with its rows' buckets (zeros for data of one shape) and its
    footer: from the footers and a bucketed file's bucket column, no other data read."""
    layout: Layout = []
    left = limit
    for file in files:
        if left <= 0:
            break
        with _parquet(file, where) as parquet:
            rows = min(parquet.metadata.num_rows, left)
            buckets = np.zeros(rows, np.int64)
            if reader.bucket_shapes and rows:
                _check_columns(parquet, [BUCKET_COLUMN])
                column = parquet.iter_batches(batch_size=65536, columns=[BUCKET_COLUMN])
                buckets = np.concatenate([batch.column(0).to_numpy() for batch in _first(column, rows)])[:rows]
        if rows:
            layout.append((file, buckets.astype(np.int64), parquet.metadata))
        left -= rows
    return layout


def _first(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The batches up to the one that holds row ``rows - 1``."""
    for batch in batches:
        yield batch
        rows -= batch.num_rows
        if rows <= 0:
            return


def _check_columns(parquet: pq.ParquetFile, names: list[str]) -> None:
    missing = [c for c in names if c not in parquet.schema_arrow.names]
    if missing:
        raise DataError(f"has no column {missing[0]!r}; its columns are {', '.join(parquet.schema_arrow.names)}")


def _file_rows(
    reader: RowReader, source: tuple[str, pq.FileMetaData], where: str, wanted: np.ndarray
) -> list[RowBatch]:
    """The rows ``wanted`` (ascending row numbers) of a file (``source``: it, and its footer), decoded in runs of one
    bucket: only the row groups that hold them are read, READ_BATCH rows at a time, and only those rows kept."""
    file = source[0]
    names = ([reader.columns.latent] if reader.latent_shape is not None else []) + list(reader.columns.captions)
    added = reader.added.names() if reader.added else []
    names += [c for c in (*reader.extra, *added, *([BUCKET_COLUMN] if reader.bucket_shapes else [])) if c not in names]
    out: list[RowBatch] = []
    with _parquet(file, where, source[1]) as parquet:
        _check_columns(parquet, names)
        sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
        ends = np.cumsum(sizes)
        for group in np.unique(np.searchsorted(ends, wanted, side="right")):
            first = int(ends[group]) - sizes[group]
            rows = wanted[(wanted >= first) & (wanted < ends[group])]
            for batch in parquet.iter_batches(batch_size=READ_BATCH, row_groups=[int(group)], columns=names):
                taken = rows[(rows >= first) & (rows < first + batch.num_rows)]
                if len(taken):
                    table = pa.Table.from_batches([batch]).take(pa.array(taken - first))
                    out += _decoded(reader, table, file, taken)
                first += batch.num_rows
                if first > rows[-1]:
                    break
    return out


def _decoded(reader: RowReader, table: pa.Table, file: str, rows: np.ndarray) -> list[RowBatch]:
    """``table``'s rows (the file's ``rows``) decoded as :class:`RowReader` decodes a batch, a batch per run of one
    bucket."""
    bucket = table.column(BUCKET_COLUMN).to_numpy() if reader.bucket_shapes else np.zeros(table.num_rows, np.int64)
    breaks = np.flatnonzero(np.diff(bucket)) + 1
    out = []
    for start, stop in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(bucket)]]), strict=True):
        part = table.slice(int(start), int(stop - start))
        caption = part.column(reader.columns.caption)
        storage_type = caption.type.storage_type if isinstance(caption.type, pa.ExtensionType) else caption.type
        shape = reader.caption_shape[:1] if pa.types.is_integer(storage_type.value_type) else reader.caption_shape
        captions = caption_array(part, reader.columns.captions, shape, None, int(rows[start]))
        latent_shape = reader.bucket_shapes[int(bucket[start])] if reader.bucket_shapes else reader.latent_shape
        assert latent_shape is not None
        latents = to_array(part.column(reader.columns.latent), latent_shape, reader.columns.latent)
        added = reader.added.decode(part) if reader.added else {}
        extra = {c: part.column(c) for c in reader.extra}
        out.append(RowBatch(file, int(rows[start]), latents, captions, extra, added))
    return out
