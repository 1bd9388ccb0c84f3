"""A rank's stream in horizons (sdtrain.data.horizons): the chain of datasets reads exactly what one dataset of the
whole run would, and what a worker-group start plans stays one horizon's however long the run."""

import time

import pytest
import ray
import torch
from conftest import write_latents
from support.datasets import inspect_dataset

from sdtrain.config.learning import Columns
from sdtrain.config.schema import DataConfig
from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.bucket_runs import runs_of
from sdtrain.data.horizons import HORIZON_READS_VAR, Horizons, horizon_reads
from sdtrain.data.read_order import DataState, SamplePlan
from sdtrain.data.streams import WindowReader, rank_dataset
from sdtrain.errors import TrainingFailed
from sdtrain.train.train_stream import TrainStream


def _rows(plan, stretches) -> list[int]:
    """The sample indices one rank's stretches read, in order."""
    return [int(i) for stretch in stretches for window in plan.windows(stretch) for i in plan.sample_indices(window)]


def _sample_plan() -> SamplePlan:
    return SamplePlan([37, 50, 29, 44], seed=3, chunk_rows=5, window_rows=16)


def _bucket_plan() -> BucketPlan:
    files = [[(0, 30), (1, 11)], [(0, 7), (2, 25), (3, 5)], [(1, 40)], [(0, 19), (2, 3)]]
    shapes = [(4, 8, 8), (4, 6, 10), (4, 10, 6), (4, 4, 16)]
    return BucketPlan([sum(n for _, n in f) for f in files], runs_of(files), shapes, 1, 5, 12, 20)


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("horizon", [1, 2, 5, 7, 1000])
def test_the_horizons_of_a_run_read_what_one_stream_of_it_reads(bucketed, horizon):
    """From a position mid-epoch after a world-size change, over several epochs, with a last horizon cut short."""
    plan = _bucket_plan() if bucketed else _sample_plan()
    if bucketed:  # 12-row global steps: 4 ranks trained 7 steps, then 3 ranks go on
        state, world_size, rows_per_step, steps = plan.advance(DataState(), 4, 3, 7), 3, 4, 31
    else:  # 2 ranks of 6 rows trained 9 steps, then 3 ranks of 4 rows go on
        state, world_size, rows_per_step, steps = plan.advance(DataState(), 2, 6, 9), 3, 4, 40
    horizons = Horizons(state, world_size, rows_per_step, steps, horizon)
    assert sum(horizons.steps_of(i) for i in range(len(horizons))) == steps
    whole = plan.rank_stretches(state, world_size, rows_per_step, steps)
    for rank in range(world_size):
        chained = [i for h in range(len(horizons)) for i in _rows(plan, horizons.stretches(plan, h)[rank])]
        assert chained == _rows(plan, whole[rank])
        assert len(chained) == steps * rows_per_step


def test_a_horizon_is_sized_in_read_tasks_and_the_override_is_checked(monkeypatch):
    plan = _sample_plan()  # 16-row windows
    assert Horizons.of(plan, 100, DataState(), 2, 8, 10**6).horizon == 200  # 2 steps a window
    assert Horizons.of(plan, 1, DataState(), 2, 64, 10**6).horizon == 1  # several windows a step: at least one
    monkeypatch.setenv(HORIZON_READS_VAR, "3")
    assert horizon_reads() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(HORIZON_READS_VAR, bad)
        with pytest.raises(ValueError, match=HORIZON_READS_VAR):
            horizon_reads()


def test_what_a_start_plans_is_one_horizon_however_long_the_run():
    """Ray Data makes and puts every read task of a dataset when it starts it: one dataset of a 550k-step run was
    ~275k tasks a rank at world size 8, at every worker-group start."""
    plan = SamplePlan([10_000] * 2_000, seed=0, chunk_rows=64, window_rows=512)  # 2e7 rows
    counts = []
    for steps in (10_000, 1_000_000):
        horizons = Horizons.of(plan, 64, DataState(), 8, 256, steps)
        counts.append(sum(plan.num_windows(stretch) for stretch in horizons.stretches(plan, 0)[3]))
        assert len(horizons) == -(-steps // horizons.horizon)
    assert counts[0] == counts[1] <= 65


def _one_rank(tmp_path, monkeypatch, reads: int):
    """One rank of a 96-row file in 16-row windows, 12 steps of 8 rows (two epochs): (the plan, its horizons, the
    reader in Ray's object store)."""
    write_latents(tmp_path / "a.parquet", rows=48, seed=0, row_group_size=8)
    files = [str(tmp_path / "a.parquet")]
    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=16)
    monkeypatch.setenv(HORIZON_READS_VAR, str(reads))
    reader = WindowReader(spec, DataConfig(train=files), plan)
    return plan, Horizons.of(plan, reader.horizon_reads, DataState(), 1, 8, 12), ray.put(reader)


