"""A dataset read in this process, in file order, without Ray: for evaluation on the driver.

Kept apart from :mod:`sdtrain.data.streams`, whose module every Ray Data read task imports: this
one needs torch, which costs each fresh read worker about 1.6 s before its first window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sdtrain.config.schema import DataConfig
from sdtrain.data.decode import decode_batch
from sdtrain.data.inspection import DatasetSpec
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for


def iter_local_batches(
    spec: DatasetSpec, data: DataConfig, batch_size: int, key: str = "data.val"
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) tensors, in file order.

    Rows with NaN or infinite values are an error naming the file, the first such row and their count in it
    (``key``: the config key naming the files): one such row makes a loss over the set NaN for every model.
    """
    for file in spec.files:
        fs, path = filesystem_for(file)
        first, bad, row = None, 0, 0
        with fs.open_input_file(path) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(
                batch_size, columns=[data.latent_column, data.caption_column]
            ):
                arrays = decode_batch(
                    pa.Table.from_batches([batch]),
                    data.latent_column,
                    data.caption_column,
                    spec.latent_shape,
                    spec.caption_shape,
                )
                finite = np.ones(batch.num_rows, bool)
                for values in arrays.values():
                    finite &= np.isfinite(values.reshape(len(values), -1)).all(axis=1)
                if not finite.all():
                    first = row + int(np.flatnonzero(~finite)[0]) if first is None else first
                    bad += int((~finite).sum())
                row += batch.num_rows
                if first is None:  # the rest of a file with a bad row is read only to count them
                    yield {name: torch.tensor(values) for name, values in arrays.items()}
        if first is not None:
            raise DataError(
                f"{key}: {file}: {bad} row(s) hold NaN or infinite values (the first: row {first}); a loss over "
                "them is NaN for any model, so no model could be compared. Fix or remove those rows"
            )
