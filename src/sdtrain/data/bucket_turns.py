"""Turns of bucketed data's steps, and the lanes of a turn a rank reads (``data.bucket_steps``).

A *turn* is ``k = data.bucket_steps`` consecutive steps of one bucket: positions [T k G, (T + 1) k G) of the bucket's
order for the epoch (:mod:`sdtrain.data.bucket_order`), G the global batch. The turn is cut into *lanes* of
``k q`` consecutive positions, ``q = data.shuffle_chunk_rows / k``, so that a lane is a chunk's worth of the order.
Step i of the turn (i < k) takes the i-th q positions of every lane, and its row t is row t % q of lane t // q's part:

    lane:       |  0: q q q  |  1: q q q  | ...        (k = 3)
    step 0:        ^          ^
    step 1:          ^          ^

A step's rows therefore do not depend on the world size, and rank r of W, which takes rows [r G/W, (r + 1) G/W) of
every step, takes the same lanes at each of the turn's steps: over the turn it reads k G/W consecutive positions,
whole chunks, where one step a turn would have it read a part of a chunk a step, the rest of which (its row groups)
other ranks read too. One step a turn (k = 1) is one lane, the whole batch: a rank's share is consecutive
positions, whole chunks where it is a multiple of a chunk.

For a lane to be one chunk, not the ends of two chunks far apart in the order, the chunks must start where lanes
do. A bucket's epoch order is its whole chunks shuffled and then its last rows (fewer than a chunk;
:class:`TurnOrder`), and an epoch's lanes are rotated within each turn by the rows the bucket carried in, modulo a
chunk: its own chunks then start on lane boundaries. Only the rows carried in (a turn or less a bucket an epoch),
the bucket's last rows and the one lane a turn that the rotation wraps around the turn's end are not whole chunks.
A chunk is in turn whole row groups of one file: a bucket's chunks are cut within its runs
(:func:`sdtrain.data.bucket_runs.run_pieces`), and preprocessing starts a row group at each run
(``sdtrain.preprocess.outputs.parquet_bytes``). Read order buckets-1 cut chunks from runs laid end to end, and for
one-step turns shuffled the short chunk anywhere and did not rotate the lanes.
"""

from __future__ import annotations

import numpy as np

from sdtrain.data.chunks import Chunks, EpochOrder


