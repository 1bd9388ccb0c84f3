"""The data of a run against its model, on the driver before Ray starts: data.train and data.val listed and indexed
(:mod:`sdtrain.data.dataset_index`), their columns and shapes checked against the UNet and each other, token ids
against their text encoder, and the latent scaling factor the files record."""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Mapping

import numpy as np
import pyarrow.fs as pafs

from sdtrain.config.schema import Config
from sdtrain.data.added_columns import PLACEMENT_COLUMNS, AddedColumns
from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.bucket_turns import auto_bucket_steps, consecutive_rows, fitting_bucket_steps
from sdtrain.data.dataset_index import IndexedDataset, IndexStats, index_dataset
from sdtrain.data.index_format import run_index_uri
from sdtrain.data.inspection import DatasetSpec, first_row
from sdtrain.data.metadata import TOKEN_ID_COLUMNS, vae_downsampling
from sdtrain.data.read_order import ReadPlan, SamplePlan, files_digest
from sdtrain.errors import ConfigError, DataError
from sdtrain.logs import log
from sdtrain.model.conditioning import pooled_width
from sdtrain.model.recipe import load_unconditional_caption, stored_latent_scaling
from sdtrain.model.token_captions import check_text_encoder, text_encoder_configs
from sdtrain.model.unet import check_unet, unet_config
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import UNCONDITIONAL_FILE, UNCONDITIONAL_IDS_FILE
from sdtrain.storage.uris import is_uri


def check_data(config: Config, run_dir: str) -> tuple[IndexedDataset, IndexedDataset | None, float | None]:
    """data.train and data.val, checked against the UNet and each other; and the latent scaling factor the files
    record."""
    require_train_data(config)
    unet = unet_config(config.model)
    # The run's dataset index (its first start reads the footers; later starts, the index and changed files).
    train_data = indexed_dataset(config, "data.train", config.data.train, unet, run_dir)
    val_data = indexed_dataset(config, "data.val", config.data.val, unet, run_dir) if config.data.val else None
    train = train_data.spec
    warn_of_large_row_groups(train_data.stats, config.data.shuffle_chunk_rows)
    warn_of_small_shares(train_data.stats, train, config)
    warn_of_runs_across_row_groups(train_data.stats, config.data.shuffle_chunk_rows)
    _check_shapes_agree(train, val_data.spec if val_data is not None else None)
    captions = train.embedding_shape(unet["cross_attention_dim"])
    check_unet(config.model, train.latent_shape, captions)  # on the meta device, in a second
    check_buckets(config, train, train_data.schema_file)
    if val_data is not None:
        check_buckets(config, val_data.spec, val_data.schema_file, "data.val")
    if pooled_width(unet) is not None and config.data.unconditional_caption not in ("zeros", "auto"):
        raise ConfigError(
            f"data.unconditional_caption: {config.data.unconditional_caption} is no empty prompt for an SDXL-shaped "
            "UNet, which drops captions to zeros, hidden states and pooled embedding alike, as SDXL was trained and "
            "as its pipelines sample (force_zeros_for_empty_prompt); set data.unconditional_caption: zeros"
        )
    if config.data.unconditional_caption != "auto":  # auto: checked as it is resolved (unconditional_caption_of)
        load_unconditional_caption(config.data.unconditional_caption, captions, token_ids=train.token_ids is not None)
    stored_scale = stored_latent_scaling(
        [(data.schema_file, data.schema_metadata) for data in (train_data, val_data) if data is not None], config.data
    )
    buckets = train.bucket_shapes
    latents = train.latent_shape if buckets is None else f"in {len(buckets)} aspect-ratio buckets"
    log.info(
        f"data.train: {train.num_rows} rows in {len(train.files)} file(s), latents {latents}, captions "
        f"{_describe_captions(train)}; {_describe_steps(train, config)}"
    )
    if train.num_rows < config.train.global_batch_size:
        raise DataError(
            f"data.train: {train.num_rows} rows cannot fill one step of train.global_batch_size="
            f"{config.train.global_batch_size} samples; add data or lower the batch size"
        )
    return train_data, val_data, stored_scale


