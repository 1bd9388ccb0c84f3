"""sdtrain's copy of Ray Train's record of a run's checkpoints (checkpoint_manager_snapshot.json). On local or NFS
storage Ray Train rewrites the record in place, so a controller killed during the write leaves it empty or cut short
with every checkpoint intact: the driver restores it from the copy the controller's callback keeps. And checkpoint
directories uploaded but never registered, which nothing prunes, are named to the user. Ray Train's checkpoint
manager is driven here without a cluster (as in test_snapshot_scores)."""

import json

import pyarrow.fs as pafs
import pytest
import ray.train
from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
from support.log_lines import LogLines
from test_snapshot_scores import _manager, _report

from sdtrain.controller.data_hook import committed_run
from sdtrain.controller.snapshot_copy import COPY_FILE, SnapshotCopy
from sdtrain.errors import SdtrainError


def _report_and_copy(root, manager, step: int, val_loss: float) -> None:
    """A report as Ray Train's controller processes it: its checkpoint manager first, then sdtrain's callback."""
    metrics = {"step": step, "loss": 1.0, "val_loss": val_loss}
    _report(root, manager, step, metrics)
    checkpoint = ray.train.Checkpoint(str(root / "run" / f"checkpoint_{step:08d}"))
    SnapshotCopy(None, str(root / "run")).after_report(run_context=None, metrics=[metrics], checkpoint=checkpoint)


