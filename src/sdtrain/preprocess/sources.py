"""The inputs as shards: img2dataset-style parquet, WebDataset tars, or a folder of images with a
captions file. Each shard becomes one output file, so a shard is also the unit of resuming.

A shard's identity is its source, never its file name alone: its name holds a digest of the input file's (or
folder's) path, so two inputs with the same file names (img2dataset's 00000.parquet of two days) never share an
output name, and its ``identity`` (recorded in its _shards/<name>.json) holds the file's size and version (ETag
or modification time) and its rows, or for a folder the image keys it holds. A folder is cut by key content:
keys a done shard of the folder holds are never cut again, and the others are cut into new shards named by a
digest of their keys, so an image added later never moves a row of a done shard.

A source has one spelling in shard names and records (:func:`canonical_source`): a folder named with a trailing '/',
'./' or as a file:// URI is the same input, its done shards found. A captions file's names that leave the folder (an
absolute path, '..' above it, a URI) are never opened: their rows are skipped and counted (``OUTSIDE_FOLDER``).

Listing runs on the driver and checks what it can before any worker starts (a missing column, a column of a type
that holds no image bytes or captions, an unreadable captions file); reading a shard runs in Ray Data tasks and never
raises on bad rows.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import posixpath
import re
import tarfile
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.fs as pafs

from sdtrain.data.listing import list_dataset
from sdtrain.errors import ConfigError, DataError
from sdtrain.logs import log
from sdtrain.preprocess.config import InputConfig
from sdtrain.preprocess.parquet_rows import parquet_values
from sdtrain.preprocess.planning import image_bytes, parquet_row_counts, row_ranges
from sdtrain.storage.filesystems import filesystem_for, read_text
from sdtrain.storage.uris import is_uri, split_s3, uri_prefix

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
OUTSIDE_FOLDER = "file_outside_folder"
TAR_BUFFER = 16 << 20
"""Bytes a WebDataset tar is read in: a request each on object storage (see _tar_rows)."""
"""The skip reason of a folder row whose file name leaves the folder."""


@dataclass(frozen=True)
class Shard:
    """Rows ``start``..``stop`` of one input (a tar is read whole); ``name`` is its output file's stem."""

    name: str
    source: str
    start: int = 0
    stop: int = -1
    rows: tuple[tuple[str, str | None], ...] = ()
    """folder: (image file, caption or None) of each row."""
    identity: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """What the shard was made from, recorded with it: {path, size, version, rows} of a parquet file's rows,
    {path, size, version} of a tar, {path, keys} of a folder's shard."""


@dataclass
class Row:
    key: str
    image: bytes | None
    caption: object
    skip: str | None = None
    """Why the row is skipped without reading its image (OUTSIDE_FOLDER), else None."""


def list_shards(config: InputConfig, done: Mapping[str, Mapping[str, Any]] | None = None) -> list[Shard]:
    """Every shard of the input, in a stable order; ConfigError/DataError naming the path if it is unusable.

    Args:
        config: the input section.
        done: the records (_shards/<name>.json) of the shards the output holds, by name: a folder's done shards
            are listed as they were cut (their keys are not cut again); a parquet file whose shards are all done
            is not opened (its rows from the records). Files' shards are the same with or without them.
    """
    done = done or {}
    paths = [canonical_source(path) for path in config.paths]
    if config.format == "folder":
        shards = _folder_shards(config, paths[0], done)
    else:
        files = _parquet_shards(config, paths, done) if config.format == "parquet" else _tar_shards(paths)
        shards = _recorded_names(files, done)
    unique: dict[str, Shard] = {}
    for shard in shards:  # a file named twice (a directory and a file in it) is one input
        if unique.setdefault(shard.name, shard).identity != shard.identity:
            raise ConfigError(
                f"input.paths: {unique[shard.name].source} and {shard.source} would both write {shard.name}.parquet; "
                "preprocess them into different output.path directories"
            )
    return list(unique.values())


