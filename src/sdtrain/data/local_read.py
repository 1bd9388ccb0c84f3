"""A dataset read in this process, in file order, without Ray: for evaluation on the driver.

Kept apart from :mod:`sdtrain.data.streams`, whose module every Ray Data read task imports: this
one needs torch, which costs each fresh read worker about 1.6 s before its first window.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sdtrain.config.schema import DataConfig
from sdtrain.data.decode import decode_batch
from sdtrain.data.inspection import DatasetSpec
from sdtrain.storage.filesystems import filesystem_for


def iter_local_batches(spec: DatasetSpec, data: DataConfig, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) tensors, in file order."""
    for file in spec.files:
        fs, path = filesystem_for(file)
        with fs.open_input_file(path) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(
                batch_size, columns=[data.image_column, data.caption_column]
            ):
                arrays = decode_batch(
                    pa.Table.from_batches([batch]),
                    data.image_column,
                    data.caption_column,
                    spec.latent_shape,
                    spec.caption_shape,
                )
                yield {name: torch.tensor(values) for name, values in arrays.items()}