def unconditional_caption_of(config: Config, train: DatasetSpec) -> Config:
    """``config`` with data.unconditional_caption: auto resolved (others as they are): the empty prompt's embedding, or
    ids for token-id data, that preprocessing wrote beside data.train's first file, checked against the data's
    captions; zeros where there is none, and for an SDXL-shaped UNet."""
    if config.data.unconditional_caption != "auto":
        return config
    unet = unet_config(config.model)
    name = UNCONDITIONAL_IDS_FILE if train.token_ids is not None else UNCONDITIONAL_FILE
    found = None if pooled_width(unet) is not None else _beside(train.files[0], name)
    if found is not None:
        try:
            captions = train.embedding_shape(unet["cross_attention_dim"])
            load_unconditional_caption(found, captions, token_ids=train.token_ids is not None)
        except ConfigError as e:
            raise ConfigError(
                f"{e} (data.unconditional_caption: auto found it beside data.train's first file; set "
                "data.unconditional_caption to the empty prompt's embedding the data was encoded with, or zeros)"
            ) from None
    if found is not None:
        why = "beside data.train's first file"
    elif pooled_width(unet) is not None:
        why = "an SDXL-shaped UNet drops captions to zeros"
    else:
        why = f"no {name} beside data.train's first file"
    resolved = found or "zeros"
    log.info(f"data.unconditional_caption: auto: {resolved} ({why}; a resumed run keeps its checkpoint's)")
    return dataclasses.replace(config, data=dataclasses.replace(config.data, unconditional_caption=resolved))


def _beside(file: str, name: str) -> str | None:
    """``name`` in ``file``'s directory, if it is a file there."""
    directory = posixpath.dirname(file) if is_uri(file) else os.path.dirname(file)
    candidate = posixpath.join(directory, name) if is_uri(file) else os.path.join(directory, name)
    fs, path = filesystem_for(candidate)
    return candidate if fs.get_file_info(path).type == pafs.FileType.File else None


def require_train_data(config: Config) -> None:
    """A ConfigError for a config without data.train: a retraining config's (retrain.data_root), which
    entrypoints/retrain.py runs, setting data.train to each round's partitions; training and its check train
    data.train."""
    if not config.data.train:
        raise ConfigError(
            "data.train: is empty: a retraining config (retrain.data_root) runs with entrypoints/retrain.py, which "
            "sets data.train to each round's new partitions; to train or check it, set data.train to the data to "
            "train on (a parquet file, directory, glob or list of them)"
        )


def dataset_spec(config: Config, key: str, specs: list[str], unet: Mapping) -> DatasetSpec:
    """The files ``specs`` name, read and checked against the UNet config ``unet`` (from the run's dataset
    index where it has them; nothing is written)."""
    run_dir = config.run.directory
    return indexed_dataset(config, key, specs, unet, run_dir).spec