def source_digest(path: str) -> str:
    """A digest of an input's path or URI (10 hex): part of its shards' names, so inputs never share one."""
    return hashlib.sha256(path.rstrip("/").encode()).hexdigest()[:10]


def canonical_source(path: str) -> str:
    """The one spelling of an input's path or URI that its shards' names and records hold: the file or directory it
    reads. A local path or a file:// URI is the absolute, normalized local path ('./', '//', a trailing '/' and
    %-escapes resolved); s3://bucket/prefix/ is s3://bucket/prefix (S3 keys are literal: 'a/./b' is another key,
    kept); another store's URI loses its trailing '/'."""
    if path.startswith("s3://"):
        bucket, key = split_s3(path)
        return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if path.startswith("file://") and urllib.parse.urlsplit(path).netloc == "":
        path = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
    elif is_uri(path):
        return path.rstrip("/")
    return re.sub("^/+", "/", os.path.normpath(os.path.abspath(os.path.expanduser(path))))  # POSIX keeps '//x'


def shard_prefix(config: InputConfig) -> str | None:
    """What every shard name of a folder input starts with; None for files, whose shards a re-run names the same."""
    if config.format != "folder":
        return None
    folder = canonical_source(config.paths[0])
    return f"{_stem(folder)}-{source_digest(folder)}-"


def changed_source(shard: Shard, record: Mapping[str, Any]) -> str | None:
    """Why a done shard's record does not match the shard as listed now (None if it does): the file was rewritten
    (size or version), or its rows are others."""
    recorded = record.get("identity")
    if recorded and _canonical(recorded) == _canonical(shard.identity):
        return None
    return (
        f"shard {shard.name} was made from {_describe(recorded)}, the input now is {_describe(shard.identity)}"
        if recorded
        else f"shard {shard.name} records no source (written by an earlier sdtrain)"
    )


def _canonical(identity: Mapping[str, Any]) -> dict[str, Any]:
    """``identity`` with its path in one spelling (a record written before sources had one holds another)."""
    return {**identity, "path": canonical_source(identity["path"])} if "path" in identity else dict(identity)


def _recorded_names(shards: list[Shard], done: Mapping[str, Mapping[str, Any]]) -> list[Shard]:
    """Files' shards under the names of the done shards of the same file and rows recorded with another spelling of
    its path (file:///x for /x, before sources had one): found done, not written again under a new name."""
    recorded = {}
    for name, record in done.items():
        identity = record.get("identity") or {}
        if "path" in identity and "keys" not in identity:
            recorded[canonical_source(identity["path"]), str(identity.get("rows"))] = name
    return [
        shard
        if shard.name in done
        else replace(shard, name=recorded.get((shard.identity["path"], str(shard.identity.get("rows"))), shard.name))
        for shard in shards
    ]


def _describe(identity: Mapping[str, Any] | None) -> str:
    if not identity:
        return "an unrecorded source"
    text = f"{identity.get('path')} (size {identity.get('size')}, version {identity.get('version')!r}"
    if "rows" in identity:
        text += f", rows {identity['rows'][0]}..{identity['rows'][1]}"
    return text + ")"


def read_shard(shard: Shard, config: InputConfig) -> Iterator[Row]:
    """The rows of ``shard``. A file that cannot be opened raises OSError (the job counts the shard as unreadable)."""
    if config.format == "parquet":
        yield from _parquet_rows(shard, config)
    elif config.format == "webdataset":
        yield from _tar_rows(shard, config)
    else:
        yield from _folder_rows(shard)


def _stem(path: str) -> str:
    return posixpath.basename(path.rstrip("/")).split(".")[0] or "shard"


