"""Ray Train's data hook: one ordered training stream per rank, positioned at the latest checkpoint.

Ray Train calls ``DataConfig.configure`` each time it starts a worker group (first start,
restart after a failure, resize, or a new driver on the same run). :class:`PlannedStreams`
reads the data position from the latest checkpoint Ray Train has committed, the same one the
workers are restored from, and gives each rank the rows :mod:`sdtrain.data.read_order` assigns it
from there for a horizon of steps (:mod:`sdtrain.data.horizons`; the rank goes on to ``train.max_steps``
itself). Open-source Ray Data keeps no iterator state across restarts (ray-project/ray#37633); the
position lives in our checkpoints instead.
"""

from __future__ import annotations

import json
import math
import posixpath
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.train

from sdtrain.config.schema import Config
from sdtrain.controller.snapshot_copy import (
    COPY_FILE,
    checkpoint_step,
    restore_snapshot,
    run_entries,
    warn_unregistered,
)
from sdtrain.data.horizons import Horizons
from sdtrain.data.object_store import fetched
from sdtrain.data.position import DataPosition
from sdtrain.data.read_order import DataState
from sdtrain.data.streams import WindowReader, rank_dataset
from sdtrain.errors import SdtrainError
from sdtrain.evaluation.scores import SCORE_ATTRIBUTES, worst_score
from sdtrain.logs import log
from sdtrain.private import ray as ray_private
from sdtrain.storage.filesystems import ray_storage, read_bytes, uri_for, write_bytes


class PlannedStreams(ray.train.DataConfig):
    def __init__(self, reader: ray.ObjectRef, run_dir: str, config: Config):
        """Args:
        reader: the run's :class:`WindowReader`, in Ray's object store.
        """
        super().__init__(datasets_to_split=["train"])
        self.shared = reader
        # (filesystem, path) made here on the driver: it carries the S3 endpoint to the controller.
        self.run_storage = ray_storage(run_dir)
        self.config = config

    @property
    def reader(self) -> WindowReader:
        return fetched(self.shared)

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        if "train" not in datasets:  # validation: every worker gets the whole set, in file order
            return super().configure(datasets, world_size, worker_handles, worker_node_ids, **kwargs)
        # Not repaired here: Ray Train's controller holds the record in memory and rewrites it at every checkpoint.
        result = committed_run(*self.run_storage, repair_scores=False)
        step, state = (0, DataState())
        if result is not None:
            assert result.checkpoint is not None  # committed_run returns only runs with a committed checkpoint
            position = DataPosition.read(result.checkpoint.filesystem, result.checkpoint.path)
            step, state = position.resume(self.reader.plan, self.config.data.on_resume_change, result.checkpoint.path)
        reader, rows_per_step = self.reader, self.config.batch_layout(world_size).rows_per_step
        horizons = Horizons.of(
            reader.plan, reader.horizon_reads, state, world_size, rows_per_step, self.config.train.max_steps - step
        )
        stretches = horizons.stretches(reader.plan, 0)  # each rank makes its next horizons' datasets itself
        # Each rank's dataset carries the reader's reference: pickled into every rank's dataset, the reader (~9 MB at
        # 2e5 files) left this process world-size times at every worker group's start.
        output = []
        for rank in range(world_size):
            node = worker_node_ids[rank] if worker_node_ids else None
            dataset = rank_dataset(reader, stretches[rank], node, self.shared)
            options = self.default_ingest_options()
            options.preserve_order = True  # the plan's order is what makes resumption exact
            dataset.context.execution_options = options
            output.append({"train": dataset.iterator()})
        return output


