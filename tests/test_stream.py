"""A rank's Ray Data stream: one task per window, a scheduling loop paced while the trainer is
behind, a worker's stream started before its model is built, and Ray Data's start-up run on the
driver before any stream (a real local Ray cluster)."""

import subprocess
import sys
import textwrap
import time

import pytest
import ray
import ray.cloudpickle
import ray.data
import torch
from conftest import corrupt_row_group, write_latents
from ray.data import ExecutionResources
from ray.data._internal.execution.execution_callback import ExecutionCallback
from support.datasets import inspect_dataset

from sdtrain.config.learning import Columns
from sdtrain.config.schema import DataConfig
from sdtrain.data.pacing import ROUND_S, PacedScheduling
from sdtrain.data.read_order import DataState, SamplePlan
from sdtrain.data.streams import WindowReader, file_order_dataset, rank_dataset
from sdtrain.train.train_stream import TrainStream

pytestmark = pytest.mark.slow  # Ray Data streams on a local Ray cluster


class CountRounds(ExecutionCallback):
    """Counts rounds of the scheduling loop (it runs on a thread of this process)."""

    rounds = 0

    def on_execution_step(self, executor):
        CountRounds.rounds += 1


# The dataset's context (with its callbacks) travels to the read tasks, which cannot import tests.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rounds_while_a_slow_trainer_reads(tmp_path, paced: bool) -> tuple[int, float]:
    files = [str(tmp_path / "a.parquet")]
    if not (tmp_path / "a.parquet").exists():
        write_latents(tmp_path / "a.parquet", rows=96, seed=0, row_group_size=8)
    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=8)
    (stretches,) = plan.rank_stretches(DataState(), 1, 8, 12)
    dataset = rank_dataset(WindowReader(spec, DataConfig(train=files), plan), stretches, None)
    callbacks = dataset.context.custom_execution_callback_classes
    assert callbacks == [PacedScheduling]
    if not paced:
        callbacks.remove(PacedScheduling)
    callbacks.append(CountRounds)
    # A budget of about two windows: the stream runs ahead of the trainer and is held back.
    dataset.context.execution_options.resource_limits = ExecutionResources(object_store_memory=300_000)
    CountRounds.rounds = 0
    started = time.monotonic()
    stream = dataset.iterator()
    for _ in stream.iter_batches(batch_size=8, prefetch_batches=1):
        time.sleep(0.25)  # the trainer's step
    # One task per window, carrying only its window.
    assert "Operator 1 ReadRankWindows: 12 tasks executed" in stream.stats()
    return CountRounds.rounds, time.monotonic() - started


@pytest.mark.usefixtures("ray_cluster")
def test_the_scheduling_loop_waits_instead_of_spinning_while_the_trainer_is_behind(tmp_path):
    paced_rounds, paced_s = _rounds_while_a_slow_trainer_reads(tmp_path, paced=True)
    unpaced_rounds, unpaced_s = _rounds_while_a_slow_trainer_reads(tmp_path, paced=False)
    allowed = paced_s / ROUND_S + 1
    assert paced_rounds <= allowed, (paced_rounds, paced_s)
    # Ray Data's own loop goes round many times more in the same time: the spin the pace removes
    # (if a Ray upgrade stops it, sdtrain.data.pacing can go).
    assert unpaced_rounds > 5 * unpaced_s / ROUND_S, (unpaced_rounds, unpaced_s)


@pytest.mark.usefixtures("ray_cluster")
def test_each_ranks_dataset_carries_a_reference_to_the_reader_not_the_reader():
    """Ray Train's dataset manager pickles each rank's dataset for it: with the reader in it (its file table, ~45 B a
    file) that was world size x 9 MB at 2e5 files out of one process at every worker group's start."""
    from sdtrain.data.inspection import DatasetSpec
    from sdtrain.data.read_order import files_digest

    files = [f"s3://laion/part-{i:06d}.parquet" for i in range(20_000)]
    spec = DatasetSpec(tuple(files), (1_000,) * len(files), (4, 32, 32), (77, 1024))
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=64, window_rows=512, files_digest=files_digest(files))
    stretches = plan.rank_stretches(DataState(), 256, 8 * 256, 10)[0]
    reader = WindowReader(spec, DataConfig(train=["s3://laion/"]), plan)
    carried = len(ray.cloudpickle.dumps(rank_dataset(reader, stretches, None)))
    referenced = len(ray.cloudpickle.dumps(rank_dataset(reader, stretches, None, ray.put(reader))))
    assert carried > len(ray.cloudpickle.dumps(reader)) > 20 * len(files) and referenced < carried // 20


