"""The S3 keys of a listing made before (a previous index of the run), for cutting a new listing of a prefix into
key ranges that are listed at once (sdtrain.data.listing)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from sdtrain.storage.uris import split_s3


class KnownKeys:
    """The S3 keys of paths listed before, by bucket, sorted once: a spec's keys under its prefix are then a bisect
    away (filtering every path for each of many specs cost specs x paths: minutes at 1000 specs of 2e5 files)."""

    def __init__(self, paths: Sequence[str]):
        by_bucket: dict[str, set[str]] = {}
        for path in paths:
            if path.startswith("s3://"):
                bucket, name = split_s3(path)
                by_bucket.setdefault(bucket, set()).add(name)
        self._keys = {bucket: sorted(names) for bucket, names in by_bucket.items()}

    @classmethod
    def of(cls, known: Sequence[str] | KnownKeys | None) -> KnownKeys | None:
        """``known`` paths as KnownKeys (made once, where many specs are listed against them)."""
        return known if known is None or isinstance(known, KnownKeys) else cls(known)

    def under(self, bucket: str, prefix: str) -> list[str]:
        """The known keys in ``bucket`` that start with ``prefix``, in order."""
        keys = self._keys.get(bucket, [])
        return keys[bisect.bisect_left(keys, prefix) : bisect.bisect_left(keys, prefix + "\U0010ffff")]


def split_keys(known: KnownKeys | None, bucket: str, prefix: str, page_size: int, threads: int) -> list[str]:
    """Keys under ``prefix`` in ``bucket`` of the ``known`` ones, every few pages' worth, for ranges of whole pages
    spread over ``threads`` threads; none for what one page lists."""
    keys = known.under(bucket, prefix) if known is not None else []
    pages = -(-len(keys) // page_size)
    if pages <= 1:
        return []
    step = page_size * -(-pages // threads)
    return keys[step - 1 : len(keys) - 1 : step]
