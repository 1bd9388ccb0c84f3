"""The dataset index: what a start of a run needs to know of its data (files, sizes, versions, rows, the checked
schema), kept as one parquet object so that a restart reads one object instead of every file's footer.

The contract, owned here:

- **Listing**: :func:`sdtrain.data.listing.list_dataset` (``list_dataset`` and ``DIRECTORY_INDEX`` are
  importable from here too).
- **Index** (:class:`DatasetIndex`): per file (path, size, version, rows) plus the checked schema (the arrow
  schema with its metadata, the image and caption columns it was checked with, the latent and caption shapes),
  one parquet object: columns ``path size version rows``, the rest in its schema metadata. Written by the
  driver's first start of a run to ``<run dir>/dataset_index/<train|val>.parquet``, and by the preprocessing job
  beside its shards (``<output>/_sdtrain_index.parquet``, paths relative to the directory). Shapes an index
  records are (C, H, W) and (L, D) as checked against a model; a writer that knows no model (the preprocessing
  job) records the values per row as a 1-tuple. For variable-size lists only their product is used.
- **A start** (:func:`index_dataset`): read the run's index (one GET); list (on S3, key ranges cut at the
  index's paths, listed concurrently); use the run's index, else an index found beside the data: take each listed
  file's rows from it when its size and version are unchanged (an index beside the data held to the reference
  schema as the footers of its files would be); read the footers of the others (new or rewritten; bounded
  parallelism); drop files gone; check the columns and shapes against the model from the recorded
  schema, without I/O. The first row is read (the finiteness check) only on a start that
  read footers (of the first of them with rows) or that has no index of its own yet.
"""

from __future__ import annotations

import base64
import io
import json
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.data.inspection import (
    CheckedSchema,
    DatasetSpec,
    check_same_layouts,
    check_shapes,
    first_row,
    read_footers,
)
from sdtrain.data.listing import (
    DIRECTORY_INDEX,
    LIST_PAGE_SIZE,
    FoundIndex,
    Listing,
    _client,
    _strictly_increasing,
    list_dataset,
    list_spec,
    merge_listings,
    names_directory,
    object_version,
)
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import DATASET_INDEX_DIR
from sdtrain.storage.uris import is_uri, split_s3

INDEX_FORMAT = 1
UNINDEXED_HINT_FILES = 1000
"""A directory listed at every restart is worth indexing (entrypoints/index.py) from this many files: 1 S3 page."""
_META = b"sdtrain.dataset_index"
_SCHEMA = b"sdtrain.dataset_index.schema"


