"""What the preprocessing job writes (a later reader finds where the latents came from with
sdtrain.data.metadata.encoder_sources).

::

    <output.path>/<shard>.parquet            one file per input shard: latents, caption embeddings and/or token ids
                                             (output.captions), caption, key
    <output.path>/_shards/<shard>.json       that shard's counts and source: the shard is done (its parquet is
                                             written beside it as _shards/<shard>.parquet first, then moved to its
                                             name: write_shard)
    <output.path>/unconditional_caption.npy  the text encoder's embedding of "" (L x D): data.unconditional_caption
                                             (the name: sdtrain.storage.run_layout.UNCONDITIONAL_FILE; not written for
                                             output.captions: token_ids, nor for an SDXL model, whose empty prompt is
                                             zeros: the manifest's unconditional_caption says which)
    <output.path>/unconditional_caption_ids.npy  the tokenizer's ids of "" (L int32): data.unconditional_caption for
                                             token-id data (UNCONDITIONAL_IDS_FILE; token_ids and both)
    <output.path>/_shards.jsonl.gz           every done shard's record as the last run ended: a re-run reads the
                                             markers older than it from it (read_shard_stats)
    <output.path>/manifest.json              totals: inputs read, rows written, rows skipped by reason
    <output.path>/_settings.json             the settings every run into this directory must share (RESUME_KEYS),
                                             and the buckets they cut images to (sdtrain.preprocess.recorded_buckets)
    <output.path>/_sdtrain_index.parquet     the dataset index (rows, sizes, versions, schema): training reads no
                                             footer of this output (sdtrain.data.dataset_index)

The schema metadata keys every shard carries are sdtrain.data.metadata's. Training lists only the *.parquet files
outside '_'/'.' names (sdtrain.data.parquet_files), so the side files and a half-written temporary never reach it.
"""

from __future__ import annotations

import datetime
import gzip
import io
import json
import os
import posixpath
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.data.added_columns import BUCKET_COLUMN
from sdtrain.data.added_columns import PLACEMENT_COLUMNS as PLACEMENT
from sdtrain.data.metadata import BUCKET_RUNS, BUCKET_SHAPES
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.planning import MARKER_READS, in_order
from sdtrain.storage.filesystems import delete_file, filesystem_for, move_file, write_bytes
from sdtrain.storage.s3 import s3_connections
from sdtrain.storage.uris import is_uri

SHARDS_DIR = "_shards"
MANIFEST_FILE = "manifest.json"
SETTINGS_FILE = "_settings.json"
# What a re-run must share with the runs that wrote the output: which rows a shard holds, and what its values mean.
# (Others, such as encode.batch_size or input.paths, may change: new inputs add shards.)
RESUME_KEYS = (
    "input.format",
    "input.rows_per_shard",
    "input.image_column",
    "input.caption_column",
    "input.file_column",
    "input.captions_file",
    "image.resolution",
    "image.small_images",
    "encode.model",
    "encode.latent",
    "encode.seed",
    "output.latent_column",
    "output.caption_column",
    "output.captions",
    "output.token_id_column",
    "output.pooled_column",
    "image.buckets",
    "image.bucket_step",
    "image.max_aspect",
)


def join(root: str, *parts: str) -> str:
    return posixpath.join(root.rstrip("/"), *parts) if is_uri(root) else os.path.join(root, *parts)


def check_settings(output: str, settings: dict[str, Any]) -> None:
    """Record ``settings`` (RESUME_KEYS) in the output the first time; later, refuse a run whose settings differ
    from the recorded ones (its shards would not match those already written: a changed input.rows_per_shard
    would write some rows twice), naming the key.

    Args:
        output: output.path.
        settings: this run's value of each of RESUME_KEYS.
    """
    fs, path = filesystem_for(join(output, SETTINGS_FILE))
    if fs.get_file_info(path).type != pafs.FileType.File:
        write_bytes(join(output, SETTINGS_FILE), json.dumps(settings, indent=2).encode())
        return
    with fs.open_input_stream(path) as f:
        recorded = json.loads(f.read())
    for old, new in PreprocessConfig.RENAMED.items():  # outputs written before a key was renamed
        if old in recorded:
            recorded.setdefault(new, recorded.pop(old))
    for key, value in settings.items():
        if key in recorded and recorded[key] != value:
            raise ConfigError(
                f"{key}: {output} was written with {recorded[key]!r}, this run has {value!r}; a re-run must keep it "
                f"(the shards already there were made with it): set it back, or write to another output.path"
            )