def lane_part_rows(bucket_steps: int, chunk_rows: int, global_batch: int) -> int:
    """Rows a step takes of each lane of its turn (q): the global batch where a turn is one step (one lane)."""
    if bucket_steps == 1:
        return global_batch
    if chunk_rows % bucket_steps or global_batch % (chunk_rows // bucket_steps):
        raise ValueError(
            f"turns of {bucket_steps} steps take {chunk_rows / bucket_steps:g} rows of each {chunk_rows}-row lane a "
            f"step, which does not divide the global batch {global_batch}"
        )
    return chunk_rows // bucket_steps


class TurnOrder:
    """A bucket's order for an epoch of turns: its whole chunks in a seeded order (:class:`EpochOrder`), then its last
    ``rows % chunk_rows`` rows; the same interface as :class:`EpochOrder` for spans of the bucket's row sequence."""

    def __init__(self, rows: int, chunk_rows: int, key: tuple[int, ...]):
        whole = rows - rows % chunk_rows
        # One chunk or none has one order: built for every epoch a small bucket's carried rows walk back through.
        self.whole = whole if whole > chunk_rows else 0
        self.order = EpochOrder(Chunks(np.array([whole], np.int64), chunk_rows), key) if self.whole else None

    def spans(self, intervals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Spans (0, first row, end row) of the rows at the positions ``intervals`` cover, in their order, and the
        (non-empty) interval each is part of."""
        intervals = intervals[intervals[:, 1] > intervals[:, 0]]
        lo, hi = intervals[:, 0], intervals[:, 1]
        head = lo < self.whole
        pieces, owners = [], []
        if self.order is not None and head.any():
            spans, owner = self.order.spans(np.stack([lo[head], np.minimum(hi[head], self.whole)], axis=1))
            pieces.append(spans)
            owners.append(np.flatnonzero(head)[owner] * 2)
        tail = hi > self.whole  # the last rows, as they are
        tail_lo = np.maximum(lo[tail], self.whole)
        pieces.append(np.stack([np.zeros_like(tail_lo), tail_lo, hi[tail]], axis=1))
        owners.append(np.flatnonzero(tail) * 2 + 1)
        owner = np.concatenate(owners)
        order = np.argsort(owner, kind="stable")  # each interval's chunks, then its last rows
        return np.concatenate(pieces)[order], owner[order] // 2


def share_positions(
    batches: np.ndarray,
    shifts: np.ndarray,
    bucket_steps: int,
    chunk_rows: int,
    global_batch: int,
    world_size: int,
    rank: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions [lo, hi) of the bucket orders that rank ``rank``'s shares take, as pieces in read order (step by step,
    each step's rows in order), and the step (index into ``batches``) of each piece.

    Args:
        batches: the batch index within its bucket of each step.
        shifts: each step's rotation of its turn's lanes (0 where a turn is one step).
        bucket_steps: data.bucket_steps (k).
        chunk_rows: data.shuffle_chunk_rows.
        global_batch: train.global_batch_size (G).
        world_size: the ranks (W).
        rank: the rank.
    """
    lane_part, share = lane_part_rows(bucket_steps, chunk_rows, global_batch), global_batch // world_size
    first_row, end_row = rank * share, (rank + 1) * share
    lanes = np.arange(first_row // lane_part, (end_row - 1) // lane_part + 1, dtype=np.int64)
    within_lo = np.maximum(first_row - lanes * lane_part, 0)
    within_hi = np.minimum(end_row - lanes * lane_part, lane_part)
    turn_rows = bucket_steps * global_batch
    # Within the turn, lanes start `shift` positions on (TurnOrder's chunks do), the last wrapping past its end.
    lane_base = (batches % bucket_steps * lane_part + shifts)[:, None] + lanes * (bucket_steps * lane_part)
    lo, hi = (lane_base + within_lo).ravel(), (lane_base + within_hi).ravel()
    step_of = np.repeat(np.arange(len(batches)), len(lanes))
    past = lo >= turn_rows
    lo[past], hi[past] = lo[past] - turn_rows, hi[past] - turn_rows
    # A piece the turn's end cuts is two: its part up to the end, then the rest from the turn's start.
    cut = hi > turn_rows
    piece = np.repeat(np.arange(len(lo)), 1 + cut)
    rest = np.zeros(len(piece), bool)
    rest[np.cumsum(1 + cut)[cut] - 1] = True
    lo, hi, step_of = lo[piece], hi[piece], step_of[piece]
    hi[cut[piece] & ~rest] = turn_rows
    lo[rest], hi[rest] = 0, hi[rest] - turn_rows
    turn_start = batches // bucket_steps * turn_rows
    return turn_start[step_of] + lo, turn_start[step_of] + hi, step_of


def window_count(first: int, steps: int, per_window: int) -> int:
    """Read tasks of a stretch of ``steps`` steps from step ``first``: one for each multiple of ``per_window`` of the
    epoch's steps it reaches into (see :func:`window_edges`)."""
    return -(-(first + steps) // per_window) - first // per_window if steps > 0 else 0


def window_edges(first: int, steps: int, per_window: int, first_window: int, count: int) -> np.ndarray:
    """The steps read tasks ``first_window`` to ``first_window + count`` of a stretch of ``steps`` steps from step
    ``first`` start at, and the end of the last: task i reads steps [edges[i], edges[i + 1]). Tasks start at the
    epoch's multiples of ``per_window`` (whole turns), so a stretch that starts or ends mid-turn has a short one.
    """
    number = first // per_window + first_window  # of the first task, counted from the epoch's start
    return np.unique(np.clip(np.arange(number, number + count + 1) * per_window, first, first + steps))


def consecutive_rows(bucket_steps: int, chunk_rows: int, share: int) -> int:
    """Consecutive positions of a bucket's order a rank reads at a time with shares of ``share`` rows a step: its share
    of a step where a turn is one step, else its lanes' parts over a turn, up to a whole lane (a chunk)."""
    return share if bucket_steps == 1 else min(bucket_steps * share, chunk_rows)


def fitting_bucket_steps(chunk_rows: int, global_batch: int, share: int, group_rows: int) -> int | None:
    """The fewest steps a turn with which a rank reads, at ``share`` rows a step, at least a row group of
    ``group_rows`` rows (or a whole chunk) at a time; None where no divisor of ``chunk_rows`` does."""
    want = min(group_rows, chunk_rows)
    for steps in range(2, chunk_rows + 1):
        if chunk_rows % steps == 0 and global_batch % (chunk_rows // steps) == 0 and steps * share >= want:
            return steps
    return None


def auto_bucket_steps(chunk_rows: int, global_batch: int, most_workers: int) -> int:
    """``data.bucket_steps: auto``: the fewest steps a turn over which each of ``most_workers`` ranks reads whole
    chunks (its lanes' parts make a chunk); 1 where a rank's share of a step is a chunk or more already."""
    share = global_batch // most_workers
    if share >= chunk_rows:
        return 1
    steps = fitting_bucket_steps(chunk_rows, global_batch, share, chunk_rows)
    assert steps is not None  # chunk_rows steps a turn: lanes' parts of one row, whole chunks at any share of one
    return steps
