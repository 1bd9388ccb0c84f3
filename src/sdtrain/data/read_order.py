"""The order training rows are read in: seeded per epoch, split over ranks, resumable mid-epoch.

Epoch ``e`` orders the dataset as a seeded permutation of *chunks* (runs of up to
``data.shuffle_chunk_rows`` consecutive rows of one file). Every worker-group start begins a
*segment*: the rows the epoch has not consumed yet are cut into equal contiguous parts, one
per rank, and each rank reads its part in *windows* of ``data.shuffle_window_rows`` rows whose
rows it shuffles with a seeded permutation. A rank consumes ``global_batch_size / world_size``
rows per optimizer step.

Everything is a pure function of the seed and the :class:`DataState` a checkpoint stores:
the epoch and, for each segment of it so far, the world size and the rows each rank consumed.
Replaying those segments gives exactly the rows not consumed yet, so a run resumed mid-epoch,
at the same or another world size, reads every remaining row of the epoch once. (A rank maps
only its own part back through them, :mod:`sdtrain.data.rank_part`.) Rows are dropped only at an
epoch's end (fewer than one global batch), as with ``drop_last``.

Rows are named by their *sample index*: the row's position in the file list read in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sdtrain.data.chunks import Chunks, EpochOrder
from sdtrain.data.intervals import positions_to_intervals, slice_many, slice_rows, span_rows
from sdtrain.data.rank_part import SegmentLayout, rank_part, segment_layouts


@dataclass(frozen=True)
class DataState:
    """Where the data stream stands after some optimizer step (saved with every checkpoint)."""

    epoch: int = 0
    segments: tuple[tuple[int, int], ...] = ()
    """(world size, rows consumed by each rank) for each worker-group start within the epoch."""

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_dict(cls, raw: dict) -> DataState:
        return cls(int(raw["epoch"]), tuple((int(w), int(n)) for w, n in raw["segments"]))


@dataclass(frozen=True)
class Window:
    """One read task: the rows of ``spans`` in the order of a seeded permutation, entries [lo, hi) of it (no seed:
    the spans' own order)."""

    spans: np.ndarray
    seed: tuple[int, ...]
    lo: int
    hi: int
    bucket: int = 0
    """The aspect-ratio bucket of its first rows (sdtrain.data.bucket_order); 0 for data of one shape."""
    blocks: tuple[tuple[int, int], ...] = ()
    """Bucketed data: (bucket, rows) of each block it makes, in order (one a step); empty: one block."""

    def order(self) -> np.ndarray:
        """Positions (into the concatenated spans) of the rows read, in read order."""
        if not self.seed:
            return np.arange(self.lo, self.hi)
        return np.random.default_rng(self.seed).permutation(span_rows(self.spans))[self.lo : self.hi]


@dataclass(frozen=True)
class Stretch:
    """One rank's reads within one epoch: rows [skip, skip + rows) (in window order) of its part
    of what ``state``'s epoch has left, split over ``world_size`` ranks."""

    state: DataState
    world_size: int
    rank: int
    skip: int
    rows: int

    def num_windows(self, window_rows: int) -> int:
        return (self.skip + self.rows - 1) // window_rows - self.skip // window_rows + 1


class ReadPlan(Protocol):
    """What the streams, the data hook and the workers ask of a read plan: :class:`SamplePlan` for data of one shape,
    :class:`sdtrain.data.bucket_order.BucketPlan` for aspect-ratio buckets."""

    file_offsets: np.ndarray
    window_rows: int

    @property
    def num_rows(self) -> int: ...

    def fingerprint(self) -> dict[str, Any]: ...

    def rank_stretches(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> list[list[Any]]: ...

    def advance(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> DataState: ...

    def num_windows(self, stretch: Any) -> int: ...

    def window(self, stretch: Any, index: int) -> Window: ...

    def windows(self, stretch: Any, first: int = 0, count: int | None = None) -> list[Window]: ...

    def sample_indices(self, window: Window) -> np.ndarray: ...


@dataclass
class SamplePlan:
    rows_per_file: Sequence[int]
    seed: int
    chunk_rows: int
    window_rows: int
    files_digest: str = ""
    """:func:`files_digest` of the files, in order: what the sample indices name."""
    content_digest: str = ""
    """A digest of each file's size and ETag or mtime (the dataset index's): a file rewritten in place."""
    _orders: dict = field(init=False, repr=False, default_factory=dict)
    _parts_cache: dict = field(init=False, repr=False, default_factory=dict)
    _layouts_cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        rows = self.rows = np.asarray(self.rows_per_file, np.int64)
        self.file_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.chunks = Chunks(rows, self.chunk_rows)
        self._rows_digest = hashlib.sha256(rows.tobytes()).hexdigest()[:16]

    def __getstate__(self):
        # Sent to every worker once: the arrays above are rebuilt from the rows per file.
        return {
            "rows_per_file": self.rows,
            "seed": self.seed,
            "chunk_rows": self.chunk_rows,
            "window_rows": self.window_rows,
            "files_digest": self.files_digest,
            "content_digest": self.content_digest,
        }

    def __setstate__(self, state):
        type(self).__init__(self, **state)

    @property
    def num_rows(self) -> int:
        return int(self.file_offsets[-1])

    @property
    def num_chunks(self) -> int:
        return self.chunks.count

    def fingerprint(self) -> dict[str, Any]:
        """What a :class:`DataState` of this plan refers to, saved beside it in every checkpoint."""
        return {
            "files": len(self.rows),
            "rows": self.num_rows,
            "files_digest": self.files_digest,
            "rows_digest": self._rows_digest,
            "content_digest": self.content_digest,
            "seed": self.seed,
            "chunk_rows": self.chunk_rows,
            "window_rows": self.window_rows,
            "order": ORDER_VERSION,
        }

    def epoch_order(self, epoch: int) -> EpochOrder:
        if epoch not in self._orders:
            self._orders.clear()  # a rank walks the epochs in turn
            self._orders[epoch] = EpochOrder(self.chunks, (self.seed, epoch))
        return self._orders[epoch]

    def remaining(self, state: DataState) -> np.ndarray:
        """Intervals [lo, hi) of epoch positions not consumed by ``state``'s segments, in a deterministic order.

        The whole epoch is one interval; each segment keeps, of each rank's part, the rows its rank did not
        read (a partial window's leftover rows, then the rest of the part), then the tail. So the list grows
        with the segments and world sizes of the epoch, never with the dataset.
        """
        intervals = np.array([[0, self.num_rows]], np.int64)
        for segment, (world_size, consumed) in enumerate(state.segments):
            intervals = self._unconsumed(intervals, (state.epoch, segment), world_size, consumed)
        return intervals

    def rank_stretches(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> list[list[Stretch]]:
        """Each rank's reads for the next ``steps`` optimizer steps, one stretch per epoch they touch."""
        stretches: list[list[Stretch]] = [[] for _ in range(world_size)]
        for before, skip, taken, _ in self._epochs_ahead(state, world_size, rows_per_step, steps):
            if taken:
                for rank in range(world_size):
                    stretches[rank].append(Stretch(before, world_size, rank, skip, taken * rows_per_step))
        return stretches

    def advance(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> DataState:
        """The state after ``steps`` more optimizer steps at ``world_size`` from ``state``."""
        for before, skip, taken, available in self._epochs_ahead(state, world_size, rows_per_step, steps):
            if taken < available:  # the steps end inside this epoch
                return DataState(before.epoch, before.segments + ((world_size, skip + taken * rows_per_step),))
            state = DataState(before.epoch + 1)
        return state

    def _epochs_ahead(
        self, state: DataState, world_size: int, rows_per_step: int, steps: int
    ) -> Iterator[tuple[DataState, int, int, int]]:
        """For each epoch the next ``steps`` steps touch: (the state its current segment split, the rows each rank
        read in that segment, the steps taken in it, the steps it had left)."""
        while steps > 0:
            before, skip = self._segment_start(state, world_size)
            available = (self._rows_left(before) // world_size - skip) // rows_per_step
            self._check_fits(available, before, skip, world_size, rows_per_step)
            taken = min(available, steps)
            yield before, skip, taken, available
            steps -= taken
            state = DataState(state.epoch + 1)

    def num_windows(self, stretch: Stretch) -> int:
        """Read tasks of ``stretch``: one a window of data.shuffle_window_rows rows."""
        return stretch.num_windows(self.window_rows)

    def window(self, stretch: Stretch, index: int) -> Window:
        """Read task ``index`` of ``stretch``."""
        return self.windows(stretch, index, 1)[0]

    def windows(self, stretch: Stretch, first: int = 0, count: int | None = None) -> list[Window]:
        """Read tasks ``first`` to ``first + count`` of ``stretch`` (default: to its end), computed together: the
        positions they cover are cut at window boundaries and mapped to chunks in one pass."""
        rows = self.window_rows
        count = stretch.num_windows(rows) - first if count is None else count
        part = self.part(stretch.state, stretch.world_size, stretch.rank)
        number = stretch.skip // rows + first  # of the first window, counted from the part's start
        start = number * rows
        positions = slice_rows(part, start, start + count * rows)
        # Cut the intervals at window boundaries: piece k of interval i lies in window w_first[i] + k.
        lengths = positions[:, 1] - positions[:, 0]
        ends = np.cumsum(lengths)
        begins = ends - lengths
        w_first, w_last = begins // rows, (ends - 1) // rows
        pieces = w_last - w_first + 1
        interval = np.repeat(np.arange(len(positions)), pieces)
        which = (
            np.repeat(w_first, pieces) + np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        )
        lo = np.maximum(begins[interval], which * rows) - begins[interval] + positions[interval, 0]
        hi = np.minimum(ends[interval], (which + 1) * rows) - begins[interval] + positions[interval, 0]
        spans, owner = self.epoch_order(stretch.state.epoch).spans(np.stack([lo, hi], axis=1))
        bounds = np.searchsorted(which[owner], np.arange(count + 1))
        out = []
        for index in range(count):
            window_start = start + index * rows
            key = (self.seed, stretch.state.epoch, len(stretch.state.segments), stretch.rank, number + index)
            lo_row = max(stretch.skip - window_start, 0)
            hi_row = min(rows, stretch.skip + stretch.rows - window_start)
            out.append(Window(spans[bounds[index] : bounds[index + 1]], key, lo_row, hi_row))
        return out

    def _segment_start(self, state: DataState, world_size: int) -> tuple[DataState, int]:
        """(state the current segment split, rows each rank has read in it). A restart at the same
        world size continues the segment, so it reads exactly what an uninterrupted run would."""
        if state.segments and state.segments[-1][0] == world_size:
            return DataState(state.epoch, state.segments[:-1]), state.segments[-1][1]
        return state, 0

    def _check_fits(self, available: int, state: DataState, skip: int, world_size: int, rows_per_step: int) -> None:
        if available == 0 and skip == 0 and not state.segments:  # a whole epoch cannot make one step
            raise ValueError(
                f"{self.num_rows} rows cannot fill one step of {rows_per_step} rows on each of {world_size} ranks"
            )

    def _layouts(self, state: DataState) -> list[SegmentLayout]:
        key = (state.epoch, state.segments)
        if key not in self._layouts_cache:
            self._layouts_cache.clear()  # a rank walks one segment at a time
            self._layouts_cache[key] = segment_layouts(
                self.num_rows, self.seed, self.window_rows, state.epoch, state.segments
            )
        return self._layouts_cache[key]

    def _rows_left(self, state: DataState) -> int:
        layouts = self._layouts(state)
        return layouts[-1].rows_out if layouts else self.num_rows

    def part(self, state: DataState, world_size: int, rank: int) -> np.ndarray:
        """Intervals of epoch positions: ``rank``'s part, of ``world_size`` equal ones, of what ``state``'s segments
        left. Mapped back through the segments (:mod:`sdtrain.data.rank_part`), not cut from :meth:`remaining`, whose
        replay grows with the square of the segments."""
        key = (state, world_size, rank)
        if key not in self._parts_cache:
            self._parts_cache.clear()  # a rank walks one stretch at a time
            self._parts_cache[key] = rank_part(self._layouts(state), self.num_rows, world_size, rank)
        return self._parts_cache[key]

    def sample_indices(self, window: Window) -> np.ndarray:
        """The sample index of every row ``window`` reads, in read order."""
        return window_sample_indices(window.spans, self.file_offsets)[window.order()]

    def _unconsumed(self, intervals: np.ndarray, key: tuple[int, int], world_size: int, consumed: int) -> np.ndarray:
        """``intervals`` split equally over ``world_size`` ranks, minus the first ``consumed`` rows each rank read (in
        window order): each rank's partial window's leftover rows then the rest of its part, then the tail.

        Every rank's window and rest are cut from ``intervals`` in one pass (they are ranges of it at offsets of the
        part size): a slice per rank made a start after many world-size changes cost ranks x intervals.
        """
        total = span_rows(intervals)
        each = total // world_size
        part = np.arange(world_size, dtype=np.int64) * each
        full, partial = divmod(consumed, self.window_rows)
        start = full * self.window_rows
        skip = start + (self.window_rows if partial else 0)
        rests = slice_many(intervals, np.append(part + skip, world_size * each), np.append(part + each, total))
        if not partial:
            return np.concatenate(rests)
        windows = slice_many(intervals, part + start, part + min(start + self.window_rows, each))
        out = []
        for rank, (window, rest) in enumerate(zip(windows, rests[:-1], strict=True)):
            order = np.random.default_rng((self.seed, *key, rank, full)).permutation(span_rows(window))
            out += [positions_to_intervals(window, np.sort(order[partial:])), rest]
        return np.concatenate([*out, rests[-1]])


# The version of the order's algorithm, in the fingerprint: a checkpoint of another order resumes as a change.
# 2: chunks shuffled by ChunkShuffle (1, unrecorded: a permutation of a table of every chunk).
ORDER_VERSION = 2


def window_sample_indices(spans: np.ndarray, file_offsets: np.ndarray) -> np.ndarray:
    """The sample index of every row of ``spans``, in span order."""
    if len(spans) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(file_offsets[f] + a, file_offsets[f] + b) for f, a, b in spans])


def files_digest(files: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
