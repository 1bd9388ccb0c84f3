"""Row ranges as int64 arrays: cut, split equally and rebuilt from positions, each in one vectorized pass.

Spans are arrays of shape (n, 3): (file index, first row, end row), rows [start, stop). Intervals are (n, 2):
[first, end) of positions in an epoch's row order. Both end in (start, stop), so every function here takes either.
"""

from __future__ import annotations

import numpy as np

FILE, START, STOP = 0, -2, -1


def span_rows(spans: np.ndarray) -> int:
    return int((spans[:, STOP] - spans[:, START]).sum())


def split_equal(spans: np.ndarray, parts: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``parts`` contiguous runs of equal row count, and the < ``parts`` rows left over."""
    total = span_rows(spans)
    cuts = np.arange(parts + 1, dtype=np.int64) * (total // parts)
    pieces = slice_many(spans, cuts, np.append(cuts[1:], total))
    return pieces[:parts], pieces[parts]


def slice_many(spans: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
    """:func:`slice_rows` of each range [lo[i], hi[i]) (none where lo[i] >= hi[i]), all cut in one pass: a
    worker-group start cuts every rank's part of what an epoch has left, which grows with each world-size change."""
    lengths = spans[:, STOP] - spans[:, START]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    lo = np.asarray(lo, np.int64)
    hi = np.minimum(np.asarray(hi, np.int64), int(ends[-1]) if len(ends) else 0)
    # slice_rows keeps the spans with ends > lo and begins < hi: a contiguous range, as neither decreases (empty
    # spans strictly inside are kept, those at the edges not).
    first = np.searchsorted(ends, lo, side="right")
    counts = np.where(lo < hi, np.maximum(np.searchsorted(begins, hi, side="left") - first, 0), 0)
    offsets = np.cumsum(counts) - counts
    owner = np.repeat(np.arange(len(lo)), counts)
    which = first[owner] + np.arange(int(counts.sum())) - offsets[owner]
    out = spans[which]  # fancy indexing copies: the clipping below leaves ``spans`` as it was
    out[:, START] += np.maximum(lo[owner] - begins[which], 0)
    out[:, STOP] -= np.maximum(ends[which] - hi[owner], 0)
    return np.split(out, np.cumsum(counts)[:-1])


def slice_rows(spans: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The spans (or intervals) covering rows [lo, hi) of the row sequence ``spans`` describes."""
    lengths = spans[:, STOP] - spans[:, START]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    hi = min(hi, int(ends[-1]) if len(ends) else 0)
    keep = (ends > lo) & (begins < hi)
    out = spans[keep].copy()
    out[:, START] += np.maximum(lo - begins[keep], 0)
    out[:, STOP] -= np.maximum(ends[keep] - hi, 0)
    return out


def positions_to_intervals(intervals: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Intervals for the sorted ``positions`` of the sequence ``intervals`` describes, consecutive ones merged."""
    if len(positions) == 0:
        return np.zeros((0, 2), np.int64)
    lengths = intervals[:, STOP] - intervals[:, START]
    ends = np.cumsum(lengths)
    which = np.searchsorted(ends, positions, side="right")
    values = intervals[which, START] + positions - (ends[which] - lengths[which])
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(values)]])
    return np.stack([values[starts], values[stops - 1] + 1], axis=1).astype(np.int64)
