"""The read order of data in aspect-ratio buckets: every optimizer step is one bucket's, and the sequence of steps is a
pure function of (seed, epoch, step), whatever the world size.

Each file holds its rows bucket by bucket, one *run* of consecutive rows per bucket (preprocessing sorts a shard's rows
by bucket and starts a row group at each run). A bucket's rows are one sequence: the whole chunks of ``c =
data.shuffle_chunk_rows`` rows of each of its runs in file order, then each run's last rows
(:mod:`sdtrain.data.bucket_runs`), cut into chunks of c rows, so that a chunk is whole row groups of one file. Each
epoch orders a bucket's chunks by a seeded bijection (:class:`sdtrain.data.chunks.EpochOrder`): that is the bucket's
*order* for the epoch. Its rows are consumed a *turn* of ``k = data.bucket_steps`` global batches of G rows at a time:
turn T of bucket b is positions [T k G, (T + 1) k G) of its order. An epoch holds ``S_b = floor(L_b / (k G))`` turns of
bucket b, where ``L_b`` is its rows plus the rows it carried in; the rows left over (fewer than a turn) are not dropped
or padded: they open the bucket's order of the next epoch. The epoch's steps are its turns in a seeded order
(:class:`sdtrain.data.chunks.ChunkShuffle` over the turns), k steps each, so buckets draw steps in proportion to their
rows.

Step s of an epoch is batch i of a turn of bucket b whatever the world size, and rank r of W reads rows
[r G/W, (r + 1) G/W) of it: the same lanes of the turn at each of its steps (:mod:`sdtrain.data.bucket_turns`). A run
resumed at another world size therefore continues with exactly the rows, buckets and order the uninterrupted run
would have. The data position (:class:`sdtrain.data.read_order.DataState`) counts the steps done in the epoch as rows
per rank at each world size; no table of steps or rows is held: a rank plans from the files' runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np

from sdtrain.data.bucket_runs import run_pieces
from sdtrain.data.bucket_turns import TurnOrder, lane_part_rows, share_positions, window_count, window_edges
from sdtrain.data.chunks import Chunks, ChunkShuffle, EpochOrder
from sdtrain.data.read_order import DataState, Window, window_sample_indices

BUCKET_ORDER_VERSION = "buckets-2"
"""The version of this order's algorithm that new runs read, in the fingerprint. Since buckets-2, chunks are cut within
runs (:mod:`sdtrain.data.bucket_runs`); buckets-1 cut them from a bucket's runs laid end to end."""
ORDERS = ("buckets-1", BUCKET_ORDER_VERSION)
"""The versions this plan reads: a run resumes in the one its checkpoints were written in
(:meth:`BucketPlan.resumed_as`); a checkpoint of any other resumes as a change of the read order."""
# A plan's fields but its files' rows and runs: pickled as they are.
_SETTINGS: tuple[str, ...] = ("bucket_shapes", "seed", "chunk_rows", "global_batch", "window_rows", "files_digest")
_SETTINGS += ("content_digest", "bucket_steps", "order")
_DIGEST_BLOCK = 1 << 16
"""Runs hashed at a time by BucketPlan.runs_digest: a 1.5 MB int64 block, not the whole table."""


@dataclass(frozen=True)
class BucketStretch:
    """One rank's steps within one epoch: steps [first, first + steps) of the epoch, at ``world_size``."""

    state: DataState
    world_size: int
    rank: int
    first: int
    steps: int


