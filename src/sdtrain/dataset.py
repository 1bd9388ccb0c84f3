"""The Ray Data pipeline: parquet files -> decoded latent/caption tensors, streamed."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
import torch

from sdtrain.config import DataConfig
from sdtrain.dataspec import DatasetSpec
from sdtrain.decode import decode_batch
from sdtrain.files import filesystem_for


def build_dataset(spec: DatasetSpec, data: DataConfig, preserve_order: bool = False) -> ray.data.Dataset:
    """A lazy, streaming dataset of ``latents`` (N,C,H,W) and ``captions`` (N,L,D) rows.

    Only the two configured columns are read (plus the file path, so a bad row can name its
    file). ``preserve_order`` makes the row order the file order, for validation that must
    see the same samples in the same order every time.
    """
    dataset = ray.data.read_parquet(
        list(spec.files),
        columns=[data.image_column, data.caption_column],
        include_paths=True,
    )
    if preserve_order:
        dataset.context.execution_options.preserve_order = True
    return dataset.map_batches(
        decode_batch,
        batch_format="pyarrow",
        batch_size=None,  # whole blocks: decoding is vectorized, bigger is cheaper
        fn_kwargs=dict(
            image_column=data.image_column,
            caption_column=data.caption_column,
            latent_shape=spec.latent_shape,
            caption_shape=spec.caption_shape,
        ),
    )


def iter_local_batches(spec: DatasetSpec, data: DataConfig, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """The dataset in file order, read in this process without Ray: for evaluation on the driver."""
    for file in spec.files:
        fs, path = filesystem_for(file)
        with fs.open_input_file(path) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size, columns=[data.image_column, data.caption_column]):
                arrays = decode_batch(
                    pa.Table.from_batches([batch]), data.image_column, data.caption_column, spec.latent_shape, spec.caption_shape
                )
                yield {name: torch.tensor(values) for name, values in arrays.items()}
