"""The read order's fast paths against what they replaced: every rank's cuts at once against the per-rank ones (the
same pieces, bit for bit), and a rank's part mapped back through the segments against its cut of the whole replay (the
same rows in the same order)."""

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


def _rows(intervals):
    return np.concatenate([np.arange(lo, hi) for lo, hi in intervals]) if len(intervals) else np.zeros(0, np.int64)


def _random_state(rng, plan, epoch):
    segments: tuple[tuple[int, int], ...] = ()
    for _ in range(int(rng.integers(0, 10))):
        left = int(np.diff(plan.remaining(DataState(epoch, segments)), axis=1).sum())
        world_size = int(rng.integers(1, 12))
        each = left // world_size
        # Whole windows, a partial one, the whole part, nothing, one row past the last whole window.
        whole = plan.window_rows * (each // plan.window_rows)
        choices = [rng.integers(0, each + 1), each, 0, min(each, 16 * (each // 32)), min(each, whole + 1)]
        segments += ((world_size, int(rng.choice(choices))),)
    return DataState(epoch, segments)


def test_a_ranks_part_mapped_back_through_the_segments_is_its_cut_of_the_whole_replay():
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(250):
        rows = rng.integers(0, 400, size=int(rng.integers(1, 12)))
        plan = SamplePlan(rows, trial, int(rng.integers(1, 40)), int(rng.integers(1, 48)), "x")
        state = _random_state(rng, plan, int(rng.integers(0, 3)))
        whole = plan.remaining(state)
        # More ranks than rows too: every part empty.
        for world_size in {1, 2, int(rng.integers(1, 16)), int(np.diff(whole, axis=1).sum()) + 2}:
            parts, _ = split_equal(whole, world_size)
            for rank in range(world_size):
                part = plan.part(state, world_size, rank)
                assert part.dtype == np.int64 and part.shape[1:] == (2,)
                assert (part[:, 1] > part[:, 0]).all() and (part[1:, 0] > part[:-1, 1]).all()  # merged, in order
                np.testing.assert_array_equal(_rows(part), _rows(parts[rank]))
                checked += 1
    assert checked > 2000


def test_a_ranks_windows_are_those_of_its_cut_of_the_whole_replay_after_many_resizes():
    # The read tasks themselves (their rows, in read order), at a size where every segment ends inside a window.
    plan = SamplePlan((5000,) * 200, 11, 16, 64, "x")
    state = DataState(2)
    for done in range(12):
        state = plan.advance(state, 8 - done % 3, 12, 150 + 7 * done)
    assert len(state.segments) == 12
    world_size = 5
    (stretches,) = zip(*plan.rank_stretches(state, world_size, 12, 400), strict=True)
    parts, _ = split_equal(plan.remaining(state), world_size)
    replayed = SamplePlan((5000,) * 200, 11, 16, 64, "x")
    for rank, stretch in enumerate(stretches):
        replayed._parts_cache[(stretch.state, world_size, rank)] = parts[rank]  # as every rank cut it before
        for new, old in zip(plan.windows(stretch), replayed.windows(stretch), strict=True):
            assert new.seed == old.seed and (new.lo, new.hi) == (old.lo, old.hi)
            np.testing.assert_array_equal(plan.sample_indices(new), replayed.sample_indices(old))
