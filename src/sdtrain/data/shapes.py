"""What a dataset's rows hold, checked against the model: the latent shape (C, H, W) and the caption shape (L, D)
or (L,) token ids, from the checked schema's column layouts, an index's record or the first row, with errors that
say what the values most likely are in the user's terms."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from sdtrain.data.decode import ColumnLayout, caption_array, to_array
from sdtrain.data.inspection import CheckedSchema
from sdtrain.data.metadata import BUCKET_SHAPES, TOKEN_VOCAB_SIZE
from sdtrain.errors import DataError


def check_shapes(
    key: str,
    checked: CheckedSchema,
    in_channels: int,
    cross_attention_dim: int,
    row: pa.Table | None,
    row_file: str,
    recorded: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """(latent shape, caption shape) of the checked columns, checked against the model; token ids against the
    vocabulary their file records (the text encoder they name: sdtrain.model.token_captions.check_text_encoder).

    Variable-size lists have their values per row from ``recorded`` (the shapes an index recorded: their product),
    else from ``row`` (the first row of ``row_file``); ``row``, when given, is checked to fit the shapes and to
    hold finite values.
    """
    image_layout, caption_layout = checked.layouts(key)
    image, caption = checked.columns.latent, checked.columns.caption
    file = row_file if recorded is None else checked.file
    if checked.buckets is not None:
        return _bucketed_shapes(key, checked, in_channels, cross_attention_dim, row, row_file, recorded)
    latent_shape = _latent_shape(key, file, image, image_layout, row, in_channels, recorded and recorded[0])
    captions = checked.caption_columns(key)
    caption_shape = _caption_shape(
        key, file, captions, caption_layout, row, cross_attention_dim, recorded and recorded[1]
    )
    if row is not None:
        try:
            first = {
                image: to_array(row.column(image), latent_shape, image),
                caption: caption_array(row, captions, caption_shape),
            }
        except DataError as e:
            raise DataError(f"{key}: {row_file}: {e}") from None
        for column, values in first.items():
            if not np.isfinite(values).all():
                raise DataError(f"{key}: {row_file}, column {column!r}: the first row holds NaN or infinite values")
        ids = checked.token_ids(key)
        values = first[caption]
        if ids is not None and (values.min() < 0 or values.max() >= ids.vocab_size):
            raise DataError(
                f"{key}: {row_file}, column {caption!r}: the first row holds token ids from {values.min()} to "
                f"{values.max()}, outside the vocabulary of {ids.vocab_size} the file records ({TOKEN_VOCAB_SIZE})"
            )
    return latent_shape, caption_shape


def _bucketed_shapes(
    key: str,
    checked: CheckedSchema,
    in_channels: int,
    cross_attention_dim: int,
    row: pa.Table | None,
    row_file: str,
    recorded: tuple[tuple[int, ...], tuple[int, ...]] | None,
) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """Bucketed data: every bucket's latents have the UNet's channels; ``row`` (with its ``bucket`` column) holds its
    bucket's values, finite. The latent shape returned is the first bucket's (the caller picks the most common)."""
    buckets = checked.buckets
    assert buckets is not None
    image = checked.columns.latent
    wrong = [shape for shape in buckets if shape[0] != in_channels]
    if wrong:
        raise DataError(
            f"{key}: {checked.file}: buckets of latent shapes {wrong} ({BUCKET_SHAPES}); every bucket needs C = the "
            f"UNet's in_channels = {in_channels}"
        )
    _, caption_layout = checked.layouts(key)
    caption_shape = _caption_shape(
        key,
        checked.file,
        checked.caption_columns(key),
        caption_layout,
        row,
        cross_attention_dim,
        recorded and recorded[1],
    )
    if row is not None:
        if "bucket" not in row.column_names:
            raise DataError(f"{key}: {row_file}: a bucketed file ({BUCKET_SHAPES}) has no column 'bucket'")
        bucket = int(row.column("bucket")[0].as_py())
        values = to_array(row.column(image), buckets[bucket], image)
        if not np.isfinite(values).all():
            raise DataError(f"{key}: {row_file}, column {image!r}: the first row holds NaN or infinite values")
    return buckets[0], caption_shape


def _values_per_row(where: str, layout: ColumnLayout, row: pa.Table | None, column: str, recorded) -> int:
    if layout.values_per_row is not None:
        return layout.values_per_row
    if recorded:
        return math.prod(recorded)
    assert row is not None
    value = row.column(column)[0]
    if not value.is_valid:
        raise DataError(f"{where}: the first row is null; every row needs a value")
    return len(value)


def _latent_shape(key, file, column, layout, row, in_channels, recorded=None) -> tuple[int, int, int]:
    where = f"{key}: {file}, column {column!r} (data.latent_column)"
    if layout.shape is not None:
        if len(layout.shape) != 3 or layout.shape[0] != in_channels:
            raise DataError(
                f"{where} holds latents of shape {layout.shape}; expected (C, H, W) with "
                f"C = the UNet's in_channels = {in_channels}"
            )
        return tuple(layout.shape)
    n = _values_per_row(where, layout, row, column, recorded)
    side = math.isqrt(n // in_channels) if n % in_channels == 0 else 0
    if side == 0 or in_channels * side * side != n:
        raise DataError(
            f"{where} has {n} values a row, which is not C*H*W for C = the UNet's in_channels = "
            f"{in_channels} and a square H = W (e.g. 4096 = 4x32x32). {_latent_hint(n)}Check data.latent_column "
            "and model.unet.in_channels, or store the latents as a Ray tensor column with their shape"
        )
    return (in_channels, side, side)


def _caption_shape(key, file, columns, layout, row, cross_attention_dim, recorded=None) -> tuple[int, ...]:
    """(L, D) of caption embeddings in ``columns[0]``; (T x L,) of token ids, L in each of ``columns``, T of them."""
    column = columns[0]
    where = f"{key}: {file}, column {column!r} (data.caption_column)"
    if layout.token_ids:
        if layout.shape is not None and len(layout.shape) != 1:
            raise DataError(f"{where} holds token ids of shape {layout.shape}; expected (L,): one id per position")
        per_column = recorded and (recorded[0] // len(columns),)  # an index records the T x L a batch holds
        return (_values_per_row(where, layout, row, column, per_column) * len(columns),)
    if layout.shape is not None:
        if len(layout.shape) != 2 or layout.shape[1] != cross_attention_dim:
            raise DataError(
                f"{where} holds caption embeddings of shape {layout.shape}; expected (L, D) with "
                f"D = the UNet's cross_attention_dim = {cross_attention_dim}. "
                + _caption_hint(math.prod(layout.shape), cross_attention_dim)
            )
        return tuple(layout.shape)
    n = _values_per_row(where, layout, row, column, recorded)
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
