"""The sample order: exactly once per epoch across restarts and world-size changes (pure logic, no Ray)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sdtrain.data.position import DataPosition, plan_changes
from sdtrain.data.read_order import DataState, SamplePlan, files_digest
from sdtrain.errors import DataError


def consumed(plan: SamplePlan, state: DataState, world_size: int, rows_per_step: int, steps: int) -> list[np.ndarray]:
    """Sample indices each rank reads in the next ``steps`` steps."""
    return [
        np.concatenate(
            [
                plan.sample_indices(plan.window(stretch, i))
                for stretch in stretches
                for i in range(stretch.num_windows(plan.window_rows))
            ]
        )
        for stretches in plan.rank_stretches(state, world_size, rows_per_step, steps)
    ]


def test_one_epoch_reads_every_row_once_shuffled():
    plan = SamplePlan((100, 60, 40), seed=3, chunk_rows=8, window_rows=32)
    global_batch = 40
    ranks = consumed(plan, DataState(), 2, global_batch // 2, 200 // global_batch)
    seen = np.concatenate(ranks)
    assert sorted(seen) == list(range(200))
    assert not np.array_equal(seen, np.arange(200))  # shuffled
    assert plan.advance(DataState(), 2, 20, 5) == DataState(1, ())
    # The next epoch is a different order of the same rows.
    again = np.concatenate(consumed(plan, DataState(1), 2, 20, 5))
    assert sorted(again) == list(range(200)) and not np.array_equal(again, seen)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4, 1), (4, 2, 3), (1, 3)])
def test_interrupted_epoch_reads_the_same_rows_once_at_any_world_size(sizes):
    plan = SamplePlan((70, 50, 90, 30), seed=0, chunk_rows=7, window_rows=20)
    global_batch = 24  # divides over 1..4 ranks
    steps_per_epoch = 240 // global_batch
    state, seen, done = DataState(), [], 0
    cuts = np.linspace(0, steps_per_epoch, len(sizes) + 1).astype(int)
    for world_size, (a, b) in zip(sizes, itertools.pairwise(cuts), strict=True):
        seen += consumed(plan, state, world_size, global_batch // world_size, b - a)
        state = plan.advance(state, world_size, global_batch // world_size, b - a)
        done += b - a
    seen = np.concatenate(seen)
    assert len(seen) == steps_per_epoch * global_batch == 240
    assert sorted(seen) == list(range(240))
    assert state == DataState(1, ())


def test_a_restart_at_the_same_world_size_reads_what_an_uninterrupted_run_reads():
    plan = SamplePlan((45, 51), seed=2, chunk_rows=6, window_rows=10)
    straight = consumed(plan, DataState(), 2, 8, 12)  # one epoch and then some: crosses into epoch 1
    state, pieces = DataState(), [[], []]
    for steps in (3, 2, 7):  # cuts inside windows and at the epoch boundary
        for rank, ids in enumerate(consumed(plan, state, 2, 8, steps)):
            pieces[rank].append(ids)
        state = plan.advance(state, 2, 8, steps)
    assert all(np.array_equal(np.concatenate(p), s) for p, s in zip(pieces, straight, strict=True))
    assert state == plan.advance(DataState(), 2, 8, 12)


def test_segment_state_replays_to_the_rows_not_yet_read():
    plan = SamplePlan((50, 50), seed=1, chunk_rows=5, window_rows=16)
    first = np.concatenate(consumed(plan, DataState(), 2, 6, 3))
    state = plan.advance(DataState(), 2, 6, 3)
    assert state == DataState(0, ((2, 18),))
    left, _ = plan.epoch_order(state.epoch).spans(plan.remaining(state))  # positions in the epoch's order -> rows
    left_ids = np.concatenate([np.arange(plan.file_offsets[f] + a, plan.file_offsets[f] + b) for f, a, b in left])
    assert sorted(np.concatenate([first, left_ids])) == list(range(100))


def test_too_small_dataset_is_an_error():
    plan = SamplePlan((10,), seed=0, chunk_rows=4, window_rows=8)
    with pytest.raises(ValueError, match="10 rows cannot fill one step of 8 rows on each of 2 ranks"):
        plan.rank_stretches(DataState(), 2, 8, 1)


def test_a_position_is_resumed_only_against_the_data_and_settings_it_refers_to():
    plan = SamplePlan((48, 48), seed=0, chunk_rows=8, window_rows=16, files_digest=files_digest(["a", "b"]))
    state = plan.advance(DataState(), 2, 12, 2)  # 48 of the 96 rows consumed
    saved = {"step": 2, "data": state.to_dict(), "plan": plan.fingerprint()}
    assert DataPosition.from_dict(saved).resume(plan, "fail", "ckpt") == (2, state)
    old = {"step": 2, "data": state.to_dict()}  # a checkpoint from before fingerprints: replayed as before
    assert DataPosition.from_dict(old).resume(SamplePlan((48, 48, 24), 0, 8, 16), "fail", "ckpt") == (2, state)

    added = SamplePlan((48, 48, 24), 0, 8, 16, files_digest(["a", "b", "c"]))
    with pytest.raises(
        DataError, match=r"ckpt \(step 2, epoch 0\) .* data.train has 3 file\(s\), the checkpoint's had 2"
    ):
        DataPosition.from_dict(saved).resume(added, "fail", "ckpt")
    assert plan_changes(plan.fingerprint(), SamplePlan((48, 48), 1, 4, 16, plan.files_digest).fingerprint()) == [
        "train.seed is 1, was 0",
        "data.shuffle_chunk_rows is 4, was 8",
    ]
    assert plan_changes(plan.fingerprint(), SamplePlan((48, 48), 0, 8, 16, files_digest(["a", "x"])).fingerprint()) == [
        "the list of data.train files changed (renamed, moved or replaced)"
    ]
    # Deliberately: keep the weights, start the next epoch on the data as it is now.
    assert DataPosition.from_dict(saved).resume(added, "new_epoch", "ckpt") == (2, DataState(epoch=1))


def test_random_plans_read_every_row_once_per_epoch_across_world_size_changes_and_resume_bitwise():
    """Property test: random plans (many files, empty and short ones, uneven tails), random restarts at random
    world sizes; every epoch's rows are distinct, an epoch leaves fewer than one step's rows, and a restart at
    the same world size reads what an uninterrupted run reads, in the same order."""
    rng = np.random.default_rng(2026)
    for case in range(24):
        rows = rng.integers(0, 70, size=int(rng.integers(1, 40)))
        rows[rng.random(len(rows)) < 0.1] = 0  # some empty files
        chunk_rows, window_rows = int(rng.integers(1, 20)), int(rng.integers(1, 64))
        plan = SamplePlan(
            tuple(int(r) for r in rows),
            seed=int(rng.integers(0, 2**31)),
            chunk_rows=chunk_rows,
            window_rows=window_rows,
        )
        rows_per_rank = int(rng.integers(1, 6))
        if plan.num_rows < 4 * rows_per_rank:
            continue
        state, per_epoch = DataState(), {0: []}
        for _ in range(int(rng.integers(1, 7))):
            world_size = int(rng.integers(1, 5))
            steps = int(rng.integers(1, 3 + plan.num_rows // (world_size * rows_per_rank)))
            for stretches in plan.rank_stretches(state, world_size, rows_per_rank, steps):
                for stretch in stretches:
                    ids = np.concatenate(
                        [plan.sample_indices(plan.window(stretch, i)) for i in range(stretch.num_windows(window_rows))]
                    )
                    per_epoch.setdefault(stretch.state.epoch, []).append(ids)
                    assert len(ids) == stretch.rows, case
            # Bitwise: the same stretch read in two restarts at the same world size is the uninterrupted one.
            cut = int(rng.integers(0, steps + 1))
            straight = consumed(plan, state, world_size, rows_per_rank, steps)
            middle = plan.advance(state, world_size, rows_per_rank, cut)
            halves = [
                np.concatenate([a, b])
                for a, b in zip(
                    consumed(plan, state, world_size, rows_per_rank, cut) if cut else [np.zeros(0, int)] * world_size,
                    consumed(plan, middle, world_size, rows_per_rank, steps - cut)
                    if steps - cut
                    else [np.zeros(0, int)] * world_size,
                    strict=True,
                )
            ]
            assert all(np.array_equal(h, s) for h, s in zip(halves, straight, strict=True)), case
            state = plan.advance(state, world_size, rows_per_rank, steps)
        for epoch, pieces in per_epoch.items():
            seen = np.concatenate(pieces) if pieces else np.zeros(0, int)
            assert len(np.unique(seen)) == len(seen), (case, epoch)  # exactly once
            assert seen.min(initial=0) >= 0 and seen.max(initial=0) < plan.num_rows
            if epoch < state.epoch:  # a finished epoch left fewer rows than one step of its last world size
                assert plan.num_rows - len(seen) < 4 * rows_per_rank + 4, (case, epoch)


def test_the_plan_at_two_billion_rows_is_small_and_its_windows_cheap():
    """200k files of 10k rows: the plan holds per-file arrays, not a table of its 31M chunks, and a rank's
    window needs only its own few chunks."""
    plan = SamplePlan(np.full(200_000, 10_000), seed=0, chunk_rows=64, window_rows=512)
    assert plan.num_rows == 2_000_000_000 and plan.num_chunks == 31_400_000
    state = plan.advance(DataState(), 64, 32, 1000)  # mid-epoch, then a restart at another world size
    (stretch, *_), *_ = plan.rank_stretches(state, 48, 32, 100)
    assert len(plan.sample_indices(plan.window(stretch, 0))) == 512  # starts with the leftovers of the last segment
    window = plan.window(stretch, 3)
    assert window.spans.shape[0] <= 512 // 64 + 2 and len(plan.sample_indices(window)) == 512
    # Per rank of the segment: the scattered leftover of a partial window (at most a window's rows), then the rest.
    assert len(plan.remaining(state)) <= 64 * (512 + 1) + 1


def test_a_file_rewritten_in_place_is_a_change_but_a_checkpoint_without_a_content_digest_is_not():
    plan = SamplePlan((48, 48), seed=0, chunk_rows=8, window_rows=16, files_digest="f", content_digest="c1")
    rewritten = SamplePlan((48, 48), seed=0, chunk_rows=8, window_rows=16, files_digest="f", content_digest="c2")
    assert plan_changes(plan.fingerprint(), rewritten.fingerprint()) == [
        "a data.train file was rewritten in place (its size or ETag/mtime changed)"
    ]
    older = {k: v for k, v in plan.fingerprint().items() if k != "content_digest"}  # written before the index
    assert plan_changes(older, rewritten.fingerprint()) == []
    # A fingerprint of the order before the chunk shuffle (no "order" key) names the upgrade.
    before_shuffle = {k: v for k, v in plan.fingerprint().items() if k != "order"}
    assert plan_changes(before_shuffle, plan.fingerprint()) == [
        "the checkpoint was written with read order 1 of an earlier sdtrain, this one reads order 2"
    ]
