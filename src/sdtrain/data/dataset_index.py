"""A start of a run: the files its data specs name, their rows and shapes checked against the model, from the run's
dataset index (:mod:`sdtrain.data.index_format`) where it has them.

Read the run's index (one GET); list (on S3, key ranges cut at the index's paths, listed concurrently), except the
directories sealed in it and unchanged since (:mod:`sdtrain.data.index_sealing`); take each listed file's rows from
the run's index, else from an index found beside the data, when its size and version are unchanged (an index beside
the data held to the reference schema as the footers of its files would be); read the footers of the others (new or
rewritten; bounded parallelism); drop files gone; check the columns and shapes against the model from the recorded
schema, without I/O. The first row is read (the finiteness check) only on a start that read footers (of the first of
them with rows) or that has no index of its own yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sdtrain.config.learning import Columns
from sdtrain.data.footer_counts import FooterCounts
from sdtrain.data.index_format import DatasetIndex, SealedDirectory, pack_runs, read_index, recorded_rows, runs_array
from sdtrain.data.index_sealing import files_of, sealed_directories, unchanged_directories
from sdtrain.data.inspection import (
    CheckedSchema,
    DatasetSpec,
    check_same_layouts,
    first_row,
    read_footers,
)
from sdtrain.data.listing import (
    LIST_PAGE_SIZE,
    FoundIndex,
    Listing,
    list_specs,
    merge_listings,
    names_directory,
    strictly_increasing,
)
from sdtrain.data.shapes import check_shapes
from sdtrain.errors import DataError
from sdtrain.logs import log

UNINDEXED_HINT_FILES = 1000
"""A directory listed at every restart is worth indexing (entrypoints/index.py) from this many files: 1 S3 page."""


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
    """:func:`sdtrain.data.directory_index.write_directory_index` only: False when every file was as the index
    already there recorded it."""
    largest_row_group: tuple[int, str] | None = None
    """(rows, file) of the largest row group of the footers read at this start (None: none read). A training read of
    data.shuffle_chunk_rows rows reads its whole row group (sdtrain.driver.data_check warns of large ones)."""
    runs_across_groups: tuple[int, str] | None = None
    """(files, one of them) of the bucketed files whose footers were read at this start with row groups that do not
    start at each bucket run (sdtrain.data.footer_counts.FooterCounts.check)."""


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


@dataclass
class _Listed:
    """The files of a start: each spec's part (listed, or a stretch of the run's index), merged into one listing."""

    specs: Sequence[str]
    own: DatasetIndex | None
    unchanged: dict[str, SealedDirectory]
    parts: list[Listing]
    placed: list[tuple[int, int]]
    """Where each spec's files are in ``listing``: (start, count)."""
    listing: Listing
    directory_indexes: dict[str, DatasetIndex | None]

    def directory_index(self, found: FoundIndex) -> DatasetIndex | None:
        """The index beside the data at ``found``, read once."""
        if found.uri not in self.directory_indexes:
            self.directory_indexes[found.uri] = read_index(found.uri, found.base)
        return self.directory_indexes[found.uri]

    def as_before(self) -> bool:
        """Whether the listing is the run's index as it was: every file taken from it, in its order."""
        own = self.own
        return (
            own is not None
            and len(self.listing) == len(own.paths)
            and all(
                spec in self.unchanged and (start, count) == (self.unchanged[spec].start, self.unchanged[spec].count)
                for spec, (start, count) in zip(self.specs, self.placed, strict=True)
            )
        )

    def dropped(self) -> int:
        """Files of the run's index gone from the listing."""
        if self.own is None or self.as_before():
            return 0
        listed = set(self.listing.paths)
        return sum(1 for p in self.own.paths if p not in listed)


