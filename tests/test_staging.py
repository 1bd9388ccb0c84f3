"""Local disk a worker uses for checkpoints: staged before upload, restored copies, leftovers of a
killed worker (a real S3-protocol server for the download; the Ray runs in test_train_ray and
test_job_submit go through the same functions)."""

import os

import pytest
from ray.train import Checkpoint

from sdtrain.config.schema import CheckpointConfig, Config, DataConfig, RunConfig
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.train.checkpointing import DropRestoreCopy, restored_directory, worker_scratch


def test_each_rank_of_each_run_gets_an_emptied_directory_under_checkpoint_staging_dir(tmp_path):
    run = Config(
        data=DataConfig(train=["x"]),
        run=RunConfig(name="a"),
        checkpoint=CheckpointConfig(staging_dir=str(tmp_path / "disk")),
    )
    scratch = worker_scratch(run, "s3://b/runs/a", rank=0)
    assert scratch.startswith(str(tmp_path / "disk" / "sdtrain-staging" / "a-")) and os.listdir(scratch) == []
    # A worker killed mid-upload left a whole staged checkpoint; the next worker group clears it.
    os.makedirs(os.path.join(scratch, "checkpoint_000000004-x1"))
    assert worker_scratch(run, "s3://b/runs/a", rank=0) == scratch and os.listdir(scratch) == []
    # Another rank, or another run of the same name elsewhere, never touches these files.
    assert worker_scratch(run, "s3://b/runs/a", rank=1) != scratch
    assert worker_scratch(run, "s3://other/runs/a", rank=0) != scratch
    default = Config(data=DataConfig(train=["x"]), run=RunConfig(name="a"))
    assert worker_scratch(default, "s3://b/runs/a", 0).startswith(os.path.join(os.sep, "tmp"))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_checkpoint_in_object_storage_is_copied_once_and_dropped_after_the_restore(s3_bucket, tmp_path):
    source = tmp_path / "checkpoint_000000004"
    source.mkdir()
    (source / "checkpoint.ckpt").write_bytes(b"x" * 1000)
    local = Checkpoint.from_directory(str(source))
    with restored_directory(local, str(tmp_path / "scratch")) as (directory, is_copy):
        assert (directory, is_copy) == (str(source), False)  # on this disk: read in place, never deleted
    assert source.exists()

    fs, path = filesystem_for(f"{s3_bucket}/runs/a/checkpoint_000000004")
    fs.create_dir(path)
    with fs.open_output_stream(f"{path}/checkpoint.ckpt") as f:
        f.write(b"x" * 1000)
    remote = Checkpoint(path, filesystem=fs)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with restored_directory(remote, str(scratch)) as (directory, is_copy):
        assert is_copy and directory.startswith(str(scratch))
        assert open(os.path.join(directory, "checkpoint.ckpt"), "rb").read() == b"x" * 1000
        DropRestoreCopy(directory).on_train_start(None, None)  # Lightning has restored: the copy goes
        assert not os.path.exists(directory)
    with restored_directory(remote, str(scratch)) as (directory, _):
        pass
    assert not os.path.exists(directory)  # and it goes at the end whatever happened