@pytest.mark.usefixtures("ray_cluster")
def test_a_workers_stream_goes_on_through_datasets_it_makes_one_horizon_each(tmp_path, monkeypatch):
    """Each next horizon's dataset is made by the rank (as sdtrain.train.worker does) and starts reading before the
    previous one ends; the micro-batches are the plan's, each once, across the two epochs."""
    plan, horizons, shared = _one_rank(tmp_path, monkeypatch, reads=1)  # a window a horizon: 2 steps
    assert (horizons.horizon, len(horizons)) == (2, 6)
    reader = ray.get(shared)
    made: list[tuple[int, float]] = []

    def shard(index: int):
        made.append((index, time.perf_counter()))
        return rank_dataset(reader, horizons.stretches(plan, index)[0], None, shared).iterator()

    stream = TrainStream(shard(0), micro_batch=8, prefetch_batches=1, device=torch.device("cpu"))
    stream.expected_first = plan.sample_indices(plan.window(horizons.stretches(plan, 0)[0][0], 0))[:8]
    stream.follow_with([horizons.steps_of(i) for i in range(len(horizons))], shard, ahead=1)
    stream.start()
    taken: list[tuple[list[int], float]] = []
    for batch in stream:
        taken.append((batch["sample_index"].tolist(), time.perf_counter()))
    assert [i for rows, _ in taken for i in rows] == _rows(plan, plan.rank_stretches(DataState(), 1, 8, 12)[0])
    assert [index for index, _ in made] == list(range(6))
    # Horizon h's dataset was made when its predecessor's last batch was still to come (ahead=1).
    assert all(made[h][1] < taken[2 * h - 1][1] for h in range(1, 6))
    epoch_rows = [sorted(i for rows, _ in taken[6 * e : 6 * e + 6] for i in rows) for e in (0, 1)]
    assert epoch_rows[0] == epoch_rows[1] == list(range(48))  # every row once an epoch


@pytest.mark.usefixtures("ray_cluster")
def test_a_horizon_that_yields_other_than_its_plan_stops_the_stream(tmp_path, monkeypatch):
    plan, horizons, shared = _one_rank(tmp_path, monkeypatch, reads=1)
    reader = ray.get(shared)

    def shard(index: int):
        return rank_dataset(reader, horizons.stretches(plan, index)[0], None, shared).iterator()

    stream = TrainStream(shard(0), micro_batch=8, prefetch_batches=1, device=torch.device("cpu"))
    stream.expected_first = plan.sample_indices(plan.window(horizons.stretches(plan, 0)[0][0], 0))[:8]
    stream.follow_with([3, 2, 2, 2, 2, 2], shard, ahead=1)  # the first horizon holds 2 micro-batches, not 3
    stream.start()
    # A TrainingFailed: the controller stops the run at once (StopOnDeterministicErrors), spending no restart.
    with pytest.raises(TrainingFailed, match="horizon 0 held 2 micro-batches, its plan 3"):
        list(stream)

    # The last horizon short of its plan: the run would end before train.max_steps.
    stream = TrainStream(shard(0), micro_batch=8, prefetch_batches=1, device=torch.device("cpu"))
    stream.expected_first = plan.sample_indices(plan.window(horizons.stretches(plan, 0)[0][0], 0))[:8]
    stream.follow_with([2, 2, 2, 2, 2, 3], shard, ahead=1)
    stream.start()
    taken = []
    with pytest.raises(TrainingFailed, match="horizon 5 held 2 micro-batches, its plan 3"):
        for batch in stream:
            taken.append(batch)
    assert len(taken) == 12  # every batch the horizons held, then the error where the 13th was asked for
    # Lightning's next epoch, were the error lost: never a second pass over the rows.
    with pytest.raises(TrainingFailed, match="read to its end before train.max_steps"):
        next(iter(stream))
