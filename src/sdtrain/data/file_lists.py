"""Many files of one S3 folder named one by one (data.train as a list of 2e5 file URIs, as a curation job writes
it): found with the folder's listing, 1000 keys a request, instead of a HEAD each (2e5 requests at every start,
~8 minutes at 20 ms and 8 at once; file specs are never sealed in an index). sdtrain.data.listing lists; this module
decides which folders to list and what their listings found."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence

FOLDER_LISTING_MIN = 64
"""Files of one folder, named one by one, from which the folder is listed instead of a HEAD each."""
SCAN_PER_FILE = 100
"""Keys a folder's listing may read for each file it looks for before the rest are HEADed (a page of 1000 keys is a
request: at this bound the listing costs a tenth of the HEADs, in a folder holding many files not named)."""


def folders_to_list(objects: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    """The folders worth listing among ``objects`` (bucket, key) named one by one: (bucket, folder) -> the keys named
    in it, sorted, for folders with FOLDER_LISTING_MIN or more of them."""
    folders: dict[tuple[str, str], set[str]] = {}
    for bucket, key in objects:
        folders.setdefault((bucket, posixpath.dirname(key)), set()).add(key)
    return {folder: sorted(keys) for folder, keys in folders.items() if len(keys) >= FOLDER_LISTING_MIN}


def listing_bounds(folder: str, keys: Sequence[str]) -> tuple[str, str, str]:
    """(prefix, after, through) of the folder's listing that covers ``keys`` (sorted): S3's StartAfter is
    exclusive, and the first key less its last character sorts just before it."""
    return (f"{folder}/" if folder else ""), keys[0][:-1], keys[-1]


def found_keys(listed: Iterable[tuple[str, int, str]], keys: Sequence[str]) -> dict[str, tuple[int, str]]:
    """(size, version) of each of ``keys`` in a folder's listing (key, size, version), reading at most SCAN_PER_FILE
    listed keys for each of them; the keys not found are left to a HEAD each."""
    wanted, found = set(keys), dict[str, tuple[int, str]]()
    budget = SCAN_PER_FILE * len(keys)
    for scanned, (key, size, version) in enumerate(listed):
        if scanned >= budget or len(found) == len(wanted):
            break
        if key in wanted:
            found[key] = (size, version)
    return found
