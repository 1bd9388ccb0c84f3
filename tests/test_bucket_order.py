"""The read order of bucketed data (sdtrain.data.bucket_order), pure logic: every step one bucket's, every row once an
epoch with the remainders carried, and the same global steps whatever the world size and however often it changes."""

import hashlib

import numpy as np
import pytest

from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.bucket_runs import runs_of
from sdtrain.data.bucket_turns import auto_bucket_steps, lane_part_rows
from sdtrain.data.position import plan_changes
from sdtrain.data.read_order import DataState, window_sample_indices

SHAPES = [(4, 8, 8), (4, 6, 10), (4, 10, 6), (4, 4, 16)]


def _plan(seed=0, global_batch=12, chunk_rows=5, window_rows=20, bucket_steps=1, order="buckets-2"):
    # Files of several buckets each, sorted by bucket; one bucket (3) too small for a batch in one epoch.
    files = [[(0, 30), (1, 11)], [(0, 7), (2, 25), (3, 5)], [(1, 40)], [(0, 19), (2, 3)]]
    rows = [sum(n for _, n in f) for f in files]
    return BucketPlan(
        rows,
        runs_of(files),
        SHAPES,
        seed,
        chunk_rows,
        global_batch,
        window_rows,
        bucket_steps=bucket_steps,
        order=order,
    )


def _bucket_of_rows(plan):
    """The bucket of every row, by its sample index."""
    bucket = np.full(plan.num_rows, -1)
    for f, b, n in plan.run_table():
        at = plan.file_offsets[f] + int((bucket[plan.file_offsets[f] : plan.file_offsets[f + 1]] >= 0).sum())
        bucket[at : at + n] = b
    return bucket


def _blocks(plan, window):
    """A read task's rows as the blocks it makes, one a step."""
    indices = plan.sample_indices(window)
    assert len(indices) == sum(rows for _, rows in window.blocks)
    return np.split(indices, np.cumsum([rows for _, rows in window.blocks])[:-1])


def _read(plan, state, world_size, steps):
    """(the global batch of each of ``steps`` steps: the ranks' shares in rank order; the state after them)."""
    share = plan.global_batch // world_size
    for stretches in plan.rank_stretches(state, world_size, share, steps):
        assert all(len(plan.windows(stretch)) == plan.num_windows(stretch) for stretch in stretches)
    per_rank = [
        [block for stretch in stretches for w in plan.windows(stretch) for block in _blocks(plan, w)]
        for stretches in plan.rank_stretches(state, world_size, share, steps)
    ]
    batches = [np.concatenate([per_rank[r][s] for r in range(world_size)]) for s in range(steps)]
    return batches, plan.advance(state, world_size, share, steps)


def test_every_step_is_one_buckets_and_every_row_is_read_once_an_epoch_with_the_rest_carried():
    plan = _plan()
    bucket = _bucket_of_rows(plan)
    state, seen = DataState(), []
    for epoch in range(3):
        assert state == DataState(epoch)
        steps = plan.steps_in_epoch(epoch)
        batches, state = _read(plan, state, 3, steps)
        assert state == DataState(epoch + 1)  # the epoch's steps, exactly
        for batch in batches:
            assert len(batch) == plan.global_batch and len(set(bucket[batch])) == 1  # one bucket a step
        counts = np.bincount(bucket[np.concatenate(batches)], minlength=len(SHAPES)) // plan.global_batch
        assert counts.tolist() == plan.epoch_batches(epoch).tolist()  # steps in proportion to each bucket's rows
        seen.append(np.concatenate(batches))
    # Over three epochs every row is read three times, but for the rows carried into the fourth (fewer than a
    # batch of each bucket): nothing dropped, nothing padded, nothing read twice within its turn.
    reads = np.bincount(np.concatenate(seen), minlength=plan.num_rows)
    assert set(reads.tolist()) <= {2, 3}
    carried = np.bincount(bucket[reads == 2], minlength=len(SHAPES))
    assert carried.tolist() == plan.carried(3).tolist()
    # The small bucket (5 rows) fills a batch only once three epochs have carried its rows.
    assert plan.epoch_batches(0)[3] == 0 and plan.epoch_batches(2)[3] == 1


