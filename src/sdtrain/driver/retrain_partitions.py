"""Retraining's new data: the complete ``date=YYYY-MM-DD`` partitions under ``retrain.data_root`` and, among those
production has not seen, the ones that hold rows and that training's data check accepts."""

from __future__ import annotations

import datetime
import posixpath
import re
from collections.abc import Collection, Mapping, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.config.schema import Config
from sdtrain.data.index_format import run_index_uri, write_index
from sdtrain.data.listing import list_dataset
from sdtrain.driver.data_check import dataset_spec, indexed_dataset
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import absolute, uri_prefix

_PARTITION = re.compile(r"date=(\d{4}-\d{2}-\d{2})")


def find_partitions(
    data_root: str, up_to: datetime.date, complete_marker: str | None = "_SUCCESS", seen: Collection[str] = ()
) -> dict[str, str]:
    """{date: path} of the complete ``date=YYYY-MM-DD`` partitions under ``data_root`` up to ``up_to``,
    in date order. With ``complete_marker``, a partition is complete once it holds that file (its
    writer's last act); without, only dates before ``up_to`` count (``up_to``'s may still be filling). A date in
    ``seen`` (production's ``partitions_seen``) was complete when a run took it: its marker is not asked again, so
    that a run makes one request per new partition, not one per day of the years behind it."""
    fs, root = filesystem_for(absolute(data_root))
    seen = set(seen)
    found = {}
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        match = _PARTITION.fullmatch(info.base_name)
        if info.type != pafs.FileType.Directory or not match:
            continue
        date = match.group(1)
        if complete_marker is None:
            complete = date < up_to.isoformat()
        else:
            complete = date <= up_to.isoformat() and (
                date in seen or _is_file(fs, posixpath.join(info.path, complete_marker))
            )
        if complete:
            found[date] = uri_prefix(data_root) + info.path
    if not found:
        which = f"holding {complete_marker}" if complete_marker else "before it"
        raise DataError(
            f"retrain.data_root: {data_root} holds no complete date=YYYY-MM-DD partitions up to {up_to} ({which})"
        )
    return dict(sorted(found.items()))


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def new_partitions(partitions: dict[str, str], seen: list[str]) -> tuple[list[str], list[str]]:
    """(dates to train on, dates to pass over as empty) among ``partitions`` not in ``seen``: empty is no parquet
    file, or parquet files that hold no rows (Spark writes a schema-only part file for a day without rows)."""
    new: list[str] = []
    empty: list[str] = []
    for date in partitions:
        if date in seen:
            continue
        try:
            listing = list_dataset([partitions[date]], "retrain.data_root")
        except DataError:  # complete, and no parquet file in it
            empty.append(date)
            continue
        (new if _holds_rows(listing.paths, listing.sizes) else empty).append(date)
    return new, empty


def _holds_rows(files: list[str], sizes: Sequence[int]) -> bool:
    """Whether any of ``files`` holds a row, by their footers, largest file first: a partition with data answers with
    one footer, however many files it has (training's start reads them all anyway); only a day without rows, whose
    files are schema-only and small, has each read. A footer that cannot be read counts as rows:
    :func:`usable_partitions` then names the file and leaves the partition out."""
    for i in sorted(range(len(files)), key=lambda i: -sizes[i]):
        fs, path = filesystem_for(files[i])
        try:
            if pq.read_metadata(path, filesystem=fs).num_rows > 0:
                return True
        except (OSError, pa.ArrowException):
            return True
    return False


def usable_partitions(
    config: Config, unet: Mapping, partitions: dict[str, str], dates: list[str], run_dir: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the dates among ``dates`` whose files training's data check accepts, {date: why} of the others), before Ray
    starts, by the check training starts with (:func:`sdtrain.driver.data_check.indexed_dataset`: every footer
    readable, the columns and shapes ``unet``, the run's UNet config, takes).

    All of ``dates`` are checked together first, as data.train of the training run at ``run_dir`` (the run that
    trains on all of them), and the dataset index that check builds is written there: that run's own check then
    reads the index, not every footer a second time. Only if that fails is each partition checked on its own.

    One corrupt file (a truncated upload) used to fail training's data check at every run, and every retry of it, so
    that no later day was trained either. A partition left out is not marked seen: a later run checks it again, and
    takes it once its files are fixed. Storage failing for now (StorageUnavailable) is raised, not taken for a bad
    partition."""
    if run_dir is not None and _usable_together(config, unet, [partitions[d] for d in dates], run_dir):
        return list(dates), {}
    usable: list[str] = []
    left_out: dict[str, str] = {}
    for date in dates:
        try:
            dataset_spec(config, "retrain.data_root", [partitions[date]], unet)
        except DataError as error:
            left_out[date] = str(error)
            log.warning(
                f"retrain.data_root: left partition {date} ({partitions[date]}) out of this run: {error}. It is not "
                "marked seen: a later run checks it again, and trains on it once its files are fixed"
            )
            continue
        usable.append(date)
    return usable, left_out


def _usable_together(config: Config, unet: Mapping, files: list[str], run_dir: str) -> bool:
    """Whether training's data check accepts ``files`` as data.train of the run at ``run_dir``; if so, the run's
    dataset index is written there as that run's own check would write it. Not with run.start_fresh, which moves
    the run's directory aside before its check (a directory holding only this index would be reported moved)."""
    if config.run.start_fresh:
        return False
    try:
        indexed = indexed_dataset(config, "data.train", files, unet, run_dir)
    except DataError as error:
        log.info(
            f"retrain.data_root: the new partitions together fail training's data check ({error}); each is "
            "checked on its own"
        )
        return False
    if indexed.stale:
        write_index(run_index_uri(run_dir, "data.train"), indexed.index)
    return True


def described_left_out(left_out: dict[str, str]) -> str:
    return f"left out {len(left_out)} partition(s) whose files training cannot read: " + "; ".join(
        f"{date}: {why}" for date, why in left_out.items()
    )