@dataclass
class BucketPlan:
    """The read plan of bucketed data.

    Args:
        rows_per_file: rows of each file, in file order.
        runs: (n, 3) integers: (file, bucket, rows) of each run, in file order and within a file in row order; a file's
            runs sum to its rows.
        bucket_shapes: each bucket's latent shape (C, H, W), by bucket index.
        seed: train.seed.
        chunk_rows: data.shuffle_chunk_rows.
        global_batch: train.global_batch_size: the rows of every step.
        window_rows: data.shuffle_window_rows: about the rows of one read task (whole steps' shares).
        bucket_steps: data.bucket_steps: steps of one bucket in a row, a *turn* (sdtrain.data.bucket_turns).
        order: the version of the order, one of ORDERS.
    """

    rows_per_file: Sequence[int]
    runs: InitVar[np.ndarray]
    bucket_shapes: Sequence[tuple[int, int, int]]
    seed: int
    chunk_rows: int
    global_batch: int
    window_rows: int = 512
    files_digest: str = ""
    content_digest: str = ""
    bucket_steps: int = 1
    order: str = BUCKET_ORDER_VERSION
    _orders: dict = field(init=False, repr=False, default_factory=dict)
    _carries: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self, runs: np.ndarray):
        lane_part_rows(self.bucket_steps, self.chunk_rows, self.global_batch)  # refuses lanes that miss the batch
        if self.order not in ORDERS:
            raise ValueError(f"read order {self.order}: this sdtrain reads orders {', '.join(ORDERS)}")
        runs = np.asarray(runs).reshape(-1, 3)
        self._index(runs[:, 0], runs[:, 1], runs[:, 2])

    def _index(self, run_file: np.ndarray, run_bucket: np.ndarray, run_rows: np.ndarray) -> None:
        """Check the runs and index them by bucket. Per run, the smallest integers that hold it: a rank keeps 14 bytes
        a run and 12 a piece (one or two a run): up to ~38 bytes a run (4e6 runs at 2e9 rows in 2e5 files)."""
        self._runs_digest: str | None = None
        self.rows = np.asarray(self.rows_per_file, np.int64)
        self.file_offsets = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)
        self.run_file = run_file.astype(np.int32, copy=False)
        self.run_bucket = run_bucket.astype(np.int16 if len(self.bucket_shapes) < 2**15 else np.int32, copy=False)
        self.run_rows = run_rows.astype(np.int32, copy=False)
        if len(self.run_file) and (np.diff(self.run_file) < 0).any():
            raise ValueError("the runs are not in file order")
        sums = np.bincount(self.run_file, self.run_rows, minlength=len(self.rows)).astype(np.int64)
        if not np.array_equal(sums, self.rows):
            bad = int(np.flatnonzero(sums != self.rows)[0])
            raise ValueError(f"file {bad}: its bucket runs hold {sums[bad]} rows, the file {self.rows[bad]}")
        # Runs follow each other within a file: a run starts where the file's previous one ended.
        ends = np.cumsum(self.run_rows, dtype=np.int64)
        self.run_start = (ends - self.run_rows - self.file_offsets[self.run_file]).astype(np.int32)
        del ends
        buckets = len(self.bucket_shapes)
        if len(self.run_bucket) and (self.run_bucket.min() < 0 or self.run_bucket.max() >= buckets):
            raise ValueError(f"a run names a bucket outside the {buckets} buckets")
        # A bucket's rows are one sequence of pieces of its runs (sdtrain.data.bucket_runs) cut into chunks, so only
        # its last chunk is short and its epoch order costs a few integers.
        by_bucket = np.argsort(self.run_bucket, kind="stable").astype(np.int32)
        counts = np.bincount(self.run_bucket, minlength=buckets)
        chunk = None if self.order == "buckets-1" else self.chunk_rows
        self._lanes = self.bucket_steps > 1 or chunk is not None  # chunks start where lanes do, but in buckets-1's k=1
        self.bucket_pieces = [
            run_pieces(r, self.run_rows[r], chunk) for r in np.split(by_bucket, np.cumsum(counts)[:-1])
        ]
        self.bucket_rows = np.array([int(p.ends[-1]) if len(p.ends) else 0 for p in self.bucket_pieces], np.int64)
        self.bucket_chunks = [Chunks(np.array([n], np.int64), self.chunk_rows) for n in self.bucket_rows]

    def __getstate__(self):
        # Sent to every worker once: 4 to 6 bytes a run (the file of each run is implied by their order); the arrays
        # above are rebuilt from them.
        return {
            "rows_per_file": self.rows,
            "runs_per_file": np.bincount(self.run_file, minlength=len(self.rows)).astype(np.int32),
            "run_bucket": self.run_bucket,
            # A run holds at most its file's rows: 16 bits where every file has fewer than 65,536.
            "run_rows": self.run_rows.astype(np.uint16) if self.rows.max(initial=0) < 2**16 else self.run_rows,
            **{name: getattr(self, name) for name in _SETTINGS},
        }

    def __setstate__(self, state):
        files = np.repeat(np.arange(len(state["rows_per_file"]), dtype=np.int32), state.pop("runs_per_file"))
        bucket, rows = state.pop("run_bucket"), state.pop("run_rows")
        self.__dict__.update(state, _orders={}, _carries={})
        self._index(files, bucket, rows)

    def resumed_as(self, stored: dict[str, Any] | None, keep_turns: bool = False) -> BucketPlan:
        """This plan in the read order a checkpoint's fingerprint names (if in ORDERS) and, with ``keep_turns``
        (data.bucket_steps: auto), in its turns: a run keeps both across upgrades and changes of its workers."""
        stored = stored or {}
        kept = {"order": stored["order"]} if stored.get("order") in ORDERS else {}
        lanes = (stored.get("chunk_rows"), stored.get("global_batch")) == (self.chunk_rows, self.global_batch)
        if keep_turns and lanes:
            kept["bucket_steps"] = stored.get("bucket_steps", 1)  # its lanes make this batch
        if all(getattr(self, key) == value for key, value in kept.items()):
            return self
        plan = BucketPlan.__new__(BucketPlan)
        plan.__setstate__(self.__getstate__() | kept)
        return plan

    @property
    def num_rows(self) -> int:
        return int(self.file_offsets[-1])

    @property
    def turn_rows(self) -> int:
        """Positions of a bucket's order that a turn takes."""
        return self.bucket_steps * self.global_batch

    def run_table(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """(file, bucket, rows) of runs [lo, hi), as int64 (what the fingerprint digests)."""
        runs = slice(lo, hi)
        return np.stack([self.run_file[runs], self.run_bucket[runs], self.run_rows[runs]], axis=1).astype(np.int64)

    def runs_digest(self) -> str:
        """The digest of :meth:`run_table`, once a plan (every rank start and resume asks; the table of 4e6 runs takes
        ~0.2 s and ~180 MB whole), hashed a block of runs at a time (the same bytes); not pickled (``__getstate__``)."""
        if self._runs_digest is None:
            digest = hashlib.sha256()
            for lo in range(0, len(self.run_file), _DIGEST_BLOCK):
                digest.update(self.run_table(lo, lo + _DIGEST_BLOCK).tobytes())
            self._runs_digest = digest.hexdigest()[:16]
        return self._runs_digest

    def fingerprint(self) -> dict[str, Any]:
        """What a :class:`DataState` of this plan refers to, saved beside it in every checkpoint."""
        return {
            "files": len(self.rows),
            "rows": self.num_rows,
            "files_digest": self.files_digest,
            "rows_digest": self.runs_digest(),
            "content_digest": self.content_digest,
            "seed": self.seed,
            "chunk_rows": self.chunk_rows,
            "global_batch": self.global_batch,
            "buckets": [list(s) for s in self.bucket_shapes],
            "order": self.order,
            # Only where it is not 1: turns of one step are the order checkpoints without the key name.
            **({"bucket_steps": self.bucket_steps} if self.bucket_steps != 1 else {}),
        }

    # --- epochs and steps --------------------------------------------------------------------------------------

    def carried(self, epoch: int) -> np.ndarray:
        """Rows each bucket carries into ``epoch`` (fewer than a turn each)."""
        if epoch not in self._carries:
            # From the latest epoch worked out before this one (a rank walks the epochs in turn), else from 0.
            start = max((e for e in self._carries if e < epoch), default=0)
            carry = self._carries.get(start, np.zeros(len(self.bucket_shapes), np.int64))
            for _ in range(start, epoch):
                carry = (carry + self.bucket_rows) % self.turn_rows
            self._carries = {e: c for e, c in self._carries.items() if e >= epoch - 1} | {epoch: carry}
        return self._carries[epoch]

    def epoch_turns(self, epoch: int) -> np.ndarray:
        """Turns of each bucket in ``epoch``."""
        return (self.carried(epoch) + self.bucket_rows) // self.turn_rows

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """Batches of each bucket in ``epoch``."""
        return self.epoch_turns(epoch) * self.bucket_steps

    def steps_in_epoch(self, epoch: int) -> int:
        return int(self.epoch_batches(epoch).sum())

    def step_batches(self, epoch: int, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bucket, batch index within the bucket) of each of ``steps`` of ``epoch``: the epoch's turns in a seeded
        order, each its bucket's next ``bucket_steps`` batches."""
        turns = self.epoch_turns(epoch)
        offsets = np.concatenate([[0], np.cumsum(turns)]).astype(np.int64)
        steps = np.asarray(steps, np.int64)
        slots = ChunkShuffle(int(turns.sum()), (self.seed, epoch, 1)).chunk_at(steps // self.bucket_steps)
        bucket = np.searchsorted(offsets, slots, side="right") - 1
        return bucket, (slots - offsets[bucket]) * self.bucket_steps + steps % self.bucket_steps

    def _bucket_order(self, epoch: int, bucket: int) -> EpochOrder | TurnOrder:
        key = (epoch, bucket)
        if key not in self._orders:
            if len(self._orders) > 64:  # a rank walks a few epochs of every bucket
                self._orders.clear()
            seed, rows = (self.seed, epoch, 2, bucket), int(self.bucket_rows[bucket])
            turns = self._lanes  # chunks that start where lanes do: sdtrain.data.bucket_turns
            self._orders[key] = (
                TurnOrder(rows, self.chunk_rows, seed) if turns else EpochOrder(self.bucket_chunks[bucket], seed)
            )
        return self._orders[key]

    def order_spans(self, epoch: int, bucket: int, lo: int, hi: int) -> np.ndarray:
        """Spans (file, first row, end row) of positions [lo, hi) of ``bucket``'s order in ``epoch``: the rows it
        carried in first (the end of the previous epoch's order), then its own chunk order."""
        rows, batch = int(self.bucket_rows[bucket]), self.turn_rows
        carry = int(self.carried(epoch)[bucket])
        parts = []  # spans of the bucket's row sequence, each epoch's own rows, the latest epoch first
        # A loop, not a recursion: a bucket of r rows carries rows from up to G / r epochs back (2047 at G = 2048
        # and r = 1, past Python's recursion limit). It ends at epoch 0, which carries nothing in.
        while True:
            if hi > carry:
                parts.append(self._own_spans(epoch, bucket, max(lo, carry) - carry, hi - carry))
            if lo >= carry:
                break
            # The previous epoch's carry from this one's (carry = (previous carry + r) mod G, invertible): O(1) a
            # step back, where carried() would walk forward from the latest epoch it holds.
            epoch, hi = epoch - 1, min(hi, carry)
            carry = (carry - rows) % batch
            previous = (carry + rows) // batch * batch  # the previous epoch's batches come before what it carried on
            lo, hi = previous + lo, previous + hi
        if not parts:
            return np.zeros((0, 3), np.int64)
        spans = np.concatenate(parts[::-1])
        return self._file_spans(bucket, spans, np.zeros(len(spans), np.int64))[0]

    def _own_spans(self, epoch: int, bucket: int, lo: int, hi: int) -> np.ndarray:
        """Spans of ``bucket``'s row sequence at positions [lo, hi) of its own chunk order in ``epoch``."""
        if self.bucket_chunks[bucket].count == 1 and not self._lanes:
            # One chunk has one order: its rows as they are. These buckets (r <= chunk rows) are the ones carried
            # over many epochs, where building each epoch's shuffle walked back costs ~1 ms (2 s at G = 2048, r = 1).
            return np.array([[0, lo, hi]], np.int64)[: int(hi > lo)]
        spans, _ = self._bucket_order(epoch, bucket).spans(np.array([[lo, hi]], np.int64))
        return spans

    # --- the same interface as sdtrain.data.read_order.SamplePlan ----------------------------------------------

    def steps_done(self, state: DataState) -> int:
        """Steps of ``state``'s epoch done: each segment's rows per rank times its world size, over the batch."""
        return sum(rows * world_size for world_size, rows in state.segments) // self.global_batch

    def rank_stretches(
        self, state: DataState, world_size: int, rows_per_step: int, steps: int
    ) -> list[list[BucketStretch]]:
        """Each rank's steps for the next ``steps`` optimizer steps, one stretch per epoch they touch."""
        self._check_share(world_size, rows_per_step)
        stretches: list[list[BucketStretch]] = [[] for _ in range(world_size)]
        epoch, done = state.epoch, self.steps_done(state)
        while steps > 0:
            taken = min(self._steps_left(epoch, done), steps)
            for rank in range(world_size):
                if taken:
                    stretches[rank].append(BucketStretch(state, world_size, rank, done, taken))
            steps -= taken
            epoch, done = epoch + 1, 0
            state = DataState(epoch)
        return stretches

    def advance(self, state: DataState, world_size: int, rows_per_step: int, steps: int) -> DataState:
        """The state after ``steps`` more optimizer steps at ``world_size`` from ``state``."""
        self._check_share(world_size, rows_per_step)
        epoch, done, segments = state.epoch, self.steps_done(state), state.segments
        while True:
            left = self._steps_left(epoch, done)
            if steps < left:
                if segments and segments[-1][0] == world_size:  # the same group goes on: its segment grows
                    segments = (*segments[:-1], (world_size, segments[-1][1] + steps * rows_per_step))
                elif steps:
                    segments = (*segments, (world_size, steps * rows_per_step))
                return DataState(epoch, segments)
            steps -= left
            epoch, done, segments = epoch + 1, 0, ()

    def _steps_left(self, epoch: int, done: int) -> int:
        left = self.steps_in_epoch(epoch) - done
        if left <= 0 and self.bucket_rows.sum() == 0:
            raise ValueError("the data holds no rows")
        return max(left, 0)

    def _check_share(self, world_size: int, rows_per_step: int) -> None:
        if rows_per_step * world_size != self.global_batch:
            share = f"{rows_per_step} rows a step on each of {world_size} ranks"
            raise ValueError(f"{share} is not the plan's global batch {self.global_batch}")

    def steps_per_window(self, world_size: int) -> int:
        """Steps one read task reads its rank's shares of: about data.shuffle_window_rows rows, one block a step, in
        whole turns (a rank's rows of a turn are whole lanes: sdtrain.data.bucket_turns)."""
        steps = self.bucket_steps
        return steps * max(1, self.window_rows // (steps * (self.global_batch // world_size)))

    def num_windows(self, stretch: BucketStretch) -> int:
        """Read tasks of ``stretch``, which start at the epoch's multiples of :meth:`steps_per_window`."""
        return window_count(stretch.first, stretch.steps, self.steps_per_window(stretch.world_size))

    def window(self, stretch: BucketStretch, index: int) -> Window:
        return self.windows(stretch, index, 1)[0]

    def windows(self, stretch: BucketStretch, first: int = 0, count: int | None = None) -> list[Window]:
        """Read tasks ``first`` to ``first + count`` of ``stretch``, computed together: each reads the rank's shares of
        a few consecutive steps, one block a step (each of one bucket's shape)."""
        k = self.steps_per_window(stretch.world_size)
        count = self.num_windows(stretch) - first if count is None else count
        edges = window_edges(stretch.first, stretch.steps, k, first, count)
        if len(edges) < 2:
            return []
        begin, end = int(edges[0]), int(edges[-1])
        spans, owner = self._share_spans(stretch.state.epoch, np.arange(begin, end), stretch.world_size, stretch.rank)
        buckets, _ = self.step_batches(stretch.state.epoch, np.arange(begin, end))
        share = self.global_batch // stretch.world_size
        bounds = np.searchsorted(owner, edges - begin)
        out = []
        for i in range(len(edges) - 1):
            blocks = tuple((int(b), share) for b in buckets[edges[i] - begin : edges[i + 1] - begin])
            out.append(Window(spans[bounds[i] : bounds[i + 1]], (), 0, share * len(blocks), blocks[0][0], blocks))
        return out

    def _share_spans(self, epoch: int, steps: np.ndarray, world_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Spans of rank ``rank``'s shares of ``steps`` (in step order), and the step (index into ``steps``) each span
        is of: each bucket's shares mapped through its chunk order at once."""
        buckets, batches = self.step_batches(epoch, steps)
        carry = self.carried(epoch)
        shifts = carry[buckets] % self.chunk_rows if self._lanes else np.zeros_like(batches)
        turn = (self.bucket_steps, self.chunk_rows, self.global_batch)
        lo, hi, step_of = share_positions(batches, shifts, *turn, world_size, rank)
        buckets = buckets[step_of]
        spans_of, owners = [], []  # owners: the piece (index into lo) each span is of
        for bucket in np.unique(buckets).tolist():
            mine = np.flatnonzero(buckets == bucket)
            starts = lo[mine] - carry[bucket]
            own = starts >= 0
            if own.any():  # the bucket's own order: every piece past its carried rows at once
                intervals = np.stack([starts[own], hi[mine][own] - carry[bucket]], axis=1)
                spans, owner = self._bucket_order(epoch, bucket).spans(intervals)
                spans, owner = self._file_spans(bucket, spans, owner)
                spans_of.append(spans)
                owners.append(mine[own][owner])
            for piece in mine[~own].tolist():  # the few pieces that reach into the rows carried in
                spans = self.order_spans(epoch, bucket, int(lo[piece]), int(hi[piece]))
                spans_of.append(spans)
                owners.append(np.full(len(spans), piece))
        spans, owner = np.concatenate(spans_of), np.concatenate(owners)
        order = np.argsort(owner, kind="stable")  # piece order: step by step, each step's rows in order
        return spans[order], step_of[owner[order]]

    def _file_spans(self, bucket: int, spans: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Spans of ``bucket``'s row sequence as spans of its files (sdtrain.data.bucket_runs.Pieces.file_spans)."""
        return self.bucket_pieces[bucket].file_spans(spans, owner, self.run_file, self.run_start, self.run_rows)

    def sample_indices(self, window: Window) -> np.ndarray:
        """The sample index of every row ``window`` reads, in read order."""
        return window_sample_indices(window.spans, self.file_offsets)[window.order()]