def _expand(paths: list[str], suffixes: tuple[str, ...], key: str) -> list[tuple[str, int, str]]:
    """(file, size, version = modification time in ns) of every file with one of ``suffixes`` the paths name."""
    found: list[tuple[str, int, str]] = []
    for spec in paths:
        fs, path = filesystem_for(spec)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            found.append((spec, info.size, str(info.mtime_ns)))
        elif info.type == pafs.FileType.Directory:
            prefix = uri_prefix(spec)
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            found += sorted(
                (prefix + i.path, i.size, str(i.mtime_ns))
                for i in infos
                if i.type == pafs.FileType.File and i.path.lower().endswith(suffixes)
            )
        else:
            raise DataError(f"{key}: {spec} does not exist")
    if not found:
        raise DataError(f"{key}: {', '.join(paths)} holds no {' or '.join(suffixes)} files")
    return found


def _tar_shards(paths: list[str]) -> list[Shard]:
    return [
        Shard(f"{_stem(tar)}-{source_digest(tar)}", tar, identity={"path": tar, "size": size, "version": version})
        for tar, size, version in _expand(paths, (".tar",), "input.paths")
    ]


def _parquet_shards(config: InputConfig, paths: list[str], done: Mapping[str, Mapping[str, Any]]) -> list[Shard]:
    """Each file's shards: its rows from its footer (its columns' types checked), read PLANNING_READS at a time, or
    from the records of a file whose shards are all done (sdtrain.preprocess.planning)."""
    listing = list_dataset(paths, "input.paths")  # sizes and versions (ETag or mtime) with the files
    counts = parquet_row_counts(listing.paths, listing.sizes, listing.versions, config, done)
    return [
        Shard(
            f"{_stem(file)}-{source_digest(file)}-{start:08d}",
            file,
            start,
            stop,
            identity={"path": file, "size": size, "version": version, "rows": [start, stop]},
        )
        for file, size, version, rows in zip(listing.paths, listing.sizes, listing.versions, counts, strict=True)
        for start, stop in row_ranges(rows, config.rows_per_shard)
    ]


def _parquet_rows(shard: Shard, config: InputConfig) -> Iterator[Row]:
    # Streamed a batch at a time (sdtrain.preprocess.parquet_rows): a shard's groups read whole, and copied to
    # Python, held ~2.7x its image bytes; one large group, all of it in each of its shards' tasks.
    columns = [config.image_column, config.caption_column]
    for number, image, caption in parquet_values(shard.source, shard.start, shard.stop, columns):
        yield Row(f"{shard.source}:{number}", image_bytes(image), caption)


def _tar_rows(shard: Shard, config: InputConfig) -> Iterator[Row]:
    fs, path = filesystem_for(shard.source)
    key: str | None = None
    parts: dict[str, bytes] = {}
    # Buffered: tarfile's stream mode reads 10 KiB at a time, and each read of pyarrow's unbuffered S3 stream is a
    # ranged GET of its own (a 500 MB tar took ~50,000 requests, each a round trip); TAR_BUFFER makes it one GET
    # per 16 MiB, for 16 MiB of memory per reading task.
    with (
        fs.open_input_stream(path, buffer_size=TAR_BUFFER) as stream,
        tarfile.open(fileobj=stream, mode="r|*") as tar,
    ):
        for member in tar:  # streamed: img2dataset writes a sample's files next to each other
            if not member.isfile():
                continue
            directory, base = posixpath.split(member.name)
            stem, _, ext = base.partition(".")
            if stem.startswith("."):
                continue
            member_key = posixpath.join(directory, stem)
            if member_key != key:
                if key is not None:
                    yield _tar_row(key, parts, config)
                key, parts = member_key, {}
            handle = tar.extractfile(member)
            parts["." + ext.lower()] = handle.read() if handle is not None else b""
    if key is not None:
        yield _tar_row(key, parts, config)


def _tar_row(key: str, parts: dict[str, bytes], config: InputConfig) -> Row:
    image = next((parts[ext] for ext in IMAGE_EXTENSIONS if ext in parts), None)
    caption: object = None
    if ".txt" in parts:
        caption = parts[".txt"].decode("utf-8", errors="replace")
    elif ".json" in parts:
        try:
            caption = json.loads(parts[".json"]).get(config.caption_column)
        except (ValueError, AttributeError):
            caption = None
    return Row(key, image, caption)


