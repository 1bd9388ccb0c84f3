"""Local disk a worker uses for checkpoints: staged before upload, restored copies, leftovers of a
killed worker (a real S3-protocol server for the download; the Ray runs in test_train_ray and
test_job_submit go through the same functions)."""

import os

import pytest
from ray.train import Checkpoint

from sdtrain.config.schema import CheckpointConfig, Config, DataConfig, RunConfig
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.train.checkpointing import DropRestoreCopy, node_scratch, restored_directory, worker_scratch


def _config(tmp_path) -> Config:
    return Config(
        data=DataConfig(train=["x"]),
        run=RunConfig(name="a"),
        checkpoint=CheckpointConfig(staging_dir=str(tmp_path / "disk")),
    )


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _stage(scratch: str, name: str) -> None:
    """A checkpoint staged in ``scratch``, as rank 0 leaves it when killed mid-upload."""
    os.makedirs(os.path.join(scratch, name))
    with open(os.path.join(scratch, name, "checkpoint.ckpt"), "wb") as f:
        f.write(b"x" * 1000)


def test_each_worker_of_each_run_gets_an_emptied_directory_under_checkpoint_staging_dir(tmp_path):
    run = _config(tmp_path)
    scratch = worker_scratch(run, "s3://b/runs/a", local_rank=0, local_world_size=2)
    assert scratch.startswith(str(tmp_path / "disk" / "sdtrain-staging" / "a-")) and os.listdir(scratch) == []
    # A worker killed mid-upload left a whole staged checkpoint; the next worker group clears it.
    os.makedirs(os.path.join(scratch, "checkpoint_000000004-x1"))
    assert worker_scratch(run, "s3://b/runs/a", 0, 2) == scratch and os.listdir(scratch) == []
    # Another worker of the node, or another run of the same name elsewhere, never touches these files.
    assert worker_scratch(run, "s3://b/runs/a", 1, 2) != scratch
    assert worker_scratch(run, "s3://other/runs/a", 0, 2) != scratch
    default = Config(data=DataConfig(train=["x"]), run=RunConfig(name="a"))
    assert worker_scratch(default, "s3://b/runs/a", 0, 1).startswith(os.path.join(os.sep, "tmp"))


def test_what_a_killed_rank_0_staged_goes_when_other_ranks_of_the_next_group_start_on_its_node(tmp_path):
    """World rank 0 (local rank 0 of node A's 4 workers) is killed mid-upload; after the restart node A runs
    world ranks 4-7, rank 0 another node: node A's next workers, local ranks 0-3, leave none of its files."""
    run, disk = _config(tmp_path), tmp_path / "disk"
    _stage(worker_scratch(run, "s3://b/runs/a", local_rank=0, local_world_size=4), "checkpoint_000004000-x1")
    for local_rank in range(4):  # world ranks 4-7: no world rank 0 on the node to clear its old directory
        worker_scratch(run, "s3://b/runs/a", local_rank, local_world_size=4)
    assert _files(disk) == []


def test_a_node_that_hosts_fewer_workers_drops_the_extra_ones_directories_and_a_killed_groups_restore_copy(
    tmp_path,
):
    run, disk = _config(tmp_path), tmp_path / "disk"
    for local_rank in range(8):  # 8 workers on the node, each killed with a checkpoint staged
        _stage(worker_scratch(run, "s3://b/runs/a", local_rank, 8), f"checkpoint_00000400{local_rank}-x")
    node = node_scratch(run, "s3://b/runs/a")
    _stage(os.path.join(node, "restored"), "stale")  # a restore copy its killed group never dropped
    for local_rank in range(4):  # the resized group runs 4 workers there
        worker_scratch(run, "s3://b/runs/a", local_rank, 4)
    run_scratch = os.path.dirname(node)
    assert _files(disk) == [] and sorted(os.listdir(run_scratch)) == ["rank0", "rank1", "rank2", "rank3"]


def test_starting_workers_leave_the_directories_of_the_other_workers_of_their_node_alone(tmp_path):
    """Local rank 0's clean-up runs while the node's other workers start and stage: it must not remove them."""
    run = _config(tmp_path)
    others = [worker_scratch(run, "s3://b/runs/a", local_rank, 4) for local_rank in (1, 2, 3)]
    for scratch in others:
        _stage(scratch, "checkpoint_000000008-in-progress")
    worker_scratch(run, "s3://b/runs/a", 0, 4)
    for scratch in others:
        assert _files(scratch) == [os.path.join("checkpoint_000000008-in-progress", "checkpoint.ckpt")]


