"""Listing a data spec's files: what :mod:`sdtrain.data.dataset_index` starts from.

- **Listing** (:func:`list_dataset`): the files a data spec names (files, directories of .parquet with '_'/'.'
  hidden parts skipped, globs; duplicates removed; each spec's files sorted), streamed page by page (S3:
  ``list_objects_v2``; local: an ``os.scandir`` walk) with each file's size and version (the S3 ETag, or the
  local ``st_mtime_ns``), held once as parallel lists.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow.fs as pafs

from sdtrain.data.file_lists import files_in_listed_folders
from sdtrain.data.known_keys import KnownKeys, split_keys
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import is_transient, raise_if_unavailable
from sdtrain.storage.uris import split_s3, uri_prefix

DIRECTORY_INDEX = "_sdtrain_index.parquet"  # '_': outside the parquet listing
_GLOB_CHARS = "*?["
LIST_PAGE_SIZE = 1000  # S3's largest page


class FoundIndex(NamedTuple):
    """A directory index found beside the data, with the object's own size and version when it was listed."""

    uri: str
    base: str
    """The directory its relative paths are under."""
    size: int
    version: str


@dataclass
class Listing:
    """Files with their sizes and versions, as parallel lists (one entry a file, held once)."""

    paths: list[str] = field(default_factory=list)
    sizes: array = field(default_factory=lambda: array("q"))
    versions: list[str] = field(default_factory=list)
    indexes: list[FoundIndex] = field(default_factory=list)
    """Directory indexes found beside the data."""

    def __len__(self) -> int:
        return len(self.paths)

    def add(self, path: str, size: int, version: str) -> None:
        self.paths.append(path)
        self.sizes.append(size)
        self.versions.append(version)

    def content_digest(self) -> str:
        return content_digest(self.paths, self.sizes, self.versions)


def content_digest(paths: Sequence[str], sizes: Sequence[int], versions: Sequence[str]) -> str:
    """sha256 (first 16 hex) of each file's (path, size, version), in file order."""
    digest = hashlib.sha256()
    for path, size, version in zip(paths, sizes, versions, strict=True):
        digest.update(f"{path}\t{size}\t{version}\n".encode())
    return digest.hexdigest()[:16]


def list_dataset(
    specs: Sequence[str], key: str, page_size: int = LIST_PAGE_SIZE, known: Sequence[str] | None = None
) -> Listing:
    """Every parquet file ``specs`` names, with size and version, in a stable order, duplicates removed.

    ``known``: paths listed before (a previous index of the run): on S3 their keys split the key space into ranges
    that are listed concurrently (:func:`_s3_objects_in_ranges`); the result is the same without them.
    Raises DataError naming ``key`` and the spec when a spec names nothing.
    """
    parts = list_specs(specs, key, page_size, known)
    if len(parts) == 1 and strictly_increasing(parts[0].paths):
        return parts[0]  # an S3 listing comes sorted: held once, not copied
    return merge_listings(parts)[0]


def list_specs(
    specs: Sequence[str], key: str, page_size: int = LIST_PAGE_SIZE, known: Sequence[str] | KnownKeys | None = None
) -> list[Listing]:
    """:func:`list_spec` of each of ``specs``, in their order, LIST_THREADS at a time: a list of many files costs a
    request each (S3: a HEAD), which one after another cost hours at 1e5 files. The first failure is raised."""
    known = KnownKeys.of(known)
    if len(specs) <= 1:
        return [list_spec(spec, key, page_size, known) for spec in specs]
    from concurrent.futures import ThreadPoolExecutor

    def folder(bucket: str, prefix: str, after: str, through: str) -> Iterator[S3Object]:
        return s3_objects(listing_client(), bucket, prefix, page_size, after, through)

    listed: dict[str, Listing] = {}  # many S3 files of one folder: found with its listing (sdtrain.data.file_lists)
    s3_files = [s for s in specs if s.startswith("s3://") and not s.endswith("/") and not _has_glob(s)]
    for uri, (size, version) in files_in_listed_folders(s3_files, folder, key).items():
        listed[uri] = Listing()
        listed[uri].add(uri, size, version)
    with ThreadPoolExecutor(min(LIST_THREADS, len(specs)), thread_name_prefix="sdtrain-specs") as pool:
        futures = [pool.submit(list_spec, spec, key, page_size, known) for spec in specs if spec not in listed]
        try:
            ahead = iter(futures)
            return [listed[spec] if spec in listed else next(ahead).result() for spec in specs]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def list_spec(
    spec: str, key: str, page_size: int = LIST_PAGE_SIZE, known: Sequence[str] | KnownKeys | None = None
) -> Listing:
    """The files one spec names, in the order listed (:func:`list_dataset` without the merging)."""
    found = Listing()
    try:
        _expand(spec, key, found, page_size, KnownKeys.of(known))
    except Exception as e:  # boto3's errors are no OSErrors (and botocore is imported only to list S3)
        raise_if_unavailable(e, f"{key}: cannot list {spec}")
        raise
    if not found.paths:
        raise DataError(
            f"{key}: {spec} matches no parquet files; expected a .parquet file, a directory "
            "containing .parquet files, or a glob such as data/*.parquet"
        )
    return found