def _one_rank_of_one_file(tmp_path) -> tuple[SamplePlan, list, WindowReader]:
    """48 rows in one file, windows of 16, 6 steps of 8 rows on one rank: (the plan, the rank's stretches, the
    reader)."""
    write_latents(tmp_path / "a.parquet", rows=48, seed=0, row_group_size=8)
    files = [str(tmp_path / "a.parquet")]
    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=16)
    (stretches,) = plan.rank_stretches(DataState(), 1, 8, 6)
    return plan, stretches, WindowReader(spec, DataConfig(train=files), plan)


@ray.remote(num_cpus=0)
def _in_a_rank(refs: list, source_blob: bytes) -> tuple[bool, bool, int]:
    from ray.data.context import DataContext

    from sdtrain.data.object_store import fetched

    (shared,) = refs  # in a list: Ray passes a bare reference's object, as it does the train loop's config

    plan = fetched(shared).plan  # the worker's own planning (sdtrain.train.worker)
    source = ray.cloudpickle.loads(source_blob)  # its dataset's source, as Ray Train hands it over
    tasks = source.get_read_tasks(1, data_context=DataContext.get_current())
    return source.reader.plan is plan, fetched(shared) is source.reader, len(tasks)


@pytest.mark.usefixtures("ray_cluster")
def test_a_rank_holds_one_copy_of_the_reader_for_its_planning_and_its_read_tasks(tmp_path):
    """ray.get deserializes anew at every call, and a bucketed plan is rebuilt from its runs into ~100 MB at 2e5
    files: a rank asked for it twice (its planning, its read tasks) and held two."""
    from sdtrain.data.streams import RankWindows

    plan, stretches, reader = _one_rank_of_one_file(tmp_path)
    shared = ray.put(reader)
    source = RankWindows(reader, stretches, shared)
    same_plan, same_reader, tasks = ray.get(_in_a_rank.remote([shared], ray.cloudpickle.dumps(source)))
    assert same_plan and same_reader
    assert tasks == source.count == 3


@pytest.mark.usefixtures("ray_cluster")
def test_a_workers_stream_starts_reading_before_it_is_iterated_and_hands_over_every_batch_once(tmp_path):
    """The worker starts its stream before building its model; Lightning iterates it later."""
    plan, stretches, reader = _one_rank_of_one_file(tmp_path)
    dataset = rank_dataset(
        reader, stretches, None, ray.put(reader)
    )  # the reader in the object store, as PlannedStreams
    stream = TrainStream(dataset.iterator(), micro_batch=8, prefetch_batches=1, device=torch.device("cpu"))
    stream.expected_first = plan.sample_indices(plan.window(stretches[0], 0))[:8]

    first = stream.start()
    assert first.result(timeout=120)["sample_index"].tolist() == stream.expected_first.tolist()  # read before iterating
    batches = [batch["sample_index"].tolist() for batch in stream]
    planned = [
        index
        for w in range(stretches[0].num_windows(16))
        for index in plan.sample_indices(plan.window(stretches[0], w))
    ]
    assert [index for batch in batches for index in batch] == planned  # the background first batch, then the rest
    assert len(batches) == 6


def test_validation_streams_are_paced_too_and_keep_it_through_ray_trains_copy(tmp_path):
    write_latents(tmp_path / "a.parquet", rows=8, seed=0)
    files = [str(tmp_path / "a.parquet")]
    spec = inspect_dataset(files, "data.val", Columns("image_latents_256", "caption_latents"), 4, 32)
    dataset = file_order_dataset(spec, DataConfig(train=files, val=files), "data.val")
    copied = ray.data.Dataset.copy(dataset)  # what Ray Train's DataConfig.configure iterates
    assert copied.context.custom_execution_callback_classes == [PacedScheduling]


