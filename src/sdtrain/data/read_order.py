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
at the same or another world size, reads every remaining row of the epoch once. Rows are
dropped only at an epoch's end (fewer than one global batch), as with ``drop_last``.

Rows are named by their *sample index*: the row's position in the file list read in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdtrain.errors import DataError

# Spans are int64 arrays of shape (n, 3): (file index, first row, end row), rows [start, stop).
FILE, START, STOP = 0, 1, 2


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
    """One read task: the rows of ``spans`` in the order of a seeded permutation, entries [lo, hi) of it."""

    spans: np.ndarray
    seed: tuple[int, ...]
    lo: int
    hi: int

    def order(self) -> np.ndarray:
        """Positions (into the concatenated spans) of the rows read, in read order."""
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


@dataclass
class SamplePlan:
    rows_per_file: tuple[int, ...]
    seed: int
    chunk_rows: int
    window_rows: int
    files_digest: str = ""
    """:func:`files_digest` of the files, in order: what the sample indices name."""
    _chunks: np.ndarray = field(init=False, repr=False)
    _parts_cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        self.file_offsets = np.concatenate([[0], np.cumsum(self.rows_per_file)]).astype(np.int64)
        self._make_chunks()

    def __getstate__(self):
        # Pickled into every read task: rebuild the chunk table there instead of shipping it.
        return {
            "rows_per_file": self.rows_per_file,
            "seed": self.seed,
            "chunk_rows": self.chunk_rows,
            "window_rows": self.window_rows,
            "files_digest": self.files_digest,
        }

    def __setstate__(self, state):
        type(self).__init__(self, **state)

    def _make_chunks(self) -> None:
        chunks = []
        for index, rows in enumerate(self.rows_per_file):
            starts = np.arange(0, rows, self.chunk_rows, dtype=np.int64)
            stops = np.minimum(starts + self.chunk_rows, rows)
            chunks.append(np.stack([np.full_like(starts, index), starts, stops], axis=1))
        self._chunks = np.concatenate(chunks) if chunks else np.zeros((0, 3), np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.file_offsets[-1])

    def fingerprint(self) -> dict[str, Any]:
        """What a :class:`DataState` of this plan refers to, saved beside it in every checkpoint."""
        rows = hashlib.sha256(np.asarray(self.rows_per_file, np.int64).tobytes()).hexdigest()[:16]
        return {
            "files": len(self.rows_per_file),
            "rows": self.num_rows,
            "files_digest": self.files_digest,
            "rows_digest": rows,
            "seed": self.seed,
            "chunk_rows": self.chunk_rows,
            "window_rows": self.window_rows,
        }

    def epoch_order(self, epoch: int) -> np.ndarray:
        permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self._chunks))
        return self._chunks[permutation]

    def remaining(self, state: DataState) -> np.ndarray:
        """The spans of ``state.epoch`` not consumed by its segments, in a deterministic order."""
        spans = self.epoch_order(state.epoch)
        for segment, (world_size, consumed) in enumerate(state.segments):
            parts, tail = split_equal(spans, world_size)
            spans = np.concatenate(
                [self._unconsumed(part, (state.epoch, segment, rank), consumed) for rank, part in enumerate(parts)]
                + [tail]
            )
        return spans

    def rank_stretches(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> list[list[Stretch]]:
        """Each rank's reads for the next ``steps`` optimizer steps, one stretch per epoch they touch."""
        stretches: list[list[Stretch]] = [[] for _ in range(world_size)]
        while steps > 0:
            before, skip = self._segment_start(state, world_size)
            available = (span_rows(self._parts(before, world_size)[0]) - skip) // rows_per_step
            self._check_fits(available, before, skip, world_size, rows_per_step)
            taken = min(available, steps)
            if taken:
                for rank in range(world_size):
                    stretches[rank].append(Stretch(before, world_size, rank, skip, taken * rows_per_step))
            steps -= taken
            state = DataState(state.epoch + 1)
        return stretches

    def advance(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> DataState:
        """The state after ``steps`` more optimizer steps at ``world_size`` from ``state``."""
        while steps > 0:
            before, skip = self._segment_start(state, world_size)
            available = (span_rows(self._parts(before, world_size)[0]) - skip) // rows_per_step
            self._check_fits(available, before, skip, world_size, rows_per_step)
            if steps < available:
                return DataState(before.epoch, before.segments + ((world_size, skip + steps * rows_per_step),))
            steps -= available
            state = DataState(state.epoch + 1)
        return state

    def window(self, stretch: Stretch, index: int) -> Window:
        """Read task ``index`` of ``stretch``: computed on demand, so a long run never lists them all."""
        part = self._parts(stretch.state, stretch.world_size)[stretch.rank]
        number = stretch.skip // self.window_rows + index
        start = number * self.window_rows
        spans = slice_rows(part, start, start + self.window_rows)
        key = (self.seed, stretch.state.epoch, len(stretch.state.segments), stretch.rank, number)
        lo = max(stretch.skip - start, 0)
        hi = min(self.window_rows, stretch.skip + stretch.rows - start)
        return Window(spans, key, lo, hi)

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

    def _parts(self, state: DataState, world_size: int) -> list[np.ndarray]:
        key = (state, world_size)
        if key not in self._parts_cache:
            self._parts_cache.clear()  # read tasks walk one stretch at a time
            self._parts_cache[key] = split_equal(self.remaining(state), world_size)[0]
        return self._parts_cache[key]

    def sample_indices(self, window: Window) -> np.ndarray:
        """The sample index of every row ``window`` reads, in read order."""
        return window_sample_indices(window.spans, self.file_offsets)[window.order()]

    def _unconsumed(self, part: np.ndarray, key: tuple[int, int, int], consumed: int) -> np.ndarray:
        """``part`` minus the first ``consumed`` rows its rank read (in window order)."""
        full, partial = divmod(consumed, self.window_rows)
        start = full * self.window_rows
        rest = slice_rows(part, start + (self.window_rows if partial else 0), span_rows(part))
        if not partial:
            return rest
        window = slice_rows(part, start, start + self.window_rows)
        order = np.random.default_rng((self.seed, *key, full)).permutation(span_rows(window))
        left = np.sort(order[partial:])
        return np.concatenate([rows_to_spans(window, left), rest])


def span_rows(spans: np.ndarray) -> int:
    return int((spans[:, STOP] - spans[:, START]).sum())


def split_equal(spans: np.ndarray, parts: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``parts`` contiguous runs of equal row count, and the < ``parts`` rows left over."""
    each = span_rows(spans) // parts
    pieces = [slice_rows(spans, i * each, (i + 1) * each) for i in range(parts)]
    return pieces, slice_rows(spans, parts * each, span_rows(spans))


def slice_rows(spans: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The spans covering rows [lo, hi) of the row sequence ``spans`` describes."""
    lengths = spans[:, STOP] - spans[:, START]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    hi = min(hi, int(ends[-1]) if len(ends) else 0)
    keep = (ends > lo) & (begins < hi)
    out = spans[keep].copy()
    out[:, START] += np.maximum(lo - begins[keep], 0)
    out[:, STOP] -= np.maximum(ends[keep] - hi, 0)
    return out


def rows_to_spans(spans: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Spans for the sorted ``positions`` of the row sequence ``spans``, consecutive rows merged."""
    if len(positions) == 0:
        return np.zeros((0, 3), np.int64)
    lengths = spans[:, STOP] - spans[:, START]
    ends = np.cumsum(lengths)
    which = np.searchsorted(ends, positions, side="right")
    rows = spans[which, START] + positions - (ends[which] - lengths[which])
    files = spans[which, FILE]
    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(files) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(rows)]])
    return np.stack([files[starts], rows[starts], rows[stops - 1] + 1], axis=1).astype(np.int64)


def window_sample_indices(spans: np.ndarray, file_offsets: np.ndarray) -> np.ndarray:
    """The sample index of every row of ``spans``, in span order."""
    if len(spans) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(file_offsets[f] + a, file_offsets[f] + b) for f, a, b in spans])


def files_digest(files: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]


def resume_position(saved: dict[str, Any], plan: SamplePlan, on_change: str, where: str) -> tuple[int, DataState]:
    """(step, data state) to resume from, given a checkpoint's saved data state (``data_state.json``).

    Args:
        saved: the checkpoint's data state: step, position and the fingerprint of the plan it refers to.
        plan: the plan of this run (the data and settings as they are now).
        on_change: data.on_change: fail, or new_epoch (start the next epoch on the current plan).
        where: the checkpoint, for the error.
    """
    step, state = int(saved["step"]), DataState.from_dict(saved["data"])
    stored = saved.get("plan")  # None: written before fingerprints were kept; replayed as before
    changes = [] if stored is None else plan_changes(stored, plan.fingerprint())
    if not changes:
        return step, state
    if on_change == "new_epoch":
        return step, DataState(epoch=state.epoch + 1)
    raise DataError(
        f"data.train: the data position of {where} (step {step}, epoch {state.epoch}) refers to other data than "
        f"this run's: {'; '.join(changes)}. Resuming would read rows twice or never. Restore the data and settings, "
        "set data.on_change=new_epoch to keep the weights and start the next epoch on the data as it is now, or "
        "start a new run (another run.name) with model.pretrained set to this run's export"
    )


_CHANGES = {
    "files": "data.train has {new} file(s), the checkpoint's had {old}",
    "rows": "data.train has {new} rows, the checkpoint's had {old}",
    "files_digest": "the list of data.train files changed (renamed, moved or replaced)",
    "rows_digest": "the rows per file of data.train changed",
    "seed": "train.seed is {new}, was {old}",
    "chunk_rows": "data.shuffle_chunk_rows is {new}, was {old}",
    "window_rows": "data.shuffle_window_rows is {new}, was {old}",
}


def plan_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two :meth:`SamplePlan.fingerprint` s, in the config's terms."""
    changed = [key for key in _CHANGES if stored.get(key) != current.get(key)]
    if "files" in changed or "rows" in changed:  # the digests differ too; the counts say more
        changed = [key for key in changed if key not in ("files_digest", "rows_digest")]
    return [_CHANGES[key].format(new=current.get(key), old=stored.get(key)) for key in changed]
