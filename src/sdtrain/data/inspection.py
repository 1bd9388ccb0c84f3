"""What a dataset holds (files, rows, tensor shapes), read from parquet footers and one row.

Runs on the driver before Ray starts any worker, so that a wrong column, shape or file fails
in seconds with an error that names the file and the column, instead of on every worker.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Registers Ray's tensor extension types with pyarrow, so their shapes are read from footers.
import ray.data  # noqa: F401

from sdtrain.data.decode import ColumnLayout, column_layout, to_array
from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for


@dataclass(frozen=True)
class DatasetSpec:
    files: tuple[str, ...]
    rows_per_file: tuple[int, ...]
    latent_shape: tuple[int, int, int]
    caption_shape: tuple[int, int]

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_file)


def inspect_dataset(
    files: list[str],
    key: str,
    image_column: str,
    caption_column: str,
    in_channels: int,
    cross_attention_dim: int,
) -> DatasetSpec:
    """Read every file's footer and the first row; check columns, shapes and types against the model."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        footers = list(pool.map(lambda f: _read_footer(f, key), files))

    layouts: dict[str, tuple[str, ColumnLayout]] = {}  # column: (first file, its layout there)
    for column, role in ((image_column, "data.image_column"), (caption_column, "data.caption_column")):
        for file, (schema, _) in zip(files, footers, strict=True):
            if column not in schema.names:
                raise DataError(
                    f"{key}: {file} has no column {column!r} ({role}); its columns are "
                    f"{', '.join(schema.names)}. Set {role} to the column that holds the data."
                )
            try:
                layout = column_layout(schema.field(column))
            except DataError as e:
                raise DataError(f"{key}: {file}, column {column!r} ({role}) {e}") from None
            first = layouts.setdefault(column, (file, layout))
            if layout != first[1]:
                raise DataError(
                    f"{key}: column {column!r} is a {layout.describe()} in {file} but a "
                    f"{first[1].describe()} in {first[0]}; every file must store it the same way"
                )

    rows = tuple(num_rows for _, num_rows in footers)
    if sum(rows) == 0:
        raise DataError(f"{key}: the {len(files)} parquet file(s) hold no rows (first: {files[0]})")

    file = files[next(i for i, n in enumerate(rows) if n)]
    row = _first_row(file, key, [image_column, caption_column])
    latent_shape = _latent_shape(key, file, image_column, layouts[image_column][1], row, in_channels)
    caption_shape = _caption_shape(key, file, caption_column, layouts[caption_column][1], row, cross_attention_dim)
    for column, shape in ((image_column, latent_shape), (caption_column, caption_shape)):
        try:
            values = to_array(row.column(column), shape, column)
        except DataError as e:
            raise DataError(f"{key}: {file}: {e}") from None
        if not np.isfinite(values).all():
            raise DataError(f"{key}: {file}, column {column!r}: the first row holds NaN or infinite values")
    return DatasetSpec(tuple(files), rows, latent_shape, caption_shape)


def _read_footer(file: str, key: str) -> tuple[pa.Schema, int]:
    fs, path = filesystem_for(file)
    try:
        metadata = pq.read_metadata(path, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{key}: cannot read {file} as parquet: {e}") from None
    return metadata.schema.to_arrow_schema(), metadata.num_rows


def _first_row(file: str, key: str, columns: list[str]) -> pa.Table:
    fs, path = filesystem_for(file)
    try:
        with fs.open_input_file(path) as handle:
            batch = next(pq.ParquetFile(handle).iter_batches(batch_size=1, columns=columns))
    except (OSError, pa.ArrowException, StopIteration) as e:  # a footer that reads, over damaged pages
        raise DataError(f"{key}: cannot read the first row of {file}: {type(e).__name__}: {e}") from None
    return pa.Table.from_batches([batch.slice(0, 1)])


def _values_per_row(where: str, layout: ColumnLayout, row: pa.Table, column: str) -> int:
    if layout.values_per_row is not None:
        return layout.values_per_row
    value = row.column(column)[0]
    if not value.is_valid:
        raise DataError(f"{where}: the first row is null; every row needs a value")
    return len(value)


def _latent_shape(key, file, column, layout, row, in_channels) -> tuple[int, int, int]:
    where = f"{key}: {file}, column {column!r} (data.image_column)"
    if layout.shape is not None:
        if len(layout.shape) != 3 or layout.shape[0] != in_channels:
            raise DataError(
                f"{where} holds latents of shape {layout.shape}; expected (C, H, W) with "
                f"C = the UNet's in_channels = {in_channels}"
            )
        return tuple(layout.shape)
    n = _values_per_row(where, layout, row, column)
    side = math.isqrt(n // in_channels) if n % in_channels == 0 else 0
    if side == 0 or in_channels * side * side != n:
        raise DataError(
            f"{where} has {n} values a row, which is not C*H*W for C = the UNet's in_channels = "
            f"{in_channels} and a square H = W (e.g. 4096 = 4x32x32). {_latent_hint(n)}Check data.image_column "
            "and model.unet.in_channels, or store the latents as a Ray tensor column with their shape"
        )
    return (in_channels, side, side)


def _caption_shape(key, file, column, layout, row, cross_attention_dim) -> tuple[int, int]:
    where = f"{key}: {file}, column {column!r} (data.caption_column)"
    if layout.shape is not None:
        if len(layout.shape) != 2 or layout.shape[1] != cross_attention_dim:
            raise DataError(
                f"{where} holds caption embeddings of shape {layout.shape}; expected (L, D) with "
                f"D = the UNet's cross_attention_dim = {cross_attention_dim}. "
                + _caption_hint(math.prod(layout.shape), cross_attention_dim)
            )
        return tuple(layout.shape)
    n = _values_per_row(where, layout, row, column)
    if n == 0 or n % cross_attention_dim:
        raise DataError(
            f"{where} has {n} values a row, which is not L*D for D = the UNet's cross_attention_dim = "
            f"{cross_attention_dim} (e.g. 78848 = 77x1024). {_caption_hint(n, cross_attention_dim)}"
        )
    return (n // cross_attention_dim, cross_attention_dim)


# Caption widths of the text encoders Stable Diffusion models use, for errors in the user's terms.
_TEXT_ENCODERS = {768: "CLIP ViT-L/14, as SD 1.x writes", 1024: "OpenCLIP ViT-H/14, as SD 2.x writes"}


def _caption_hint(n: int, cross_attention_dim: int) -> str:
    """What ``n`` values a row most likely are, when a 77-token embedding of another width."""
    if n and n % 77 == 0:
        width = n // 77
        encoder = f" ({_TEXT_ENCODERS[width]})" if width in _TEXT_ENCODERS else ""
        return (
            f"{n} = 77 x {width}: {width}-wide embeddings{encoder}, for a UNet with cross_attention_dim "
            f"{width}. Set model.unet.cross_attention_dim={width} (or a preset of that width), or re-encode the "
            f"captions with a {cross_attention_dim}-wide text encoder"
        )
    return "The caption width must match the UNet: check data.caption_column and model.unet.cross_attention_dim"


def _latent_hint(n: int) -> str:
    """What ``n`` values a row are if they are SD VAE latents (4 channels, 8x downsampling)."""
    side = math.isqrt(n // 4) if n % 4 == 0 else 0
    if side and 4 * side * side == n:
        return f"{n} = 4x{side}x{side}: the latents of {side * 8} px images through SD's VAE (4 channels). "
    return ""