def committed_run(
    filesystem: pafs.FileSystem | None, run_dir: str, repair_scores: bool = True
) -> ray.train.Result | None:
    """Ray Train's record of the run in ``run_dir``, if it has committed a checkpoint. With ``repair_scores`` (the
    driver, before Ray Train starts) the record is repaired first: restored from sdtrain's copy when cut short
    (:func:`sdtrain.controller.snapshot_copy.restore_snapshot`), its null scores repaired (:func:`repair_null_scores`);
    and checkpoint directories it never registered are warned of."""
    entries = None
    if repair_scores:
        entries = run_entries(filesystem or pafs.LocalFileSystem(), run_dir)
        restore_snapshot(filesystem or pafs.LocalFileSystem(), run_dir, entries)
        repair_null_scores(filesystem, run_dir)
    try:
        result = ray.train.Result.from_path(run_dir, storage_filesystem=filesystem)
    except ray_private.checkpoint_record_error() as e:
        record = ray_private.checkpoint_record_file()
        raise SdtrainError(
            f"run: {run_dir}: Ray Train's record of the run's checkpoints ({record}) cannot be read: "
            f"{' '.join(str(e).split())[:300]}. On local or NFS storage Ray Train rewrites it in place, so a "
            "controller or head node killed during that write leaves it empty or cut short (the checkpoints are "
            f"intact); sdtrain then restores it from its copy, {COPY_FILE}, but that is missing, does not parse or "
            "names checkpoints that are gone. A record written by another Ray version is another cause. Restore "
            f"{record} from a copy, or set run.start_fresh=true to move the run aside and start over"
        ) from None
    except RuntimeError:  # no run directory or no committed checkpoint yet: a fresh run
        result = None
    committed = result if result is not None and result.checkpoint is not None else None
    if entries:
        _warn_unregistered(run_dir, entries, committed)
    return committed


def _warn_unregistered(run_dir: str, entries: dict[str, pafs.FileType], result: ray.train.Result | None) -> None:
    recorded = set()
    step = 0
    if result is not None and result.checkpoint is not None:
        recorded = {posixpath.basename(checkpoint.path) for checkpoint, _ in result.best_checkpoints or []}
        latest = posixpath.basename(result.checkpoint.path)
        recorded.add(latest)
        step = checkpoint_step(latest) or 0
    warn_unregistered(run_dir, entries, recorded, step)


def repair_null_scores(filesystem: pafs.FileSystem | None, run_dir: str) -> list[str]:
    """Rewrite, in Ray Train's record of the run's checkpoints, every score (a metric checkpoint.score_attribute may
    name) that is not a finite number to the worst score (sdtrain.evaluation.scores.worst_score); returns what was
    repaired, as ``<checkpoint dir> <metric>=<value>``.

    Why: a NaN or infinite score (reported before scored_metrics replaced them) is written null there, as JSON has
    neither, and Ray Train's next controller of the run failed on it at its first new checkpoint (``-1.0 * None``),
    on every re-run. The worst score keeps its ranking: Ray Train ranks NaN last too. A record that does not parse
    is left as it is, for Ray Train's own reading to name."""
    path = posixpath.join(run_dir, ray_private.checkpoint_record_file())
    uri = path if filesystem is None else uri_for(filesystem, path)
    data = read_bytes(uri)
    if data is None:
        return []
    try:
        record = json.loads(data)
    except ValueError:  # UnicodeDecodeError is one
        return []
    repaired = _repair_entries(record) if isinstance(record, dict) else []
    if repaired:
        # Compact, key order kept: the bytes Ray Train's pydantic model writes, but for the scores repaired.
        write_bytes(uri, json.dumps(record, separators=(",", ":")).encode("utf-8"))
        log.warning(
            "%s: repaired checkpoint scores that Ray Train recorded as null (a NaN or infinite metric; its JSON has "
            "neither), which fail the run at its next checkpoint when checkpoint.score_attribute names them, to "
            "the worst score: %s",
            uri,
            ", ".join(repaired),
        )
    return repaired


def _repair_entries(record: dict[str, Any]) -> list[str]:
    entries: list[Any] = [record.get("latest_checkpoint_result")]
    for key in ("checkpoint_results", "pending_training_results"):
        entries += record.get(key) or []
    repaired = []
    for entry in entries:
        metrics = entry.get("metrics") if isinstance(entry, dict) else None
        if not isinstance(metrics, dict):
            continue
        for attribute in SCORE_ATTRIBUTES:
            value = metrics.get(attribute, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                metrics[attribute] = worst_score(attribute)
                repaired.append(f"{entry.get('checkpoint_dir_name')} {attribute}={json.dumps(value)}")
    return list(dict.fromkeys(repaired))  # the latest is also one of the checkpoint results
