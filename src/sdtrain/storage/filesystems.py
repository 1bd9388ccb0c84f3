"""Any path or URI to the pyarrow filesystem that holds it, and the operations on whole
directories that work the same on local disk and on object storage."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow.fs as pafs

from sdtrain.errors import DataError
from sdtrain.storage.s3 import (
    SINGLE_COPY_MAX,
    S3Settings,
    copy_object,
    large_object_transfer,
    move_prefix,
    resolved_s3_settings,
    s3_client,
    s3_filesystem,
)
from sdtrain.storage.uris import absolute, is_uri, split_s3, uri_prefix


def filesystem_for(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds ``path``, and the path within it."""
    if path.startswith("s3://"):
        # Not from_uri: it reads '?' (a glob character here) as the start of URI options, and
        # would not apply our endpoint and retries.
        bucket, key = split_s3(path)
        return s3_filesystem(bucket), f"{bucket}/{key}" if key else bucket
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def filesystems_for(paths: Sequence[str]) -> list[tuple[pafs.FileSystem, str]]:
    """``filesystem_for`` of each path, with one filesystem per S3 bucket (many files, few buckets)."""
    buckets: dict[str, pafs.FileSystem] = {}
    out = []
    for path in paths:
        if not path.startswith("s3://"):
            out.append(filesystem_for(path))
            continue
        bucket, key = split_s3(path)
        if bucket not in buckets:
            buckets[bucket] = s3_filesystem(bucket)
        out.append((buckets[bucket], f"{bucket}/{key}"))
    return out


def uri_for(filesystem: pafs.FileSystem, path: str) -> str:
    """The URI of ``path`` on ``filesystem`` (pyarrow and Ray hand back paths without a scheme)."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return path
    return f"{filesystem.type_name}://{path}"


def ray_storage(path: str) -> tuple[pafs.FileSystem | None, str]:
    """(storage_filesystem, storage path) to hand Ray Train for ``path``: for a URI our own
    filesystem (endpoint and retries travel with it to the controller and workers) and the path
    within it; for a local path (None, its absolute path: Ray refuses relative ones), Ray's default."""
    if not is_uri(path):
        return None, absolute(path)
    return filesystem_for(path)


def local_copy(uri: str) -> str:
    """A local directory holding the directory at ``uri``, downloaded once per process and URI."""
    if uri not in _LOCAL_COPIES:
        fs, path = filesystem_for(uri)
        local = tempfile.mkdtemp(prefix="sdtrain-")
        pafs.copy_files(path, local, source_filesystem=fs)
        _LOCAL_COPIES[uri] = local
    return _LOCAL_COPIES[uri]


_LOCAL_COPIES: dict[str, str] = {}


def set_aside(path: str) -> str | None:
    """Rename the directory at ``path`` (local or URI) to ``<path>.replaced-<UTC time>``; return
    the new location, or None if nothing is there. Object stores have no rename: copy, then delete (on S3 copies
    that S3 makes, sdtrain.storage.s3.move_prefix)."""
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.NotFound:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = f"{fs_path.rstrip('/')}.replaced-{stamp}"
    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(fs_path, target)
    elif isinstance(fs, pafs.S3FileSystem):
        bucket, key = fs_path.rstrip("/").split("/", 1)
        move_prefix(bucket, key, target.split("/", 1)[1])  # pyarrow's directory markers too: keys under key/
    else:
        pafs.copy_files(fs_path, target, source_filesystem=fs, destination_filesystem=fs)
        fs.delete_dir(fs_path)
    return uri_prefix(path) + target


