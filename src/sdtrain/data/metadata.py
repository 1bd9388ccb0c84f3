"""The parquet schema metadata keys sdtrain writes beside stored latents and reads back: their one owner.

Preprocessing writes them into every shard it outputs; training reads them from the dataset index's checked schema
(sdtrain.data.dataset_index), so a restart opens no file to learn them. Export and sampling read the encoders a
dataset was made with from them (encoder_sources).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from sdtrain.data.footer import read_schema
from sdtrain.errors import DataError

LATENT_SCALING_FACTOR = "sdtrain.latent_scaling_factor"
"""The factor the stored latents are already multiplied by (the VAE's scaling_factor); absent = raw VAE latents or
latents scaled by a writer that did not say."""
RESOLUTION = "sdtrain.resolution"
"""The image resolution the latents were encoded at."""
VAE_SOURCE = "sdtrain.vae_source"
"""Where the VAE that encoded the latents came from (a local path, s3:// URI or hub id)."""
TEXT_ENCODER_SOURCE = "sdtrain.text_encoder_source"
"""Where the text encoder that encoded the captions came from."""
LATENT = "sdtrain.latent"
"""Which latent of the VAE's distribution was stored: ``mean`` or ``sample`` (preprocessing's encode.latent)."""
LATENT_CLASSIFIER = "sdtrain.latent_classifier"
"""A module that reads the stored latents without a VAE (sdtrain.sampling.latent_classifier): their class, and a
picture of them. The digits demo's files name theirs (sdtrain.demo.digits); preprocessing's name none."""
BUCKET_SHAPES = "sdtrain.bucket_shapes"
"""Aspect-ratio buckets (preprocessing's image.buckets: aspect): the latent shape [C, H, W] of each bucket, by bucket
index, as JSON. The latent column then holds C*H*W values a row for the row's bucket."""
BUCKET_RUNS = "sdtrain.bucket_runs"
"""Beside BUCKET_SHAPES, in each file: its rows bucket by bucket, as JSON [[bucket, rows], ...] in row order."""
VAE_DOWNSAMPLING = "sdtrain.vae_downsampling"
"""Pixels per latent side of the VAE that encoded the latents (8 for every Stable Diffusion VAE; tiny test VAEs
less): what SDXL's size conditioning is measured in. Absent = 8."""
TOKEN_VOCAB_SIZE = "sdtrain.token_vocab_size"
"""Beside a column of caption token ids (integers): the size of the tokenizer's vocabulary they were made with, which
bounds every stored id. With TEXT_ENCODER_SOURCE it is what training needs to encode the ids in its step."""
TOKEN_ID_COLUMNS = "sdtrain.token_id_columns"
"""Beside caption token ids: the columns holding each tokenizer's ids, in the text encoders' order, as JSON (an SDXL
model's two: ["caption_ids", "caption_ids_2"]). Absent = the caption column alone, of one tokenizer."""


@dataclass(frozen=True)
class TokenIds:
    """What a dataset whose caption column holds token ids says about them (its schema metadata)."""

    text_encoder: str
    """Where the text encoder the ids are for came from: training encodes them with it."""
    vocab_size: int
    """The tokenizers' vocabulary size: every stored id is below it."""
    columns: tuple[str, ...]
    """The columns of each tokenizer's ids, in the text encoders' order: data.caption_column first, then (SDXL) the
    second tokenizer's. A batch holds them joined, T x L ids a row (sdtrain.model.encoders.TextEncoders)."""

    @property
    def sequences(self) -> int:
        """How many tokenizers' ids a row holds: 1, or SDXL's 2."""
        return len(self.columns)


def token_ids(metadata: Mapping[bytes, bytes] | None, where: str, column: str) -> TokenIds:
    """The text encoder, vocabulary and id columns of the token-id caption column ``column``, from its file's schema
    metadata; a DataError naming ``where`` (file and column) and the missing keys if the file does not record them."""
    metadata = metadata or {}
    missing = [key for key in (TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE) if key.encode() not in metadata]
    if missing:
        raise DataError(
            f"{where} holds integers (caption token ids), but the file's schema metadata lacks {', '.join(missing)}: "
            "training cannot know which text encoder the ids are for. Write the data with sdtrain's preprocessing "
            "(output.captions: token_ids), or record those keys (docs/data.md)"
        )
    columns = token_id_columns(metadata, where, column)
    return TokenIds(metadata[TEXT_ENCODER_SOURCE.encode()].decode(), int(metadata[TOKEN_VOCAB_SIZE.encode()]), columns)


def token_id_columns(metadata: Mapping[bytes, bytes] | None, where: str, column: str) -> tuple[str, ...]:
    """The columns of each tokenizer's ids the file records (TOKEN_ID_COLUMNS), ``column`` first; ``(column,)`` where
    it records none. A DataError naming ``where`` when ``column`` is not the first tokenizer's."""
    value = (metadata or {}).get(TOKEN_ID_COLUMNS.encode())
    if value is None:
        return (column,)
    try:
        listed = json.loads(value)
        if not isinstance(listed, list):
            raise TypeError(f"got {type(listed).__name__}")
        columns = tuple(str(name) for name in listed)
    except (ValueError, TypeError) as error:
        raise DataError(f"{where}: {TOKEN_ID_COLUMNS} is not a list of column names: {error}") from None
    if not columns:
        raise DataError(f"{where}: {TOKEN_ID_COLUMNS} names no column")
    if columns[0] != column:
        raise DataError(
            f"{where}: the file records its token ids in the columns {list(columns)} ({TOKEN_ID_COLUMNS}), one per "
            f"tokenizer in the text encoders' order: set data.caption_column to the first, {columns[0]!r}"
        )
    return columns


def vae_downsampling(metadata: Mapping[bytes, bytes] | None) -> int:
    """The VAE downsampling a file's schema metadata records (VAE_DOWNSAMPLING), else 8."""
    value = (metadata or {}).get(VAE_DOWNSAMPLING.encode())
    return 8 if value is None else int(value)


def latent_classifier(metadata: Mapping[bytes, bytes] | None) -> str | None:
    """The module a file's schema metadata names as the reader of its latents, or None."""
    value = (metadata or {}).get(LATENT_CLASSIFIER.encode())
    return None if value is None else value.decode()


def bucket_shapes(metadata: Mapping[bytes, bytes] | None, where: str) -> tuple[tuple[int, int, int], ...] | None:
    """The latent shapes of a bucketed file's buckets, or None for a file of one shape."""
    value = (metadata or {}).get(BUCKET_SHAPES.encode())
    if value is None:
        return None
    try:
        listed = [[int(d) for d in shape] for shape in json.loads(value)]
    except (ValueError, TypeError) as error:
        raise DataError(f"{where}: {BUCKET_SHAPES} is not a list of [C, H, W]: {error}") from None
    if not listed or any(len(shape) != 3 or min(shape) < 1 for shape in listed):
        raise DataError(f"{where}: {BUCKET_SHAPES} must list [C, H, W] latent shapes, got {value.decode()}")
    return tuple((c, h, w) for c, h, w in listed)


def bucket_runs(metadata: Mapping[bytes, bytes] | None, where: str, rows: int, buckets: int) -> list[tuple[int, int]]:
    """A bucketed file's runs: (bucket, rows) in row order, checked to hold its ``rows`` rows in ``buckets`` buckets."""
    value = (metadata or {}).get(BUCKET_RUNS.encode())
    if value is None:
        raise DataError(
            f"{where}: a bucketed file ({BUCKET_SHAPES}) without {BUCKET_RUNS}: its rows' buckets are unknown"
        )
    try:
        runs = [(int(b), int(n)) for b, n in json.loads(value)]
    except (ValueError, TypeError) as error:
        raise DataError(f"{where}: {BUCKET_RUNS} is not a list of [bucket, rows]: {error}") from None
    if sum(n for _, n in runs) != rows or any(not 0 <= b < buckets or n < 0 for b, n in runs):
        raise DataError(
            f"{where}: {BUCKET_RUNS} {value.decode()} does not cover the file's {rows} rows in its {buckets} buckets"
        )
    return runs


def latent_scaling(metadata: Mapping[bytes, bytes] | None) -> float | None:
    """The factor a file's schema metadata says its latents carry, or None."""
    value = (metadata or {}).get(LATENT_SCALING_FACTOR.encode())
    return None if value is None else float(value)


def describe_scaling(factor: float | None) -> str:
    return "no factor" if factor is None else f"latents multiplied by {factor:g}"


@dataclass(frozen=True)
class EncoderSources:
    """Where a dataset's latents and caption embeddings came from: diffusers model directories or hub ids holding
    vae/ and tokenizer/ + text_encoder/ subfolders."""

    vae: str
    text_encoder: str
    resolution: int | None = None


def encoder_sources(files: list[str]) -> EncoderSources | None:
    """The VAE and text encoder the first of ``files`` records in its parquet metadata, if any.

    Args:
        files: parquet files written by the preprocessing job (or any parquet: None when they record nothing).
    """
    for file in files[:1]:
        metadata = read_schema(file, "the data's encoders").metadata or {}
        if VAE_SOURCE.encode() in metadata and TEXT_ENCODER_SOURCE.encode() in metadata:
            resolution = metadata.get(RESOLUTION.encode())
            return EncoderSources(
                vae=metadata[VAE_SOURCE.encode()].decode(),
                text_encoder=metadata[TEXT_ENCODER_SOURCE.encode()].decode(),
                resolution=int(resolution) if resolution else None,
            )
    return None