def index_dataset(
    specs: Sequence[str],
    key: str,
    columns: Columns,
    in_channels: int,
    cross_attention_dim: int,
    index_uri: str | None = None,
    page_size: int = LIST_PAGE_SIZE,
) -> IndexedDataset:
    """The files ``specs`` name, their rows and shapes checked against the model, from the index at
    ``index_uri`` (the run's) or one beside the data where it has them, else from the footers. Writes nothing:
    :func:`sdtrain.data.index_format.write_index` the result's ``index`` to ``index_uri`` when ``stale``."""
    listed = _list(specs, key, read_index(index_uri) if index_uri else None, columns, page_size)
    listing, own = listed.listing, listed.own
    rows, runs, to_read = _rows_of_unchanged_directories(listed)
    # The run's own index first (one GET); an index beside the data only for what it leaves unknown.
    to_read, reference = _rows_from_indexes(_candidates(listed), listing, rows, runs, to_read, key, columns)
    read_files = [listing.paths[i] for i in to_read]
    read_rows, checked, counts = _footers(read_files, to_read, key, columns, reference, rows, runs)
    if int(rows.sum()) == 0:
        raise DataError(f"{key}: the {len(listing)} parquet file(s) hold no rows (first: {listing.paths[0]})")

    # The first row: of the first file read with rows; on a first start from an index beside the data, of the first
    # file with rows. A restart that read no footer reads none.
    row_file = next((f for f, r in zip(read_files, read_rows, strict=True) if r), None)
    if not read_files and own is None:
        row_file = listing.paths[int(np.flatnonzero(rows)[0])]
    row, latent_shape, caption_shape = _shapes(
        key, checked, reference, row_file, counts, in_channels, cross_attention_dim
    )

    sealed = sealed_directories(specs, listed.parts, listed.placed, listing, listed.unchanged, listed.directory_index)
    as_before = listed.as_before()
    digest = own.content_digest if as_before and own is not None and own.content_digest else listing.content_digest()
    bucketed = _bucketed(key, checked, listing, runs)
    index = DatasetIndex(
        listing.paths, listing.sizes, listing.versions, rows, checked, latent_shape, caption_shape, sealed, digest
    )
    index.runs = [r for r in runs if r is not None] if bucketed is not None else None
    stats = IndexStats(
        files=len(listing),
        from_index=len(listing) - len(to_read),
        footers_read=len(to_read),
        dropped=listed.dropped(),
        rows_read=int(row is not None),
        source=None if reference is None else (index_uri if reference is own else "beside the data"),
        unlisted=sum(len(part) for spec, part in zip(specs, listed.parts, strict=True) if spec in listed.unchanged),
        largest_row_group=counts.largest_row_group,
        runs_across_groups=counts.runs_across_groups,
    )
    _report(key, listed, stats)
    spec = DatasetSpec(
        tuple(listing.paths), tuple(rows.tolist()), latent_shape, caption_shape, digest, checked.token_ids(key)
    )
    if bucketed is not None:
        spec = bucketed_spec(spec, checked, bucketed)
    return IndexedDataset(spec, stats, index, _stale(own, index, stats))


def _footers(
    files: list[str],
    positions: list[int],
    key: str,
    columns: Columns,
    reference: DatasetIndex | None,
    rows: np.ndarray,
    runs: list[bytes | None],
) -> tuple[list[int], CheckedSchema, FooterCounts]:
    """The footers of ``files`` (``positions`` of the listing) read into ``rows`` and ``runs``, checked against the
    reference index's schema and shapes (else the first's); returns their rows, the schema the data was checked
    with and what the footers counted."""
    read_runs: dict[int, list[tuple[int, int]]] = {}
    counts = recorded_counts(key, reference)
    read_rows, checked = read_footers_with_progress(
        files, key, columns, reference.checked if reference is not None else None, read_runs, counts
    )
    if checked is None:  # no file read and no index: nothing named (list_dataset refuses a spec matching none)
        raise DataError(f"{key}: names no parquet files; give a parquet file, directory, glob or list of them")
    rows[positions] = read_rows
    for k, file_runs in read_runs.items():
        runs[positions[k]] = pack_runs(file_runs)
    return read_rows, checked, counts


