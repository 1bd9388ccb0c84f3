"""The captions to sample with: embeddings from a .npy file, or parquet rows (one per label when they have labels)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sdtrain.config.learning import Columns
from sdtrain.data.decode import column_layout
from sdtrain.data.footer import read_schema
from sdtrain.data.inspection import first_row
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.data.rows import RowReader
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
    or glob): one row per distinct ``label`` when the data has that column, else the first ``rows``.
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

    return _parquet_captions(path, caption_dim, column, rows, encode)


def _parquet_captions(
    path: str, caption_dim: int, column: str, rows: int, encode: Callable[[torch.Tensor], torch.Tensor] | None
) -> Captions:
    files = resolve_parquet_files([path], "--captions")
    schema = read_schema(files[0], "--captions")
    if column not in schema.names:
        raise DataError(
            f"--captions: {files[0]} has no column {column!r}; its columns are {', '.join(schema.names)} "
            "(see --caption-column)"
        )
    layout = column_layout(schema.field(column))
    width = layout.values_per_row or len(first_row(files[0], "--captions", [column]).column(column)[0])
    if layout.token_ids:
        if encode is None:
            raise DataError(f"--captions: column {column!r} holds token ids; sampling needs their text encoder")
        shape: tuple[int, ...] = (width,)
    elif width % caption_dim:
        raise DataError(
            f"--captions: column {column!r} has {width} values a row, not a multiple of the UNet's "
            f"cross_attention_dim {caption_dim}"
        )
    else:
        shape = (width // caption_dim, caption_dim)
    labelled = "label" in schema.names
    reader = RowReader(Columns("", column), None, shape, extra=("label",) if labelled else ())
    order: list[Any] | None = None
    if labelled:  # one row per label, the first that has it, in the labels' order
        first: dict[Any, np.ndarray] = {}
        for batch in reader.batches(files, "--captions"):
            for label, caption in zip(batch.extra["label"].to_pylist(), batch.captions, strict=True):
                first.setdefault(label, caption)
        order = sorted(first)
        values = np.stack([first[label] for label in order])
        names = [f"label {label}" for label in order]
    else:
        values = np.concatenate([batch.captions for batch in reader.batches(files, "--captions", limit=rows)])
        names = [f"row {i}" for i in range(len(values))]
    if layout.token_ids:
        assert encode is not None
        return Captions(encode(torch.from_numpy(values)).float(), names, order)
    return Captions(torch.from_numpy(values.astype(np.float32)), names, order)