def _folder_shards(config: InputConfig, folder: str, done: Mapping[str, Mapping[str, Any]]) -> list[Shard]:
    fs, root = filesystem_for(folder)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise DataError(f"input.paths: {folder} is not a directory (format folder reads a directory of images)")
    captions_file = config.captions_file or posixpath.join(folder, "captions.jsonl")
    captions = _read_captions_file(captions_file, config)
    outside = [name for name in captions if outside_folder(name)]
    if outside:
        named = ", ".join(map(repr, outside[:3])) + (", ..." if len(outside) > 3 else "")
        log.info(
            f"input.captions_file: {captions_file}: {len(outside)} file names leave the folder ({named}): "
            f"never read, skipped as {OUTSIDE_FOLDER}"
        )
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    images = sorted(
        os.path.relpath(i.path, root) if not uri_prefix(folder) else i.path[len(root) :].lstrip("/")
        for i in infos
        if i.type == pafs.FileType.File and i.path.lower().endswith(IMAGE_EXTENSIONS)
    )
    # Every image and every caption entry is a row: an image without a caption, or a caption whose image is
    # absent, is skipped and counted rather than silently dropped.
    names = images + sorted(set(captions) - set(images))
    if not names:
        raise DataError(
            f"input.paths: {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)}) and {captions_file} none"
        )
    # The folder's done shards as they were cut (recorded with whatever spelling of its path); the keys none of them
    # holds, cut anew in key order.
    stem = f"{_stem(folder)}-{source_digest(folder)}"
    shards = [
        Shard(name, folder, identity=dict(record["identity"]))
        for name, record in sorted(done.items())
        if "keys" in (record.get("identity") or {}) and canonical_source(record["identity"]["path"]) == folder
    ]
    taken = {key for shard in shards for key in shard.identity["keys"]}
    rows = [(name, captions.get(name)) for name in names if name not in taken]
    for a, b in row_ranges(len(rows), config.rows_per_shard):
        keys = [name for name, _ in rows[a:b]]
        digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:12]
        shards.append(Shard(f"{stem}-{digest}", folder, rows=tuple(rows[a:b]), identity={"path": folder, "keys": keys}))
    return shards


def _read_captions_file(path: str, config: InputConfig) -> dict[str, str | None]:
    text = read_text(path, "input.captions_file")
    if path.endswith(".csv"):
        records = list(csv.DictReader(io.StringIO(text)))
    else:
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"input.captions_file: {path} line {number} is not JSON: {e}") from None
            if not isinstance(record, dict):
                raise DataError(f"input.captions_file: {path} line {number} is not a JSON object")
            records.append(record)
    captions: dict[str, str | None] = {}
    for number, record in enumerate(records, 1):
        if config.file_column not in record:
            raise DataError(
                f"input.file_column: record {number} of {path} has no field {config.file_column!r}; its fields are "
                f"{', '.join(map(str, record))}"
            )
        caption = record.get(config.caption_column)
        name = str(record[config.file_column])
        name = name if outside_folder(name) else posixpath.normpath(name)  # named as written in what is skipped
        captions[name] = caption if isinstance(caption, str) else None
    return captions


def outside_folder(name: str) -> bool:
    """Whether a file name of a folder input leaves the folder: an absolute path, a URI, or '..' above the folder.
    Joined to the folder and read, it would encode any file the job can read (on S3, any prefix of any bucket its
    credentials reach) into the output."""
    normal = posixpath.normpath(name)
    return is_uri(name) or name.startswith("/") or normal == ".." or normal.startswith("../")


def _folder_rows(shard: Shard) -> Iterator[Row]:
    fs, root = filesystem_for(shard.source)
    for name, caption in shard.rows:
        if outside_folder(name):  # checked where it is read too: a listed S3 key may hold '..'
            yield Row(name, None, caption, OUTSIDE_FOLDER)
            continue
        try:
            with fs.open_input_stream(posixpath.join(root, name)) as f:
                image: bytes | None = f.read()
        except (OSError, FileNotFoundError):
            image = None
        yield Row(name, image, caption)
