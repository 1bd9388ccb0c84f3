"""The rows ``start``..``stop`` of a parquet input file, read in bounded memory.

A shard is a range of a file's rows, and img2dataset or pyarrow's writers may put a whole file in one row group (one
group under 1Mi rows by default): a shard's rows are streamed from its groups PARQUET_BATCH_ROWS at a time through a
buffered stream (PARQUET_BUFFER: a request each on object storage), the rows of the group before the shard's first
decoded and dropped a batch at a time. Read whole, a 10 GiB group was held by each of its shards' tasks, for a few
thousand of its rows. (Every such shard still reads the group's bytes up to its last row: planning warns of the
files whose groups are larger than input.rows_per_shard, sdtrain.preprocess.planning.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow.parquet as pq

from sdtrain.storage.filesystems import filesystem_for

PARQUET_BATCH_ROWS = 64
"""Rows decoded, and copied to Python, at once."""
PARQUET_BUFFER = 8 << 20
"""Bytes of each column chunk read at once (a ranged GET on object storage); 0 would read a column's chunk whole."""


def parquet_values(source: str, start: int, stop: int, columns: list[str]) -> Iterator[tuple[int, object, object]]:
    """(the row's number in the file, its image value, its caption value) of rows ``start``..``stop`` of ``source``
    (``columns``: the image column's name, the caption column's)."""
    fs, path = filesystem_for(source)
    with fs.open_input_file(path) as handle:
        reader = pq.ParquetFile(handle, buffer_size=PARQUET_BUFFER, pre_buffer=False)
        first = 0  # the file's number of group g's first row
        for g in range(reader.num_row_groups):
            rows = reader.metadata.row_group(g).num_rows
            if first < stop and start < first + rows:
                yield from _group_values(reader, g, first, start, stop, columns)
            first += rows
            if first >= stop:
                break


def _group_values(
    reader: pq.ParquetFile, group: int, first: int, start: int, stop: int, columns: list[str]
) -> Iterator[tuple[int, object, object]]:
    """Those of the rows of row group ``group`` (its first row the file's ``first``): a batch at a time, one group's
    (a batch of many small groups' rows was as large as a group read whole)."""
    position = first  # the file's number of the batch's first row
    batches = reader.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group], columns=columns, use_threads=False)
    for batch in batches:
        low, high = max(start, position), min(stop, position + batch.num_rows)
        if low < high:
            part = batch.slice(low - position, high - low)
            images, captions = (part.column(name).to_pylist() for name in columns)
            for offset, (image, caption) in enumerate(zip(images, captions, strict=True)):
                yield low + offset, image, caption
        position += batch.num_rows
        if position >= stop:
            break
