"""The Ray Data pipelines: parquet files -> decoded latent/caption tensors, streamed.

Training data is read per rank in the order :mod:`sdtrain.data.read_order` plans (one Ray Data
block per window); validation data is read in file order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.data.extensions import ArrowTensorArray

from sdtrain.config.learning import Columns
from sdtrain.config.schema import DataConfig
from sdtrain.data.added_columns import AddedColumns
from sdtrain.data.decode import TokenIdOutOfRange, caption_array, to_array
from sdtrain.data.horizons import horizon_reads
from sdtrain.data.inspection import DatasetSpec
from sdtrain.data.intervals import FILE, START, STOP, slice_rows
from sdtrain.data.object_store import fetched
from sdtrain.data.pacing import paced
from sdtrain.data.read_order import ReadPlan, Window, window_sample_indices
from sdtrain.data.rows import RowReader
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.private import ray as ray_private
from sdtrain.storage.filesystems import filesystem_for, filesystems_for
from sdtrain.storage.s3 import raise_if_unavailable, s3_filesystem
from sdtrain.storage.uris import split_s3

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id."""


@dataclass(frozen=True)
class ReadSettings:
    """What a read task needs of the config and the data's checked shapes."""

    columns: Columns
    on_read_error: str
    latent_shape: tuple[int, ...]
    caption_shape: tuple[int, ...]
    vocab_size: int | None = None
    """The caption column holds int32 token ids, each checked to be below this as it is read (the vocabulary the
    files record); None: float embeddings."""
    bucket_shapes: tuple[tuple[int, int, int], ...] | None = None
    """Aspect-ratio buckets: each bucket's latent shape (a read task's blocks each hold one bucket's rows)."""
    added: AddedColumns | None = None
    """An SDXL-shaped UNet's added conditioning columns (sdtrain.data.added_columns), read beside the others."""


class FileTable:
    """The training files, held compactly where a rank plans its reads: one string of every name, offsets into
    it, and one filesystem per S3 bucket (resolved on the driver: they carry the job's S3 endpoint and retries
    to the read tasks, which on a separately started cluster know neither). A read task gets only its own files.
    """

    def __init__(self, files: Sequence[str]):
        self._names = "\n".join(files).encode()
        lengths = np.fromiter((len(f.encode()) + 1 for f in files), np.int64, len(files))
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._buckets = {
            bucket: s3_filesystem(bucket)
            for bucket in dict.fromkeys(split_s3(f)[0] for f in files if f.startswith("s3://"))
        }

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def name(self, index: int) -> str:
        return self._names[self._offsets[index] : self._offsets[index + 1] - 1].decode()

    def source(self, index: int) -> tuple[str, pafs.FileSystem, str]:
        """(URI, filesystem, path within it) of file ``index``."""
        uri = self.name(index)
        if uri.startswith("s3://"):
            bucket, key = split_s3(uri)
            return uri, self._buckets[bucket], f"{bucket}/{key}"
        return (uri, *filesystem_for(uri))