def test_ray_trains_controller_loads_no_model_libraries():
    """Ray Train's controller unpickles the data hook (sdtrain.controller.data_hook) and the failure callback:
    diffusers and Lightning imported there cost ~6 s of every run's start-up."""
    code = (
        "import sys, sdtrain.controller.data_hook, sdtrain.controller.failures; "
        "loaded = [m for m in ('torch', 'diffusers', 'lightning') if m in sys.modules]; assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_read_tasks_do_not_import_torch():
    """A fresh read worker imports sdtrain.data.streams before its first window: torch would add ~1.6 s."""
    code = "import sys, sdtrain.data.streams; assert 'torch' not in sys.modules, 'sdtrain.data.streams imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_driver_starts_ray_datas_cluster_actors_before_any_stream_and_quietly():
    """sdtrain.driver.ray_data_startup: until Ray Data's autoscaling coordinator answers, a stream's executor
    sees no CPUs and reads one window at a time; on a fresh cluster the coordinator takes seconds
    to start. The warm-up (a fresh cluster of its own here) starts it and the stats actor, and
    keeps its own dataset's lines off the console; on a cluster that has them it runs nothing."""
    code = textwrap.dedent("""
        import ray
        ray.init(address="local", num_cpus=1, include_dashboard=False)
        named = lambda: {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)}
        assert "AutoscalingCoordinator" not in named(), named()
        from sdtrain.driver.ray_data_startup import warm_up_ray_data
        thread = warm_up_ray_data()
        thread.join(120)
        assert not thread.is_alive(), "the warm-up did not finish in 120 s"
        assert {"AutoscalingCoordinator", "datasets_stats_actor"} <= named(), named()
        assert warm_up_ray_data() is None  # the next run on this cluster: nothing to start
        ray.shutdown()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "execution finished" not in result.stderr + result.stdout, result.stderr


@ray.remote(num_cpus=1)
class _TrainWorker:
    """Holds a CPU as a training worker does."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster")
def test_streams_read_while_the_worker_group_holds_every_cpu(tmp_path):
    """An elastic group resized onto the CPUs left after a node is lost takes them all: its reads must
    still run (on the worker's CPUs, on its node), or the run waits for data for good."""
    workers = [_TrainWorker.remote() for _ in range(int(ray.cluster_resources()["CPU"]))]
    node = ray.get([worker.node_id.remote() for worker in workers])[0]
    assert ray.available_resources().get("CPU", 0) == 0
    write_latents(tmp_path / "a.parquet", rows=32, seed=0, row_group_size=8)
    files = [str(tmp_path / "a.parquet")]
    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=8)
    (stretches,) = plan.rank_stretches(DataState(), 1, 8, 4)

    train = rank_dataset(WindowReader(spec, DataConfig(train=files), plan), stretches, node)
    rows = [i for batch in train.iter_batches(batch_size=8) for i in batch["sample_index"].tolist()]
    assert sorted(rows) == list(range(32))
    val = file_order_dataset(spec, DataConfig(train=files), "data.val")
    assert sum(len(batch["latents"]) for batch in val.iter_batches(batch_size=None)) == 32


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster")
def test_a_validation_file_damaged_past_its_first_row_group_is_named_not_a_raw_pyarrow_error(tmp_path):
    """The driver's checks read a file's footer and first row; a row group damaged further on fails the
    validation read with our DataError (which stops the run without retries), naming the key and file."""
    from sdtrain.errors import DataError

    write_latents(tmp_path / "v.parquet", rows=24, seed=0, row_group_size=8)
    files = [str(tmp_path / "v.parquet")]
    spec = inspect_dataset(files, "data.val", Columns("image_latents_256", "caption_latents"), 4, 32)
    corrupt_row_group(tmp_path / "v.parquet", 2)
    val = file_order_dataset(spec, DataConfig(train=files), "data.val")
    with pytest.raises(DataError, match=r"data\.val: .*v\.parquet cannot be read \(.*\)\. The file is damaged"):
        for _ in val.iter_batches(batch_size=None):
            pass


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster")
def test_a_token_id_past_the_vocabulary_read_by_a_ray_data_task_stops_the_run_naming_file_row_and_value(tmp_path):
    """The error a read task raises reaches the worker wrapped by Ray; the controller's callback still finds our
    DataError (so no restart is spent on it) and the driver's message is that one paragraph, not a traceback."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import column

    from sdtrain.controller.failures import StopOnDeterministicErrors
    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE
    from sdtrain.driver.run import failure_message
    from sdtrain.errors import DataError

    ids = np.random.default_rng(0).integers(0, 1000, (16, 77)).astype(np.int32)
    ids[5, 3] = 1234  # row 0, which the driver's check reads, is fine
    latents = np.zeros((16, 4, 16, 16), np.float16)
    table = pa.table({"image_latents_256": column(latents, "list"), "caption_ids": column(ids, "list")})
    file = str(tmp_path / "ids.parquet")
    # The read path needs only the recorded vocabulary; the encoder named is never loaded here.
    pq.write_table(table.replace_schema_metadata({TEXT_ENCODER_SOURCE: "a-tokenizer", TOKEN_VOCAB_SIZE: "1000"}), file)
    spec = inspect_dataset([file], "data.train", Columns("image_latents_256", "caption_ids"), 4, 32)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=8)
    (stretches,) = plan.rank_stretches(DataState(), 1, 8, 2)
    reader = WindowReader(spec, DataConfig(train=[file], caption_column="caption_ids"), plan)
    with pytest.raises(Exception) as raised:
        for _ in rank_dataset(reader, stretches, None).iter_batches(batch_size=None):
            pass

    expected = f"data.train: {file}: column 'caption_ids', row 5: token id 1234 "
    with pytest.raises(DataError) as stopped:
        StopOnDeterministicErrors().after_exception(None, {0: raised.value})
    assert str(stopped.value).startswith(expected) and "vocabulary of 1000 ids" in str(stopped.value)
    message = failure_message(raised.value, str(tmp_path / "run"))
    assert message.startswith(f"training failed: {expected}") and len(message.splitlines()) == 2
