"""The read order's cuts of every rank at once against the per-rank ones they replaced: the same pieces, bit for bit."""

import numpy as np
import pytest

from sdtrain.data.intervals import START, STOP, positions_to_intervals, slice_rows, split_equal
from sdtrain.data.read_order import DataState, SamplePlan


def _old_split_equal(spans, parts):
    # split_equal before it cut all ranks at once: slice_rows (unchanged, still the one-range cut) once per rank.
    total = int((spans[:, STOP] - spans[:, START]).sum())
    each = total // parts
    pieces = [slice_rows(spans, i * each, (i + 1) * each) for i in range(parts)]
    return pieces, slice_rows(spans, parts * each, total)


def _random_spans(rng, columns):
    n = int(rng.integers(0, 30))
    # Many empty pieces (left behind by partly read windows) and pieces of a row or two.
    lengths = rng.choice([0, 0, 1, 2, 3, 9], size=n) * (rng.random(n) < 0.8)
    starts = rng.integers(0, 1000, size=n)
    cols = [starts, starts + lengths]
    if columns == 3:
        cols.insert(0, rng.integers(0, 20, size=n))
    return np.stack(cols, axis=1).astype(np.int64).reshape(n, columns)


def _assert_same(new, old):
    (parts, tail), (old_parts, old_tail) = new, old
    assert len(parts) == len(old_parts)
    for a, b in zip([*parts, tail], [*old_parts, old_tail], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("columns", [2, 3])
def test_split_equal_cuts_the_pieces_the_per_rank_slices_did(columns):
    rng = np.random.default_rng(columns)
    for _ in range(400):
        spans = _random_spans(rng, columns)
        total = int((spans[:, STOP] - spans[:, START]).sum())
        # More ranks than rows too: every rank's part is empty, all rows are the tail.
        for parts in {1, 2, int(rng.integers(1, 70)), max(total, 1), total + 3}:
            _assert_same(split_equal(spans, parts), _old_split_equal(spans, parts))


def test_split_equal_of_no_pieces_and_of_only_empty_pieces():
    for spans in (np.zeros((0, 2), np.int64), np.array([[5, 5], [9, 9]], np.int64)):
        for parts in (1, 4):
            _assert_same(split_equal(spans, parts), _old_split_equal(spans, parts))


def _old_remaining(plan, state):
    # SamplePlan.remaining and _unconsumed as they were before every rank's cuts were made in one pass.
    intervals = np.array([[0, plan.num_rows]], np.int64)
    for segment, (world_size, consumed) in enumerate(state.segments):
        parts, tail = _old_split_equal(intervals, world_size)
        kept = []
        for rank, part in enumerate(parts):
            full, partial = divmod(consumed, plan.window_rows)
            start = full * plan.window_rows
            part_rows = int((part[:, STOP] - part[:, START]).sum())
            rest = slice_rows(part, start + (plan.window_rows if partial else 0), part_rows)
            if partial:
                window = slice_rows(part, start, start + plan.window_rows)
                window_rows = int((window[:, STOP] - window[:, START]).sum())
                order = np.random.default_rng((plan.seed, state.epoch, segment, rank, full)).permutation(window_rows)
                rest = np.concatenate([positions_to_intervals(window, np.sort(order[partial:])), rest])
            kept.append(rest)
        intervals = np.concatenate([*kept, tail])
    return intervals


def test_remaining_after_many_world_size_changes_is_the_replay_with_the_old_cuts():
    rng = np.random.default_rng(0)
    for _ in range(150):
        plan = SamplePlan(rng.integers(0, 300, size=int(rng.integers(1, 12))), 3, int(rng.integers(1, 40)), 16, "x")
        segments: tuple[tuple[int, int], ...] = ()
        for _ in range(int(rng.integers(0, 9))):
            left = int(np.diff(_old_remaining(plan, DataState(1, segments)), axis=1).sum())
            world_size = int(rng.integers(1, 12))
            each = left // world_size
            # Whole windows, a partial one, the whole part, nothing.
            consumed = int(rng.choice([rng.integers(0, each + 1), each, 0, min(each, 16 * (each // 32))]))
            segments += ((world_size, consumed),)
            state = DataState(1, segments)
            new, old = plan.remaining(state), _old_remaining(plan, state)
            assert new.dtype == old.dtype and new.shape == old.shape
            np.testing.assert_array_equal(new, old)