@dataclass(frozen=True)
class WindowRead:
    """One read task, whole: its window's spans, the files they name and how to decode them. It is all a read
    task receives, so its size and cost do not grow with the dataset.

    A block carries ``latents`` and ``captions``, ``sample_index`` (which rows these are: the resume check and
    audits use it) and ``valid`` (False for rows of an unreadable file skipped under
    ``data.on_read_error=skip``; the loss leaves them out).
    """

    window: Window
    """Its spans' file column indexes ``sources``."""
    sources: tuple[tuple[str, pafs.FileSystem, str], ...]
    first_index: np.ndarray
    """The sample index of row 0 of each of ``sources``."""
    settings: ReadSettings
    planned_rows: np.ndarray
    """The rows of each of ``sources`` when the run planned its reads."""

    __name__ = "read_window"  # Ray Data names a read task by its function's name

    def __call__(self) -> list[pa.Table]:
        return self.read_blocks() if self.window.blocks else [self.read()]

    def read_blocks(self) -> list[pa.Table]:
        """Bucketed data: a block a step, each of its bucket's latent shape, the rows in the spans' order."""
        window, settings = self.window, self.settings
        assert settings.bucket_shapes is not None
        files: dict[int, pq.ParquetFile] = {}
        row_groups: dict[tuple[int, int], tuple[pa.Table, int]] = {}  # each with its rows left to read
        indices = window_sample_indices(window.spans, self.first_index)
        tables, first = [], 0
        for bucket, rows in window.blocks:
            shape = settings.bucket_shapes[bucket]
            pieces = [
                piece
                for file_index, start, stop in slice_rows(window.spans, first, first + rows)
                for piece in self._read_span(files, row_groups, int(file_index), int(start), int(stop), shape)
            ]
            arrays = {key: np.concatenate([piece[key] for piece in pieces]) for key in pieces[0]}
            tables.append(_block(arrays, indices[first : first + rows]))
            first += rows
        return tables

    def read(self) -> pa.Table:
        window = self.window
        files: dict[int, pq.ParquetFile] = {}
        row_groups: dict[tuple[int, int], tuple[pa.Table, int]] = {}  # chunks of a window often share row groups
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
        destination = np.full(sum(len(piece["valid"]) for piece in pieces), -1)
        destination[order] = np.arange(len(order))
        # Skipped rows (zeros of the narrowest type) must not widen float16; token ids stay int32.
        arrays = {
            key: np.empty((len(order), *pieces[0][key].shape[1:]), np.result_type(*(piece[key] for piece in pieces)))
            for key in pieces[0]
        }
        first = 0
        for piece in pieces:
            rows = destination[first : first + len(piece["valid"])]
            first += len(rows)
            taken = rows >= 0
            if not taken.all():
                rows, piece = rows[taken], {key: values[taken] for key, values in piece.items()}
            for key, values in piece.items():
                arrays[key][rows] = values
        return _block(arrays, window_sample_indices(window.spans, self.first_index)[order])

    def _read_span(self, files, row_groups, file_index: int, start: int, stop: int, latent_shape=None):
        """The batch arrays (latents, captions, added conditioning, valid) of rows [start, stop) of a file, one piece
        per row group, so an unreadable row group costs only its own rows under data.on_read_error=skip.
        ``latent_shape``: a bucket's, else the data's one."""
        latent_shape = latent_shape or self.settings.latent_shape
        file, fs, path = self.sources[file_index]
        try:
            if file_index not in files:
                files[file_index] = pq.ParquetFile(fs.open_input_file(path))
            meta = files[file_index].metadata
        except (OSError, pa.ArrowException) as error:
            raise_if_unavailable(error, f"data.train: {file}")
            return [self._unreadable(file, start, stop, error, latent_shape)]
        offsets = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        # A file cut short since the run planned its reads: as an IndexError (no error of ours) every restart of
        # Ray Train would fail on it, naming no file, until failure.max_failures is spent.
        if stop > offsets[-1]:
            held, planned = int(offsets[-1]), int(self.planned_rows[file_index])
            changed = DataError(
                f"the file holds {held} rows now, the run planned {planned}: it changed since the run started"
            )
            return [self._unreadable(file, start, stop, changed, latent_shape)]
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop, side="left"))
        pieces = []
        for group in range(first, last):
            lo, hi = max(start, int(offsets[group])), min(stop, int(offsets[group + 1]))
            try:
                table = self._row_group(files[file_index], row_groups, (file_index, group), offsets, hi - lo)
                pieces.append(self._decode(table.slice(lo - int(offsets[group]), hi - lo), latent_shape, lo))
            except TokenIdOutOfRange as error:  # the file is readable, its ids are wrong: skipping would hide that
                raise DataError(f"data.train: {file}: {error}") from None
            except (OSError, pa.ArrowException, DataError) as error:
                raise_if_unavailable(error, f"data.train: {file}")
                pieces.append(self._unreadable(file, lo, hi, error, latent_shape))
        return pieces

    def _row_group(self, file: pq.ParquetFile, row_groups: dict, key: tuple[int, int], offsets: np.ndarray, rows: int):
        """Row group ``key`` (file, group), ``rows`` of it taken now: read once a task and held until the window's last
        rows of it, so a task holds about one step's row groups, not its window's (bucketed, ~10x the rows used)."""
        if key not in row_groups:
            columns = self.settings.columns.names() + (self.settings.added.names() if self.settings.added else [])
            spans, (lo, hi) = self.window.spans[self.window.spans[:, FILE] == key[0]], offsets[key[1] : key[1] + 2]
            uses = np.maximum(np.minimum(spans[:, STOP], hi) - np.maximum(spans[:, START], lo), 0).sum()
            row_groups[key] = file.read_row_group(key[1], columns=columns), int(uses)
        table, left = row_groups.pop(key)
        if left > rows:  # more of it to read in this window
            row_groups[key] = table, left - rows
        return table

    def _decode(self, table: pa.Table, latent_shape: tuple[int, ...], first_row: int) -> dict[str, np.ndarray]:
        settings, columns = self.settings, self.settings.columns
        return {
            "latents": to_array(table.column(columns.latent), latent_shape, columns.latent),
            "captions": caption_array(table, columns.captions, settings.caption_shape, settings.vocab_size, first_row),
            **(settings.added.decode(table) if settings.added else {}),
            "valid": np.ones(table.num_rows, bool),
        }

    def _unreadable(self, file: str, start: int, stop: int, error: Exception, latent_shape: tuple[int, ...]):
        reason = " ".join(str(error).split())  # pyarrow's messages span lines
        if self.settings.on_read_error == "fail":
            raise DataError(
                f"data.train: {file}: rows {start}-{stop - 1} cannot be read ({reason}). The file is damaged "
                "or changed since the run started: replace or remove it and re-run (the run resumes from "
                "its latest checkpoint), or set data.on_read_error=skip to train on without those rows"
            ) from None
        log.warning("skipping rows %d-%d of %s: %s", start, stop - 1, file, reason)
        rows, settings = stop - start, self.settings
        return {
            "latents": np.zeros((rows, *latent_shape), np.float16),
            # Token ids: 0 is an id like any other, and these rows carry valid=False: the loss leaves them out.
            "captions": np.zeros(
                (rows, *settings.caption_shape), np.int32 if settings.vocab_size is not None else np.float16
            ),
            **(settings.added.empty(rows) if settings.added else {}),
            "valid": np.zeros(rows, bool),
        }


