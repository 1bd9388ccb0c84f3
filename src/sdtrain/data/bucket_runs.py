"""The runs of bucketed files: each file holds its rows bucket by bucket, one *run* a bucket
(:mod:`sdtrain.data.bucket_order`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def runs_of(file_buckets: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """The runs array of files given as their (bucket, rows) pairs in row order."""
    runs = [(f, b, n) for f, pairs in enumerate(file_buckets) for b, n in pairs]
    return np.array(runs, np.int64).reshape(-1, 3)
