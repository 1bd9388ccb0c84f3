"""A bucket's row sequence as pieces of its runs, and spans of that sequence as spans of files.

Each file holds its rows bucket by bucket, one *run* a bucket (:mod:`sdtrain.data.bucket_order`). A bucket's orders
count positions in one sequence of its rows: the whole chunks (``data.shuffle_chunk_rows`` rows) of each of its runs in
file order, then each run's last rows. Preprocessing starts a row group at each run, so a chunk of the sequence is whole
row groups of one file, but for the chunks cut from runs' last rows. In read order buckets-1 the sequence was the runs
end to end, and a chunk most often the end of one row group and the start of the next. The sequence is held as
*pieces*, each a stretch of one run: 12 bytes a piece, one or two a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pieces:
    """A bucket's row sequence as pieces of its runs, one after another: first pieces that start their runs (their
    whole chunks, or whole runs), then pieces that end them (their last rows).

    Args:
        ends: the sequence position just past each piece (int64).
        runs: the run of each piece, an index into the plan's runs (int32).
        tails_from: the first piece that ends its run rather than starting it.
    """

    ends: np.ndarray
    runs: np.ndarray
    tails_from: int

    def file_spans(
        self, spans: np.ndarray, owner: np.ndarray, run_file: np.ndarray, run_start: np.ndarray, run_rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Spans (column 0 unused, first position, end position) of the sequence as spans (file, first row, end row)
        of its files, cut where its pieces meet; each keeps its span's ``owner``.

        Args:
            run_file: the file of each of the plan's runs.
            run_start: the row of its file each of the plan's runs starts at.
            run_rows: the rows of each of the plan's runs.
        """
        lo, hi = spans[:, 1], spans[:, 2]
        first = np.searchsorted(self.ends, lo, side="right")
        last = np.searchsorted(self.ends, hi - 1, side="right")
        count = last - first + 1
        which = np.repeat(np.arange(len(spans)), count)
        piece = np.repeat(first, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        piece_lo = np.concatenate([[0], self.ends])[piece]
        start = np.maximum(lo[which], piece_lo) - piece_lo
        stop = np.minimum(hi[which], self.ends[piece]) - piece_lo
        runs = self.runs[piece]
        # A piece that ends its run starts its length before the run's end.
        into_run = np.where(piece >= self.tails_from, run_rows[runs] - (self.ends[piece] - piece_lo), 0)
        base = run_start[runs] + into_run
        return np.stack([run_file[runs], base + start, base + stop], axis=1), owner[which]


def run_pieces(runs: np.ndarray, rows: np.ndarray, chunk_rows: int | None) -> Pieces:
    """A bucket's sequence of ``runs`` (in file order, of ``rows`` rows each): the whole chunks of every run in turn,
    then every run's last ``rows % chunk_rows`` rows; without ``chunk_rows`` (read order buckets-1) the runs end to
    end."""
    rows = rows.astype(np.int64)
    if chunk_rows is None:
        return Pieces(np.cumsum(rows), runs, len(runs))
    tail = rows % chunk_rows
    whole, ends = rows > tail, tail > 0  # runs with whole chunks; runs whose last rows are not a whole chunk
    lengths = np.concatenate([(rows - tail)[whole], tail[ends]])
    return Pieces(np.cumsum(lengths), np.concatenate([runs[whole], runs[ends]]), int(whole.sum()))


def runs_of(file_buckets: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """The runs array of files given as their (bucket, rows) pairs in row order."""
    runs = [(f, b, n) for f, pairs in enumerate(file_buckets) for b, n in pairs]
    return np.array(runs, np.int64).reshape(-1, 3)
