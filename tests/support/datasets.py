"""A dataset checked as a run's first start checks it (every footer, the first row, the shapes against the model),
with no index: what tests and benchmarks compare the rest with."""

from __future__ import annotations

from sdtrain.config.learning import Columns
from sdtrain.data.dataset_index import index_dataset
from sdtrain.data.inspection import DatasetSpec


def inspect_dataset(files, key: str, columns: Columns, in_channels: int, cross_attention_dim: int) -> DatasetSpec:
    """The spec of ``files`` (each a file), every footer read."""
    return index_dataset([str(f) for f in files], key, columns, in_channels, cross_attention_dim).spec
