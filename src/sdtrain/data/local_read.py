"""A dataset read in this process, in file order, without Ray: the retraining gate's validation loss on the driver.

Kept apart from :mod:`sdtrain.data.rows`, which every Ray Data read task imports: this one needs torch, which costs
each fresh read worker about 1.6 s before its first window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from sdtrain.config.schema import DataConfig
from sdtrain.data.inspection import DatasetSpec
from sdtrain.data.rows import RowReader
from sdtrain.errors import DataError


def iter_local_batches(
    spec: DatasetSpec, data: DataConfig, batch_size: int, key: str = "data.val"
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) tensors, in file order.

    Rows with NaN or infinite values are an error naming the file, the first such row and their count in it
    (``key``: the config key naming the files): one such row makes a loss over the set NaN for every model.
    """
    reader = RowReader.of(spec, data.columns)
    for file in spec.files:
        first, bad = None, 0
        for rows in reader.file_batches(file, key, batch_size=batch_size):
            assert rows.latents is not None
            finite = np.ones(len(rows), bool)
            for values in (rows.latents, rows.captions):
                finite &= np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if not finite.all():
                first = rows.first_row + int(np.flatnonzero(~finite)[0]) if first is None else first
                bad += int((~finite).sum())
            if first is None:  # the rest of a file with a bad row is read only to count them
                yield {key: torch.tensor(values) for key, values in rows.arrays().items()}
        if first is not None:
            raise DataError(
                f"{key}: {file}: {bad} row(s) hold NaN or infinite values (the first: row {first}); a loss over "
                "them is NaN for any model, so no model could be compared. Fix or remove those rows"
            )