def merge_listings(parts: Sequence[Listing]) -> tuple[Listing, list[tuple[int, int]]]:
    """One listing of ``parts`` in order, each part's files sorted, a file already taken from an earlier part left
    out; and where each part's files went: (first position, files kept)."""
    listing = Listing()
    seen: set[str] = set()
    placed = []
    for found in parts:
        start = len(listing)
        for i in sorted(range(len(found.paths)), key=found.paths.__getitem__):
            path = found.paths[i]
            if path in seen:
                continue
            seen.add(path)
            listing.add(path, found.sizes[i], found.versions[i])
        listing.indexes.extend(found.indexes)
        placed.append((start, len(listing) - start))
    return listing, placed


def names_directory(spec: str) -> bool:
    """Whether ``spec`` can only name a directory, not a file or a glob (the specs a directory index serves)."""
    return not any(c in spec for c in _GLOB_CHARS) and not spec.endswith(".parquet")


def strictly_increasing(paths: Sequence[str]) -> bool:
    return all(a < b for a, b in zip(paths, itertools.islice(paths, 1, None), strict=False))


def _expand(spec: str, key: str, found: Listing, page_size: int, known: KnownKeys | None = None) -> None:
    prefix = uri_prefix(spec)
    if spec.startswith("s3://"):
        _expand_s3(spec, key, found, page_size, known)
    elif not prefix:
        _expand_local(spec, found)
    else:
        _expand_pyarrow(spec, found)


def _hidden(path: str, root: str) -> bool:
    """Files under a '.' or '_' name (``_SUCCESS``, ``.tmp``) are writer by-products, not data."""
    return any(part.startswith((".", "_")) for part in path[len(root) :].split("/") if part)


def _glob_base(path: str) -> str:
    return path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]


def _expand_local(spec: str, found: Listing) -> None:
    import glob

    path = os.path.abspath(os.path.expanduser(spec))
    if any(c in spec for c in _GLOB_CHARS):
        for match in glob.glob(path, recursive=True):
            try:
                st = os.stat(match)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.add(match, st.st_size, str(st.st_mtime_ns))
        return
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        found.add(spec, st.st_size, str(st.st_mtime_ns))
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    index = os.path.join(path, DIRECTORY_INDEX)
    try:
        index_stat = os.stat(index)
        found.indexes.append(FoundIndex(index, path, index_stat.st_size, str(index_stat.st_mtime_ns)))
    except OSError:
        pass
    stack = [path]
    while stack:  # '_'/'.' directories are not entered: nothing under them is data
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.name.startswith((".", "_")):
                    continue
                if entry.is_dir():
                    stack.append(entry.path)
                elif entry.name.endswith(".parquet") and entry.is_file():
                    st = entry.stat()
                    found.add(entry.path, st.st_size, str(st.st_mtime_ns))


S3Object = tuple[str, int, str]
"""(key, size, ETag without its quotes): what the listing keeps of an S3 object."""

LIST_THREADS = 8
"""Key ranges listed at once (botocore's pool holds 10 connections)."""


def s3_objects(
    client, bucket: str, prefix: str, page_size: int, after: str | None = None, through: str | None = None
) -> Iterator[S3Object]:
    """The objects under ``prefix`` (after the key ``after``, up to and including ``through``), one page of
    ``page_size`` at a time (never the whole listing at once); stops at the first page that passes ``through``."""
    kwargs = {"StartAfter": after} if after is not None else {}
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}, **kwargs
    )
    for page in pages:
        for obj in page.get("Contents", ()):
            key = obj["Key"]
            if through is not None and key > through:
                return
            yield key, int(obj["Size"]), _etag(obj)


def _s3_objects_in_ranges(
    client, bucket: str, prefix: str, page_size: int, known: KnownKeys | None
) -> Iterator[S3Object]:
    """The objects under ``prefix`` in key order, as :func:`s3_objects`; with ``known`` keys (of a previous
    listing), the key space is cut at every few pages' worth of them into ranges (after one split key, through
    the next) listed by ``LIST_THREADS`` threads at once and yielded in order. A range's own listing finds what
    was added in it and leaves out what was deleted (a split key need not exist any more); S3 pages come one after
    another, each waiting for the last one's token, so concurrent ranges are what shortens a large listing."""
    splits = split_keys(known, bucket, prefix, page_size, LIST_THREADS)
    if not splits:
        yield from s3_objects(client, bucket, prefix, page_size)
        return
    bounds = list(zip([None, *splits], [*splits, None], strict=True))

    def one(bound: tuple[str | None, str | None]) -> list[S3Object]:
        return list(s3_objects(client, bucket, prefix, page_size, *bound))

    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(LIST_THREADS, len(bounds)), thread_name_prefix="sdtrain-list") as pool:
        # Ranges are listed at most LIST_THREADS ahead of the one being yielded, so what is held waiting is too.
        waiting = iter(bounds)
        pending = deque(pool.submit(one, b) for b in itertools.islice(waiting, LIST_THREADS))
        while pending:
            objects = pending.popleft().result()
            pending.extend(pool.submit(one, b) for b in itertools.islice(waiting, 1))
            yield from objects


