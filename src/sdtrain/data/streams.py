"""The Ray Data pipelines: parquet files -> decoded latent/caption tensors, streamed.

Training data is read per rank in the order :mod:`sdtrain.data.read_order` plans (one Ray Data
block per window); validation data is read in file order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.data
from ray.data._internal.datasource.range_datasource import RangeDatasource
from ray.data.extensions import ArrowTensorArray

from sdtrain.config.schema import DataConfig
from sdtrain.data.decode import decode_batch, to_array
from sdtrain.data.inspection import DatasetSpec
from sdtrain.data.pacing import paced
from sdtrain.data.read_order import SamplePlan, Stretch, Window, window_sample_indices
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystems_for
from sdtrain.storage.s3 import is_transient

log = logging.getLogger("sdtrain")

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id."""


@dataclass(frozen=True)
class WindowReader:
    """Reads one window of training rows: its spans' rows, decoded, in the window's shuffled order.

    Besides ``latents`` and ``captions`` a block carries ``sample_index`` (which rows these are:
    the resume check and audits use it) and ``valid`` (False for rows of an unreadable file
    skipped under ``data.on_read_error=skip``; the loss leaves them out).
    """

    spec: DatasetSpec
    data: DataConfig
    plan: SamplePlan
    _sources: list[tuple[pafs.FileSystem, str]] = field(init=False, repr=False, compare=False)  # per file

    def __post_init__(self):
        # Resolved here, on the driver: the filesystems carry the job's S3 endpoint and retries
        # to Ray Data's read tasks, which on a separately started cluster know neither.
        object.__setattr__(self, "_sources", filesystems_for(self.spec.files))

    def read(self, window: Window) -> pa.Table:
        files: dict[int, pq.ParquetFile] = {}
        row_groups: dict[tuple[int, int], pa.Table] = {}  # chunks of a window often share row groups
        pieces = [
            piece
            for file_index, start, stop in window.spans
            for piece in self._read_span(files, row_groups, int(file_index), int(start), int(stop))
        ]
        # Output row i is row order[i] of the concatenated pieces: a shuffled selection (a window
        # cut by a resume or by train.max_steps leaves some rows out). Each piece's selected rows are
        # written once, straight to their output rows: no concatenated copy of the window besides
        # the output (a window of SD-sized rows is ~85 MB; each copy costs that again per read task).
        order = window.order()
        destination = np.full(sum(len(valid) for _, _, valid in pieces), -1)
        destination[order] = np.arange(len(order))
        dtype = np.result_type(*(latents for latents, _, _ in pieces))  # skipped rows must not widen float16
        latents = np.empty((len(order), *self.spec.latent_shape), dtype)
        captions = np.empty((len(order), *self.spec.caption_shape), dtype)
        valid = np.empty(len(order), bool)
        first = 0
        for piece in pieces:
            rows = destination[first : first + len(piece[2])]
            first += len(rows)
            taken = rows >= 0
            if not taken.all():
                rows, piece = rows[taken], [part[taken] for part in piece]
            latents[rows], captions[rows], valid[rows] = piece
        return pa.table(
            {
                "latents": ArrowTensorArray.from_numpy(latents),
                "captions": ArrowTensorArray.from_numpy(captions),
                "sample_index": window_sample_indices(window.spans, self.plan.file_offsets)[order],
                "valid": valid,
            }
        )

    def _read_span(self, files, row_groups, file_index: int, start: int, stop: int):
        """(latents, captions, valid) for rows [start, stop) of a file, one piece per row group, so an
        unreadable row group costs only its own rows under data.on_read_error=skip."""
        file = self.spec.files[file_index]
        try:
            if file_index not in files:
                fs, path = self._sources[file_index]
                files[file_index] = pq.ParquetFile(fs.open_input_file(path))
            meta = files[file_index].metadata
        except (OSError, pa.ArrowException) as error:
            _raise_if_transient(error, file)
            return [self._unreadable(file, start, stop, error)]
        offsets = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop, side="left"))
        pieces = []
        for group in range(first, last):
            lo, hi = max(start, int(offsets[group])), min(stop, int(offsets[group + 1]))
            try:
                if (file_index, group) not in row_groups:
                    columns = [self.data.image_column, self.data.caption_column]
                    row_groups[file_index, group] = files[file_index].read_row_group(group, columns=columns)
                table = row_groups[file_index, group].slice(lo - int(offsets[group]), hi - lo)
                pieces.append(
                    (
                        to_array(table.column(self.data.image_column), self.spec.latent_shape, self.data.image_column),
                        to_array(
                            table.column(self.data.caption_column), self.spec.caption_shape, self.data.caption_column
                        ),
                        np.ones(hi - lo, bool),
                    )
                )
            except (OSError, pa.ArrowException, DataError) as error:
                _raise_if_transient(error, file)
                pieces.append(self._unreadable(file, lo, hi, error))
        return pieces

    def _unreadable(self, file: str, start: int, stop: int, error: Exception):
        reason = " ".join(str(error).split())  # pyarrow's messages span lines
        if self.data.on_read_error == "fail":
            raise DataError(
                f"data.train: {file}: rows {start}-{stop - 1} cannot be read ({reason}). The file is damaged "
                "or changed since the run started: replace or remove it and re-run (the run resumes from "
                "its latest checkpoint), or set data.on_read_error=skip to train on without those rows"
            ) from None
        log.warning("skipping rows %d-%d of %s: %s", start, stop - 1, file, reason)
        return (
            np.zeros((stop - start, *self.spec.latent_shape), np.float16),
            np.zeros((stop - start, *self.spec.caption_shape), np.float16),
            np.zeros(stop - start, bool),
        )


