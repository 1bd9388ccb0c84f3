"""A checkpoint's data position (``data_state.json``): the optimizer step, the :class:`DataState` after it, and the
fingerprint of the read plan it refers to. One owner, written by rank 0 with each checkpoint and read back in one call
by the driver (before Ray starts), Ray Train's controller (each worker group's streams) and the workers (the restored
checkpoint).
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from sdtrain.data.read_order import DataState, ReadPlan
from sdtrain.errors import DataError
from sdtrain.storage.run_layout import DATA_STATE_FILE


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream stood after optimizer step ``step``."""

    step: int
    state: DataState
    plan: dict[str, Any] | None = None
    """:meth:`SamplePlan.fingerprint` of the plan ``state`` refers to; None in checkpoints written before it was."""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.state.to_dict(), "plan": self.plan}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DataPosition:
        return cls(int(raw["step"]), DataState.from_dict(raw["data"]), raw.get("plan"))

    @classmethod
    def read(cls, filesystem: pafs.FileSystem, checkpoint_dir: str) -> DataPosition:
        """The position a checkpoint directory holds (local: ``pafs.LocalFileSystem()``)."""
        with filesystem.open_input_stream(posixpath.join(checkpoint_dir, DATA_STATE_FILE)) as f:
            return cls.from_dict(json.loads(f.read()))

    def write(self, checkpoint_dir: str) -> None:
        """Into a local checkpoint directory that is being written (rank 0's staging copy)."""
        with open(os.path.join(checkpoint_dir, DATA_STATE_FILE), "w") as f:
            json.dump(self.to_dict(), f)

    def resume(self, plan: ReadPlan, on_change: str, where: str) -> tuple[int, DataState]:
        """(step, data state) to resume from on ``plan`` (the data and settings as they are now).

        Args:
            plan: the plan of this run.
            on_change: data.on_resume_change: fail, or new_epoch (start the next epoch on the current plan).
            where: the checkpoint, for the error.
        """
        changes = [] if self.plan is None else plan_changes(self.plan, plan.fingerprint())
        if not changes:  # a position without a fingerprint was written before they were kept: replayed as before
            return self.step, self.state
        if on_change == "new_epoch":
            return self.step, DataState(epoch=self.state.epoch + 1)
        raise DataError(
            f"data.train: the data position of {where} (step {self.step}, epoch {self.state.epoch}) refers to other "
            f"data than this run's: {'; '.join(changes)}. Resuming would read rows twice or never. Restore the data "
            "and settings, set data.on_resume_change=new_epoch to keep the weights and start the next epoch on the "
            "data as it is now, or start a new run (another run.name) with model.pretrained set to this run's export"
        )


_CHANGES = {
    "files": "data.train has {new} file(s), the checkpoint's had {old}",
    "rows": "data.train has {new} rows, the checkpoint's had {old}",
    "files_digest": "the list of data.train files changed (renamed, moved or replaced)",
    "rows_digest": "the rows per file of data.train changed",
    "content_digest": "a data.train file was rewritten in place (its size or ETag/mtime changed)",
    "seed": "train.seed is {new}, was {old}",
    "chunk_rows": "data.shuffle_chunk_rows is {new}, was {old}",
    "window_rows": "data.shuffle_window_rows is {new}, was {old}",
    # Bucketed data only (a one-shape plan records neither): the bucket order is cut in global batches.
    "global_batch": "train.global_batch_size is {new}, was {old} (bucketed data's order is cut in global batches)",
    "bucket_steps": "data.bucket_steps is {new}, was {old} (bucketed data's order is cut in turns of that many steps)",
    "buckets": "the data's aspect-ratio buckets are {new}, were {old}",
    "order": "the checkpoint was written with read order {old} of an earlier sdtrain, this one reads order {new}",
}
# What a fingerprint written before a key existed (or without a key it leaves out at its default) meant by it.
_DEFAULTS = {"order": 1, "bucket_steps": 1}


def plan_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two :meth:`SamplePlan.fingerprint` s, in the config's terms."""
    stored, current = {**_DEFAULTS, **stored}, {**_DEFAULTS, **current}
    # A content digest is compared where both sides have one: checkpoints from before it, or plans made without
    # the dataset index, have none.
    changed = [
        key
        for key in _CHANGES
        if stored.get(key) != current.get(key) and (key != "content_digest" or (stored.get(key) and current.get(key)))
    ]
    if "files" in changed or "rows" in changed:  # the digests differ too; the counts say more
        changed = [key for key in changed if key not in ("files_digest", "rows_digest", "content_digest")]
    return [_CHANGES[key].format(new=current.get(key), old=stored.get(key)) for key in changed]