# --- the index object ----------------------------------------------------------------------------------------


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

    def table(self, relative_to: str | None = None) -> pa.Table:
        paths = self.paths
        if relative_to is not None:
            root = relative_to.rstrip("/") + "/"
            paths = [p[len(root) :] if p.startswith(root) else p for p in paths]
        meta = {
            "format": INDEX_FORMAT,
            "relative": relative_to is not None,
            "schema_file": self.checked.file,
            "image_column": self.checked.image_column,
            "caption_column": self.checked.caption_column,
            "latent_shape": list(self.latent_shape),
            "caption_shape": list(self.caption_shape),
            "sealed": [asdict(s) for s in self.sealed],
            "content_digest": self.content_digest,
        }
        schema = pa.schema(
            [("path", pa.string()), ("size", pa.int64()), ("version", pa.string()), ("rows", pa.int64())],
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
        print(f"[sdtrain] the dataset index {uri} cannot be read ({reason}); reading the footers instead", flush=True)
        return None


def _parsed_index(table: pa.Table, meta: dict, schema: bytes, uri: str, base: str | None) -> DatasetIndex:
    """The index ``table`` holds, its metadata ``meta``; a KeyError, TypeError or ValueError for any field missing
    or of another type."""
    relative = _typed(meta, "relative", bool, False)
    paths = table.column("path").to_pylist()
    if relative:
        root = (base if base is not None else posixpath.dirname(uri)).rstrip("/")
        paths = [_join(root, p) for p in paths]
    checked = CheckedSchema(
        _typed(meta, "schema_file", str),
        pa.ipc.read_schema(pa.py_buffer(base64.b64decode(schema))),
        _typed(meta, "image_column", str),
        _typed(meta, "caption_column", str),
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
    if uri.startswith("s3://"):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            return _client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
    return read_bytes(uri)


def run_index_uri(run_dir: str, key: str) -> str:
    """Where a run keeps the index of ``key`` (data.train, data.val): ``<run dir>/dataset_index/<train>.parquet``."""
    name = f"{key.rsplit('.', 1)[-1]}.parquet"
    return _join(run_dir, DATASET_INDEX_DIR, name)


def _join(root: str, *parts: str) -> str:
    return posixpath.join(root.rstrip("/"), *parts) if is_uri(root) else os.path.join(root, *parts)


# --- a start -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexStats:
    files: int
    from_index: int
    """Files whose rows came from an index (size and version unchanged)."""
    footers_read: int
    dropped: int
    """Files of the run's index that are gone from the listing."""
    rows_read: int
    """First rows read for the finiteness check (0 or 1)."""
    source: str | None
    """The index used, if any."""
    unlisted: int = 0
    """Files of directories unchanged since their directory index, taken from the run's index without a listing."""
    written: bool = True
    """:func:`write_directory_index` only: False when every file was as the index already there recorded it."""


@dataclass
class IndexedDataset:
    spec: DatasetSpec
    stats: IndexStats
    index: DatasetIndex
    stale: bool
    """Whether ``index`` differs from the run's own (none yet, footers read, files dropped): write it."""

    @property
    def schema_file(self) -> str:
        return self.index.checked.file

    @property
    def schema_metadata(self) -> Mapping[bytes, bytes]:
        return self.index.checked.schema.metadata or {}


def index_dataset(
    specs: Sequence[str],
    key: str,
    image_column: str,
    caption_column: str,
    in_channels: int,
    cross_attention_dim: int,
    index_uri: str | None = None,
    page_size: int = LIST_PAGE_SIZE,
) -> IndexedDataset:
    """The files ``specs`` name, their rows and shapes checked against the model, from the index at
    ``index_uri`` (the run's) or one beside the data where it has them, else from the footers. Writes nothing:
    :func:`write_index` the result's ``index`` to ``index_uri`` when ``stale``."""
    columns = (image_column, caption_column)
    own = read_index(index_uri) if index_uri else None
    # Directories unchanged since their directory index are taken from the run's index, if it was checked with
    # these columns (else its schema is no reference, and the footers are read).
    unchanged = {}
    if own is not None and (own.checked.image_column, own.checked.caption_column) == columns:
        unchanged = _unchanged_directories(own, specs)
    listed_before = own.paths if own is not None else None
    parts = [
        _files_of(own, unchanged[spec])
        if own is not None and spec in unchanged
        else list_spec(spec, key, page_size, listed_before)
        for spec in specs
    ]
    if len(parts) == 1 and (specs[0] in unchanged or _strictly_increasing(parts[0].paths)):
        listing, placed = parts[0], [(0, len(parts[0]))]  # held once, not copied (the index's order is sorted)
    else:
        listing, placed = merge_listings(parts)
    n = len(listing)
    directory_indexes: dict[str, DatasetIndex | None] = {}

    def directory_index(found: FoundIndex) -> DatasetIndex | None:
        if found.uri not in directory_indexes:
            directory_indexes[found.uri] = read_index(found.uri, found.base)
        return directory_indexes[found.uri]

    rows = np.zeros(n, np.int64)
    unknown_rows = np.ones(n, bool)
    for spec, part, (start, count) in zip(specs, parts, placed, strict=True):
        if spec in unchanged and count == len(part):  # one stretch of the run's index: copied, not matched
            assert own is not None
            rows[start : start + count] = own.rows[unchanged[spec].start : unchanged[spec].start + count]
            unknown_rows[start : start + count] = False
    to_read = np.flatnonzero(unknown_rows).tolist()
    del unknown_rows
    # The run's own index first (one GET); an index beside the data only for what it leaves unknown.
    candidates = _candidates(own, listing, directory_index)
    to_read, reference = _rows_from_indexes(candidates, listing, rows, to_read, key, columns)
    # The run's index as it was, every file taken from it in its order: nothing dropped, the same content digest.
    as_before = (
        own is not None
        and n == len(own.paths)
        and all(
            spec in unchanged and start == unchanged[spec].start and count == unchanged[spec].count
            for spec, (start, count) in zip(specs, placed, strict=True)
        )
    )
    dropped = 0
    if own is not None and not as_before:
        listed = set(listing.paths)
        dropped = sum(1 for p in own.paths if p not in listed)

    read_files = [listing.paths[i] for i in to_read]
    read_rows, checked = _read_footers(
        read_files, key, image_column, caption_column, reference.checked if reference is not None else None
    )
    assert checked is not None  # a listing is never empty: list_dataset raises
    for i, num_rows in zip(to_read, read_rows, strict=True):
        rows[i] = num_rows
    if int(rows.sum()) == 0:
        raise DataError(f"{key}: the {n} parquet file(s) hold no rows (first: {listing.paths[0]})")

    # The first row: of the first file read with rows; on a first start from an index beside the data, of the first
    # file with rows. A restart that read no footer reads none.
    row_file = None
    if read_files:
        row_file = next((f for f, r in zip(read_files, read_rows, strict=True) if r), None)
    elif own is None:
        row_file = listing.paths[int(np.flatnonzero(rows)[0])]
    row = first_row(row_file, key, [image_column, caption_column]) if row_file is not None else None
    recorded = (reference.latent_shape, reference.caption_shape) if reference is not None else None
    latent_shape, caption_shape = check_shapes(
        key, checked, in_channels, cross_attention_dim, row, row_file or checked.file, recorded
    )

    sealed = _sealed(specs, parts, placed, listing, unchanged, directory_index)
    digest = own.content_digest if as_before and own is not None and own.content_digest else listing.content_digest()
    index = DatasetIndex(
        listing.paths, listing.sizes, listing.versions, rows, checked, latent_shape, caption_shape, sealed, digest
    )
    stats = IndexStats(
        files=n,
        from_index=n - len(to_read),
        footers_read=len(to_read),
        dropped=dropped,
        rows_read=int(row is not None),
        source=None if reference is None else (index_uri if reference is own else "beside the data"),
        unlisted=sum(len(part) for spec, part in zip(specs, parts, strict=True) if spec in unchanged),
    )
    stale = (
        own is None
        or bool(to_read)
        or dropped > 0
        or (own.latent_shape, own.caption_shape) != (latent_shape, caption_shape)
        or own.sealed != sealed
        or own.content_digest != digest
    )
    dropped_note = f", {dropped} gone since the index" if dropped else ""
    unlisted_note = (
        f"; {stats.unlisted} in {len(unchanged)} director{'y' if len(unchanged) == 1 else 'ies'} unchanged since "
        "their directory index, not listed"
        if unchanged
        else ""
    )
    print(
        f"[sdtrain] {key}: {n} files ({stats.from_index} from the index, {stats.footers_read} footers read"
        f"{dropped_note}{unlisted_note})",
        flush=True,
    )
    for spec, part in zip(specs, parts, strict=True):
        if len(part) >= UNINDEXED_HINT_FILES and spec not in unchanged and not part.indexes and names_directory(spec):
            print(
                f"[sdtrain] {key}: {spec} has no directory index, so every restart lists its {len(part)} files; "
                f"`python entrypoints/index.py {spec}` once makes restarts list nothing",
                flush=True,
            )
    dataset = DatasetSpec(
        tuple(listing.paths),
        tuple(rows.tolist()),
        latent_shape,
        caption_shape,
        digest,
        token_ids=checked.token_ids(key),
    )
    return IndexedDataset(dataset, stats, index, stale)


def _read_footers(
    files: list[str], key: str, image_column: str, caption_column: str, reference: CheckedSchema | None
) -> tuple[list[int], CheckedSchema | None]:
    """:func:`read_footers`, with a progress line for 1000 files or more."""

    def progress(done: int, total: int) -> None:
        print(f"[sdtrain] {key}: read {done}/{total} footers", flush=True)

    return read_footers(files, key, image_column, caption_column, reference, progress if len(files) >= 1000 else None)


def _rows_from_indexes(
    candidates: Iterator[DatasetIndex],
    listing: Listing,
    rows: np.ndarray,
    to_read: list[int],
    key: str,
    columns: tuple[str, str],
) -> tuple[list[int], DatasetIndex | None]:
    """Fill in ``rows`` of the files ``to_read`` that an index records at the size and version listed; return the
    files left to read and the reference: the first index checked with the data's columns (the run's own, else
    the first beside the data). An index some of whose files still stand records the schema they were checked
    with, so it is held to the reference as their footers would be (layouts, latent scaling, text encoder): a
    mixed dataset is refused, not trained with the reference's metadata."""
    reference: DatasetIndex | None = None
    for index in candidates:
        if (index.checked.image_column, index.checked.caption_column) != columns:
            continue
        reference = reference or index
        if not to_read:
            break
        entries = zip(index.paths, index.sizes, index.versions, index.rows, strict=True)
        known = {path: (int(size), version, int(n)) for path, size, version, n in entries}
        found, unknown = [], []
        for i in to_read:
            entry = known.get(listing.paths[i])
            if entry is not None and entry[0] == listing.sizes[i] and entry[1] == listing.versions[i]:
                found.append((i, entry[2]))
            else:
                unknown.append(i)
        del known
        if found and index is not reference:
            check_same_layouts(key, index.checked.file, index.checked.schema, reference.checked)
        for i, num_rows in found:
            rows[i] = num_rows
        to_read = unknown
        if not to_read:  # the next index beside the data is not read
            break
    return to_read, reference


def _candidates(
    own: DatasetIndex | None, listing: Listing, read: Callable[[FoundIndex], DatasetIndex | None]
) -> Iterator[DatasetIndex]:
    if own is not None:
        yield own
    for found in listing.indexes:  # read only when reached
        index = read(found)
        if index is not None:
            yield index


def _unchanged_directories(own: DatasetIndex, specs: Sequence[str]) -> dict[str, SealedDirectory]:
    """The specs of ``own.sealed`` among ``specs`` whose directory index object is as it was (one HEAD each,
    concurrently): their files are the run's index's."""
    wanted = [s for s in own.sealed if s.spec in set(specs) and s.start + s.count <= len(own.paths)]
    if not wanted:
        return {}
    if len(wanted) == 1:
        version = object_version(wanted[0].index_uri)
        return {wanted[0].spec: wanted[0]} if version == (wanted[0].size, wanted[0].version) else {}
    with ThreadPoolExecutor(min(16, len(wanted)), thread_name_prefix="sdtrain-head") as pool:
        versions = list(pool.map(lambda s: object_version(s.index_uri), wanted))
    return {s.spec: s for s, version in zip(wanted, versions, strict=True) if version == (s.size, s.version)}


def _files_of(own: DatasetIndex, sealed: SealedDirectory) -> Listing:
    stop = sealed.start + sealed.count
    listing = Listing(own.paths[sealed.start : stop], versions=own.versions[sealed.start : stop])
    listing.sizes.frombytes(np.asarray(own.sizes[sealed.start : stop], np.int64).tobytes())
    return listing


def _sealed(
    specs: Sequence[str],
    parts: Sequence[Listing],
    placed: Sequence[tuple[int, int]],
    listing: Listing,
    unchanged: Mapping[str, SealedDirectory],
    read: Callable[[FoundIndex], DatasetIndex | None],
) -> tuple[SealedDirectory, ...]:
    """The specs whose files are exactly their directory index's, with where they are in ``listing``."""
    sealed = []
    for spec, part, (start, count) in zip(specs, parts, placed, strict=True):
        if count != len(part):  # some of its files came first from another spec: not one stretch of its own
            continue
        if spec in unchanged:
            sealed.append(replace(unchanged[spec], start=start))
            continue
        if len(part.indexes) != 1:
            continue
        found = part.indexes[0]
        index = read(found)
        if index is None or len(index.paths) != count:
            continue
        recorded = {p: (int(size), v) for p, size, v in zip(index.paths, index.sizes, index.versions, strict=True)}
        if all(
            recorded.get(listing.paths[i]) == (listing.sizes[i], listing.versions[i])
            for i in range(start, start + count)
        ):
            sealed.append(SealedDirectory(spec, found.uri, found.size, found.version, start, count))
    return tuple(sealed)


# --- the preprocessing job's index ---------------------------------------------------------------------------


def write_directory_index(
    directory: str,
    image_column: str,
    caption_column: str,
    known_rows: Mapping[str, int] | None = None,
    sample: str | None = None,
    key: str = "output.path",
) -> IndexStats | None:
    """The index of the parquet files under ``directory``, written beside them (``_sdtrain_index.parquet``,
    paths relative to the directory), for training on it to read no footer. ``known_rows``: rows of files by
    name relative to the directory (the preprocessing job's shard records); the others' rows come from the index
    already there where their size and version are unchanged, else from their footers. The schema is the footer
    of ``sample`` (a name relative to the directory: a file the writer just wrote) or else of the first file; the
    values per row, the first row of that file or else of the first with rows. None if the directory holds no
    parquet file with rows. ``key``: the name errors give the directory."""
    try:
        listing = list_dataset([directory], key)
    except DataError:
        return None
    base = directory.rstrip("/")
    if not is_uri(base):
        base = os.path.abspath(os.path.expanduser(base))
    rows = np.zeros(len(listing), np.int64)
    to_read = []
    for i, path in enumerate(listing.paths):
        name = path[len(base) + 1 :] if path.startswith(base + "/") else None
        if known_rows is not None and name is not None and name in known_rows:
            rows[i] = known_rows[name]
        else:
            to_read.append(i)
    before = _previous_directory_index(listing, base, image_column, caption_column) if to_read else None
    if before is not None:
        entries = zip(before.paths, before.sizes, before.versions, before.rows, strict=True)
        recorded = {p: (int(size), v, int(n)) for p, size, v, n in entries}
        unknown = []
        for i in to_read:
            entry = recorded.get(listing.paths[i])
            if entry is not None and entry[:2] == (listing.sizes[i], listing.versions[i]):
                rows[i] = entry[2]
            else:
                unknown.append(i)
        if len(unknown) == len(to_read):
            before = None  # nothing of it still stands: its schema is no reference for the new files either
        elif not unknown and _same_files(before, listing):
            # Rewriting it would change its version and make every run sealed on it list the directory again.
            return IndexStats(len(listing), len(listing), 0, 0, 0, None, written=False)
        to_read = unknown

    read_files = [listing.paths[i] for i in to_read]
    read_rows, checked = _read_footers(
        read_files, key, image_column, caption_column, before.checked if before is not None else None
    )
    for i, num_rows in zip(to_read, read_rows, strict=True):
        rows[i] = num_rows
    sample_path = _join(base, sample) if sample is not None else None
    position = {path: i for i, path in enumerate(listing.paths)}.get(sample_path or "")
    if checked is None:  # every file's rows were known: one footer for the schema
        first = position if position is not None else 0
        _, checked = read_footers(listing.paths[first : first + 1], key, image_column, caption_column)
        assert checked is not None
    with_rows = np.flatnonzero(rows)
    if len(with_rows) == 0:
        return None
    file = listing.paths[position if position is not None and rows[position] else int(with_rows[0])]
    row = first_row(file, key, [image_column, caption_column])
    image_layout, caption_layout = checked.layouts(key)
    latent_shape = image_layout.shape or (_values(row, image_column, key),)
    caption_shape = caption_layout.shape or (_values(row, caption_column, key),)
    index = DatasetIndex(listing.paths, listing.sizes, listing.versions, rows, checked, latent_shape, caption_shape)
    write_index(_join(base, DIRECTORY_INDEX), index, base)
    return IndexStats(len(listing), len(listing) - len(to_read), len(to_read), 0, 1, None)


def _previous_directory_index(
    listing: Listing, base: str, image_column: str, caption_column: str
) -> DatasetIndex | None:
    """The directory index already beside the files, if it was written for these columns: a re-index reads the
    footers of what changed only, and checks them against the schema it recorded."""
    found = next((f for f in listing.indexes if f.base.rstrip("/") == base), None)
    index = read_index(found.uri, found.base) if found is not None else None
    if index is None or (index.checked.image_column, index.checked.caption_column) != (image_column, caption_column):
        return None
    return index


def _same_files(index: DatasetIndex, listing: Listing) -> bool:
    return (
        index.paths == listing.paths
        and index.versions == listing.versions
        and np.array_equal(np.asarray(index.sizes, np.int64), np.asarray(listing.sizes, np.int64))
    )


def _values(row: pa.Table, column: str, key: str) -> int:
    value = row.column(column)[0]
    if not value.is_valid:
        raise DataError(f"{key}: column {column!r}: the first row is null")
    return len(value)
