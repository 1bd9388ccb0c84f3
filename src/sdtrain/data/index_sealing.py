"""Sealing: a run's index remembers which of its specs were directories whose files were exactly those of the directory
index beside them (:class:`sdtrain.data.index_format.SealedDirectory`). The preprocessing job and
``entrypoints/index.py`` rewrite a directory index whenever they change its directory, so while that object is
unchanged (one HEAD) a restart takes the spec's files from the run's index and lists nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from sdtrain.data.index_format import DatasetIndex, SealedDirectory
from sdtrain.data.listing import FoundIndex, Listing, object_version


def unchanged_directories(own: DatasetIndex, specs: Sequence[str]) -> dict[str, SealedDirectory]:
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


def files_of(own: DatasetIndex, sealed: SealedDirectory) -> Listing:
    stop = sealed.start + sealed.count
    listing = Listing(own.paths[sealed.start : stop], versions=own.versions[sealed.start : stop])
    listing.sizes.frombytes(np.asarray(own.sizes[sealed.start : stop], np.int64).tobytes())
    return listing


def sealed_directories(
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
