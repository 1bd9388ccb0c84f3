"""Many files of one S3 folder named one by one (data.train as a list of 2e5 file URIs, as a curation job writes
it): found with the folder's listing, 1000 keys a request, instead of a HEAD each (2e5 requests at every start,
~8 minutes at 20 ms and 8 at once; file specs are never sealed in an index). sdtrain.data.listing lists; this module
decides which folders to list and what their listings found."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Iterator, Sequence

from sdtrain.logs import log
from sdtrain.storage.s3 import raise_if_unavailable
from sdtrain.storage.uris import split_s3

ListFolder = Callable[[str, str, str, str], Iterator[tuple[str, int, str]]]
"""(bucket, prefix, after, through) -> the folder's objects (key, size, version) in key order (listing.s3_objects)."""

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


def files_in_listed_folders(
    uris: Sequence[str], list_folder: ListFolder, key: str = "data.train"
) -> dict[str, tuple[int, str]]:
    """(size, version) of each of ``uris`` (s3:// objects named one by one) found by listing its folder, where the
    folder holds FOLDER_LISTING_MIN or more of them; the others are left to a HEAD each.

    Args:
        uris: the specs that name one S3 object each (no glob, no trailing '/').
        list_folder: lists a folder's objects between two keys.
        key: the config key that names ``uris`` (for errors).
    """
    from botocore.exceptions import ClientError

    found: dict[str, tuple[int, str]] = {}
    named = [split_s3(uri) for uri in uris]
    for (bucket, folder), keys in folders_to_list([(b, k) for b, k in named if k]).items():
        try:
            in_folder = found_keys(list_folder(bucket, *listing_bounds(folder, keys)), keys)
        except Exception as e:
            # A store throttling or failing would fail a HEAD each too, after many more requests.
            raise_if_unavailable(
                e, f"{key}: cannot list s3://{bucket}/{folder} (for the {len(keys)} files named in it)"
            )
            if not isinstance(e, ClientError):
                raise
            # No s3:ListBucket (data shared for GetObject alone): a HEAD each, as before.
            log.info(f"cannot list s3://{bucket}/{folder} ({e}): its {len(keys)} files are asked for one by one")
            continue
        found.update({f"s3://{bucket}/{name}": value for name, value in in_folder.items()})
    return found