def indexed_dataset(config: Config, key: str, specs: list[str], unet: Mapping, run_dir: str) -> IndexedDataset:
    """The files ``specs`` name, checked against ``unet``, with the run's dataset index of them (read from
    ``run_dir``'s, or from one beside the data, for the files whose size and version it records; the others'
    footers read). The caller writes ``.index`` to :func:`run_index_uri` when ``.stale``. Token-id captions: their
    text encoder checked against the UNet (its config only)."""
    indexed = index_dataset(
        specs,
        key,
        columns=config.data.columns,
        in_channels=unet["in_channels"],
        cross_attention_dim=unet["cross_attention_dim"],
        index_uri=run_index_uri(run_dir, key),
    )
    ids = indexed.spec.token_ids
    if ids is not None:
        where = f"{key}: {indexed.schema_file}, column {config.data.caption_column!r}"
        check_text_encoder(ids, where, unet["cross_attention_dim"], pooled_width(unet))
        tokenizers = len(text_encoder_configs(ids.text_encoder))
        if ids.sequences != tokenizers:
            raise DataError(
                f"{where}: the files hold the ids of {ids.sequences} tokenizer(s), in {list(ids.columns)}, but "
                f"{ids.text_encoder} has {tokenizers}: store each tokenizer's ids in a column of its own and name "
                f"the columns in order in the files' {TOKEN_ID_COLUMNS} (sdtrain's preprocessing writes "
                "caption_ids and caption_ids_2 for an SDXL model)"
            )
    added = added_columns(config, key, indexed, unet)
    downsampling = vae_downsampling(indexed.schema_metadata)
    indexed.spec = dataclasses.replace(indexed.spec, added=added, vae_downsampling=downsampling)
    return indexed


def added_columns(config: Config, key: str, indexed: IndexedDataset, unet: Mapping) -> AddedColumns | None:
    """What an SDXL-shaped UNet's added conditioning is read from (sdtrain.data.added_columns): the pooled embedding
    column of caption embeddings (refused, naming it, if the files lack it or hold another width), the rows'
    placement where the files have it. None for an SD 1/2 UNet."""
    width = pooled_width(unet)
    if width is None:
        return None
    schema, file = indexed.index.checked.schema, indexed.schema_file
    placement = all(name in schema.names for name in PLACEMENT_COLUMNS)
    if not placement:
        log.info(
            f"{key}: {file} records no placement ({', '.join(PLACEMENT_COLUMNS)}): the UNet's size conditioning "
            "takes each image to be its latents' own size, uncropped"
        )
    if indexed.spec.token_ids is not None:  # the text encoders make the pooled embedding in the step
        return AddedColumns(None, width, placement)
    column = config.data.pooled_caption_column
    where = f"{key}: {file}, column {column!r} (data.pooled_caption_column)"
    if column not in schema.names:
        raise DataError(
            f"{where}: no such column. An SDXL-shaped UNet takes each caption's pooled text embedding ({width} values "
            "a row) beside its hidden states: preprocess with an SDXL model (encode.model with text_encoder_2/), or "
            "name the column that holds it"
        )
    values = np.asarray(first_row(file, key, [column]).column(column).to_pylist()[0]).size
    if values != width:
        raise DataError(
            f"{where} holds {values} values a row, but the UNet's pooled text embedding is {width} wide "
            "(projection_class_embeddings_input_dim less its time ids)"
        )
    return AddedColumns(column, width, placement)


ROW_GROUP_CHUNKS = 4
"""Row groups of more than this many chunks (data.shuffle_chunk_rows) are warned of."""


def warn_of_large_row_groups(stats: IndexStats, chunk_rows: int) -> None:
    """One warning when the largest row group of the data.train footers read at this start holds more than
    ROW_GROUP_CHUNKS chunks: each read of a chunk reads its whole row group (files written with one row group each
    read the whole file for every chunk)."""
    if stats.largest_row_group is None or stats.largest_row_group[0] <= ROW_GROUP_CHUNKS * chunk_rows:
        return
    rows, file = stats.largest_row_group
    log.warning(
        f"data.train: {file} has row groups of {rows} rows, and every read of a chunk of data.shuffle_chunk_rows="
        f"{chunk_rows} rows reads its whole row group: about {rows / chunk_rows:.0f}x the data the chunk needs. "
        f"Rewrite the files with pyarrow.parquet.write_table(..., row_group_size={chunk_rows}) (sdtrain's "
        f"preprocessing: output.row_group_rows={chunk_rows}), or raise data.shuffle_chunk_rows"
    )