def read_text(uri: str, key: str) -> str:
    """The whole of a UTF-8 text file (with or without a byte-order mark), local or on object storage.

    Args:
        uri: a local path or a storage URI.
        key: the setting or flag that named the file: a file that cannot be read or decoded is a DataError that
            starts with it (``input.captions_file: cannot read <uri>: <why>``).
    """
    fs, path = filesystem_for(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode("utf-8-sig")  # a leading byte-order mark (Excel's UTF-8 CSV) dropped
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{key}: cannot read {uri}: {e}") from None


def read_bytes(uri: str) -> bytes | None:
    """The whole file at ``uri`` (local or through pyarrow's filesystems), or None if there is none."""
    fs, path = filesystem_for(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        raise


def write_bytes(uri: str, data: bytes) -> None:
    """The whole file at once: locally a temporary name then an atomic rename (S3 has no rename); on S3 a single
    PutObject, which leaves no object, nor an unfinished multipart upload, if the job dies during it."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        _client().put_object(Bucket=bucket, Key=key, Body=data)
        return
    fs, path = filesystem_for(uri)
    if is_uri(uri):  # another object store: its output stream makes the object visible only when closed
        with fs.open_output_stream(path, compression=None) as f:  # the bytes as given, a .gz name not compressed
            f.write(data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def move_file(source: str, target: str) -> None:
    """A file to another name in the same store: locally an atomic rename; on S3, which has no rename, a
    server-side CopyObject then a DeleteObject (pyarrow's move would leave a '<prefix>/' marker object)."""
    if source.startswith("s3://"):
        (bucket, key), (target_bucket, target_key) = split_s3(source), split_s3(target)
        _client().copy_object(Bucket=target_bucket, Key=target_key, CopySource={"Bucket": bucket, "Key": key})
        _client().delete_object(Bucket=bucket, Key=key)
        return
    fs, path = filesystem_for(source)
    fs.move(path, filesystem_for(target)[1])


def copy_file(source: str, target: str, size: int | None = None, single_request_max: int = SINGLE_COPY_MAX) -> None:
    """One file to another name, whole and at once (a reader never finds it half written): between S3 objects copies
    S3 makes itself (one CopyObject up to ``single_request_max``, parts over it: one CopyObject is refused over 5 GiB;
    a HeadObject first where ``size``, the source's bytes as listed, is not given), between local files a copy to a
    temporary name then a rename, else read then written (write_bytes)."""
    if source.startswith("s3://") and target.startswith("s3://"):
        copy_object(_client(), split_s3(source), split_s3(target), size, single_request_max)
        return
    if not is_uri(source) and not is_uri(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        temporary = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(source, temporary)
        os.replace(temporary, target)
        return
    fs, path = filesystem_for(source)
    with fs.open_input_stream(path, compression=None) as f:  # a .gz as it is, not inflated by its name
        data = f.read()
    write_bytes(target, data)


def put_file(local: str, uri: str, single_request_max: int = SINGLE_COPY_MAX) -> None:
    """A local file to ``uri`` whole and at once, read from disk as it is sent (not held in memory): on S3 one
    PutObject up to ``single_request_max`` and a multipart upload over it (one PutObject is refused over 5 GiB; either
    leaves no object if the sender dies during it), between local files a copy to a temporary name then a rename,
    elsewhere pyarrow's output stream (the object is visible when it is closed)."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        _client().upload_file(local, bucket, key, Config=large_object_transfer(single_request_max))
        return
    if not is_uri(uri):
        copy_file(local, uri)
        return
    fs, path = filesystem_for(uri)
    with open(local, "rb") as f, fs.open_output_stream(path, compression=None) as out:
        shutil.copyfileobj(f, out, 16 << 20)


def delete_file(uri: str) -> None:
    """Delete one file, if it is there (on S3 one DeleteObject: pyarrow's would put a '<prefix>/' marker)."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        _client().delete_object(Bucket=bucket, Key=key)
        return
    fs, path = filesystem_for(uri)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def _client() -> Any:
    """One boto3 client per S3 settings (making one costs ~0.2 s: two a shard would add up). Its credentials
    refresh themselves where they expire (an instance role)."""
    settings = resolved_s3_settings()
    if settings not in _CLIENTS:
        _CLIENTS[settings] = s3_client()
    return _CLIENTS[settings]


_CLIENTS: dict[S3Settings, Any] = {}
