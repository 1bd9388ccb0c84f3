"""The index beside a directory of parquet files (``_sdtrain_index.parquet``, paths relative to the directory), written
by the preprocessing job after each shard and by ``entrypoints/index.py`` for latents made elsewhere: training on
the directory then reads no footer (:mod:`sdtrain.data.dataset_index`), and a run sealed on it lists nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from sdtrain.config.learning import Columns
from sdtrain.data.dataset_index import IndexStats, read_footers_with_progress, recorded_counts
from sdtrain.data.index_format import DatasetIndex, join_path, pack_runs, read_index, recorded_rows, write_index
from sdtrain.data.inspection import CheckedSchema, first_row, read_footers
from sdtrain.data.listing import DIRECTORY_INDEX, Listing, list_dataset
from sdtrain.errors import DataError
from sdtrain.storage.uris import is_uri


def write_directory_index(
    directory: str,
    columns: Columns,
    known_rows: Mapping[str, int] | None = None,
    sample: str | None = None,
    key: str = "output.path",
) -> IndexStats | None:
    """The index of the parquet files under ``directory``, written beside them (``_sdtrain_index.parquet``,
    paths relative to the directory), for training on it to read no footer. ``known_rows``: rows of files by
    name relative to the directory (the preprocessing job's shard records); the others' rows come from the index
    already there where their size and version are unchanged, else from their footers. The schema is the footer
    of ``sample`` (a name relative to the directory: a file the writer just wrote) or else of the first file; the
    values per row, the first row of that file or else of the first with rows. None if the directory holds no
    parquet file with rows. ``key``: the name errors give the directory. Bucketed data (aspect-ratio buckets) records
    each file's runs too, from the index already there or from its footer: give it no ``known_rows``."""
    try:
        listing = list_dataset([directory], key)
    except DataError:
        return None
    base = directory.rstrip("/")
    if not is_uri(base):
        base = os.path.abspath(os.path.expanduser(base))
    rows, to_read = _known_rows(listing, base, known_rows)
    runs: list[bytes | None] = [None] * len(listing)
    before = _previous_directory_index(listing, base, columns) if to_read else None
    if before is not None:
        unknown = _rows_of(before, listing, to_read, rows, runs)
        if len(unknown) == len(to_read):
            before = None  # nothing of it still stands: its schema is no reference for the new files either
        elif not unknown and _same_files(before, listing):
            # Rewriting it would change its version and make every run sealed on it list the directory again.
            return IndexStats(len(listing), len(listing), 0, 0, 0, None, written=False)
        to_read = unknown

    read_files = [listing.paths[i] for i in to_read]
    read_runs: dict[int, list[tuple[int, int]]] = {}
    reference, counts = (before.checked if before is not None else None), recorded_counts(key, before)
    read_rows, checked = read_footers_with_progress(read_files, key, columns, reference, read_runs, counts)
    for i, num_rows in zip(to_read, read_rows, strict=True):
        rows[i] = num_rows
    for k, file_runs in read_runs.items():
        runs[to_read[k]] = pack_runs(file_runs)
    sample_path = join_path(base, sample) if sample is not None else None
    index = _new_index(
        listing, rows, checked, columns, key, {p: i for i, p in enumerate(listing.paths)}.get(sample_path or "")
    )
    if index is None:
        return None
    index.runs = _known_runs(key, index.checked, listing, runs)
    write_index(join_path(base, DIRECTORY_INDEX), index, base)
    return IndexStats(len(listing), len(listing) - len(to_read), len(to_read), 0, 1, None)


def _new_index(
    listing: Listing, rows: np.ndarray, checked: CheckedSchema | None, columns: Columns, key: str, sample: int | None
) -> DatasetIndex | None:
    """The index of ``listing`` with ``rows``: the schema ``checked`` (None: read from ``sample``'s footer, or else
    the first file's), the values per row from ``sample``'s first row, or else the first file with rows'."""
    if checked is None:  # every file's rows were known: one footer for the schema
        first = sample if sample is not None else 0
        _, checked = read_footers(listing.paths[first : first + 1], key, columns)
        assert checked is not None
    with_rows = np.flatnonzero(rows)
    if len(with_rows) == 0:
        return None
    file = listing.paths[sample if sample is not None and rows[sample] else int(with_rows[0])]
    row = first_row(file, key, checked.row_columns(key))
    image_layout, caption_layout = checked.layouts(key)
    latent_shape = image_layout.shape or (_values(row, columns.latent, key),)
    caption_shape = caption_layout.shape or (_values(row, columns.caption, key),)
    if caption_layout.token_ids:  # what a batch holds: each tokenizer's ids joined (SDXL's two)
        caption_shape = (caption_shape[0] * len(checked.caption_columns(key)),)
    return DatasetIndex(listing.paths, listing.sizes, listing.versions, rows, checked, latent_shape, caption_shape)


def _rows_of(
    index: DatasetIndex, listing: Listing, positions: list[int], rows: np.ndarray, runs: list[bytes | None]
) -> list[int]:
    """Rows (and runs) of the files at ``positions`` that ``index`` records as they are listed; the others."""
    found, unknown = recorded_rows(index, listing, positions)
    for i, num_rows, j in found:
        rows[i] = num_rows
        if index.runs is not None:
            runs[i] = index.runs[j]
    return unknown


def _known_runs(key: str, checked, listing: Listing, runs: list[bytes | None]) -> list[bytes] | None:
    """Bucketed data: every file's runs (from the index already there or its footer); None for one shape."""
    if checked.buckets is None:
        return None
    missing = [listing.paths[i] for i, r in enumerate(runs) if r is None]
    if missing:
        raise DataError(f"{key}: the bucket runs of {missing[0]} are not known: index bucketed data without known_rows")
    return [r for r in runs if r is not None]


def _known_rows(listing: Listing, base: str, known_rows: Mapping[str, int] | None) -> tuple[np.ndarray, list[int]]:
    """Rows of the listed files the writer knows (by name relative to ``base``), and the positions of the others."""
    rows = np.zeros(len(listing), np.int64)
    to_read = []
    for i, path in enumerate(listing.paths):
        name = path[len(base) + 1 :] if path.startswith(base + "/") else None
        if known_rows is not None and name is not None and name in known_rows:
            rows[i] = known_rows[name]
        else:
            to_read.append(i)
    return rows, to_read


def _previous_directory_index(listing: Listing, base: str, columns: Columns) -> DatasetIndex | None:
    """The directory index already beside the files, if it was written for these columns: a re-index reads the
    footers of what changed only, and checks them against the schema it recorded."""
    found = next((f for f in listing.indexes if f.base.rstrip("/") == base), None)
    index = read_index(found.uri, found.base) if found is not None else None
    if index is None or index.checked.columns != columns:
        return None
    return index


def _same_files(index: DatasetIndex, listing: Listing) -> bool:
    return (
        index.paths == listing.paths
        and index.versions == listing.versions
        and np.array_equal(np.asarray(index.sizes, np.int64), np.asarray(listing.sizes, np.int64))
    )


def _values(row: pa.Table, column: str, key: str) -> int:
    value = row.column(column)[0]
    if not value.is_valid:
        raise DataError(f"{key}: column {column!r}: the first row is null")
    return len(value)