def recorded_counts(key: str, reference: DatasetIndex | None) -> FooterCounts:
    """What the rows of the footers read are held to: the shapes ``reference`` records (the files a restart reads,
    to the run's), else the first file's."""
    if reference is None:
        return FooterCounts()
    checked = reference.checked
    return FooterCounts(checked.row_shapes(key, reference.latent_shape, reference.caption_shape), checked.file)


def _shapes(
    key: str,
    checked: CheckedSchema,
    reference: DatasetIndex | None,
    row_file: str | None,
    counts: FooterCounts,
    in_channels: int,
    cross_attention_dim: int,
) -> tuple[pa.Table | None, tuple[int, int, int], tuple[int, ...]]:
    """The first row of ``row_file`` (None: none is read), and the data's latent and caption shapes, checked against
    the model and against the values per row the footers read count."""
    row = first_row(row_file, key, checked.row_columns(key)) if row_file is not None else None
    recorded = (reference.latent_shape, reference.caption_shape) if reference is not None else None
    latent_shape, caption_shape = check_shapes(
        key, checked, in_channels, cross_attention_dim, row, row_file or checked.file, recorded
    )
    # A file whose rows differ in length can still count a whole number a row: its first row tells it apart.
    shapes = checked.row_shapes(key, latent_shape, caption_shape)
    counts.check_against(key, shapes, checked.counted_columns(key), f"the first row of {row_file}")
    return row, latent_shape, caption_shape


def _bucketed(key: str, checked: CheckedSchema, listing: Listing, runs: list[bytes | None]) -> np.ndarray | None:
    """The runs of bucketed data (None for data of one shape); a DataError for a file whose runs no index or footer
    said (an index written before the data was bucketed: rewrite it)."""
    if checked.buckets is None:
        return None
    missing = next((i for i, r in enumerate(runs) if r is None), None)
    if missing is not None:
        raise DataError(
            f"{key}: {listing.paths[missing]} holds bucketed latents, but the index its rows came from records no "
            "bucket runs: run `python entrypoints/index.py` on its directory (or remove the run's dataset_index/)"
        )
    return runs_array([r for r in runs if r is not None])


def bucketed_spec(spec: DatasetSpec, checked: CheckedSchema, runs: np.ndarray) -> DatasetSpec:
    """``spec`` with its buckets and runs; its latent shape the bucket most rows are in."""
    buckets = checked.buckets
    assert buckets is not None
    rows = np.bincount(runs[:, 1], runs[:, 2], minlength=len(buckets))
    return dataclasses.replace(spec, latent_shape=buckets[int(np.argmax(rows))], bucket_shapes=buckets, runs=runs)


def _list(specs: Sequence[str], key: str, own: DatasetIndex | None, columns: Columns, page_size: int) -> _Listed:
    """Each spec's files: a stretch of the run's index for a directory unchanged since its directory index (if the
    run's index was checked with these columns; else its schema is no reference), else listed."""
    unchanged = {}
    if own is not None and own.checked.columns == columns:
        unchanged = unchanged_directories(own, specs)
    to_list = [spec for spec in specs if spec not in unchanged]
    # Listed LIST_THREADS at a time (a list of many files is a request each); the index's paths sorted once for all.
    fresh = iter(list_specs(to_list, key, page_size, own.paths if own is not None and to_list else None))
    parts = [files_of(own, unchanged[spec]) if own is not None and spec in unchanged else next(fresh) for spec in specs]
    if len(parts) == 1 and (specs[0] in unchanged or strictly_increasing(parts[0].paths)):
        listing, placed = parts[0], [(0, len(parts[0]))]  # held once, not copied (the index's order is sorted)
    else:
        listing, placed = merge_listings(parts)
    return _Listed(specs, own, unchanged, parts, placed, listing, {})