def _cut_short(path) -> None:
    """What a controller killed during Ray Train's write of its record leaves (_write_state_to_storage)."""
    whole = path.read_bytes()
    with pafs.LocalFileSystem().open_output_stream(str(path)) as f:  # truncates in place, as Ray Train's does
        f.write(whole[: len(whole) // 2])


def test_the_callback_copies_the_record_after_each_report(tmp_path):
    _report_and_copy(tmp_path, manager := _manager(tmp_path, "val_loss"), 100, 0.5)
    snapshot, copy = tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME, tmp_path / "run" / COPY_FILE
    assert copy.read_bytes() == snapshot.read_bytes()
    _report_and_copy(tmp_path, manager, 200, 0.4)
    assert copy.read_bytes() == snapshot.read_bytes()
    assert json.loads(copy.read_bytes())["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_00000200"
    good = copy.read_bytes()

    _cut_short(snapshot)  # only a record that parses is copied
    SnapshotCopy(None, str(tmp_path / "run")).after_report(run_context=None, metrics=[{}], checkpoint=None)
    assert copy.read_bytes() == good
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")] == []


def test_a_record_cut_short_is_restored_from_the_copy_and_the_run_resumes(tmp_path):
    manager = _manager(tmp_path, "val_loss")
    _report_and_copy(tmp_path, manager, 100, 0.5)
    _report_and_copy(tmp_path, manager, 200, 0.4)
    run_dir = tmp_path / "run"
    snapshot = run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    (run_dir / "checkpoint_00000300").mkdir()  # uploaded; the controller was killed writing the record for it
    _cut_short(snapshot)

    with LogLines() as lines:
        result = committed_run(None, str(run_dir))

    assert result is not None and result.checkpoint is not None
    assert result.checkpoint.path.endswith("checkpoint_00000200")
    assert snapshot.read_bytes() == (run_dir / COPY_FILE).read_bytes()  # Ray Train's own reading sees it whole
    restored = [line for line in lines.messages if "restored" in line]
    assert restored == [
        f"{snapshot} was empty or cut short (a write interrupted on local or NFS storage, where Ray Train rewrites "
        f"it in place); restored it from sdtrain's copy {run_dir / COPY_FILE}, written after Ray Train's last "
        "processed report: the run resumes from step 200 (checkpoint_00000200)"
    ]
    resumed = _manager(tmp_path, "val_loss")  # the next controller loads the restored record and goes on
    assert resumed.latest_checkpoint_result is not None
    assert resumed.latest_checkpoint_result.checkpoint.path.endswith("checkpoint_00000200")


def test_a_copy_naming_checkpoints_pruned_since_restores_without_them(tmp_path):
    """An evaluation's result reorders the kept checkpoints and Ray Train prunes one, rewriting its record without a
    report (no copy then): a copy that names the pruned one, the latest intact, was refused, and every retry failed."""
    manager = _manager(tmp_path, "val_loss")
    _report_and_copy(tmp_path, manager, 100, 0.5)
    _report_and_copy(tmp_path, manager, 200, 0.4)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint_00000100" / "model.txt").unlink()  # pruned after the last copy
    (run_dir / "checkpoint_00000100").rmdir()
    snapshot = run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    _cut_short(snapshot)

    with LogLines() as lines:
        result = committed_run(None, str(run_dir))

    assert result is not None and result.checkpoint is not None
    assert result.checkpoint.path.endswith("checkpoint_00000200")
    assert any("less the checkpoints deleted since (checkpoint_00000100)" in line for line in lines.messages)
    resumed = _manager(tmp_path, "val_loss")  # the next controller loads the restored record: the one left
    assert [kept.checkpoint.path[-8:] for kept in resumed._checkpoint_results] == ["00000200"]


@pytest.mark.parametrize("copy", ["none", "cut short", "names a latest checkpoint that is gone"])
def test_a_record_cut_short_without_a_usable_copy_is_refused_naming_the_cause(tmp_path, copy):
    manager = _manager(tmp_path, "val_loss")
    _report_and_copy(tmp_path, manager, 100, 0.5)
    _report_and_copy(tmp_path, manager, 200, 0.4)
    run_dir = tmp_path / "run"
    if copy == "none":
        (run_dir / COPY_FILE).unlink()
    elif copy == "cut short":
        _cut_short(run_dir / COPY_FILE)
    else:
        (run_dir / "checkpoint_00000200" / "model.txt").unlink()
        (run_dir / "checkpoint_00000200").rmdir()
    snapshot = run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    _cut_short(snapshot)
    cut = snapshot.read_bytes()

    with pytest.raises(SdtrainError) as caught:
        committed_run(None, str(run_dir))

    message = str(caught.value)
    assert f"({CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}) cannot be read" in message
    assert (
        "On local or NFS storage Ray Train rewrites it in place, so a controller or head node killed during that "
        "write leaves it empty or cut short (the checkpoints are intact); sdtrain then restores it from its copy, "
        f"{COPY_FILE}, but that is missing, does not parse or names checkpoints that are gone." in message
    )
    assert "run.start_fresh=true" in message
    assert "outside the run" not in message
    assert snapshot.read_bytes() == cut  # left as it was


def test_checkpoint_directories_never_registered_above_the_committed_step_are_warned_of(tmp_path):
    manager = _manager(tmp_path, "val_loss")
    _report_and_copy(tmp_path, manager, 100, 0.5)
    _report_and_copy(tmp_path, manager, 200, 0.4)
    run_dir = tmp_path / "run"
    for step in (150, 300, 400):  # 150: at or below the committed step (a pruned one's leftovers): not ours to name
        (run_dir / f"checkpoint_{step:08d}").mkdir()
    (run_dir / "checkpoint_00000500").write_text("")  # a file, not a checkpoint directory

    with LogLines() as lines:
        result = committed_run(None, str(run_dir))

    assert result is not None and result.checkpoint is not None
    assert result.checkpoint.path.endswith("checkpoint_00000200")
    assert [line for line in lines.messages if "never committed" in line] == [
        f"{run_dir}: checkpoint directories uploaded but never committed by Ray Train (the run was stopped before it "
        "registered them): checkpoint_00000300, checkpoint_00000400 (steps 300, 400). The run resumes from the "
        "committed step 200; they are never pruned and can be deleted"
    ]
    assert (run_dir / "checkpoint_00000300").is_dir()  # nothing deleted


def test_a_run_with_only_registered_checkpoints_gets_no_warning(tmp_path):
    manager = _manager(tmp_path, "val_loss")
    for step, loss in ((100, 0.5), (200, 0.4), (300, 0.6)):  # 300 is the latest though not among the best two
        _report_and_copy(tmp_path, manager, step, loss)
    with LogLines() as lines:
        assert committed_run(None, str(tmp_path / "run")) is not None
        assert committed_run(None, str(tmp_path / "elsewhere")) is None  # a fresh run: nothing listed
    assert lines.messages == []


def test_the_controller_neither_restores_nor_lists(tmp_path):
    """The data hook reads the record Ray Train's controller has already loaded whole: it repairs nothing."""
    manager = _manager(tmp_path, "val_loss")
    _report_and_copy(tmp_path, manager, 100, 0.5)
    (tmp_path / "run" / "checkpoint_00000300").mkdir()
    with LogLines() as lines:
        assert committed_run(None, str(tmp_path / "run"), repair_scores=False) is not None
    assert lines.messages == []


def test_the_callback_copies_a_record_on_object_storage(s3_bucket, tmp_path):
    from sdtrain.storage.filesystems import ray_storage, read_bytes, write_bytes

    callback = SnapshotCopy(*ray_storage(f"{s3_bucket}/runs/a"))
    with LogLines() as lines:  # a report before the first checkpoint: no record yet, nothing to copy
        callback.after_report(run_context=None, metrics=[{}], checkpoint=None)
    assert lines.messages == []
    assert read_bytes(f"{s3_bucket}/runs/a/{COPY_FILE}") is None

    _report(tmp_path, _manager(tmp_path, "val_loss"), 100, {"step": 100, "val_loss": 0.5})
    record = (tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).read_bytes()
    write_bytes(f"{s3_bucket}/runs/a/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}", record)
    callback.after_report(run_context=None, metrics=[{}], checkpoint=None)
    assert read_bytes(f"{s3_bucket}/runs/a/{COPY_FILE}") == record

    # The driver restores a record cut short on object storage too (there it is written whole, but may be damaged).
    write_bytes(f"{s3_bucket}/runs/a/checkpoint_00000100/model.txt", b"100")
    write_bytes(f"{s3_bucket}/runs/a/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}", record[: len(record) // 2])
    result = committed_run(*ray_storage(f"{s3_bucket}/runs/a"))
    assert result is not None and result.checkpoint is not None
    assert result.checkpoint.path.endswith("checkpoint_00000100")
    assert read_bytes(f"{s3_bucket}/runs/a/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}") == record