@pytest.mark.parametrize("bucket_steps", [2, 3, 6])
def test_turns_of_bucket_steps_steps_are_one_buckets_and_every_row_is_read_once_an_epoch(bucket_steps):
    plan = _plan(chunk_rows=6, bucket_steps=bucket_steps)  # lanes of 6 positions: 6 / bucket_steps rows a step
    bucket = _bucket_of_rows(plan)
    state, seen = DataState(), []
    for epoch in range(4):
        steps = plan.steps_in_epoch(epoch)
        assert steps % bucket_steps == 0
        batches, state = _read(plan, state, 3, steps)
        assert state == DataState(epoch + 1)
        for first in range(0, steps, bucket_steps):  # a turn: bucket_steps whole batches of one bucket
            turn = batches[first : first + bucket_steps]
            assert all(len(batch) == plan.global_batch for batch in turn)
            assert len(set(bucket[np.concatenate(turn)])) == 1
        seen += batches  # none in the first epoch of 6 steps a turn: no bucket has a turn's 72 rows yet
    # Every row is read once an epoch but for the rows carried on (fewer than a turn of each bucket): the rows each
    # bucket still owes after four epochs are the rows it carries into the fifth.
    reads = np.bincount(np.concatenate(seen), minlength=plan.num_rows)
    owed = np.bincount(bucket, weights=4 - reads, minlength=len(SHAPES))
    assert reads.max() <= 4 and owed.tolist() == plan.carried(4).tolist()
    assert (plan.carried(4) < plan.turn_rows).all() and plan.carried(4).any()


@pytest.mark.parametrize("sizes", [[(2, 4), (3, 5), (6, 2)], [(4, 7), (1, 30)], [(3, 3), (2, 2), (6, 4), (1, 9)]])
@pytest.mark.parametrize("bucket_steps", [1, 3])
def test_the_global_steps_are_the_same_whatever_the_world_sizes_and_restarts(sizes, bucket_steps):
    # Three steps a turn: restarts mid-turn, and 4 workers' shares of 3 rows cut the lanes' 2-row parts.
    plan = _plan(seed=3, chunk_rows=6 if bucket_steps > 1 else 5, bucket_steps=bucket_steps)
    total = sum(steps for _, steps in sizes)
    reference, _ = _read(plan, DataState(), 1, total)
    got, state = [], DataState()
    for world_size, steps in sizes:  # a run resized (and restarted) several times, across epochs
        batches, state = _read(plan, state, world_size, steps)
        got += batches
    assert len(got) == total
    for want, have in zip(reference, got, strict=True):
        np.testing.assert_array_equal(want, have)  # the same rows in the same order, at every step


def test_a_ranks_share_of_a_step_is_a_few_runs_of_consecutive_rows_and_tasks_group_steps():
    plan = _plan(chunk_rows=6, global_batch=12, window_rows=6)  # a read task a step
    (stretch,), *_ = plan.rank_stretches(DataState(), 2, 6, 5)
    assert plan.num_windows(stretch) == 5
    for window in plan.windows(stretch):
        # A chunk or two, each cut where the bucket's runs (in different files) meet.
        assert len(window.spans) <= 4 and window.blocks == ((window.bucket, 6),)
        assert len(window_sample_indices(window.spans, plan.file_offsets)) == 6
    grouped = _plan(chunk_rows=6, global_batch=12, window_rows=24)  # four steps' shares a task
    (stretch,), *_ = grouped.rank_stretches(DataState(), 2, 6, 9)
    assert [len(w.blocks) for w in grouped.windows(stretch)] == [4, 4, 1]