def _raise_if_transient(error: BaseException, file: str, key: str = "data.train") -> None:
    """A storage failure that outlasted the client's retries is not a damaged file: it must neither
    stop the run as one nor drop rows under data.on_read_error=skip. It fails this attempt, and Ray
    Train restarts the workers from the latest checkpoint (failure.max_failures)."""
    if is_transient(error):
        raise OSError(f"{key}: {file}: storage failed after retries: {' '.join(str(error).split())}") from error


def rank_dataset(reader: WindowReader, stretches: list[Stretch], node_id: str | None) -> ray.data.Dataset:
    """One rank's training stream: its windows in order, each read by one Ray Data task on ``node_id``
    (the rank's node; None: anywhere)."""
    window_rows = reader.plan.window_rows
    counts = [stretch.num_windows(window_rows) for stretch in stretches]
    placement = read_placement(reader.data, node_id, sum(counts))
    dataset = _task_ids(sum(counts), placement)
    return paced(
        dataset.map_batches(
            _read_windows,  # type: ignore[arg-type]  # Ray types fn as one-argument; the rest are fn_kwargs
            # Whole blocks (one window id each): Ray Data then fuses the read of the ids into the
            # window's task instead of running a task per id first (batch_size=1 prevents fusion).
            batch_size=None,
            fn_kwargs=dict(reader=reader, stretches=stretches, first_index=np.cumsum([0] + counts)),
            **placement,
        )
    )


def _task_ids(n: int, placement: dict[str, Any]) -> ray.data.Dataset:
    """Ids 0..n-1, one block each, in order: the input of ``n`` read tasks placed by ``placement``.

    Read by a task that takes no CPU either (ray.data.range's read tasks take 1 CPU), with the same
    placement, so Ray Data fuses it into each read task.
    """
    dataset = ray.data.read_datasource(
        RangeDatasource(n=n, block_format="arrow", column_name="id"), override_num_blocks=n, **placement
    )
    # The order is the plan's (training: what makes resumption exact) or the files' (validation).
    dataset.context.execution_options.preserve_order = True
    # Our DataError (naming the file) reaches the worker as itself, not as a UserCodeException.
    dataset.context.raise_original_map_exception = True
    return dataset


def read_placement(data: DataConfig, node_id: str | None, tasks: int) -> dict[str, Any]:
    """Ray Data arguments for a worker's ``tasks`` read tasks: no CPU of their own, at most ``data.reads_per_worker``
    at once, on the worker's node.

    The CPUs they run on are those the worker reserved (scaling.cpus_per_worker). Reads that asked for
    CPUs of their own would need CPUs the worker group leaves free, which no launch-time check can
    promise: an elastic group resized onto the CPUs that remain after losing a node takes them all, and
    the stream then waits for a CPU for good. On the worker's node the windows also land in the object
    store the worker reads them from.
    """
    # Capped by the tasks there are: Ray Data warns of a limit above them.
    at_once = max(1, min(data.reads_per_worker, tasks))
    placement: dict[str, Any] = {"num_cpus": 0, "compute": ray.data.TaskPoolStrategy(size=at_once)}
    if node_id is not None:
        placement["label_selector"] = {NODE_ID_LABEL: node_id}
    return placement


def _read_windows(batch: dict[str, np.ndarray], reader: WindowReader, stretches, first_index) -> pa.Table:
    (position,) = batch["id"]
    which = int(np.searchsorted(first_index, position, side="right")) - 1
    window = reader.plan.window(stretches[which], int(position - first_index[which]))
    return reader.read(window)


def file_order_dataset(spec: DatasetSpec, data: DataConfig, key: str) -> ray.data.Dataset:
    """A lazy, streaming dataset of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) rows, in file order.

    One read task per file (``key``: the config key naming the files, for errors), a block per row group.
    The order is the file order, so validation sees the same samples every time. Every rank reads
    the whole set: it is small, so its reads go anywhere (:func:`read_placement`).
    """
    placement = read_placement(data, None, len(spec.files))
    # Not ray.data.read_parquet: its file listing runs in a task that takes a CPU.
    dataset = _task_ids(len(spec.files), placement)
    return paced(
        dataset.map_batches(
            _read_file,  # type: ignore[arg-type]  # Ray types fn as one-argument; the rest are fn_kwargs
            batch_size=None,
            fn_kwargs=dict(spec=spec, data=data, key=key, sources=filesystems_for(spec.files)),
            **placement,
        )
    )


def _read_file(batch: dict[str, np.ndarray], spec: DatasetSpec, data: DataConfig, key: str, sources):
    (index,) = batch["id"]
    file = spec.files[int(index)]
    fs, path = sources[int(index)]
    try:
        parquet = pq.ParquetFile(fs.open_input_file(path))
        for group in range(parquet.metadata.num_row_groups):
            table = parquet.read_row_group(group, columns=[data.image_column, data.caption_column])
            yield decode_batch(table, data.image_column, data.caption_column, spec.latent_shape, spec.caption_shape)
    except DataError as error:  # rows that do not decode to the shapes the first row has
        raise DataError(f"{key}: {file}: {error}") from None
    except (OSError, pa.ArrowException) as error:
        _raise_if_transient(error, file, key)
        reason = " ".join(str(error).split())
        raise DataError(
            f"{key}: {file} cannot be read ({reason}). The file is damaged or changed since the run started: "
            "replace or remove it and re-run (the run resumes from its latest checkpoint)"
        ) from None