def shard_table(rows: list[dict[str, Any]], columns: dict[str, str], metadata: dict[str, str]) -> pa.Table:
    """The rows of one shard as a table: flat lists (the layout training reads without conversion), float16 for
    latents and embeddings, int32 for token ids; each row's bucket, original size and crop. Bucketed output
    (metadata BUCKET_SHAPES) has its rows sorted by bucket, one run each, and names its runs (BUCKET_RUNS).

    Args:
        columns: each row's value to store (latents, embeddings, SDXL's pooled, each tokenizer's token_ids) and the
            column it goes to.
    """
    metadata = dict(metadata)
    if BUCKET_SHAPES in metadata:  # stable: within a bucket, the input's order
        rows = sorted(rows, key=lambda r: int(r["bucket"]))
        counts = np.bincount([int(r["bucket"]) for r in rows], minlength=len(json.loads(metadata[BUCKET_SHAPES])))
        metadata[BUCKET_RUNS] = json.dumps([[b, int(n)] for b, n in enumerate(counts) if n])
    types = {"latents": pa.float16(), "embeddings": pa.float16(), "pooled": pa.float16()}
    fields, arrays = [], []
    for value, column in columns.items():
        value_type = types.get(value, pa.int32())  # each tokenizer's ids: token_ids, token_ids_2
        fields.append((column, pa.list_(value_type)))
        arrays.append(_flat_lists([np.asarray(r[value]).reshape(-1) for r in rows], value_type))
    for name in PLACEMENT_COLUMNS:  # rows made outside the pipeline (tests, benchmarks) may not say: one square
        fields.append((name, pa.int32()))
        arrays.append(pa.array([int(r.get(name, 0)) for r in rows], pa.int32()))
    fields += [("caption", pa.string()), ("key", pa.string())]
    arrays += [pa.array([r["caption"] for r in rows], pa.string()), pa.array([r["key"] for r in rows], pa.string())]
    return pa.table(arrays, schema=pa.schema(fields, metadata=metadata))


PLACEMENT_COLUMNS = (BUCKET_COLUMN, *PLACEMENT)
"""Where each image went (sdtrain.preprocess.buckets.Placement): its bucket, its size before resizing, the top-left
corner of its crop in the resized image (what SDXL's micro-conditioning reads)."""


def _flat_lists(values: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    """One list a row, of each row's own length (a bucket's latents are of its shape)."""
    lengths = np.array([len(v) for v in values], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(values).astype(value_type.to_pandas_dtype()) if values else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, value_type))


def parquet_bytes(table: pa.Table, row_group_rows: int) -> bytes:
    """The table as zstd parquet, a row group starting at each bucket run (metadata BUCKET_RUNS): training reads a
    bucket's chunks cut within its runs (sdtrain.data.bucket_runs), which are then whole row groups, not the end of one
    and the start of the next."""
    buffer = io.BytesIO()
    runs = (table.schema.metadata or {}).get(BUCKET_RUNS.encode())
    lengths = [rows for _, rows in json.loads(runs)] if runs else [table.num_rows]
    with parquet_writer(buffer, table.schema) as writer:
        for start, rows in run_row_groups(lengths, row_group_rows):
            writer.write_table(table.slice(start, rows))
    return buffer.getvalue()


def parquet_writer(sink: Any, schema: pa.Schema) -> pq.ParquetWriter:
    """A zstd parquet writer for a shard (one row group a write_table call of fewer than ~1e6 rows). Dictionary
    encoding is kept for the strings and scalars only: on the float and token-id lists (latents, embeddings) it finds
    no repeats and costs about half the write time."""
    dictionary = [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_large_list(f.type)]
    return pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=dictionary)


def run_row_groups(lengths: Sequence[int], row_group_rows: int) -> Iterator[tuple[int, int]]:
    """(first row, rows) of each row group of a file whose bucket runs hold ``lengths`` rows in row order: up to
    ``row_group_rows`` at a time within each run, a run's last rows a shorter group of their own."""
    start = 0
    for length in lengths:
        for offset in range(0, length, row_group_rows):
            yield start + offset, min(row_group_rows, length - offset)
        start += length


def write_shard(output: str, name: str, table: pa.Table | None, stats: dict[str, Any], row_group_rows: int) -> None:
    """The shard's parquet (when it has rows) under _shards/, a name training does not list; then its record, which
    marks the shard done; then the parquet moved to <name>.parquet. A kill at any point leaves no file training reads
    that no record names: such a file would stay beside the rows' new shard when a re-run cuts a folder anew (an
    image added), and its rows be trained twice. settle_shards finishes what a kill interrupted."""
    waiting = join(output, SHARDS_DIR, f"{name}.parquet")
    if table is not None and table.num_rows:
        write_bytes(waiting, parquet_bytes(table, row_group_rows))
    write_bytes(join(output, SHARDS_DIR, f"{name}.json"), json.dumps(stats, indent=2).encode())
    if table is not None and table.num_rows:
        move_file(waiting, join(output, f"{name}.parquet"))