def warn_of_small_shares(stats: IndexStats, spec: DatasetSpec, config: Config) -> None:
    """One warning when bucketed data.train's row groups (of the footers read at this start) hold more rows than a rank
    reads at a time at the most workers: its share of a step, consecutive rows of its bucket's order, or over a turn
    of data.bucket_steps steps its lanes (sdtrain.data.bucket_turns); a read reads the row groups it touches whole."""
    if spec.bucket_shapes is None or stats.largest_row_group is None:
        return
    (group, file), batch, workers = stats.largest_row_group, config.train.global_batch_size, config.scaling.max_workers
    steps, chunk = bucket_steps(config), config.data.shuffle_chunk_rows
    share = batch // workers
    rows = consecutive_rows(steps, chunk, share)
    if rows >= group:
        return
    # s consecutive rows at a random place touch 1 + (s - 1) / g row groups of g rows on average.
    amplification = (group + rows - 1) / rows
    fitting = fitting_bucket_steps(chunk, batch, share, group)
    turns = (
        ""
        if fitting is None or fitting <= steps
        else f"set data.bucket_steps={fitting} (steps of one bucket in a row), or "
    )
    log.warning(
        f"data.train: {file} has row groups of {group} rows, but on {workers} workers (scaling.num_workers) each "
        f"reads {share} rows of a step (train.global_batch_size={batch} / {workers})"
        + ("" if steps == 1 else f", {rows} consecutive rows over data.bucket_steps={steps} steps")
        + ", and every read of bucketed data reads the row groups its rows are in whole: about "
        f"{amplification:.0f}x the rows training uses, in object-storage reads and in each read task's memory. To read "
        f"about what it uses, {turns}rewrite the files with row groups of at most {rows} rows (sdtrain's "
        f"preprocessing: output.row_group_rows={rows}; pyarrow.parquet.write_table(..., row_group_size={rows}))"
    )


def warn_of_runs_across_row_groups(stats: IndexStats, chunk_rows: int) -> None:
    """One warning when bucketed data.train files whose footers were read at this start have row groups that do not
    start at each bucket run, of at least half a chunk (below, the cost is small; above four chunks,
    warn_of_large_row_groups says more): a chunk of a run (sdtrain.data.bucket_runs) then most often takes parts of
    two row groups, and a read reads both whole."""
    if stats.runs_across_groups is None or stats.largest_row_group is None:
        return
    (files, file), group = stats.runs_across_groups, stats.largest_row_group[0]
    if not chunk_rows / 2 <= group <= ROW_GROUP_CHUNKS * chunk_rows:
        return
    log.warning(
        f"data.train: {files} of the {stats.footers_read} file(s) whose footers this start read (one: {file}) have row "
        "groups that do not start at each aspect-ratio bucket run (sdtrain's preprocessing starts one at each since "
        f"2026-12-01): a chunk of data.shuffle_chunk_rows={chunk_rows} rows of a run then takes parts of two row "
        f"groups of up to {group} rows, and every read reads them whole: about {1 + group / chunk_rows:.1f}x the rows "
        "training uses, where files with a row group starting at each run are read about once. Copy them so, on "
        "CPUs and with nothing encoded again: python entrypoints/realign_row_groups.py <their directory> <a new "
        "one> (docs/data.md, Aspect-ratio buckets)"
    )


def _describe_captions(spec: DatasetSpec) -> str:
    if spec.token_ids is None:
        return str(spec.caption_shape)
    return f"{spec.caption_shape[0]} token ids for {spec.token_ids.text_encoder} (encoded in the step)"