def test_over_a_turn_a_rank_reads_whole_lanes_so_whole_chunks_of_its_buckets_order():
    """64-row chunks, a global batch of 64 on 16 ranks (4 rows a step each, a sixteenth of a chunk): with turns of 16
    steps each rank's read task takes one lane, 64 consecutive positions of its bucket's order, where with one step a
    turn each of 16 ranks took 4 rows of the same chunk."""
    files = [[(0, 700), (1, 1300)], [(0, 520), (1, 1480)], [(0, 2000)]]  # 5 turns of 1024 rows in epoch 0
    rows = [sum(n for _, n in f) for f in files]
    plan = BucketPlan(rows, runs_of(files), SHAPES[:2], 4, 64, 64, 64, bucket_steps=16)
    assert plan.steps_per_window(16) == 16
    for rank in (0, 7, 15):
        (stretch,) = plan.rank_stretches(DataState(), 16, 4, 48)[rank]
        windows = plan.windows(stretch)
        assert [len(w.blocks) for w in windows] == [16] * 3
        buckets, batches = plan.step_batches(0, np.arange(48))
        for turn, window in enumerate(windows):
            bucket, first = int(buckets[16 * turn]), int(batches[16 * turn])
            lane = plan.order_spans(0, bucket, first * 64 + rank * 64, first * 64 + rank * 64 + 64)
            want = window_sample_indices(lane, plan.file_offsets)
            assert sorted(plan.sample_indices(window).tolist()) == sorted(want.tolist())
    # A run resumed mid-turn reads the rest of the turn in one task, then whole turns.
    (stretch,) = plan.rank_stretches(plan.advance(DataState(), 16, 4, 5), 16, 4, 27)[3]
    assert [len(w.blocks) for w in plan.windows(stretch)] == [11, 16]


def _run_rows(plan):
    """Each row's run (index into the plan's runs) and its row within the run, by sample index."""
    rows = plan.run_table()[:, 2]
    run = np.repeat(np.arange(len(rows)), rows)
    return run, np.arange(plan.num_rows) - np.repeat(np.cumsum(rows) - rows, rows)


@pytest.mark.parametrize(("bucket_steps", "world_size", "global_batch"), [(16, 16, 64), (1, 4, 256)])
def test_a_lane_is_one_whole_chunk_of_one_run_in_every_epoch_whatever_the_rows_carried_in(
    bucket_steps, world_size, global_batch
):
    """The same data as above, in epochs whose buckets carried rows in (not multiples of a chunk): each lane a rank
    reads over a turn is one whole 64-row chunk of one run, starting a multiple of 64 rows into it (so whole row groups
    of a file preprocessing wrote), but for the one lane a turn that the rotation wraps (the last rank's), the rows
    carried in (turn 0's) and the lanes cut from the runs' last rows. Turns of 16 steps at 4 rows a rank, and turns of
    one step at 64 (a lane is then a rank's share of the step)."""
    files = [[(0, 700), (1, 1300)], [(0, 520), (1, 1480)], [(0, 2000)]]
    rows = [sum(n for _, n in f) for f in files]
    plan = BucketPlan(rows, runs_of(files), SHAPES[:2], 4, 64, global_batch, 64, bucket_steps=bucket_steps)
    share, per_window = global_batch // world_size, plan.steps_per_window(world_size)
    assert bucket_steps * share == 64 and per_window == bucket_steps
    run, within = _run_rows(plan)
    whole_rows = within < plan.run_table()[run, 2] // 64 * 64  # rows of their runs' whole chunks
    assert (plan.carried(1) % 64 > 0).all() and (plan.carried(2) % 64 > 0).all()
    whole, checked, last_rows = 0, 0, 0
    for epoch in (1, 2):
        steps = plan.steps_in_epoch(epoch)
        _, batches = plan.step_batches(epoch, np.arange(steps))
        for rank in range(world_size - 1):
            for stretch in plan.rank_stretches(DataState(epoch), world_size, share, steps)[rank]:
                for window, first in zip(plan.windows(stretch), range(0, steps, per_window), strict=True):
                    lane = np.sort(plan.sample_indices(window))
                    if int(batches[first]) // bucket_steps == 0:
                        continue  # rows carried in
                    if not whole_rows[lane].all():
                        last_rows += 1
                        continue
                    checked += 1
                    one_run = (run[lane] == run[lane[0]]).all() and within[lane[0]] % 64 == 0
                    whole += one_run and np.array_equal(lane, lane[0] + np.arange(64))
    # The runs' last rows are 112 of the 6000 (60 + 8 + 16 and 20 + 8): a few lanes. With turns of 16 cut from the runs
    # laid end to end (order buckets-1), 44 of 115 lanes were one run's whole chunk.
    assert checked > 40 and whole == checked and 0 < last_rows < checked / 5


