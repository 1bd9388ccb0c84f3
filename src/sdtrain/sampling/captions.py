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
from sdtrain.data.metadata import token_id_columns
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.data.rows import RowReader
from sdtrain.errors import DataError
from sdtrain.model.conditioning import Conditioning
from sdtrain.storage.filesystems import filesystem_for


@dataclass
class Captions:
    embeddings: torch.Tensor  # (R, L, D)
    names: list[str]  # one per row of the grid
    labels: list[Any] | None = None
    pooled: torch.Tensor | None = None
    """(R, P) pooled text embeddings, for an SDXL-shaped UNet."""

    def conditioning(self, repeat: int = 1) -> Conditioning:
        """What the UNet samples the rows with, each row ``repeat`` times in a row (a grid's columns)."""
        pooled = None if self.pooled is None else self.pooled.repeat_interleave(repeat, dim=0)
        return Conditioning(self.embeddings.repeat_interleave(repeat, dim=0), pooled)


Encode = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""Token ids (R, T x L) -> (float hidden states (R, L, D), pooled (R, P) or None): the model's text encoders."""


def read_captions(
    path: str,
    caption_dim: int,
    column: str = "caption_latents",
    rows: int = 8,
    encode: Encode | None = None,
    pooled_column: str | None = None,
) -> Captions:
    """Caption embeddings from a .npy file ((L, D) or (R, L, D)), or from parquet (a file, directory
    or glob): one row per distinct ``label`` when the data has that column, else the first ``rows``.
    A parquet column of token ids is encoded by ``encode``; embeddings for an SDXL-shaped UNet come with their pooled
    embeddings from ``pooled_column`` (parquet only: a .npy file holds no pooled embeddings)."""
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

    return _parquet_captions(path, caption_dim, column, rows, encode, pooled_column)


def _parquet_captions(
    path: str, caption_dim: int, column: str, rows: int, encode: Encode | None, pooled_column: str | None
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
    columns = Columns("", column)
    if layout.token_ids:
        if encode is None:
            raise DataError(f"--captions: column {column!r} holds token ids; sampling needs their text encoder")
        # Each tokenizer's ids (SDXL's two), joined: T x L a row.
        ids = token_id_columns(schema.metadata, f"--captions: {files[0]}, column {column!r}", column)
        columns = Columns("", column, ids[1:])
        shape: tuple[int, ...] = (width * len(ids),)
    elif width % caption_dim:
        raise DataError(
            f"--captions: column {column!r} has {width} values a row, not a multiple of the UNet's "
            f"cross_attention_dim {caption_dim}"
        )
    else:
        shape = (width // caption_dim, caption_dim)
    labelled = "label" in schema.names
    pooled_column = None if layout.token_ids else pooled_column
    if pooled_column is not None and pooled_column not in schema.names:
        raise DataError(
            f"--captions: {files[0]} has no column {pooled_column!r}: an SDXL-shaped UNet samples from each caption's "
            "pooled text embedding beside its hidden states"
        )
    extra = (("label",) if labelled else ()) + ((pooled_column,) if pooled_column else ())
    reader = RowReader(columns, None, shape, extra=extra)
    order: list[Any] | None = None
    if labelled:  # one row per label, the first that has it, in the labels' order
        first: dict[Any, tuple[np.ndarray, Any]] = {}
        for batch in reader.batches(files, "--captions"):
            pooled_rows = batch.extra[pooled_column].to_pylist() if pooled_column else [None] * len(batch)
            for label, caption, pool in zip(batch.extra["label"].to_pylist(), batch.captions, pooled_rows, strict=True):
                first.setdefault(label, (caption, pool))
        order = sorted(first)
        values = np.stack([first[label][0] for label in order])
        pooled_values = [first[label][1] for label in order]
        names = [f"label {label}" for label in order]
    else:
        batches = list(reader.batches(files, "--captions", limit=rows))
        values = np.concatenate([batch.captions for batch in batches])
        pooled_values = [
            p for b in batches for p in (b.extra[pooled_column].to_pylist() if pooled_column else [None] * len(b))
        ]
        names = [f"row {i}" for i in range(len(values))]
    if layout.token_ids:
        assert encode is not None
        hidden, pooled = encode(torch.from_numpy(values))
        return Captions(hidden.float(), names, order, None if pooled is None else pooled.float())
    pooled = torch.tensor(np.asarray(pooled_values, np.float32)) if pooled_column else None
    return Captions(torch.from_numpy(values.astype(np.float32)), names, order, pooled)
