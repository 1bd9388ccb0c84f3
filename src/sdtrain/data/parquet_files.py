"""Data specs (files, directories, globs; local or s3://) to a sorted list of parquet files."""

from __future__ import annotations

from sdtrain.data.listing import list_dataset


def resolve_parquet_files(specs: list[str], key: str) -> list[str]:
    """Every parquet file that ``specs`` names, in a stable order, with duplicates removed (each spec's files
    sorted; sdtrain.data.listing's listing, which keeps their sizes and versions too).

    Raises DataError naming ``key`` and the spec when a spec names nothing.
    """
    return list_dataset(specs, key).paths
