"""Data specs (files, directories, globs; local or s3://) to a sorted list of parquet files."""

from __future__ import annotations

import fnmatch
import glob
import os

import pyarrow.fs as pafs

from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import uri_prefix

_GLOB_CHARS = "*?["


def resolve_parquet_files(specs: list[str], key: str) -> list[str]:
    """Every parquet file that ``specs`` names, in a stable order, with duplicates removed.

    Raises DataError naming ``key`` and the spec when a spec names nothing.
    """
    files: list[str] = []
    for spec in specs:
        found = _expand(spec)
        if not found:
            raise DataError(
                f"{key}: {spec} matches no parquet files; expected a .parquet file, a directory "
                "containing .parquet files, or a glob such as data/*.parquet"
            )
        files.extend(found)
    return list(dict.fromkeys(files))


def _expand(spec: str) -> list[str]:
    fs, path = filesystem_for(spec)
    prefix = uri_prefix(spec)
    if any(c in path for c in _GLOB_CHARS):
        if not prefix:
            return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        base = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(prefix + i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [spec]
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        return sorted(
            prefix + i.path
            for i in infos
            if i.type == pafs.FileType.File and i.path.endswith(".parquet") and not _hidden(i.path, path)
        )
    return []


def _hidden(path: str, root: str) -> bool:
    """Files under a '.' or '_' name (``_SUCCESS``, ``.tmp``) are writer by-products, not data."""
    return any(part.startswith((".", "_")) for part in path[len(root) :].split("/") if part)
