"""The preprocessing job: images and captions in, the parquet latents training reads out.

A Ray Data pipeline over the shards not yet done: a CPU stage (one task per shard: read, decode, convert to RGB,
resize and center-crop, skip and count bad rows) feeds an actor pool that runs the VAE and the text encoder (GPU
actors where the cluster has GPUs). Once a shard's last row is encoded, a Ray task where its rows are writes its
file whole (sdtrain.preprocess.shard_writes: the driver holds references, never rows), so an interrupted job loses
at most the shards in flight, and a re-run does only the shards without a file. A done shard is matched by its
source (sdtrain.preprocess.sources), not its name alone: one whose source changed is refused, naming both; so is a
re-run that would cut images to other buckets than the output's shards (sdtrain.preprocess.recorded_buckets).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdtrain.config.learning import Columns
from sdtrain.data.directory_index import write_directory_index
from sdtrain.data.listing import DIRECTORY_INDEX
from sdtrain.data.metadata import (
    BUCKET_SHAPES,
)
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.preprocess.buckets import Placement
from sdtrain.preprocess.config import ImageConfig, InputConfig, PreprocessConfig
from sdtrain.preprocess.images import NO_CAPTION, clean_caption, prepare_image
from sdtrain.preprocess.model_outputs import (
    check_model,
    exists,
    output_columns,
    vae_geometry,
    write_unconditional,
)
from sdtrain.preprocess.outputs import (
    MANIFEST_FILE,
    RESUME_KEYS,
    check_settings,
    done_shards,
    join,
    settle_shards,
    summarize,
    write_shards_digest,
)
from sdtrain.preprocess.recorded_buckets import check_buckets
from sdtrain.preprocess.shard_size import check_shard_size
from sdtrain.preprocess.shard_writes import ShardFiles, write_shards
from sdtrain.preprocess.sources import Shard, changed_source, list_shards, read_shard, shard_prefix
from sdtrain.storage.filesystems import write_bytes
from sdtrain.storage.s3 import S3Settings, apply_s3_settings, configure_s3, resolved_s3_settings
from sdtrain.storage.uris import absolute, is_uri


@dataclass
class PreprocessSummary:
    shards_total: int
    shards_done_before: int
    shards_written: list[str] = field(default_factory=list)
    shards_failed: dict[str, str] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def run_preprocess(config: PreprocessConfig, max_shards: int | None = None) -> PreprocessSummary:
    """Preprocess every shard of ``config.input`` that ``config.output.path`` does not hold yet.

    Args:
        config: the job's configuration.
        max_shards: do at most this many of the pending shards (a partial run; a later run does the rest).
    """
    import ray

    started = time.perf_counter()
    config = with_absolute_paths(config)
    configure_s3(config.storage.endpoint_url, config.storage.max_attempts)
    # First: check_settings records input.rows_per_shard in the output, after which it could not be lowered.
    check_shard_size(config)
    found = done_shards(config.output.path)
    done = {record["shard"]: record for record in found.records}
    shards = list_shards(config.input, done)
    pending = [s for s in shards if s.name not in done][:max_shards]
    summary = PreprocessSummary(len(shards), len(shards) - len([s for s in shards if s.name not in done]))
    # Before anything is recorded: a model that cannot be read, recorded in _settings.json, refused its correction.
    sdxl = check_model(config.encode.model)
    settings = config.to_dict()
    check_settings(config.output.path, {k: settings[k.split(".")[0]][k.split(".")[1]] for k in RESUME_KEYS})
    check_buckets(config.output.path, config.image, done)
    check_sources(config.output.path, shards, done)
    settle_shards(config.output.path, done, shard_prefix(config.input))
    scaling_factor, latent_channels, downsampling = vae_geometry(config.encode.model)
    vocab_size, unconditional = write_unconditional(config)
    try:
        if pending:
            if not ray.is_initialized():
                ray.init()  # a submitted job's cluster, RAY_ADDRESS, the one `ray start` runs here, else a new one
            latent_shapes = [[latent_channels, h // downsampling, w // downsampling] for h, w in config.image.shapes()]
            vae = (scaling_factor, downsampling)
            _run_pipeline(config, pending, vae, vocab_size, latent_shapes, summary, done, sdxl)
    finally:  # a failed run's shards too: the next run reads one file for them, not two requests a marker
        if summary.shards_written or found.markers_read:
            _write_digest(config.output.path, done)
    stats = [done[name] for name in sorted(done)]  # the records read at the start and those this run wrote
    summary.manifest = {
        **summarize(stats),
        "shards_in_input": len(shards),
        "failed_shards_last_run": summary.shards_failed,
        "latent_scaling_factor": scaling_factor,
        "vae_downsampling": downsampling,
        "unconditional_caption": unconditional,
        "resolution": config.image.resolution,
        "model": config.encode.model,
        "config": config.to_dict(),
    }
    write_bytes(join(config.output.path, MANIFEST_FILE), json.dumps(summary.manifest, indent=2).encode())
    # A run that wrote nothing keeps the index already there.
    if summary.shards_written or not exists(join(config.output.path, DIRECTORY_INDEX)):
        _write_index(config, stats, summary.shards_written)
    summary.seconds = time.perf_counter() - started
    return summary


def _write_digest(output: str, done: dict[str, dict[str, Any]]) -> None:
    try:
        write_shards_digest(output, [done[name] for name in sorted(done)])
    except Exception as error:  # the markers stay the record: the next run reads them instead
        log.warning(f"output.path: could not write the done shards' digest ({error}); the next run reads every marker")


def _write_index(config: PreprocessConfig, stats: list[dict[str, Any]], shards_written: list[str]) -> None:
    """The dataset index beside the shards (rows from the shards' records, sizes and versions from one listing):
    training on this output reads no footer (sdtrain.data.dataset_index)."""
    rows = {f"{shard['shard']}.parquet": int(shard["rows_written"]) for shard in stats if shard.get("rows_written")}
    written = [f"{name}.parquet" for name in shards_written if f"{name}.parquet" in rows]
    try:  # its schema and values per row from a shard this run wrote, where it wrote one with rows
        write_directory_index(
            config.output.path,
            # One index, of one caption column: the ids where they are the only captions, else the embeddings
            # (training on the ids of output.captions=both reads their footers at its first start).
            Columns(
                config.output.latent_column,
                config.output.token_id_column
                if config.output.captions == "token_ids"
                else config.output.caption_column,
            ),
            # Bucketed output: its files' runs from their footers (or the index already there), not the records.
            rows if config.image.buckets == "square" else None,
            written[0] if written else None,
        )
    except DataError as e:  # the shards are done whatever the index: training reads their footers instead
        log.info(f"no dataset index written beside the shards: {e}")


def check_sources(output: str, shards: list[Shard], done: dict[str, dict[str, Any]]) -> None:
    """Refuse to resume an output whose done shards were made from other sources than the input's shards of the
    same name (a file rewritten in place: skipping its shard would lose its new rows, redoing it could leave rows of
    its old ones in other shards), or that records no sources at all (written by an earlier sdtrain, whose shard
    names held the input's file name only: two inputs' 00000.parquet shared one)."""
    unrecorded = sorted(name for name, record in done.items() if "identity" not in record)
    if unrecorded:
        raise DataError(
            f"output.path: {output} holds shards that record no source (_shards/{unrecorded[0]}.json"
            + (f" and {len(unrecorded) - 1} more" if len(unrecorded) > 1 else "")
            + ": written by an earlier sdtrain, which named shards by file name alone); "
            "resuming it could skip new inputs or write rows twice: write to a new output.path"
        )
    for shard in shards:
        why = changed_source(shard, done[shard.name]) if shard.name in done else None
        if why:
            raise DataError(
                f"input.paths: {why}: resumed by name, its new rows would be lost or rows written twice; write to "
                f"another output.path, or delete {join(output, '_shards', shard.name + '.json')} and "
                f"{shard.name}.parquet beside it to redo the shard"
            )


def with_absolute_paths(config: PreprocessConfig) -> PreprocessConfig:
    """Local paths made absolute: Ray's workers do not share the driver's working directory, and the model's path
    is recorded in the output for training, export and generate.py to find from anywhere. A model path that is
    not a local directory stays as it is (a hub id looks like a relative path)."""
    model = config.encode.model
    if not is_uri(model) and os.path.isdir(os.path.expanduser(model)):
        model = absolute(model)
    captions_file = config.input.captions_file
    return dataclasses.replace(
        config,
        input=dataclasses.replace(
            config.input,
            paths=[absolute(p) for p in config.input.paths],
            captions_file=absolute(captions_file) if captions_file else None,
        ),
        encode=dataclasses.replace(config.encode, model=model),
        output=dataclasses.replace(config.output, path=absolute(config.output.path)),
    )


def _run_pipeline(
    config: PreprocessConfig,
    pending: list[Shard],
    vae: tuple[float, int],
    vocab_size: int,
    latent_shapes: list[list[int]],
    summary: PreprocessSummary,
    records: dict[str, dict[str, Any]],
    sdxl: bool,
):
    """Runs Ray Data's pipeline over the pending shards, each shard's file written by a task once its last row is in.

    Args:
        vae: the VAE's scaling factor and downsampling (pixels per latent side).
        records: the shards' records by name, to which each shard written adds its own.
        sdxl: whether the model is SDXL-shaped (model_outputs.check_model), handed to the encoders.
    """
    columns, metadata = output_columns(config, *vae, vocab_size)
    if config.image.buckets == "aspect":
        metadata[BUCKET_SHAPES] = json.dumps(latent_shapes)
    files = ShardFiles(config.output.path, columns, metadata, config.output.row_group_rows, resolved_s3_settings())

    def written(name: str, stats: dict[str, Any]) -> None:
        summary.shards_written.append(name)
        records[name] = stats

    write_shards(
        _pipeline(config, pending, sdxl), [s.name for s in pending], files, written, summary.shards_failed.__setitem__
    )


def _pipeline(config: PreprocessConfig, pending: list[Shard], sdxl: bool) -> Any:
    """Ray Data's plan: a row per pending shard, the CPU stage's rows of each, the encoders' batches."""
    import ray
    import ray.data

    from sdtrain.preprocess.encode_stage import Encoder

    num_gpus = encoder_gpus(config.encode.num_gpus, ray.cluster_resources().get("GPU", 0))
    # A cluster started apart from this driver sees neither storage.endpoint_url nor the driver's
    # AWS_ENDPOINT_URL: the read tasks and the encoders (a model on s3://) are handed them.
    s3 = resolved_s3_settings()
    # Each shard in its own row: a stage function holding the whole list was unpickled by every task (1.4 s a task
    # at 2e5 shards, 77 CPU-hours in all).
    shards = ray.data.from_items(
        [{"shard": pickle.dumps(shard)} for shard in pending], override_num_blocks=len(pending)
    )
    # flat_map: a shard in, its rows out. Ray Data fuses a task stage into the actor stage after it when both ask
    # for the same resources (encoders without a GPU), but not a stage that changes the number of rows ahead of a
    # batched one: the CPU stage runs as tasks on every free CPU, beside the encoders, instead of inside them.
    rows = shards.flat_map(_Prepare(config.input, config.image, s3), num_cpus=1)
    return rows.map_batches(
        Encoder,
        compute=ray.data.ActorPoolStrategy(size=config.encode.concurrency),
        fn_constructor_kwargs=dict(
            model=config.encode.model,
            latent=config.encode.latent,
            seed=config.encode.seed,
            dtype=config.encode.dtype,
            resolution=config.image.resolution,
            s3=s3,
            captions=config.output.captions,
            buckets=config.image.buckets,
            sdxl=sdxl,
        ),
        batch_size=config.encode.batch_size,
        batch_format="numpy",
        num_gpus=num_gpus,
    )


def encoder_gpus(setting: float | str, cluster_gpus: float) -> float:
    """GPUs each encoder actor asks for: encode.num_gpus, or for auto 1 where the cluster has GPUs now, else 0.
    auto sees only the nodes already up: on an autoscaling cluster whose GPU nodes have not started yet it is 0
    and the encoders run on CPUs in float32, which is logged as a warning (set encode.num_gpus=1 there)."""
    if setting != "auto":
        return float(setting)
    if cluster_gpus:
        log.info(f"encode.num_gpus: auto: the cluster has {cluster_gpus:g} GPU(s) now: 1 GPU per encoder actor")
        return 1
    log.warning(
        "encode.num_gpus: auto: the cluster has no GPU now, so the encoders run on CPUs (float32, far slower). "
        "auto sees only the nodes already started, not GPU nodes an autoscaling cluster has yet to start: there, "
        "set encode.num_gpus=1"
    )
    return 0


class _Prepare:
    """The CPU stage: a shard's prepared rows, then one row (valid false) with the shard's counts, so the driver
    knows when it has all of the shard."""

    def __init__(self, input_config: InputConfig, image_config: ImageConfig, s3: S3Settings):
        self.input, self.image, self.s3 = input_config, image_config, s3
        self.buckets = image_config.shapes()

    def __call__(self, row: dict[str, Any]) -> Iterator[dict[str, Any]]:
        apply_s3_settings(self.s3)
        yield from self._shard(pickle.loads(row["shard"]))  # the driver's own Shard, made by list_shards

    def _shard(self, shard: Shard) -> Iterator[dict[str, Any]]:
        stats: dict[str, Any] = {
            "shard": shard.name,
            "source": shard.source,
            "identity": shard.identity,
            "inputs_read": 0,
            "rows_written": 0,
        }
        skipped: dict[str, int] = {}
        try:
            for row in read_shard(shard, self.input):
                number = stats["inputs_read"]
                stats["inputs_read"] += 1
                caption = clean_caption(row.caption)
                pixels, placed = (
                    (None, row.skip) if row.skip else prepare_image(row.image, self.buckets, self.image.small_images)
                )
                reason = placed if isinstance(placed, str) else (NO_CAPTION if caption is None else None)
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                assert pixels is not None and caption is not None and isinstance(placed, Placement)
                stats["rows_written"] += 1
                yield _row(shard, number, row.key, pixels, caption, placed, "")
        except Exception as e:  # an unreadable file (truncated tar, vanished object): the shard fails, not the job
            stats["error"] = f"{type(e).__name__}: {e}"
        stats["skipped"] = dict(sorted(skipped.items()))
        # Square: the one shape, so a batch stays one array. Aspect: any shape (the encoder takes each row's shape,
        # and a batch of bucket 0's rows and this one is all one shape, which it handles too).
        height, width = self.buckets[0]
        empty = np.zeros((height, width, 3), np.uint8)
        yield _row(shard, -1, "", empty, "", None, json.dumps(stats))


def _row(
    shard: Shard, index: int, key: str, pixels: Any, caption: str, placed: Placement | None, stats: str
) -> dict[str, Any]:
    """A prepared row (``placed``: where its image went), or with none the shard's counts (``stats``)."""
    placed = placed or Placement(0, (0, 0), (0, 0), False)
    return {
        "shard": shard.name,
        "index": index,
        "key": key,
        "pixels": pixels,
        "caption": caption,
        "caption_text": caption,
        "valid": bool(not stats),
        "stats": stats,
        "bucket": placed.bucket,
        "original_height": placed.original_size[0],
        "original_width": placed.original_size[1],
        "crop_top": placed.crop_top_left[0],
        "crop_left": placed.crop_top_left[1],
    }