def _block(arrays: dict[str, np.ndarray], sample_index: np.ndarray) -> pa.Table:
    """One block of a training stream: rows of one latent shape; tensors as Ray tensor columns, ``valid`` and
    ``sample_index`` plain."""
    columns = {k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else v for k, v in arrays.items()}
    return pa.table({**columns, "sample_index": sample_index})


class WindowReader:
    """The training data as the ranks read it: the read plan, the files, the read settings. Put in Ray's object store
    once by the driver; a rank fetches it once (``object_store.fetched``) and reads its windows as WindowReads."""

    def __init__(self, spec: DatasetSpec, data: DataConfig, plan: ReadPlan):
        self.plan = plan
        self.reads_per_worker = data.reads_per_worker
        self.horizon_reads = horizon_reads()  # read tasks of a rank's dataset (sdtrain.data.horizons)
        self.files = FileTable(spec.files)
        self.settings = ReadSettings(
            spec.read_columns(data.columns),
            data.on_read_error,
            spec.latent_shape,
            spec.caption_shape,
            spec.token_ids.vocab_size if spec.token_ids is not None else None,
            spec.bucket_shapes,
            spec.added,
        )

    def task(self, window: Window) -> WindowRead:
        """The read task of ``window``: its spans renumbered over the few files they name."""
        used, local = np.unique(window.spans[:, FILE], return_inverse=True)
        spans = window.spans.copy()
        spans[:, FILE] = local
        return WindowRead(
            dataclasses.replace(window, spans=spans),
            tuple(self.files.source(int(f)) for f in used),
            self.plan.file_offsets[used],
            self.settings,
            self.plan.file_offsets[used + 1] - self.plan.file_offsets[used],
        )

    def read(self, window: Window) -> pa.Table:
        """``window``'s rows, read here (data of one shape)."""
        return self.task(window).read()

    def read_blocks(self, window: Window) -> list[pa.Table]:
        """The blocks of ``window``'s read task, read here."""
        return self.task(window)()


