"""A parquet file's footer (its schema with the writer's metadata, its rows, and each row group's rows and value
counts), read without its data: the one reader of footers, for the data checks, the encoders a dataset records,
retraining's partitions, captions and the demo's layout."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import raise_if_unavailable


def read_footer(
    file: str, key: str, source: Callable[[str], tuple[pafs.FileSystem, str]] = filesystem_for
) -> pq.FileMetaData:
    """The footer of ``file``; a DataError naming ``key`` and the file if it is no parquet (or missing, or denied), a
    StorageUnavailable naming both if storage failed past its retries.

    Args:
        source: the file's filesystem and path (a shared one per bucket, where many footers are read).
    """
    fs, path = source(file)
    try:
        return pq.read_metadata(path, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise_if_unavailable(e, f"{key}: cannot read {file}")
        raise DataError(f"{key}: cannot read {file} as parquet: {e}") from None


def read_schema(file: str, key: str) -> pa.Schema:
    """The arrow schema of ``file``, with the metadata its writer recorded."""
    return read_footer(file, key).schema.to_arrow_schema()