def test_the_plan_refuses_shares_that_do_not_make_its_batch_and_runs_that_do_not_make_their_files():
    plan = _plan()
    with pytest.raises(ValueError, match="not the plan's global batch 12"):
        plan.rank_stretches(DataState(), 5, 2, 1)
    with pytest.raises(ValueError, match="file 1: its bucket runs hold 36 rows, the file 37"):
        BucketPlan([41, 37], runs_of([[(0, 30), (1, 11)], [(0, 36)]]), SHAPES, 0, 5, 12)
    with pytest.raises(ValueError, match="turns of 4 steps take 16 rows of each 64-row lane a step, which does not"):
        _plan(chunk_rows=64, global_batch=24, bucket_steps=4)


def test_the_plan_pickles_small_and_reads_the_same_after():
    import pickle

    plan = _plan(seed=9)
    again = pickle.loads(pickle.dumps(plan))
    assert again.fingerprint() == plan.fingerprint()
    a, _ = _read(plan, DataState(), 2, 9)
    b, _ = _read(again, DataState(), 2, 9)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert plan.fingerprint()["order"] == "buckets-2" and plan.fingerprint()["buckets"][1] == [4, 6, 10]
    assert _plan(seed=10).fingerprint() != plan.fingerprint()
    # Turns of one step are the order checkpoints written before data.bucket_steps name; others are another order.
    assert "bucket_steps" not in plan.fingerprint()
    turns = _plan(chunk_rows=6, bucket_steps=3)
    assert turns.fingerprint()["bucket_steps"] == 3
    again = pickle.loads(pickle.dumps(turns))
    a, _ = _read(turns, DataState(), 2, 9)
    b, _ = _read(again, DataState(), 2, 9)
    assert again.fingerprint() == turns.fingerprint() and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert plan_changes(turns.fingerprint(), _plan(chunk_rows=6).fingerprint()) == [
        "data.bucket_steps is 1, was 3 (bucketed data's order is cut in turns of that many steps)"
    ]


@pytest.mark.parametrize("bucket_steps", [1, 3])
def test_a_run_resumes_in_the_read_order_its_checkpoints_were_written_in(bucket_steps):
    """buckets-1 cut a bucket's chunks from its runs laid end to end; buckets-2 cuts them within runs. A run whose
    checkpoint names buckets-1 goes on reading it after the upgrade, rather than refusing to resume; an order this
    sdtrain does not read still resumes as a change."""
    from sdtrain.data.position import DataPosition

    plan = _plan(chunk_rows=6, bucket_steps=bucket_steps)
    old = BucketPlan(plan.rows, plan.run_table(), SHAPES, 0, 6, 12, 20, bucket_steps=bucket_steps, order="buckets-1")
    steps, _ = _read(plan, DataState(), 2, 12)
    old_steps, _ = _read(old, DataState(), 2, 12)
    assert any(not np.array_equal(a, b) for a, b in zip(steps, old_steps, strict=True))  # two orders
    stored = old.fingerprint()
    assert plan_changes(stored, plan.fingerprint()) == [
        "the checkpoint was written with read order buckets-1 of an earlier sdtrain, this one reads order buckets-2"
    ]
    kept = plan.resumed_as(stored)
    assert kept.fingerprint() == stored and kept.order == "buckets-1" and plan.order == "buckets-2"
    kept_steps, _ = _read(kept, DataState(), 2, 12)
    assert all(np.array_equal(a, b) for a, b in zip(kept_steps, old_steps, strict=True))
    assert DataPosition(3, DataState(), stored).resume(kept, "fail", "ckpt") == (3, DataState())
    for other in (plan.fingerprint(), {**stored, "order": "buckets-0"}, None):
        assert plan.resumed_as(other) is plan
    with pytest.raises(ValueError, match="read order buckets-0: this sdtrain reads orders buckets-1, buckets-2"):
        BucketPlan(plan.rows, plan.run_table(), SHAPES, 0, 6, 12, order="buckets-0")