def _check_shapes_agree(train: DatasetSpec, val: DatasetSpec | None) -> None:
    """data.val's rows are of data.train's kind. Bucketed data's latent_shape is its most common bucket, which may
    differ between sets of the same buckets (a validation set of mostly 4:3 photographs): bucketed validation data
    agrees in channels, and check_buckets checks each of its buckets against the UNet."""
    if val is None:
        return
    if val.bucket_shapes is not None:
        latents_agree = val.latent_shape[0] == train.latent_shape[0]
    else:  # one shape: the training data's, or one of its buckets
        latents_agree = val.latent_shape in (train.bucket_shapes or (train.latent_shape,))
    if (
        not latents_agree
        or val.caption_shape != train.caption_shape
        or (val.token_ids and val.token_ids.text_encoder) != (train.token_ids and train.token_ids.text_encoder)
    ):
        raise ConfigError(
            f"data.val holds latents {_describe_latents(val)} and captions {_describe_captions(val)}, but data.train "
            f"holds {_describe_latents(train)} and {_describe_captions(train)}; validation data must match training "
            "data"
        )


def _describe_steps(spec: DatasetSpec, config: Config) -> str:
    steps = spec.num_rows // config.train.global_batch_size
    if spec.bucket_shapes is None:
        return f"{steps} steps per epoch"
    # A bucket's rows short of a batch (a turn) are carried into the next epoch: about this many steps an epoch.
    turns = bucket_steps(config)
    if turns == 1:
        return f"about {steps} steps per epoch"
    workers = config.scaling.max_workers
    auto = f" (data.bucket_steps=auto: each of up to {workers} workers reads whole chunks)" * (
        config.data.bucket_steps == "auto"
    )
    return f"about {steps} steps per epoch, in turns of {turns} steps of one bucket{auto}"


def bucket_steps(config: Config) -> int:
    """data.bucket_steps, auto resolved for a new run (sdtrain.data.bucket_turns.auto_bucket_steps); a resumed run
    keeps its checkpoint's turns (BucketPlan.resumed_as)."""
    if isinstance(config.data.bucket_steps, int):
        return config.data.bucket_steps
    return auto_bucket_steps(config.data.shuffle_chunk_rows, config.train.global_batch_size, config.scaling.max_workers)


def _describe_latents(spec: DatasetSpec) -> str:
    if spec.bucket_shapes is None:
        return str(spec.latent_shape)
    return f"of {spec.latent_shape[0]} channels in buckets {', '.join(str(s) for s in spec.bucket_shapes)}"


def check_buckets(config: Config, spec: DatasetSpec, file: str, key: str = "data.train") -> None:
    """Every aspect-ratio bucket's latent sides are multiples of what the UNet downsamples them by (else its skip
    connections would not line up), naming the file and the bucket (``key``: the config key naming the files)."""
    if spec.bucket_shapes is None:
        return
    factor = 2 ** (len(unet_config(config.model)["block_out_channels"]) - 1)
    for index, (_, height, width) in enumerate(spec.bucket_shapes):
        if height % factor or width % factor:
            raise DataError(
                f"{key}: {file}: bucket {index} holds latents of {height} x {width}, which the UNet cannot take: "
                f"it halves them {factor.bit_length() - 1} times, so each side must be a multiple of {factor}. "
                "Preprocess with an image.bucket_step that makes them so (the VAE's downsampling times this)"
            )


def read_plan(spec: DatasetSpec, config: Config) -> ReadPlan:
    """The order data.train is read in: by aspect-ratio bucket where its files are bucketed
    (:mod:`sdtrain.data.bucket_order`), else the one-shape plan (:mod:`sdtrain.data.read_order`)."""
    data = config.data
    if spec.bucket_shapes is not None:
        assert spec.runs is not None
        return BucketPlan(
            spec.rows_per_file,
            spec.runs,
            spec.bucket_shapes,
            config.train.seed,
            data.shuffle_chunk_rows,
            config.train.global_batch_size,
            data.shuffle_window_rows,
            files_digest(spec.files),
            spec.content_digest,
            bucket_steps(config),
        )
    return SamplePlan(
        spec.rows_per_file,
        config.train.seed,
        data.shuffle_chunk_rows,
        data.shuffle_window_rows,
        files_digest(spec.files),
        spec.content_digest,
    )
