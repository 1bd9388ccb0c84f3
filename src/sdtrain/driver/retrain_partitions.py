"""Retraining's new data: the complete ``date=YYYY-MM-DD`` partitions under ``retrain.data_root`` and, among those
production has not seen, the ones that hold rows."""

from __future__ import annotations

import datetime
import posixpath
import re
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.data.listing import list_dataset
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import absolute, uri_prefix

_PARTITION = re.compile(r"date=(\d{4}-\d{2}-\d{2})")


def find_partitions(data_root: str, up_to: datetime.date, complete_marker: str | None = "_SUCCESS") -> dict[str, str]:
    """{date: path} of the complete ``date=YYYY-MM-DD`` partitions under ``data_root`` up to ``up_to``,
    in date order. With ``complete_marker``, a partition is complete once it holds that file (its
    writer's last act); without, only dates before ``up_to`` count (``up_to``'s may still be filling)."""
    fs, root = filesystem_for(absolute(data_root))
    found = {}
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        match = _PARTITION.fullmatch(info.base_name)
        if info.type != pafs.FileType.Directory or not match:
            continue
        date = match.group(1)
        if complete_marker is None:
            complete = date < up_to.isoformat()
        else:
            complete = date <= up_to.isoformat() and _is_file(fs, posixpath.join(info.path, complete_marker))
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
    files are schema-only and small, has each read. A footer that cannot be read counts as rows: training's data
    check then names the file."""
    for i in sorted(range(len(files)), key=lambda i: -sizes[i]):
        fs, path = filesystem_for(files[i])
        try:
            if pq.read_metadata(path, filesystem=fs).num_rows > 0:
                return True
        except (OSError, pa.ArrowException):
            return True
    return False
