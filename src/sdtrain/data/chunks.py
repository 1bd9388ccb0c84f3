"""Chunks and their order in an epoch: the unit the read order shuffles.

A file's rows are cut into *chunks* of ``data.shuffle_chunk_rows`` consecutive rows (its last one may hold fewer), so
that a read task reads a few runs of consecutive rows instead of scattered single rows. An epoch orders the chunks by a
seeded bijection that costs O(1) memory (:class:`ChunkShuffle`); :class:`EpochOrder` maps row positions in that order
to the files' rows.
"""

from __future__ import annotations

import numpy as np


class Chunks:
    """The chunks of files of ``rows`` rows each, ``chunk_rows`` to a chunk: chunk ids count through the files in
    order, and only the short chunks (at most one a file) are listed."""

    def __init__(self, rows: np.ndarray, chunk_rows: int):
        self.rows = rows
        self.chunk_rows = chunk_rows
        self.offsets = np.concatenate([[0], np.cumsum(-(-rows // chunk_rows))]).astype(np.int64)
        tail = rows % chunk_rows
        self.short = self.offsets[1:][tail > 0] - 1  # the last chunk of each file with a short tail
        self.short_rows = tail[tail > 0]

    @property
    def count(self) -> int:
        return int(self.offsets[-1])

    def spans(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file, first row, end row) of each chunk id."""
        files = np.searchsorted(self.offsets, chunks, side="right") - 1
        starts = (chunks - self.offsets[files]) * self.chunk_rows
        return files, starts, np.minimum(starts + self.chunk_rows, self.rows[files])


class ChunkShuffle:
    """A seeded bijection of [0, n): chunk ids to their places in one epoch's order, in O(1) memory.

    A balanced Feistel network over the smallest even number of bits that covers ``n``, walked
    until it lands inside [0, n) ("cycle walking": a permutation of the larger domain restricted to
    [0, n) by following its cycles, which stay bijective). The domain is under 4n, so a value walks
    under four steps on average. Any chunk's place, and the chunk at any place, cost a few integer
    operations: no table of all chunks exists (2e9 rows in 64-row chunks would be 31M entries).
    """

    ROUNDS = 6

    def __init__(self, n: int, key: tuple[int, ...]):
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(key).integers(0, 2**63, size=self.ROUNDS, dtype=np.int64).astype(np.uint64)

    def _round(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        # splitmix64's finalizer: every output bit depends on every input bit.
        z = x ^ key
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & self.mask

    def _forward(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << np.uint64(self.half)) | right

    def _backward(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys[::-1]:
            left, right = right ^ self._round(left, key), left
        return (left << np.uint64(self.half)) | right

    def _walk(self, step, values: np.ndarray) -> np.ndarray:
        out = step(np.asarray(values, np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while len(outside):
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)

    def chunk_at(self, places: np.ndarray) -> np.ndarray:
        """The chunk id at each place of the epoch's order."""
        return self._walk(self._forward, places)

    def place_of(self, chunks: np.ndarray) -> np.ndarray:
        """The place of each chunk id in the epoch's order."""
        return self._walk(self._backward, chunks)


class EpochOrder:
    """One epoch's order of every row: the chunks in their shuffled order, each chunk's rows in file order.

    A *place* is a position in the chunk order; a *position* is a row's position in the epoch's row
    sequence. All chunks hold ``chunk_rows`` rows but the last of each file, which may hold fewer; so the
    rows before place p are p * chunk_rows less the shortfall of the short chunks placed before p. Only the
    short chunks are listed (their places and shortfalls: at most one per file), which is all the memory an
    epoch's order takes.
    """

    def __init__(self, chunks: Chunks, key: tuple[int, ...]):
        self.chunks = chunks
        self.shuffle = ChunkShuffle(chunks.count, key)
        places = self.shuffle.place_of(chunks.short)
        order = np.argsort(places, kind="stable")
        self.short_places = places[order]
        shortfall = (chunks.chunk_rows - chunks.short_rows)[order]
        self.shortfall_before = np.concatenate([[0], np.cumsum(shortfall)]).astype(np.int64)
        # The position just past each short chunk: where the next run of whole chunks starts.
        self.short_ends = (self.short_places + 1) * chunks.chunk_rows - self.shortfall_before[1:]

    def place_of_position(self, positions: np.ndarray) -> np.ndarray:
        """The place of the chunk that holds each row position."""
        # Past the short chunks that end at or before a position, the chunks are whole up to the next short one.
        before = np.searchsorted(self.short_ends, positions, side="right")
        return (positions + self.shortfall_before[before]) // self.chunks.chunk_rows

    def first_position(self, places: np.ndarray) -> np.ndarray:
        """The position of each place's first row."""
        return places * self.chunks.chunk_rows - self.shortfall_before[np.searchsorted(self.short_places, places)]

    def spans(self, intervals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Spans (file, first row, end row) of the rows at the positions ``intervals`` cover, in their order,
        and the interval each span is part of."""
        intervals = intervals[intervals[:, 1] > intervals[:, 0]]
        lo, hi = intervals[:, 0], intervals[:, 1]
        first, last = self.place_of_position(lo), self.place_of_position(hi - 1)
        counts = last - first + 1
        owner = np.repeat(np.arange(len(intervals)), counts)
        places = np.repeat(first, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = self.first_position(places)
        files, begin, end = self.chunks.spans(self.shuffle.chunk_at(places))
        # The first and last chunk of an interval may hold rows outside it.
        cut_front, cut_back = np.maximum(lo[owner] - starts, 0), np.maximum(starts + (end - begin) - hi[owner], 0)
        return np.stack([files, begin + cut_front, end - cut_back], axis=1).astype(np.int64), owner
