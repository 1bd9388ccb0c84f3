"""Ray Train's record of a run's checkpoints (checkpoint_manager_snapshot.json) with a score it wrote null: a NaN or
infinite checkpoint.score_attribute reported before scored_metrics replaced such scores. Ray Train's next controller
of the run failed on it at its first new checkpoint, on every re-run; the driver repairs the record before Ray Train
starts. Ray Train's checkpoint manager is driven here without a cluster."""

import asyncio
import json
import sys

import pyarrow.fs as pafs
import pytest
import ray.train
from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.context import StorageContext
from ray.train.v2._internal.execution.training_report import _TrainingReport
from support.log_lines import LogLines

from sdtrain.config.running import HIGHER_IS_BETTER
from sdtrain.controller.data_hook import committed_run, repair_null_scores
from sdtrain.evaluation.scores import SCORE_ATTRIBUTES

WORST = sys.float_info.max


def _manager(root, attribute: str) -> CheckpointManager:
    """A new controller's checkpoint manager of the run ``root``/run: it loads the run's snapshot, if any."""
    storage = StorageContext(
        storage_path=str(root), experiment_dir_name="run", storage_filesystem=pafs.LocalFileSystem()
    )
    order = "max" if attribute in HIGHER_IS_BETTER else "min"  # as sdtrain.driver.ray_configs.ray_run_config orders it
    config = ray.train.CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute=attribute, checkpoint_score_order=order
    )
    return CheckpointManager(config, storage)


def _report(root, manager: CheckpointManager, step: int, metrics: dict[str, float]) -> None:
    directory = root / "run" / f"checkpoint_{step:08d}"
    directory.mkdir(parents=True)
    (directory / "model.txt").write_text(str(step))

    async def register():
        report = _TrainingReport(checkpoint=ray.train.Checkpoint(str(directory)), metrics=metrics, validation=False)
        manager.register_checkpoint(report)
        await asyncio.sleep(0)  # the manager prunes in a task of its own

    asyncio.run(register())


@pytest.mark.parametrize(
    ("attribute", "bad"), [("val_loss", float("nan")), ("loss", float("inf")), ("clip_score", float("nan"))]
)
def test_a_null_score_in_ray_trains_snapshot_is_repaired_and_the_run_resumes(tmp_path, attribute, bad):
    good = 0.9 if attribute in HIGHER_IS_BETTER else 0.5
    _report(tmp_path, manager := _manager(tmp_path, attribute), 100, {"step": 100, "loss": 1.0, attribute: good})
    _report(tmp_path, manager, 200, {"step": 200, "loss": 1.0, attribute: bad})  # as a run before the fix did
    snapshot = tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    before = json.loads(snapshot.read_text())
    assert before["latest_checkpoint_result"]["metrics"][attribute] is None  # JSON has no NaN nor infinity

    with LogLines() as lines:
        result = committed_run(None, str(tmp_path / "run"))  # the driver, before Ray Train starts
    repaired_text = snapshot.read_text()

    # A new controller (the command re-run) loads the record and goes on (it failed here, on every re-run, with
    # TypeError: -1.0 * None): its new checkpoint is the latest, and the worst of the three is pruned.
    resumed = _manager(tmp_path, attribute)
    _report(tmp_path, resumed, 300, {"step": 300, "loss": 1.0, attribute: good})
    assert resumed.latest_checkpoint_result is not None
    assert resumed.latest_checkpoint_result.checkpoint.path.endswith("checkpoint_00000300")
    reloaded = json.loads(snapshot.read_text())
    assert reloaded["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_00000300"

    assert result is not None and result.checkpoint is not None
    assert result.checkpoint.path.endswith("checkpoint_00000200")
    assert [line for line in lines.messages if "repaired" in line] == [
        f"{snapshot}: repaired checkpoint scores that Ray Train recorded as null (a NaN or infinite metric; its JSON "
        "has neither), which fail the run at its next checkpoint when checkpoint.score_attribute names them, to the "
        "worst score: "
        f"checkpoint_00000200 {attribute}=null"
    ]
    worst = -WORST if attribute in HIGHER_IS_BETTER else WORST
    after = json.loads(repaired_text)
    assert after["latest_checkpoint_result"]["metrics"][attribute] == worst
    repaired = [entry for entry in after["checkpoint_results"] if entry["checkpoint_dir_name"] == "checkpoint_00000200"]
    assert repaired[0]["metrics"][attribute] == worst
    # Nothing else changed: the record is the one Ray Train wrote, but for the scores repaired.
    for entry in [before["latest_checkpoint_result"], *before["checkpoint_results"]]:
        if entry["metrics"][attribute] is None:
            entry["metrics"][attribute] = worst
    assert after == before
    assert repaired_text == json.dumps(after, separators=(",", ":"))
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint_0*")) == [
        "checkpoint_00000100",
        "checkpoint_00000300",
    ]


def test_a_record_without_null_scores_is_left_as_it_is(tmp_path):
    _report(tmp_path, manager := _manager(tmp_path, "val_loss"), 100, {"step": 100, "loss": 1.0, "val_loss": 0.5})
    _report(tmp_path, manager, 200, {"step": 200, "loss": 1.0})  # no val_loss: nothing to repair
    snapshot = tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    written = snapshot.read_bytes()
    assert repair_null_scores(None, str(tmp_path / "run")) == []
    assert snapshot.read_bytes() == written
    assert repair_null_scores(None, str(tmp_path / "elsewhere")) == []  # no record: a fresh run


def test_the_controller_does_not_rewrite_the_record(tmp_path):
    """Ray Train's controller holds the record in memory and rewrites it at every checkpoint: the data hook reads it
    without repairing it (the driver has, before the controller started)."""
    _report(tmp_path, _manager(tmp_path, "val_loss"), 100, {"step": 100, "val_loss": float("nan")})
    snapshot = tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    written = snapshot.read_bytes()
    assert committed_run(None, str(tmp_path / "run"), repair_scores=False) is not None
    assert snapshot.read_bytes() == written


def test_every_score_attribute_the_config_allows_is_repaired():
    from typing import get_args, get_type_hints

    from sdtrain.config.running import CheckpointConfig

    allowed = get_args(get_args(get_type_hints(CheckpointConfig)["score_attribute"])[0])
    assert set(SCORE_ATTRIBUTES) == set(allowed)


def test_a_record_on_object_storage_is_repaired_in_place(s3_bucket, tmp_path):
    from sdtrain.storage.filesystems import ray_storage, read_bytes, write_bytes

    _report(tmp_path, _manager(tmp_path, "val_loss"), 100, {"step": 100, "val_loss": float("nan")})
    local = tmp_path / "run" / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    remote = f"{s3_bucket}/runs/a/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}"
    write_bytes(remote, local.read_bytes())
    assert repair_null_scores(*ray_storage(f"{s3_bucket}/runs/a")) == ["checkpoint_00000100 val_loss=null"]
    assert repair_null_scores(None, str(tmp_path / "run")) == ["checkpoint_00000100 val_loss=null"]
    assert read_bytes(remote) == local.read_bytes()  # the same bytes as the local repair wrote
    assert json.loads(local.read_text())["latest_checkpoint_result"]["metrics"]["val_loss"] == WORST