class RankWindows(Datasource):
    """One rank's windows as a Ray Data source: a read task per window, in order. ``shared``: the reader in Ray's
    object store, carried instead of the reader (~45 B a file) and fetched once a process."""

    def __init__(self, reader: WindowReader, stretches: Sequence[Any], shared: ray.ObjectRef | None = None):
        self._reader: WindowReader | ray.ObjectRef = shared if shared is not None else reader
        self.stretches = stretches
        self.count = sum(reader.plan.num_windows(stretch) for stretch in stretches)

    @property
    def reader(self) -> WindowReader:
        return self._reader if isinstance(self._reader, WindowReader) else fetched(self._reader)

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        if data_context is None:
            # ray.data.read_datasource asks once when the dataset is made (on Ray Train's controller, for every
            # rank) only to count the tasks; the executor asks again, with its context, where the rank reads.
            # Computing every window there too would cost the controller world size x windows.
            return [_COUNTED_ONLY] * self.count
        reader = self.reader
        plan = reader.plan
        return [
            ReadTask(reader.task(window), BlockMetadata(window.hi - window.lo, None, None, None))
            for stretch in self.stretches
            for window in plan.windows(stretch)
        ]


def _counted_only() -> list[pa.Table]:
    raise RuntimeError("sdtrain: a read task that was only counted was run: Ray Data's planning changed")


_COUNTED_ONLY = ReadTask(_counted_only, BlockMetadata(None, None, None, None))


def rank_dataset(
    reader: WindowReader, stretches: Sequence[Any], node_id: str | None, shared: ray.ObjectRef | None = None
) -> ray.data.Dataset:
    """One rank's training stream (a horizon's: sdtrain.data.horizons): its windows in order, each read by one Ray Data
    task on ``node_id`` (None: anywhere); ``shared``: ``reader`` in Ray's object store, once for every rank."""
    source = RankWindows(reader, stretches, shared)
    placement = read_placement(reader.reads_per_worker, node_id, source.count)
    return paced(_ordered(ray.data.read_datasource(source, override_num_blocks=source.count, **placement)))


def _task_ids(n: int, placement: dict[str, Any]) -> ray.data.Dataset:
    """Ids 0..n-1, one block each, in order: the input of ``n`` read tasks placed by ``placement``. Read by a task
    that takes no CPU either (ray.data.range's take 1), with the same placement, so Ray Data fuses it into each."""
    return _ordered(ray.data.read_datasource(ray_private.range_datasource(n), override_num_blocks=n, **placement))


def _ordered(dataset: ray.data.Dataset) -> ray.data.Dataset:
    # The order is the plan's (training: what makes resumption exact) or the files' (validation).
    dataset.context.execution_options.preserve_order = True
    # Our DataError (naming the file) reaches the worker as itself, not as a UserCodeException.
    dataset.context.raise_original_map_exception = True
    return dataset


def read_placement(reads_per_worker: int, node_id: str | None, tasks: int) -> dict[str, Any]:
    """Ray Data arguments for a worker's ``tasks`` read tasks: no CPU of their own, at most ``data.reads_per_worker``
    at once, on the worker's node.

    The CPUs they run on are those the worker reserved (scaling.cpus_per_worker). Reads that asked for
    CPUs of their own would need CPUs the worker group leaves free, which no launch-time check can
    promise: an elastic group resized onto the CPUs that remain after losing a node takes them all, and
    the stream then waits for a CPU for good. On the worker's node the windows also land in the object
    store the worker reads them from.
    """
    # Capped by the tasks there are: Ray Data warns of a limit above them.
    at_once = max(1, min(reads_per_worker, tasks))
    placement: dict[str, Any] = {"num_cpus": 0, "compute": ray.data.TaskPoolStrategy(size=at_once)}
    if node_id is not None:
        placement["label_selector"] = {NODE_ID_LABEL: node_id}
    return placement


def file_order_dataset(spec: DatasetSpec, data: DataConfig, key: str) -> ray.data.Dataset:
    """A lazy, streaming dataset of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) rows, in file order.

    One read task per file (``key``: the config key naming the files, for errors), a block per row group.
    The order is the file order, so validation sees the same samples every time. Every rank reads
    the whole set: it is small, so its reads go anywhere (:func:`read_placement`).
    """
    placement = read_placement(data.reads_per_worker, None, len(spec.files))
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
    reader = RowReader.of(spec, data.columns)
    for rows in reader.file_batches(spec.files[int(index)], key, source=sources[int(index)]):
        yield rows.arrays()