@pytest.mark.parametrize(
    ("chunk", "batch", "workers", "steps"),
    [(64, 2048, 8, 1), (64, 2048, 64, 2), (64, 2048, 256, 8), (64, 2048, 2048, 64), (64, 24, 1, 8), (6, 10, 4, 3)],
)
def test_auto_bucket_steps_are_the_fewest_whose_lanes_make_whole_chunks_at_the_most_workers(
    chunk, batch, workers, steps
):
    """data.bucket_steps: auto. At 24 rows a step, turns of 2 or 4 steps would cut lanes into parts of 32 or 16 rows,
    which make no batch of 24: 8 is the fewest that both make a batch and read a chunk a turn."""
    share = batch // workers
    assert auto_bucket_steps(chunk, batch, workers) == steps
    lane_part_rows(steps, chunk, batch)  # lanes that make the batch: else it raises
    assert steps * share >= chunk  # a rank reads a chunk a turn at the most workers, more at fewer
    fewer = [k for k in range(2, steps) if chunk % k == 0 and batch % (chunk // k) == 0 and k * share >= chunk]
    assert fewer == [] and (steps == 1) == (share >= chunk)


def test_a_run_on_auto_bucket_steps_resumes_in_its_checkpoints_turns():
    """A run's turns are kept from its checkpoint where data.bucket_steps is auto (whose pick follows the workers),
    also the turns of one step a fingerprint leaves out; not where the chunks or the batch changed, whose lanes the
    old turns may not make, nor where the config names a number."""
    plan = _plan(chunk_rows=6, bucket_steps=3)
    one = _plan(chunk_rows=6)
    kept = one.resumed_as(plan.fingerprint(), keep_turns=True)
    assert kept.bucket_steps == 3 and kept.fingerprint() == plan.fingerprint() and one.bucket_steps == 1
    assert plan.resumed_as(one.fingerprint(), keep_turns=True).fingerprint() == one.fingerprint()
    assert plan.resumed_as(plan.fingerprint(), keep_turns=True) is plan
    assert one.resumed_as(plan.fingerprint()) is one
    for other in ({"global_batch": 6}, {"chunk_rows": 3}):
        assert one.resumed_as(plan.fingerprint() | other, keep_turns=True) is one


def _one_row_bucket_plan(global_batch):
    # Bucket 1 holds one row (sample index 4 * global_batch): it fills a batch once global_batch epochs carried it.
    files = [[(0, 4 * global_batch), (1, 1)], [(0, 2 * global_batch)]]
    rows = [sum(n for _, n in f) for f in files]
    return BucketPlan(rows, runs_of(files), SHAPES[:2], 0, 64, global_batch, 512)


def test_a_one_row_bucket_carried_2047_epochs_at_a_global_batch_of_2048_plans_its_step():
    # Carried rows were found by recursing an epoch back per epoch carried: 2047 deep here, a RecursionError at the
    # epoch of the bucket's first batch (step 12,282 here) and at every restart in it.
    plan = _one_row_bucket_plan(2048)
    assert plan.epoch_batches(2046).tolist() == [6, 0] and plan.epoch_batches(2047).tolist() == [6, 1]
    for restarted in (plan, _one_row_bucket_plan(2048)):  # a fresh plan: nothing worked out before it
        batches, state = _read(restarted, DataState(2047), 64, 7)
        assert state == DataState(2048)
        # Carrying's semantics, unchanged: the bucket's one batch is its one row, carried from each of 2048 epochs.
        (ones,) = [b for b in batches if b[0] == 4 * 2048]
        assert ones.tolist() == [4 * 2048] * 2048
    assert plan.order_spans(2047, 1, 0, 2048).tolist() == [[0, 4 * 2048, 4 * 2048 + 1]] * 2048


# sha256[:16] of every order_spans() answer below (whole orders, every single position, and runs of 3 from every
# second position, for each epoch and bucket), captured from the recursive version before it became a loop, in read
# order buckets-1, which runs that started in it still read (BucketPlan.resumed_as) and so must read as it did.
ORDER_SPANS_DIGESTS = ["85ae244b432c25c3", "8ae2370bbb084bb6", "04a701bc09aa6e5d"]


def _order_spans_digest(plan, epochs):
    digest = hashlib.sha256()
    for epoch in range(epochs):
        carried = plan.carried(epoch)
        for bucket in range(len(plan.bucket_shapes)):
            end = int(carried[bucket] + plan.bucket_rows[bucket])
            intervals = [(0, end)] + [(k, k + 1) for k in range(end)] + [(k, min(k + 3, end)) for k in range(0, end, 2)]
            for lo, hi in intervals:
                spans = plan.order_spans(epoch, bucket, lo, hi)
                digest.update(np.ascontiguousarray(spans, dtype="<i8").tobytes() + b"|")
    return digest.hexdigest()[:16]


def test_the_rows_carried_in_are_the_ones_the_recursive_walk_back_found():
    old = {"order": "buckets-1"}
    small = BucketPlan([41, 20], runs_of([[(0, 40), (1, 1)], [(0, 20)]]), SHAPES[:2], 0, 4, 8, 64, **old)
    several = BucketPlan(
        [11, 21], runs_of([[(0, 9), (1, 2)], [(0, 13), (1, 1), (2, 7)]]), SHAPES[:3], 5, 2, 16, 32, **old
    )
    # _plan: bucket 3 carried 3 epochs; small: a 1-row bucket carried 8 (G = 8); several: 3 rows (G = 16, 2-row
    # chunks, so several chunks an epoch) carried up to 6 epochs, 7 rows up to 3.
    plans = ((_plan(order="buckets-1"), 8), (small, 20), (several, 24))
    got = [_order_spans_digest(plan, epochs) for plan, epochs in plans]
    assert got == ORDER_SPANS_DIGESTS
    assert window_sample_indices(small.order_spans(7, 1, 0, 8), small.file_offsets).tolist() == [40] * 8


def test_the_runs_digest_is_the_whole_tables_worked_out_once_a_plan_and_not_pickled(monkeypatch):
    import pickle

    import sdtrain.data.bucket_order as bucket_order

    plan = _plan(seed=9)
    whole = hashlib.sha256(plan.run_table().tobytes()).hexdigest()[:16]
    monkeypatch.setattr(bucket_order, "_DIGEST_BLOCK", 2)  # hashed block by block: the same bytes
    hashed = []
    real = bucket_order.hashlib.sha256
    monkeypatch.setattr(bucket_order.hashlib, "sha256", lambda *a: hashed.append(a) or real(*a))
    assert plan.fingerprint()["rows_digest"] == whole
    assert plan.fingerprint()["rows_digest"] == whole and len(hashed) == 1
    plan.seed = 10  # what is not the runs is read as it is now
    assert plan.fingerprint()["seed"] == 10 and len(hashed) == 1
    # A pickled plan sends no digest: its copy works it out from the runs it rebuilds.
    assert "_runs_digest" not in plan.__getstate__()
    again = pickle.loads(pickle.dumps(plan))
    assert again._runs_digest is None
    assert again.fingerprint()["rows_digest"] == whole and len(hashed) == 2
    other = pickle.loads(pickle.dumps(_plan()))
    assert other.fingerprint()["rows_digest"] == whole  # the same runs; a different seed only