def listing_client():
    """One boto3 client per S3 settings and credentials in the environment (making one costs ~0.2 s, a restart's
    listing and index read would pay it twice)."""
    from sdtrain.storage.s3 import resolved_s3_settings, s3_client

    key = (resolved_s3_settings(), os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_PROFILE"))
    if key not in _CLIENTS:
        client = s3_client()
        # Timestamps kept as their text: nothing here reads one, and botocore's date parsing was two thirds of a
        # 1000-key page's parse (90 -> 33 ms a page on the dev machine). The factory is this client's own (its
        # session is new); without the attribute (another botocore) the dates are parsed as before.
        factory = getattr(getattr(client, "_endpoint", None), "_response_parser_factory", None)
        if factory is not None:
            factory.set_parser_defaults(timestamp_parser=str)
        _CLIENTS[key] = client
    return _CLIENTS[key]


_CLIENTS: dict[tuple, object] = {}


def _etag(obj: Mapping) -> str:
    return str(obj.get("ETag", "")).strip('"')


def _expand_s3(spec: str, config_key: str, found: Listing, page_size: int, known: KnownKeys | None = None) -> None:
    import fnmatch

    from botocore.exceptions import ClientError

    client = listing_client()
    bucket, key = split_s3(spec)
    if any(c in key for c in _GLOB_CHARS):
        pattern = f"{bucket}/{key}"
        base = _glob_base(pattern)
        list_prefix = base[len(bucket) + 1 :] + "/" if base != bucket else ""
        for name, size, etag in _s3_objects_in_ranges(client, bucket, list_prefix, page_size, known):
            if not name.endswith("/") and fnmatch.fnmatch(f"{bucket}/{name}", pattern):
                found.add(f"s3://{bucket}/{name}", size, etag)
        return
    if key and not spec.endswith("/"):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            found.add(spec, int(head["ContentLength"]), _etag(head))
            return
        except ClientError as e:
            if is_transient(e):
                raise  # list_spec: a storage failure, not bad input
            if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise DataError(f"{config_key}: cannot list {spec}: {e}") from None
    root = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    list_prefix = f"{key}/" if key else ""
    directory_index = list_prefix + DIRECTORY_INDEX
    for name, size, etag in _s3_objects_in_ranges(client, bucket, list_prefix, page_size, known):
        if name == directory_index:
            found.indexes.append(FoundIndex(f"s3://{bucket}/{name}", root, size, etag))
        if name.endswith(".parquet") and not _hidden(name, list_prefix):
            found.add(f"s3://{bucket}/{name}", size, etag)


def object_version(uri: str) -> tuple[int, str] | None:
    """(size, version) of one object as a listing records them (S3: one HEAD), or None if it is gone."""
    if uri.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = split_s3(uri)
        try:
            head = listing_client().head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as e:
            raise_if_unavailable(e, f"cannot read {uri}")
            if not isinstance(e, ClientError):
                raise
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise DataError(f"cannot read {uri}: {e}") from None
        return int(head["ContentLength"]), _etag(head)
    if not uri_prefix(uri):
        try:
            st = os.stat(uri)
        except OSError:
            return None
        return st.st_size, str(st.st_mtime_ns)
    fs, path = filesystem_for(uri)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        return None
    return int(info.size or 0), str(info.mtime_ns) if info.mtime_ns is not None else ""


def _expand_pyarrow(spec: str, found: Listing) -> None:
    """Another object store (pyarrow's own filesystems): version = modification time."""
    import fnmatch

    fs, path = filesystem_for(spec)
    prefix = uri_prefix(spec)

    def version(info: pafs.FileInfo) -> str:
        return str(info.mtime_ns) if info.mtime_ns is not None else ""

    if any(c in path for c in _GLOB_CHARS):
        infos = fs.get_file_info(pafs.FileSelector(_glob_base(path), recursive=True, allow_not_found=True))
        for i in infos:
            if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path):
                found.add(prefix + i.path, i.size, version(i))
        return
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        found.add(spec, info.size, version(info))
    elif info.type == pafs.FileType.Directory:
        for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if i.type != pafs.FileType.File:
                continue
            if i.path == f"{path.rstrip('/')}/{DIRECTORY_INDEX}":
                found.indexes.append(FoundIndex(prefix + i.path, prefix + path.rstrip("/"), i.size, version(i)))
            if i.path.endswith(".parquet") and not _hidden(i.path, path):
                found.add(prefix + i.path, i.size, version(i))


def _has_glob(spec: str) -> bool:
    return any(c in spec for c in _GLOB_CHARS)
