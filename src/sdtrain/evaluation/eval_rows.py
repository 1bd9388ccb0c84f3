"""The rows an evaluation samples and compares against: the first eval.num_samples rows of data.val (or of the set an
offline evaluation names), grouped by latent shape (aspect-ratio buckets), with their captions, texts and labels."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sdtrain.config.schema import Config
from sdtrain.data.added_columns import AddedColumns
from sdtrain.data.decode import column_layout
from sdtrain.data.footer import read_schema
from sdtrain.data.listing import list_dataset
from sdtrain.data.metadata import bucket_shapes, token_id_columns
from sdtrain.data.rows import RowReader


@dataclass
class ShapeGroup:
    """The rows of data.val's first eval.num_samples of one latent shape (an aspect-ratio bucket)."""

    shape: tuple[int, int, int]
    """(C, H, W) of their latents: what they are sampled at."""
    rows: np.ndarray
    """Their positions among the rows (EvalRows.captions, .texts, .labels), ascending."""
    latents: np.ndarray | None
    """(n, C, H, W) as stored; None for rows without images (prompts in words: no reference of their own)."""


@dataclass
class EvalRows:
    """The first eval.num_samples rows of data.val: what every evaluation of a run samples and compares against."""

    groups: list[ShapeGroup]
    """The rows by latent shape: one group for data of one shape; a bucket each for aspect-ratio buckets (each sample
    is generated at its row's bucket and compared with the images of the same rows)."""
    captions: np.ndarray | None
    """(N, L, D) embeddings, or (N, L) token ids; None for prompts in words (texts), which each model's own text
    encoder encodes (:mod:`sdtrain.evaluation.offline`)."""
    texts: list[str] | None
    """eval.text_column's captions, when it is measured (clip_score); or the prompts."""
    labels: np.ndarray | None
    """data.val's label column, for class_agreement."""
    files: list[str]
    """The files the rows came from (part of the reference statistics' key)."""
    versions: list[tuple[int, str]]
    """Their (size, version) as listed (the S3 ETag, or the local mtime in ns): a file rewritten in place changes it."""
    pooled: np.ndarray | None = None
    """(N, P) pooled embeddings of caption embeddings, for an SDXL-shaped UNet (data.pooled_caption_column)."""

    def __len__(self) -> int:
        return sum(len(group.rows) for group in self.groups)


def read_eval_rows(
    config: Config,
    latent_shape: tuple[int, ...],
    caption_shape: tuple[int, ...],
    sources: Sequence[str] | None = None,
    key: str = "data.val",
    measured: bool = True,
    pooled_width: int | None = None,
) -> EvalRows:
    """The first eval.num_samples rows of data.val in file order (fewer if it holds fewer): their columns only, and
    no more of a file than they need. Bucketed files are read at each row's bucket (the buckets their footer names).

    Args:
        latent_shape: (C, H, W) of a row's latents (of data of one shape).
        caption_shape: (L, D) of a caption embedding; a column of token ids holds (L,) a row (each of SDXL's two).
        sources: the files (file, directory or glob; local or a storage URI), instead of data.val.
        key: what named them, in errors.
        measured: whether the rows are sampled (their texts for clip_score and labels for class_agreement are read),
            or only a reference's images.
        pooled_width: an SDXL-shaped UNet's pooled embedding width: caption embeddings are read with their pooled
            embeddings (data.pooled_caption_column).
    """
    texts, labels = config.eval.clip is not None and measured, config.eval.class_agreement and measured
    extra = ([config.eval.text_column] if texts else []) + (["label"] if labels else [])
    listing = list_dataset(list(sources or config.data.val), key)
    schema = read_schema(listing.paths[0], key)
    buckets = bucket_shapes(schema.metadata, listing.paths[0])
    ids = (
        config.data.caption_column in schema.names and column_layout(schema.field(config.data.caption_column)).token_ids
    )
    columns = config.data.columns
    if ids:  # each tokenizer's ids (SDXL's two), joined: T x L a row
        where = f"{key}: {listing.paths[0]}, column {columns.caption!r}"
        captions = token_id_columns(schema.metadata, where, columns.caption)
        columns = dataclasses.replace(columns, further_ids=captions[1:])
        caption_shape = (caption_shape[0] * len(captions),)
    reader = RowReader(columns, tuple(latent_shape), tuple(caption_shape), extra=tuple(extra))
    added = AddedColumns(config.data.pooled_caption_column, pooled_width, False) if pooled_width and not ids else None
    reader = dataclasses.replace(reader, bucket_shapes=buckets, added=added)
    # Batch by batch, only as many rows as are wanted: a data.val file may hold gigabytes of caption embeddings.
    batches = list(reader.batches(listing.paths, f"eval: {key}", batch_size=1024, limit=config.eval.num_samples))
    read = {batch.file for batch in batches}
    used = [i for i, file in enumerate(listing.paths) if file in read]

    def extra_column(name: str) -> pa.ChunkedArray:
        return pa.chunked_array([chunk for batch in batches for chunk in batch.extra[name].chunks])

    return EvalRows(
        groups=_by_shape([batch.latents for batch in batches if batch.latents is not None]),
        captions=np.concatenate([batch.captions for batch in batches]),
        texts=[str(t) for t in extra_column(config.eval.text_column).to_pylist()] if texts else None,
        labels=extra_column("label").to_numpy() if labels else None,
        files=[listing.paths[i] for i in used],
        versions=[(listing.sizes[i], listing.versions[i]) for i in used],
        pooled=np.concatenate([batch.added["pooled"] for batch in batches]) if added else None,
    )


def _by_shape(latents: list[np.ndarray]) -> list[ShapeGroup]:
    """Batches of rows in order, each of one shape, as groups of one shape in the order their shapes first came."""
    positions: dict[tuple[int, int, int], list[np.ndarray]] = {}
    parts: dict[tuple[int, int, int], list[np.ndarray]] = {}
    first = 0
    for batch in latents:
        shape = (int(batch.shape[1]), int(batch.shape[2]), int(batch.shape[3]))
        positions.setdefault(shape, []).append(np.arange(first, first + len(batch)))
        parts.setdefault(shape, []).append(batch)
        first += len(batch)
    return [ShapeGroup(shape, np.concatenate(positions[shape]), np.concatenate(parts[shape])) for shape in parts]
