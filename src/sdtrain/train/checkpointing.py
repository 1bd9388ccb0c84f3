"""Writing a checkpoint (:mod:`sdtrain.artifacts.checkpoint_format`) and handing it to Ray Train.

Every rank takes part (saving the state and gathering the sample record are collectives); rank 0
alone writes the directory. Ray Train uploads it, commits it once it is fully in storage, and only
then prunes older ones: nothing here deletes a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import pyarrow.fs as pafs
import ray.train

from sdtrain.config.schema import Config
from sdtrain.data.position import DataPosition
from sdtrain.data.read_order import DataState
from sdtrain.storage.run_layout import (
    CHECKPOINT_FILE,
    HISTORY_FILE,
    MODEL_FILE,
    SAMPLES_FILE,
    checkpoint_dir_name,
    run_scratch_dir,
)

_NODE_DIR = "node"
_UPLOAD_MODES = {"async": ray.train.CheckpointUploadMode.ASYNC, "sync": ray.train.CheckpointUploadMode.SYNC}


@dataclass(frozen=True)
class CheckpointWriter:
    """How this worker writes its checkpoints and what they record besides the weights."""

    data_position: Callable[[int], DataState]
    """The data state after a step: where a stream resumed from the checkpoint starts."""
    plan_fingerprint: dict[str, Any]
    """What the data positions refer to (``SamplePlan.fingerprint``), checked on resume."""
    upload: Literal["async", "sync"]
    """checkpoint.upload."""
    staging: str
    """This worker's staging directory (:func:`worker_scratch`), where rank 0 writes the checkpoint."""

    def report(
        self,
        trainer: pl.Trainer,
        pl_module,
        metrics: dict[str, float],
        step: int,
        position: DataState,
        history,
        evaluate: bool = False,
        final: bool = False,
    ) -> float:
        """:func:`report_with_checkpoint` with this writer's settings: the seconds the training loop waited. The final
        checkpoint is uploaded in the loop (sync) whatever checkpoint.upload says: Ray Train would wait for it after
        the loop returns anyway, where no stall watchdog watches it (a hung upload hung the job with no message)."""
        return report_with_checkpoint(
            trainer,
            pl_module,
            metrics,
            DataPosition(step, position, self.plan_fingerprint),
            history,
            "sync" if final else self.upload,
            self.staging,
            evaluate,
        )


def report_with_checkpoint(
    trainer: pl.Trainer,
    pl_module,
    metrics: dict[str, float],
    position: DataPosition,
    history: list[dict[str, float]],
    upload: Literal["async", "sync"],
    staging: str,
    evaluate: bool = False,
) -> float:
    """Write the checkpoint of ``position.step`` and report it with ``metrics``; returns the seconds the
    training loop waited (the save, and the upload when ``upload`` is sync).

    Args:
        position: the step and the data state after it, where a resumed stream starts, with what it refers to.
        history: the metric rows reported up to the step, saved with the checkpoint.
        upload: checkpoint.upload.
        staging: this worker's staging directory (:func:`worker_scratch`), where rank 0 writes it.
        evaluate: rank 0 asks Ray Train to evaluate the checkpoint once committed (its ValidationConfig, eval).
    """
    started = time.perf_counter()
    name = checkpoint_dir_name(position.step)
    directory = tempfile.mkdtemp(prefix=f"{name}-", dir=staging) if trainer.is_global_zero else ""
    if pl_module.sample_record is not None:
        # Collective: every rank trained on as many rows; rank 0 saves them all.
        record = trainer.strategy.all_gather(pl_module.take_sample_record().to(pl_module.device))
        if trainer.is_global_zero:
            np.save(os.path.join(directory, SAMPLES_FILE), record.cpu().numpy())
    # Collective: every rank builds the state, rank 0 writes it.
    trainer.save_checkpoint(os.path.join(directory, CHECKPOINT_FILE), weights_only=False)
    if trainer.is_global_zero:
        with open(os.path.join(directory, HISTORY_FILE), "w") as f:
            json.dump(history, f)
        with open(os.path.join(directory, MODEL_FILE), "w") as f:
            json.dump(pl_module.checkpoint_meta.to_dict(), f)
        position.write(directory)
    checkpoint = ray.train.Checkpoint.from_directory(directory) if trainer.is_global_zero else None
    try:
        # Ray Train uploads (in the background when async), commits the checkpoint once it is
        # fully in storage, prunes older ones only after that, and deletes the local copy.
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=_UPLOAD_MODES[upload],
            delete_local_checkpoint_after_upload=True,
            **({"validation": True} if evaluate else {}),
        )
    except BaseException:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return time.perf_counter() - started