def _restore_on_a_node(rank: int, checkpoint: Checkpoint, node_dir: str, init: str, seen) -> None:
    """One of two ranks of one node, in a gloo process group: restores, reads, and drops the copy as a worker does."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with restored_directory(checkpoint, node_dir, local_rank=rank) as (directory, is_copy):
            file = os.path.join(directory, "checkpoint.ckpt")
            seen.put((rank, directory, is_copy, os.stat(file).st_ino, sorted(os.listdir(directory))))
            DropRestoreCopy(directory, local_rank=rank).on_train_start(None, None)  # both restored: the copy goes
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_in_object_storage_is_copied_once_a_node_and_dropped_after_the_restore(s3_bucket, tmp_path):
    """A real S3-protocol server and two ranks of one node in a gloo process group, as Ray Train's workers: local
    rank 0 downloads, both read the one copy (the same file on disk), and it goes once both have restored."""
    import multiprocessing

    source = tmp_path / "checkpoint_000000004"
    source.mkdir()
    (source / "checkpoint.ckpt").write_bytes(b"x" * 1000)
    local = Checkpoint.from_directory(str(source))
    with restored_directory(local, str(tmp_path / "node"), local_rank=0) as (directory, is_copy):
        assert (directory, is_copy) == (str(source), False)  # on this disk: read in place, never deleted
    assert source.exists()

    fs, path = filesystem_for(f"{s3_bucket}/runs/a/checkpoint_000000004")
    fs.create_dir(path)
    with fs.open_output_stream(f"{path}/checkpoint.ckpt") as f:
        f.write(b"x" * 1000)
    remote = Checkpoint(path, filesystem=fs)
    node = tmp_path / "node"
    os.makedirs(node / "restored" / "stale")  # a killed worker group's copy: replaced
    context = multiprocessing.get_context("spawn")
    seen = context.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_restore_on_a_node, args=(r, remote, str(node), init, seen)) for r in (0, 1)]
    for process in ranks:
        process.start()
    (_, directory, is_copy, inode, files), (_, other, _, other_inode, other_files) = sorted(
        seen.get(timeout=100) for _ in ranks
    )
    for process in ranks:
        process.join(timeout=30)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert is_copy and directory == other == str(node / "restored") and inode == other_inode  # one copy
    assert files == other_files == ["checkpoint.ckpt"]  # the stale copy went first
    assert not os.path.exists(directory)


@pytest.mark.slow  # the session's Ray cluster
@pytest.mark.timeout(120)
def test_the_end_of_a_fit_removes_the_runs_staging_on_every_node_and_no_other_runs(ray_cluster, tmp_path):
    """What killed workers left on a node no later worker group ran on (sdtrain.driver.staging_cleanup): a task on each
    alive node removes the run's directory, whatever ranks left it, and says what it freed."""
    import ray

    from sdtrain.driver.staging_cleanup import remove_run_staging
    from sdtrain.train.checkpointing import run_scratch

    run, disk = _config(tmp_path), tmp_path / "disk"
    _stage(worker_scratch(run, "s3://b/runs/a", local_rank=0, local_world_size=4), "checkpoint_000004000-x1")
    _stage(worker_scratch(run, "s3://b/runs/a", local_rank=3, local_world_size=4), "checkpoint_000004000-x2")
    _stage(os.path.join(node_scratch(run, "s3://b/runs/a"), "restored"), "partly-downloaded")
    _stage(worker_scratch(run, "s3://other/runs/a", local_rank=0, local_world_size=1), "checkpoint_000000002-y")
    freed = remove_run_staging(run, "s3://b/runs/a")
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert set(freed) == alive and sum(freed.values()) == 3000, freed  # each node answered; three staged files
    assert not os.path.exists(run_scratch(run, "s3://b/runs/a"))
    assert _files(disk) == [os.path.relpath(p, disk) for p in _staged(run_scratch(run, "s3://other/runs/a"))]
    assert remove_run_staging(run, "s3://b/runs/a") == dict.fromkeys(alive, 0)  # nothing left: nothing freed


def _staged(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
