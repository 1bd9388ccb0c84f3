"""The dataset index's format: what a start of a run needs to know of its data (files, sizes, versions, rows, the
checked schema), kept as one parquet object so that a restart reads one object instead of every file's footer.

An index (:class:`DatasetIndex`) is per file (path, size, version, rows) plus the checked schema (the arrow schema
with its metadata, the latent and caption columns it was checked with, the latent and caption shapes), one parquet
object: columns ``path size version rows``, the rest in its schema metadata. The driver's first start of a run
writes one to ``<run dir>/dataset_index/<train|val>.parquet`` (:mod:`sdtrain.data.dataset_index`), and the
preprocessing job and ``entrypoints/index.py`` one beside a directory's files (``<dir>/_sdtrain_index.parquet``,
paths relative to the directory: :mod:`sdtrain.data.directory_index`). Shapes an index records are (C, H, W) and
(L, D) as checked against a model; a writer that knows no model records the values per row as a 1-tuple. For
variable-size lists only their product is used.
"""

from __future__ import annotations

import base64
import io
import json
import os
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.config.learning import Columns
from sdtrain.data.inspection import CheckedSchema
from sdtrain.data.listing import Listing, listing_client
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import DATASET_INDEX_DIR
from sdtrain.storage.s3 import raise_if_unavailable
from sdtrain.storage.uris import is_uri, split_s3

INDEX_FORMAT = 1
_META = b"sdtrain.dataset_index"
_SCHEMA = b"sdtrain.dataset_index.schema"


@dataclass(frozen=True)
class SealedDirectory:
    """A spec naming a directory whose parquet files were exactly those of the directory index beside them (the
    preprocessing job's) when a run's index was written. That job rewrites its index whenever it changes the
    directory, so while the index object is unchanged (one HEAD) a restart takes the spec's files from the run's
    index without listing the directory."""

    spec: str
    index_uri: str
    size: int
    version: str
    """The directory index object's size and version (ETag, mtime) when the run's index was written."""
    start: int
    count: int
    """The spec's files: positions [start, start + count) of the run's index."""


@dataclass
class DatasetIndex:
    paths: list[str]
    sizes: Sequence[int]
    versions: list[str]
    rows: np.ndarray
    checked: CheckedSchema
    latent_shape: tuple[int, ...]
    caption_shape: tuple[int, ...]
    sealed: tuple[SealedDirectory, ...] = ()
    """A run's index only: the specs a restart need not list."""
    content_digest: str = ""
    """A run's index only: the listing's content digest (:func:`sdtrain.data.listing.content_digest`), so a restart
    that lists nothing need not hash every file again."""
    runs: list[bytes] | None = None
    """Bucketed data only: each file's runs, (bucket, rows) int32 pairs in row order (:func:`pack_runs`)."""

    def table(self, relative_to: str | None = None) -> pa.Table:
        paths = self.paths
        if relative_to is not None:
            root = relative_to.rstrip("/") + "/"
            paths = [p[len(root) :] if p.startswith(root) else p for p in paths]
        meta = {
            "format": INDEX_FORMAT,
            "relative": relative_to is not None,
            "schema_file": self.checked.file,
            "latent_column": self.checked.columns.latent,
            "caption_column": self.checked.columns.caption,
            "latent_shape": list(self.latent_shape),
            "caption_shape": list(self.caption_shape),
            "sealed": [asdict(s) for s in self.sealed],
            "content_digest": self.content_digest,
        }
        fields = [("path", pa.string()), ("size", pa.int64()), ("version", pa.string()), ("rows", pa.int64())]
        schema = pa.schema(
            fields + ([("bucket_runs", pa.binary())] if self.runs is not None else []),
            metadata={
                _META: json.dumps(meta).encode(),
                _SCHEMA: base64.b64encode(self.checked.schema.serialize().to_pybytes()),
            },
        )
        return pa.table(
            [
                pa.array(paths, pa.string()),
                pa.array(np.asarray(self.sizes, np.int64)),
                pa.array(self.versions, pa.string()),
                pa.array(np.asarray(self.rows, np.int64)),
                *([pa.array(self.runs, pa.binary())] if self.runs is not None else []),
            ],
            schema=schema,
        )


def index_bytes(index: DatasetIndex, relative_to: str | None = None) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(index.table(relative_to), buffer, compression="zstd")
    return buffer.getvalue()


def write_index(uri: str, index: DatasetIndex, relative_to: str | None = None) -> None:
    """The index as one object at ``uri`` (local: a temporary name then a rename; S3: one PutObject)."""
    write_bytes(uri, index_bytes(index, relative_to))


def read_index(uri: str, base: str | None = None) -> DatasetIndex | None:
    """The index at ``uri`` in one read (one GET on S3), or None if there is none or it cannot be used (another
    format, unreadable, a key missing or of another type: the footers are read instead). ``base``: the directory a
    relative index is under."""
    data = _read_object(uri)
    if data is None:
        return None
    try:
        table = pq.read_table(io.BytesIO(data))
        metadata = table.schema.metadata or {}
        meta = json.loads(metadata[_META])
        if not isinstance(meta, dict):
            raise TypeError(f"its metadata is a {type(meta).__name__}, not an object")
        if meta.get("format") != INDEX_FORMAT:
            return None
        return _parsed_index(table, meta, metadata[_SCHEMA], uri, base)
    except (OSError, KeyError, ValueError, TypeError, pa.ArrowException) as e:
        # Anything short of a whole index costs this start its footers, never the start itself.
        reason = f"{type(e).__name__}: {e}" if isinstance(e, KeyError | TypeError) else str(e)
        log.info(f"the dataset index {uri} cannot be read ({reason}); reading the footers instead")
        return None