def worker_scratch(config: Config, run_dir: str, local_rank: int, local_world_size: int) -> str:
    """An empty local directory for this worker of this run: staged checkpoints.

    Named by the worker's rank on its node, not in the group: a worker killed mid-upload (SIGKILL: no clean-up
    runs) leaves a whole checkpoint there, and the next worker group's workers on that node, whichever world ranks
    they hold, cover the same local ranks and empty their own. Local rank 0 also removes what none of them owns:
    the directories of local ranks past ``local_world_size`` (the node hosted more workers before a restart or
    resize) and a killed group's restore copy (:func:`node_scratch`). Named by the run's directory, so two runs
    on one node never touch each other's files.
    """
    directory = run_scratch(config, run_dir)
    if local_rank == 0:
        _drop_unowned(directory, local_world_size)
    scratch = os.path.join(directory, f"rank{local_rank}")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    return scratch


def _drop_unowned(directory: str, local_world_size: int) -> None:
    """Remove the rank directories of local ranks at or past ``local_world_size`` and the restore copy.

    Needs no barrier: no worker of the group writes these while this runs. Each lower local rank's directory is
    its own worker's (left alone here), and the restore copy is written only by this worker, afterwards
    (:func:`restored_directory` downloads afresh, so a leftover copy is never reused)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        index = re.fullmatch(r"rank(\d+)", name)
        if name == _NODE_DIR or (index is not None and int(index.group(1)) >= local_world_size):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def node_scratch(config: Config, run_dir: str) -> str:
    """The local directory this run's ranks on one node share: the one download of a restored checkpoint
    (:func:`restored_directory`, which empties it)."""
    return os.path.join(run_scratch(config, run_dir), _NODE_DIR)


def run_scratch(config: Config, run_dir: str) -> str:
    """This run's local directory on the node that calls it: its workers' and its restore copy's, under
    checkpoint.staging_dir (the node's temporary directory by default)."""
    return run_scratch_dir(config.checkpoint.staging_dir, config.run.name, run_dir)


@contextlib.contextmanager
def restored_directory(checkpoint: ray.train.Checkpoint, node_dir: str, local_rank: int) -> Iterator[tuple[str, bool]]:
    """(directory holding ``checkpoint``'s files, whether it is a copy). A checkpoint on this node's
    disk is read in place; one in object storage is downloaded once a node, by its local rank 0, into
    ``node_dir`` (:func:`node_scratch`): a rank each would take 8 downloads and 8 checkpoints of disk on an
    8-GPU node (an SDXL checkpoint with its EMA and optimizer is ~40 GB). Every rank (all of them: a collective)
    waits for the copies before reading. Local rank 0 removes the copy on exit if :class:`DropRestoreCopy` has not
    removed it once Lightning restored from it."""
    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem) and os.path.isdir(checkpoint.path):
        yield checkpoint.path, False
        return
    copy = os.path.join(node_dir, "restored")
    if local_rank == 0:
        shutil.rmtree(node_dir, ignore_errors=True)  # a killed worker group's copy, whole or not
        checkpoint.to_directory(copy)
    barrier()  # the node's copy is whole before any rank reads it
    try:
        yield copy, True
    finally:
        if local_rank == 0:
            shutil.rmtree(copy, ignore_errors=True)


def barrier() -> None:
    """Wait for every rank of the worker group (none to wait for outside a process group)."""
    import ray.train.torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":  # NCCL's barrier runs on a device: this rank's, not the current one (GPU 0)
        dist.barrier(device_ids=[ray.train.torch.get_device().index])
    else:
        dist.barrier()


class DropRestoreCopy(pl.Callback):
    """Removes the downloaded copy of the restored checkpoint once Lightning has restored from it on every rank
    (weights, optimizer and loop state are read before training starts): it would otherwise take a
    checkpoint's size of local disk for the whole run. The node's local rank 0 removes it, after the others.

    Args:
        copy: the node's copy (:func:`restored_directory`).
        local_rank: this rank's on its node.
    """

    def __init__(self, copy: str, local_rank: int):
        self.copy = copy
        self.local_rank = local_rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        barrier()  # every rank of the node has read the copy
        if self.local_rank == 0:
            shutil.rmtree(self.copy, ignore_errors=True)
