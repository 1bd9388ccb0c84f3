"""The one reader of a dataset's rows in file order: validation's Ray Data stream (each rank reads data.val whole),
the retraining gate's validation loss, the evaluation task's rows of data.val, and the captions of sample grids and
``generate.py``. Training reads in the plan's order instead (:mod:`sdtrain.data.streams`).

Light on purpose (numpy and pyarrow): Ray Data's read tasks import it, and a read worker that imported torch would
pay that at its start.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.config.learning import Columns
from sdtrain.data.added_columns import BUCKET_COLUMN, AddedColumns
from sdtrain.data.decode import caption_array, to_array
from sdtrain.data.inspection import DatasetSpec
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import raise_if_unavailable


@dataclass(frozen=True)
class RowBatch:
    """Consecutive rows of one file, decoded."""

    file: str
    first_row: int
    """The file's row number of the batch's first row."""
    latents: np.ndarray | None
    """(N, C, H, W) as stored (float16 or float32); None when the reader reads no latents."""
    captions: np.ndarray
    """(N, L, D) embeddings, or (N, L) int32 token ids."""
    extra: dict[str, pa.ChunkedArray] = field(default_factory=dict)
    """The reader's other columns, as stored."""
    added: dict[str, np.ndarray] = field(default_factory=dict)
    """An SDXL-shaped UNet's added conditioning (sdtrain.data.added_columns): ``pooled``, ``placement``."""

    def __len__(self) -> int:
        return len(self.captions)

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch a model reads: ``latents``, ``captions`` and the added conditioning."""
        assert self.latents is not None
        return {"latents": self.latents, "captions": self.captions, **self.added}


@dataclass(frozen=True)
class RowReader:
    """Which columns of a dataset's files are read and the shapes they decode to.

    Args:
        columns: the latent and caption columns (and the further tokenizers' ids: Columns.further_ids).
        latent_shape: (C, H, W) of a row's latents; None: the latents are not read (captions only).
        caption_shape: (L, D) of an embedding, or (L,) of token ids; a column of integers is read as token ids of
            its first dimension whatever is given.
        vocab_size: token ids must be below it (the file's recorded vocabulary); None: not checked.
        extra: other columns read as they are (a label, a caption's text).
        bucket_shapes: aspect-ratio buckets: each bucket's latent shape; a batch then holds one bucket's rows (the
            file's ``bucket`` column says which), at its shape.
        added: an SDXL-shaped UNet's added conditioning columns, read into each batch's ``added``.
    """

    columns: Columns
    latent_shape: tuple[int, ...] | None
    caption_shape: tuple[int, ...]
    vocab_size: int | None = None
    extra: tuple[str, ...] = ()
    bucket_shapes: tuple[tuple[int, int, int], ...] | None = None
    added: AddedColumns | None = None

    @classmethod
    def of(cls, spec: DatasetSpec, columns: Columns, extra: Sequence[str] = ()) -> RowReader:
        """The reader of a checked dataset's rows."""
        vocab = spec.token_ids.vocab_size if spec.token_ids is not None else None
        columns = spec.read_columns(columns)
        return cls(columns, spec.latent_shape, spec.caption_shape, vocab, tuple(extra), spec.bucket_shapes, spec.added)

    def batches(
        self, files: Sequence[str], key: str, batch_size: int | None = None, limit: int | None = None
    ) -> Iterator[RowBatch]:
        """The rows of ``files`` in order, ``batch_size`` at a time (None: a row group at a time), up to ``limit`` rows
        in all; no more of a file is read than the rows taken need. ``key`` names the files in errors."""
        left = limit
        for file in files:
            if left is not None and left <= 0:
                return
            for batch in self.file_batches(file, key, batch_size=batch_size, limit=left):
                if left is not None:
                    left -= len(batch)
                yield batch

    def file_batches(
        self,
        file: str,
        key: str,
        source: tuple[pafs.FileSystem, str] | None = None,
        batch_size: int | None = None,
        limit: int | None = None,
    ) -> Iterator[RowBatch]:
        """One file's rows (``source``: its filesystem and path, when made elsewhere; see :meth:`batches`). A file that
        cannot be read, or rows that do not decode, are a DataError naming ``key`` and the file; a storage failure that
        outlasted its retries is a StorageUnavailable naming both (an OSError: a retry may get through)."""
        fs, path = source if source is not None else filesystem_for(file)
        try:
            with fs.open_input_file(path) as handle:
                yield from self._decoded(pq.ParquetFile(handle), file, key, batch_size, limit)
        except DataError as error:  # rows that do not decode to the checked shapes, or ids past the vocabulary
            raise DataError(f"{key}: {file}: {error}") from None
        except (OSError, pa.ArrowException) as error:
            raise_if_unavailable(error, f"{key}: {file}")
            reason = " ".join(str(error).split())
            raise DataError(
                f"{key}: {file} cannot be read ({reason}). The file is damaged or changed since the run started: "
                "replace or remove it and re-run (the run resumes from its latest checkpoint)"
            ) from None

    def _decoded(
        self, parquet: pq.ParquetFile, file: str, key: str, batch_size: int | None, limit: int | None
    ) -> Iterator[RowBatch]:
        names = ([self.columns.latent] if self.latent_shape is not None else []) + list(self.columns.captions)
        added = self.added.names() if self.added else []
        names += [c for c in (*self.extra, *added, *([BUCKET_COLUMN] if self.bucket_shapes else [])) if c not in names]
        missing = [c for c in names if c not in parquet.schema_arrow.names]
        if missing:
            raise DataError(f"has no column {missing[0]!r}; its columns are {', '.join(parquet.schema_arrow.names)}")
        first = 0
        for table in _tables(parquet, names, batch_size, limit):
            for offset, part in self._one_shape(table):
                yield self._decode(part, file, first + offset)
            first += table.num_rows

    def _one_shape(self, table: pa.Table) -> Iterator[tuple[int, pa.Table]]:
        """The parts of ``table`` of one latent shape, with their first row in it: the whole table, or each run of
        one bucket."""
        if not self.bucket_shapes:
            yield 0, table
            return
        bucket = table.column(BUCKET_COLUMN).to_numpy()
        breaks = np.flatnonzero(np.diff(bucket)) + 1
        for start, stop in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(bucket)]]), strict=True):
            yield int(start), table.slice(int(start), int(stop - start))

    def _decode(self, table: pa.Table, file: str, first: int) -> RowBatch:
        caption = table.column(self.columns.caption)
        storage_type = caption.type.storage_type if isinstance(caption.type, pa.ExtensionType) else caption.type
        ids = pa.types.is_integer(storage_type.value_type)
        shape = self.caption_shape[:1] if ids else self.caption_shape
        captions = caption_array(table, self.columns.captions, shape, self.vocab_size if ids else None, first)
        latents = None
        if self.latent_shape is not None:
            shape = self.latent_shape
            if self.bucket_shapes:  # one bucket's rows (_one_shape)
                shape = self.bucket_shapes[int(table.column(BUCKET_COLUMN)[0].as_py())]
            latents = to_array(table.column(self.columns.latent), shape, self.columns.latent)
        added = self.added.decode(table) if self.added else {}
        return RowBatch(file, first, latents, captions, {c: table.column(c) for c in self.extra}, added)


def _tables(
    parquet: pq.ParquetFile, columns: list[str], batch_size: int | None, limit: int | None
) -> Iterator[pa.Table]:
    """The file's rows as tables: each row group, or ``batch_size`` rows at a time; ``limit`` rows at most."""
    left = limit if limit is not None else parquet.metadata.num_rows
    if batch_size is None:
        parts = (parquet.read_row_group(g, columns=columns) for g in range(parquet.metadata.num_row_groups))
    else:
        batches = parquet.iter_batches(batch_size=min(batch_size, max(left, 1)), columns=columns)
        parts = (pa.Table.from_batches([b]) for b in batches)
    for table in parts:
        if left <= 0:
            return
        table = table.slice(0, left)
        left -= table.num_rows
        yield table