def _rows_of_unchanged_directories(listed: _Listed) -> tuple[np.ndarray, list[bytes | None], list[int]]:
    """Rows (and bucket runs) of every file, those of unchanged directories copied from the run's index (one stretch
    each, not matched file by file); and the positions whose rows are still unknown."""
    rows = np.zeros(len(listed.listing), np.int64)
    runs: list[bytes | None] = [None] * len(listed.listing)
    unknown = np.ones(len(listed.listing), bool)
    for spec, part, (start, count) in zip(listed.specs, listed.parts, listed.placed, strict=True):
        if spec in listed.unchanged and count == len(part):
            own = listed.own
            assert own is not None
            first = listed.unchanged[spec].start
            rows[start : start + count] = own.rows[first : first + count]
            if own.runs is not None:
                runs[start : start + count] = own.runs[first : first + count]
            unknown[start : start + count] = False
    return rows, runs, np.flatnonzero(unknown).tolist()


def _stale(own: DatasetIndex | None, index: DatasetIndex, stats: IndexStats) -> bool:
    """Whether the run's index must be written: none yet, footers read, files dropped, anything recorded changed."""
    return (
        own is None
        or stats.footers_read > 0
        or stats.dropped > 0
        or (own.latent_shape, own.caption_shape) != (index.latent_shape, index.caption_shape)
        or own.sealed != index.sealed
        or own.content_digest != index.content_digest
    )


def _report(key: str, listed: _Listed, stats: IndexStats) -> None:
    """The start's line on where the files came from, and the hint for big directories listed at every restart."""
    unchanged = listed.unchanged
    dropped_note = f", {stats.dropped} gone since the index" if stats.dropped else ""
    unlisted_note = (
        f"; {stats.unlisted} in {len(unchanged)} director{'y' if len(unchanged) == 1 else 'ies'} unchanged since "
        "their directory index, not listed"
        if unchanged
        else ""
    )
    log.info(
        f"{key}: {stats.files} files ({stats.from_index} from the index, {stats.footers_read} footers read"
        f"{dropped_note}{unlisted_note})"
    )
    for spec, part in zip(listed.specs, listed.parts, strict=True):
        if len(part) >= UNINDEXED_HINT_FILES and spec not in unchanged and not part.indexes and names_directory(spec):
            log.info(
                f"{key}: {spec} has no directory index, so every restart lists its {len(part)} files; "
                f"`python entrypoints/index.py {spec}` once makes restarts list nothing"
            )


def read_footers_with_progress(
    files: list[str],
    key: str,
    columns: Columns,
    reference: CheckedSchema | None,
    runs: dict[int, list[tuple[int, int]]] | None = None,
    counts: FooterCounts | None = None,
) -> tuple[list[int], CheckedSchema | None]:
    """:func:`sdtrain.data.inspection.read_footers`, with a progress line for 1000 files or more."""

    def progress(done: int, total: int) -> None:
        log.info(f"{key}: read {done}/{total} footers")

    return read_footers(files, key, columns, reference, progress if len(files) >= 1000 else None, runs, counts)


def _rows_from_indexes(
    candidates: Iterator[DatasetIndex],
    listing: Listing,
    rows: np.ndarray,
    runs: list[bytes | None],
    to_read: list[int],
    key: str,
    columns: Columns,
) -> tuple[list[int], DatasetIndex | None]:
    """Fill in ``rows`` of the files ``to_read`` that an index records at the size and version listed; return the
    files left to read and the reference: the first index checked with the data's columns (the run's own, else
    the first beside the data). An index some of whose files still stand records the schema they were checked
    with, so it is held to the reference as their footers would be (layouts, latent scaling, text encoder): a
    mixed dataset is refused, not trained with the reference's metadata."""
    reference: DatasetIndex | None = None
    for index in candidates:
        if index.checked.columns != columns:
            continue
        reference = reference or index
        if not to_read:
            break
        found, to_read = recorded_rows(index, listing, to_read)
        if found and index is not reference:
            check_same_layouts(key, index.checked.file, index.checked.schema, reference.checked)
        for i, num_rows, j in found:
            rows[i] = num_rows
            if index.runs is not None:
                runs[i] = index.runs[j]
        if not to_read:  # the next index beside the data is not read
            break
    return to_read, reference


def _candidates(listed: _Listed) -> Iterator[DatasetIndex]:
    if listed.own is not None:
        yield listed.own
    for found in listed.listing.indexes:  # read only when reached
        index = listed.directory_index(found)
        if index is not None:
            yield index