def settle_shards(output: str, done: Collection[str], prefix: str | None) -> None:
    """What a job killed while writing shards left, set right before a re-run: a parquet waiting under _shards/ whose
    record was written is moved to its name (the shard is done); one without a record is deleted (the re-run writes
    its rows again). ``prefix``: a folder input's shard names (sources.shard_prefix), whose files no record names are
    deleted too: an earlier sdtrain wrote the parquet before the record, and a re-run cuts their rows into other
    shards.

    Args:
        done: the names of the shards with a record.
    """
    fs, path = filesystem_for(join(output, SHARDS_DIR))
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        name = info.base_name[: -len(".parquet")]
        if info.base_name.endswith(".parquet") and name in done:
            move_file(join(output, SHARDS_DIR, info.base_name), join(output, info.base_name))
        elif info.base_name.endswith(".parquet"):
            delete_file(join(output, SHARDS_DIR, info.base_name))
    if prefix is None:
        return
    fs, path = filesystem_for(output)
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        name = info.base_name[: -len(".parquet")]
        if name.startswith(prefix) and info.base_name.endswith(".parquet") and name not in done:
            delete_file(join(output, info.base_name))


@dataclass
class DoneShards:
    records: list[dict[str, Any]]
    """The done shards' records (their _shards/<name>.json: counts, and the source they were made from), in name
    order."""
    markers_read: int
    """How many of them were read from their markers, not from the digest (:data:`SHARDS_DIGEST`)."""


def read_shard_stats(output: str) -> list[dict[str, Any]]:
    """:attr:`DoneShards.records` of :func:`done_shards`."""
    return done_shards(output).records


def done_shards(output: str) -> DoneShards:
    """The done shards: the markers listed. A marker older than the last run's digest of them
    (:func:`write_shards_digest`) is taken from the digest, the others read MARKER_READS at a time (two requests each:
    2e6 markers 16 at a time took 2 h at 30 ms a request, ~16 min at 128; docs/limits.md)."""
    with s3_connections(MARKER_READS):
        fs, path = filesystem_for(join(output, SHARDS_DIR))
    infos = sorted(fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), key=lambda i: i.path)
    markers = [info for info in infos if info.path.endswith(".json")]
    digest, digest_time = _digest(output) if markers else ({}, None)

    def from_digest(info: pafs.FileInfo) -> bool:
        if digest_time is None or info.mtime is None or _marker_name(info) not in digest:
            return False
        return (digest_time - info.mtime).total_seconds() > DIGEST_MARGIN_S

    def read(marker: str) -> dict[str, Any]:
        with fs.open_input_stream(marker) as f:
            return json.loads(f.read())

    to_read = [info.path for info in markers if not from_digest(info)]
    read_now = dict(zip(to_read, in_order(read, to_read, MARKER_READS), strict=True))
    records = [read_now[info.path] if info.path in read_now else digest[_marker_name(info)] for info in markers]
    return DoneShards(records, len(to_read))


SHARDS_DIGEST = "_shards.jsonl.gz"
"""Every done shard's record as the last run ended, a JSON line each after a header: a re-run reads this one file
for the markers older than it, not two requests a marker."""
DIGEST_MARGIN_S = 2.0
"""A marker this close to the digest's time, or later, is read: object storage keeps whole seconds."""


def write_shards_digest(output: str, records: list[dict[str, Any]]) -> None:
    """The digest of ``records``, the done shards' as their markers hold them, at the end of a run."""
    lines = [json.dumps({"version": 1, "shards": len(records)}), *(json.dumps(r, sort_keys=True) for r in records)]
    write_bytes(join(output, SHARDS_DIGEST), gzip.compress("\n".join(lines).encode(), compresslevel=1))


def _digest(output: str) -> tuple[dict[str, Any], datetime.datetime | None]:
    """The last digest's records by shard, and its time (the store's clock, as the markers'); ({}, None) without one,
    or for a digest that does not read, which costs only the markers' reads."""
    uri = join(output, SHARDS_DIGEST)
    fs, path = filesystem_for(uri)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File or info.mtime is None:
        return {}, None
    try:
        with fs.open_input_stream(path, compression=None) as raw, gzip.open(raw, "rt") as lines:
            if json.loads(next(lines)).get("version") != 1:
                return {}, None
            return {record["shard"]: record for record in map(json.loads, lines)}, info.mtime
    except (OSError, ValueError, KeyError, StopIteration) as error:
        log.warning(f"output.path: {uri} does not read ({error}): reading every marker instead")
        return {}, None


def _marker_name(info: pafs.FileInfo) -> str:
    return info.base_name[: -len(".json")]


def summarize(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the shards' counts."""
    skipped: dict[str, int] = {}
    for shard in stats:
        for reason, count in shard["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    return {
        "shards": len(stats),
        "inputs_read": sum(s["inputs_read"] for s in stats),
        "rows_written": sum(s["rows_written"] for s in stats),
        "rows_skipped": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "unreadable_shards": [s["shard"] for s in stats if s.get("error")],
    }
