"""The captions to sample with: embeddings from a .npy file or from parquet rows (one per label for the demo)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for


@dataclass
class Captions:
    embeddings: torch.Tensor  # (R, L, D)
    names: list[str]  # one per row of the grid
    labels: list[Any] | None = None


def read_captions(
    path: str,
    caption_dim: int,
    column: str = "caption_latents",
    rows: int = 8,
    encode: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Captions:
    """Caption embeddings from a .npy file ((L, D) or (R, L, D)), or from parquet (a file, directory
    or glob): one row per distinct ``label`` when the data has that column (the demo), else the first ``rows``.
    A parquet column of token ids is encoded by ``encode`` (ids (R, L) -> float embeddings (R, L, D))."""
    if path.endswith(".npy"):
        fs, fs_path = filesystem_for(path)
        with fs.open_input_file(fs_path) as f:
            array = np.load(f, allow_pickle=False)
        if array.ndim == 2:
            array = array[None]
        if array.ndim != 3 or array.shape[-1] != caption_dim:
            raise DataError(
                f"--captions: {path} holds shape {array.shape}; expected (L, {caption_dim}) or (N, L, {caption_dim})"
            )
        return Captions(torch.from_numpy(array.astype(np.float32)), [f"caption {i}" for i in range(len(array))])

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdtrain.data.decode import to_array

    tables = []
    for file in resolve_parquet_files([path], "--captions"):
        fs, fs_path = filesystem_for(file)
        with fs.open_input_file(fs_path) as f:
            schema = pq.read_schema(f)
            if column not in schema.names:
                raise DataError(
                    f"--captions: {file} has no column {column!r}; its columns are {', '.join(schema.names)} "
                    f"(see --caption-column)"
                )
            tables.append(pq.read_table(f, columns=[column] + (["label"] if "label" in schema.names else [])))
    table = pa.concat_tables(tables)
    if "label" in table.column_names:
        labels = table.column("label").to_pylist()
        first: dict[Any, int] = {}  # label: the first row that has it
        for i, label in enumerate(labels):
            first.setdefault(label, i)
        order = sorted(first)
        table = table.take([first[label] for label in order])
        names = [f"label {label}" for label in order]
    else:
        order = None
        table = table.slice(0, rows)
        names = [f"row {i}" for i in range(table.num_rows)]
    width = table.column(column).combine_chunks()
    value_type = (width.storage if isinstance(width, pa.ExtensionArray) else width).type.value_type
    if pa.types.is_integer(value_type):
        if encode is None:
            raise DataError(f"--captions: column {column!r} holds token ids; sampling needs their text encoder")
        ids = to_array(table.column(column), (len(width[0]),), column)
        return Captions(encode(torch.from_numpy(ids)).float(), names, order)
    first_row = width.storage[0] if isinstance(width, pa.ExtensionArray) else width[0]
    length = len(first_row.values) if hasattr(first_row, "values") else len(first_row)
    if length % caption_dim:
        raise DataError(
            f"--captions: column {column!r} has {length} values a row, not a multiple of the UNet's "
            f"cross_attention_dim {caption_dim}"
        )
    embeddings = to_array(table.column(column), (length // caption_dim, caption_dim), column).astype(np.float32)
    return Captions(torch.from_numpy(embeddings), names, order)