def _parsed_index(table: pa.Table, meta: dict, schema: bytes, uri: str, base: str | None) -> DatasetIndex:
    """The index ``table`` holds, its metadata ``meta``; a KeyError, TypeError or ValueError for any field missing
    or of another type."""
    relative = _typed(meta, "relative", bool, False)
    paths = table.column("path").to_pylist()
    if relative:
        root = (base if base is not None else posixpath.dirname(uri)).rstrip("/")
        paths = [join_path(root, p) for p in paths]
    checked = CheckedSchema(
        _typed(meta, "schema_file", str),
        pa.ipc.read_schema(pa.py_buffer(base64.b64decode(schema))),
        # Indexes written before the key was data.latent_column call it image_column.
        Columns(
            _typed(meta, "latent_column" if "latent_column" in meta else "image_column", str),
            _typed(meta, "caption_column", str),
        ),
    )
    sealed = _typed(meta, "sealed", list, [])
    return DatasetIndex(
        paths=paths,
        sizes=table.column("size").to_numpy(),
        versions=table.column("version").to_pylist(),
        rows=table.column("rows").to_numpy(),
        checked=checked,
        latent_shape=_shape(meta, "latent_shape"),
        caption_shape=_shape(meta, "caption_shape"),
        sealed=() if relative else tuple(_sealed_directory(entry) for entry in sealed),
        content_digest="" if relative else _typed(meta, "content_digest", str, ""),
        runs=table.column("bucket_runs").to_pylist() if "bucket_runs" in table.column_names else None,
    )


_REQUIRED = object()


def _typed(meta: dict, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    value = meta[key] if default is _REQUIRED else meta.get(key, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is {value!r}, not a {kind.__name__}")
    return value


def _sealed_directory(entry: Any) -> SealedDirectory:
    if not isinstance(entry, dict):
        raise TypeError(f"a sealed directory is {entry!r}, not an object")
    kinds = {"spec": str, "index_uri": str, "size": int, "version": str, "start": int, "count": int}
    return SealedDirectory(**{key: _typed(entry, key, kind) for key, kind in kinds.items()})


def _shape(meta: dict, key: str) -> tuple[int, ...]:
    return tuple(_typed({key: v}, key, int) for v in _typed(meta, key, list))


def _read_object(uri: str) -> bytes | None:
    """The index object at ``uri`` whole (one GET on S3), or None if there is none; a StorageUnavailable naming it if
    storage failed past its retries, a DataError naming it if it is there but cannot be read (denied)."""
    if not uri.startswith("s3://"):
        try:
            return read_bytes(uri)
        except OSError as e:
            raise_if_unavailable(e, f"cannot read the dataset index {uri}")
            raise _unreadable(uri, e) from None
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3(uri)
    try:
        return listing_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except (ClientError, BotoCoreError) as e:
        raise_if_unavailable(e, f"cannot read the dataset index {uri}")
        if not isinstance(e, ClientError):
            raise
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _unreadable(uri, e) from None


def _unreadable(uri: str, error: BaseException) -> DataError:
    reason = " ".join(str(error).split()) or type(error).__name__
    return DataError(
        f"cannot read the dataset index {uri} ({reason}): let these credentials read it (s3:GetObject on S3), or "
        "delete it and the files' footers are read instead"
    )


def run_index_uri(run_dir: str, key: str) -> str:
    """Where a run keeps the index of ``key`` (data.train, data.val): ``<run dir>/dataset_index/<train>.parquet``."""
    name = f"{key.rsplit('.', 1)[-1]}.parquet"
    return join_path(run_dir, DATASET_INDEX_DIR, name)


def join_path(root: str, *parts: str) -> str:
    return posixpath.join(root.rstrip("/"), *parts) if is_uri(root) else os.path.join(root, *parts)


def recorded_rows(
    index: DatasetIndex, listing: Listing, positions: Iterable[int]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """For ``positions`` of ``listing``: (position, rows, position in ``index``) of the files ``index`` records at the
    size and version listed, and the positions it does not (new or rewritten files)."""
    entries = zip(index.paths, index.sizes, index.versions, index.rows, strict=True)
    known = {path: (int(size), version, int(n), j) for j, (path, size, version, n) in enumerate(entries)}
    found, unknown = [], []
    for i in positions:
        entry = known.get(listing.paths[i])
        if entry is not None and entry[0] == listing.sizes[i] and entry[1] == listing.versions[i]:
            found.append((i, entry[2], entry[3]))
        else:
            unknown.append(i)
    return found, unknown


def pack_runs(runs: list[tuple[int, int]]) -> bytes:
    """A file's runs as the index stores them: int32 (bucket, rows) pairs."""
    return np.asarray(runs, np.int32).reshape(-1, 2).tobytes()


def runs_array(per_file: Sequence[bytes]) -> np.ndarray:
    """The (file, bucket, rows) runs of files whose packed runs are ``per_file`` (:class:`sdtrain.data.bucket_order.
    BucketPlan`'s input)."""
    pairs = [np.frombuffer(b, np.int32).reshape(-1, 2) for b in per_file]
    files = np.repeat(np.arange(len(pairs)), [len(p) for p in pairs])
    stacked = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int32)
    return np.column_stack([files, stacked]).astype(np.int64)
