"""Turn the user's data specs (files, directories, globs) into a sorted list of parquet files."""

from __future__ import annotations

import datetime
import fnmatch
import glob
import os
import tempfile
from typing import Optional

import pyarrow.fs as pafs

from sdtrain.errors import DataError

_GLOB_CHARS = "*?["


def is_uri(path: str) -> bool:
    return "://" in path


def uri_for(filesystem: pafs.FileSystem, path: str) -> str:
    """The URI of ``path`` on ``filesystem`` (pyarrow and Ray hand back paths without a scheme)."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return path
    return f"{filesystem.type_name}://{path}"


def local_copy(uri: str) -> str:
    """A local directory holding the directory at ``uri``, downloaded once per process and URI."""
    if uri not in _LOCAL_COPIES:
        fs, path = filesystem_for(uri)
        local = tempfile.mkdtemp(prefix="sdtrain-")
        pafs.copy_files(path, local, source_filesystem=fs)
        _LOCAL_COPIES[uri] = local
    return _LOCAL_COPIES[uri]


_LOCAL_COPIES: dict[str, str] = {}


def uri_prefix(path: str) -> str:
    """``s3://`` for ``s3://bucket/key``; empty for a local path (pyarrow paths drop the scheme)."""
    return path[: path.index("://") + 3] if is_uri(path) else ""


def absolute(path: str) -> str:
    """Local paths become absolute (Ray workers do not share the driver's cwd); URIs are kept."""
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


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


def filesystem_for(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds ``path``, and the path within it."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def set_aside(path: str) -> Optional[str]:
    """Rename the directory at ``path`` (local or URI) to ``<path>.replaced-<UTC time>``; return
    the new location, or None if nothing is there. Object stores have no rename: copy, then delete."""
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.NotFound:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = f"{fs_path.rstrip('/')}.replaced-{stamp}"
    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(fs_path, target)
    else:
        pafs.copy_files(fs_path, target, source_filesystem=fs, destination_filesystem=fs)
        fs.delete_dir(fs_path)
    return uri_prefix(path) + target
