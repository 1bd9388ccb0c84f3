"""One rank's part of what an epoch has left, mapped back through the epoch's segments instead of replaying them.

Replaying every segment of an epoch (:meth:`sdtrain.data.read_order.SamplePlan.remaining`) passes over all the
intervals left before each one: after ``k`` world-size changes, ``k`` passes over ~``k`` x ranks x (a partly read
window's fragments), the square of the changes. A rank reads only its own part, and the controller needs only the
parts' size. A segment keeps its input's rows in order (each rank's part minus the rows its rank read, then the
tail), so a range of its output maps back to ranges of its input: the rests and the tail by an offset, a partly read
window's leftover rows through the window's seeded permutation. Walking one rank's range back to the epoch's start
costs about that rank's own intervals per segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdtrain.data.intervals import START, STOP


@dataclass(frozen=True)
class SegmentLayout:
    """Where a segment's output (the rows it left) lies in its input (the rows left before it): for each rank, the
    unread rows of its partly read window, then the rest of its part; then the input's tail."""

    key: tuple[int, ...]
    """(seed, epoch, segment): with the rank and ``full``, the seed of a partly read window's permutation."""
    world_size: int
    rows_in: int
    each: int
    """Rows of each rank's part of the input."""
    full: int
    """Whole windows each rank read."""
    partial: int
    """Rows each rank read of its next window."""
    window_rows: int

    @property
    def start(self) -> int:
        return self.full * self.window_rows

    @property
    def skip(self) -> int:
        """Where each rank's rest starts in its part."""
        return self.start + (self.window_rows if self.partial else 0)

    @property
    def window(self) -> int:
        """Rows of the partly read window (0: none)."""
        return max(min(self.window_rows, self.each - self.start), 0) if self.partial else 0

    @property
    def left(self) -> int:
        """Unread rows of each rank's partly read window."""
        return max(self.window - self.partial, 0)

    @property
    def block(self) -> int:
        """Output rows of each rank: its window's leftover rows, then its rest."""
        return self.left + max(self.each - self.skip, 0)

    @property
    def rows_out(self) -> int:
        return self.world_size * self.block + self.rows_in - self.world_size * self.each


def segment_layouts(num_rows: int, seed: int, window_rows: int, epoch: int, segments) -> list[SegmentLayout]:
    """The layout of each of an epoch's ``segments`` ((world size, rows each rank read), as in a DataState)."""
    out: list[SegmentLayout] = []
    rows = num_rows
    for segment, (world_size, consumed) in enumerate(segments):
        full, partial = divmod(consumed, window_rows)
        out.append(
            SegmentLayout((seed, epoch, segment), world_size, rows, rows // world_size, full, partial, window_rows)
        )
        rows = out[-1].rows_out
    return out


def rank_part(layouts: list[SegmentLayout], num_rows: int, world_size: int, rank: int) -> np.ndarray:
    """Intervals of epoch positions of ``rank``'s part, of ``world_size`` equal ones, of the rows ``layouts`` left: the
    same rows, in the same order, as that part of the whole replay (adjacent intervals merged)."""
    each = (layouts[-1].rows_out if layouts else num_rows) // world_size
    intervals = np.array([[rank * each, (rank + 1) * each]], np.int64)[: 1 if each else 0]
    for layout in reversed(layouts):
        if not len(intervals):
            break
        intervals = _back(layout, intervals)
    return intervals


def _back(layout: SegmentLayout, intervals: np.ndarray) -> np.ndarray:
    """``intervals`` of ``layout``'s output positions as intervals of its input positions."""
    ranks, block, left = layout.world_size, layout.block, layout.left
    edges = np.arange(ranks, dtype=np.int64) * block
    pieces = _cut(intervals, np.unique(np.concatenate([edges, edges + left, [ranks * block]])))
    lo = pieces[:, START]
    rank = np.minimum(lo // block, ranks) if block else np.full(len(lo), ranks, np.int64)
    offset = lo - rank * block
    in_tail = rank >= ranks
    leftover = ~in_tail & (offset < left)
    shift = np.where(in_tail, ranks * (layout.each - block), rank * (layout.each - block) + layout.skip - left)
    moved = pieces[~leftover] + shift[~leftover, None]
    return _merged(np.concatenate([moved, _leftover_intervals(layout, rank[leftover], pieces[leftover])]))


def _leftover_intervals(layout: SegmentLayout, ranks: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """Pieces of ranks' leftover rows (output positions) as input intervals: the window's unread rows in the order
    the whole replay keeps them (sorted), through its seeded permutation."""
    positions = []
    for rank in np.unique(ranks):
        order = np.random.default_rng((*layout.key, int(rank), layout.full)).permutation(layout.window)
        unread = np.sort(order[layout.partial :]) + int(rank) * layout.each + layout.start
        mine = pieces[ranks == rank] - int(rank) * layout.block
        positions.append(unread[_ranges(mine[:, START], mine[:, STOP])])
    if not positions:
        return np.zeros((0, 2), np.int64)
    rows = np.concatenate(positions)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    firsts, lasts = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(rows)]]) - 1
    return np.stack([rows[firsts], rows[lasts] + 1], axis=1)


def _cut(intervals: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``intervals`` cut at the sorted ``points`` that fall strictly inside them; empty intervals dropped."""
    intervals = intervals[intervals[:, STOP] > intervals[:, START]]
    lo, hi = intervals[:, START], intervals[:, STOP]
    first = np.searchsorted(points, lo, side="right")  # the first point past lo
    inside = np.maximum(np.searchsorted(points, hi, side="left") - first, 0)
    owner = np.repeat(np.arange(len(intervals)), inside + 1)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(inside + 1) - inside - 1, inside + 1)  # piece k of its interval
    last = len(points) - 1
    starts = np.where(k == 0, lo[owner], points[np.clip(first[owner] + k - 1, 0, last)])
    ends = np.where(k == inside[owner], hi[owner], points[np.clip(first[owner] + k, 0, last)])
    return np.stack([starts, ends], axis=1)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(lo[i], hi[i])``."""
    lengths = hi - lo
    return np.repeat(lo - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))


def _merged(intervals: np.ndarray) -> np.ndarray:
    """Disjoint ``intervals`` sorted, with those that touch joined."""
    intervals = intervals[np.argsort(intervals[:, START], kind="stable")]
    new = np.ones(len(intervals), bool)
    new[1:] = intervals[1:, START] != intervals[:-1, STOP]
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:] - 1, len(intervals) - 1)[: len(firsts)]
    return np.stack([intervals[firsts, START], intervals[lasts, STOP]], axis=1).astype(np.int64)
