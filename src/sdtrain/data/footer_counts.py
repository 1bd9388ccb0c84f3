"""What a parquet footer counts beyond a file's rows, checked as the footers are read: the length of every row of the
latent and caption columns, and the size of the row groups.

A row group's leaf column chunk counts its values: num_rows x values-per-row when every row has that length. A null
row counts one slot and a row of another length its own, so a file of latents of another resolution, of captions of
another text encoder, or with a null row shows in the count: it is refused on the driver, naming the file, the column
and the row group, instead of failing the read task that reaches it days into the run. The footers are read anyway;
the check costs about 0.7 µs a row group and column, and 15 µs a file (0.2 ms for 10k rows in row groups of 64).

A training read of data.shuffle_chunk_rows rows reads its whole row group, so the largest row group is kept too
(sdtrain.driver.data_check warns of row groups far larger than a chunk), and so are the bucketed files whose row
groups do not start at each bucket run, where a chunk of a run (sdtrain.data.bucket_runs) spans parts of two: ~10 µs
a file more.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from sdtrain.errors import DataError


@dataclass(frozen=True)
class _Length:
    """The values a row of a column must hold, and where that was found (for errors)."""

    values: int
    where: str
    file: str = ""
    """The file whose row groups said so; empty for a length an index recorded."""


class FooterCounts:
    """The values per row of each counted column, held to the first file's (or to what an index recorded), and the
    largest row group, over the footers read at a start; shared by the threads that read them.

    Args:
        recorded: each counted column's row shape, as the reference index records it (``source`` names that index's
            reference file); None: every file is held to the first file read.
    """

    def __init__(self, recorded: Mapping[str, tuple[int, ...]] | None = None, source: str = ""):
        self._lengths = {
            column: _Length(
                math.prod(shape), f"as the dataset index records ({_shape(shape)}; its reference file {source})"
            )
            for column, shape in (recorded or {}).items()
        }
        self._lock = threading.Lock()
        self.largest_row_group: tuple[int, str] | None = None
        """(rows, file) of the largest row group of the footers read; None while none was."""
        self.runs_across_groups: tuple[int, str] | None = None
        """(files, one of them) of the bucketed files read whose row groups do not start at each run; None: none."""

    def check(
        self,
        key: str,
        file: str,
        footer: pq.FileMetaData,
        columns: Mapping[str, str],
        runs: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Every row group with rows of ``file`` holds the same values per row in each of ``columns`` (each with the
        config key that names it) as every file before it; else the DataError naming the first row group that
        does not. A bucketed file's ``runs`` ((bucket, rows) in row order) that do not each start a row group are
        counted: written before sdtrain's preprocessing started a row group at each run, or by another writer."""
        groups = [footer.row_group(index) for index in range(footer.num_row_groups)]
        rows = np.fromiter((group.num_rows for group in groups), np.int64, len(groups))
        with_rows = np.flatnonzero(rows)
        for column, leaf in _leaves(footer, columns).items() if len(with_rows) else ():
            values = np.fromiter((group.column(leaf).num_values for group in groups), np.int64, len(groups))
            self._check_column(key, file, column, columns[column], rows, values, with_rows)
        across = runs is not None and not runs_start_row_groups(runs, rows)
        if len(groups):
            with self._lock:
                if self.largest_row_group is None or rows.max() > self.largest_row_group[0]:
                    self.largest_row_group = (int(rows.max()), file)
                if across:
                    files, example = self.runs_across_groups or (0, file)
                    self.runs_across_groups = (files + 1, example)

    def _check_column(
        self, key: str, file: str, column: str, role: str, rows: np.ndarray, values: np.ndarray, with_rows: np.ndarray
    ) -> None:
        """``values`` of ``column`` in the row groups of ``rows`` hold one number a row, the reference's."""
        first = int(with_rows[0])
        length = self._lengths.get(column)
        if length is None:  # no file settled it yet: the file's first row group with rows is its reference
            if values[first] % rows[first]:
                raise _mismatch(key, file, column, role, first, int(values[first]), int(rows[first]), None)
            length = _Length(int(values[first] // rows[first]), f"as in row group {first} of the same file")
        wrong = with_rows[values[with_rows] != rows[with_rows] * length.values]
        if len(wrong):
            index = int(wrong[0])
            raise _mismatch(key, file, column, role, index, int(values[index]), int(rows[index]), length)
        if column not in self._lengths:
            with self._lock:  # across files: the first to settle a column's length holds the others to it
                settled = self._lengths.setdefault(column, _Length(length.values, f"as in {file}", file))
            if settled.values != length.values:
                raise _mismatch(key, file, column, role, first, int(values[first]), int(rows[first]), settled)

    def check_against(
        self, key: str, shapes: Mapping[str, tuple[int, ...]], columns: Mapping[str, str], source: str
    ) -> None:
        """The values per row the footers read hold in each column are those of its row shape in ``shapes`` (the
        shapes the dataset resolved, from ``source``); else the DataError naming the file whose footers said
        otherwise."""
        for column, length in self._lengths.items():
            if length.file and column in shapes and length.values != math.prod(shapes[column]):
                raise DataError(
                    f"{key}: {length.file}, column {column!r} ({columns[column]}): its row groups hold "
                    f"{length.values} values a row, but {source} holds {math.prod(shapes[column])} "
                    f"({_shape(shapes[column])}): its rows are not all of one length (a row of another "
                    "resolution or text encoder). Every row of every file must hold as many values: rewrite the file "
                    "or remove it"
                )


def runs_start_row_groups(runs: Sequence[tuple[int, int]], group_rows: np.ndarray) -> bool:
    """Whether each of ``runs`` ((bucket, rows) in row order) starts a row group of ``group_rows`` rows each."""
    ends = np.cumsum(group_rows)
    starts = np.cumsum([rows for _, rows in runs])[:-1]
    at = np.minimum(np.searchsorted(ends, starts), len(ends) - 1)
    return bool((ends[at] == starts).all())


def _leaves(footer: pq.FileMetaData, columns: Mapping[str, str]) -> dict[str, int]:
    """The index of each column's one leaf (``column``, or ``column.list.element`` and the like) in ``footer``'s
    schema; a column without exactly one is left out (the layout checks name what is wrong with it)."""
    paths = [footer.schema.column(index).path for index in range(footer.num_columns)]
    found = {
        column: [index for index, path in enumerate(paths) if path == column or path.startswith(column + ".")]
        for column in columns
    }
    return {column: leaves[0] for column, leaves in found.items() if len(leaves) == 1}


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape))


def _mismatch(
    key: str, file: str, column: str, role: str, group: int, values: int, rows: int, length: _Length | None
) -> DataError:
    per_row = f"{values // rows}" if values % rows == 0 else f"{values / rows:.2f}"
    expected = f"{length.values} a row, {length.where}" if length is not None else "the same number in every row"
    return DataError(
        f"{key}: {file}, column {column!r} ({role}), row group {group}: {values} values in {rows} rows, {per_row} a "
        f"row; expected {expected}. A row is null or of another length (latents of another resolution, captions of "
        "another text encoder): every row of every file must hold as many values. Rewrite the file or remove it"
    )
