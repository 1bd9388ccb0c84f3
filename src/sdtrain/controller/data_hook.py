"""Ray Train's data hook: one ordered training stream per rank, positioned at the latest checkpoint.

Ray Train calls ``DataConfig.configure`` each time it starts a worker group (first start,
restart after a failure, resize, or a new driver on the same run). :class:`PlannedStreams`
reads the data position from the latest checkpoint Ray Train has committed, the same one the
workers are restored from, and gives each rank the rows :mod:`sdtrain.data.read_order` assigns it
from there to ``train.max_steps``. Open-source Ray Data keeps no iterator state across
restarts (ray-project/ray#37633); the position lives in our checkpoints instead.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import ray
import ray.train

from sdtrain.config.schema import Config
from sdtrain.data.position import DataPosition
from sdtrain.data.read_order import DataState
from sdtrain.data.streams import WindowReader, rank_dataset
from sdtrain.errors import SdtrainError
from sdtrain.private import ray as ray_private
from sdtrain.storage.filesystems import ray_storage


class PlannedStreams(ray.train.DataConfig):
    def __init__(self, reader: WindowReader, run_dir: str, config: Config):
        super().__init__(datasets_to_split=["train"])
        self.reader = reader
        # (filesystem, path) made here on the driver: it carries the S3 endpoint to the controller.
        self.run_storage = ray_storage(run_dir)
        self.config = config

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        if "train" not in datasets:  # validation: every worker gets the whole set, in file order
            return super().configure(datasets, world_size, worker_handles, worker_node_ids, **kwargs)
        result = committed_run(*self.run_storage)
        step, state = (0, DataState())
        if result is not None:
            assert result.checkpoint is not None  # committed_run returns only runs with a committed checkpoint
            position = DataPosition.read(result.checkpoint.filesystem, result.checkpoint.path)
            step, state = position.resume(self.reader.plan, self.config.data.on_resume_change, result.checkpoint.path)
        layout = self.config.batch_layout(world_size)
        stretches = self.reader.plan.rank_stretches(
            state, world_size, layout.rows_per_step, self.config.train.max_steps - step
        )
        # Put once, and each rank's dataset carries its reference: pickled into every rank's dataset, the reader
        # (~9 MB at 2e5 files) left this process world-size times at every worker group's start.
        shared = ray.put(self.reader)
        output = []
        for rank in range(world_size):
            node = worker_node_ids[rank] if worker_node_ids else None
            dataset = rank_dataset(self.reader, stretches[rank], node, shared)
            options = self.default_ingest_options()
            options.preserve_order = True  # the plan's order is what makes resumption exact
            dataset.context.execution_options = options
            output.append({"train": dataset.iterator()})
        return output


def committed_run(filesystem: pafs.FileSystem | None, run_dir: str) -> ray.train.Result | None:
    """Ray Train's record of the run in ``run_dir``, if it has committed a checkpoint."""
    try:
        result = ray.train.Result.from_path(run_dir, storage_filesystem=filesystem)
    except ray_private.checkpoint_record_error() as e:
        raise SdtrainError(
            f"run: {run_dir}: Ray Train's record of the run's checkpoints ({ray_private.checkpoint_record_file()}) "
            f"cannot be read: {' '.join(str(e).split())[:300]}. Ray Train writes it whole, so it was damaged or cut "
            "short outside the run, or written by another Ray version. Restore it from a copy, or set "
            "run.start_fresh=true to move the run aside and start over"
        ) from None
    except RuntimeError:  # no run directory or no committed checkpoint yet: a fresh run
        return None
    return result if result.checkpoint is not None else None
