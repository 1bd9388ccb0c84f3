"""The buckets an output's images were cut to, recorded in its _settings.json so that a re-run cuts to the same ones.

The settings RESUME_KEYS holds (image.buckets, image.resolution, image.bucket_step, image.max_aspect) do not fix the
buckets alone: the list sdtrain.preprocess.buckets makes of them changed between versions (the wide buckets became the
tall ones' transposes, and no two share a ratio). A newer sdtrain resuming an older one's output at the same settings
would write shards of other shapes beside the old ones: one dataset of two sets of buckets, which training refuses
only after the whole job has run. So the list itself is recorded (BUCKETS_KEY), and for an output written before it
was, read back from a done shard's footer (its latent shapes and the VAE's downsampling).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain.data.metadata import RESOLUTION, bucket_shapes, vae_downsampling
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.preprocess.config import ImageConfig
from sdtrain.preprocess.outputs import SETTINGS_FILE, SHARDS_DIR, join
from sdtrain.storage.filesystems import filesystem_for, write_bytes

BUCKETS_KEY = "image.bucket_shapes"
"""In _settings.json: the (height, width) buckets in pixels the output's images were cut to, by bucket index, as
[[height, width], ...] (image.buckets: square: the one square)."""


def check_buckets(output: str, image: ImageConfig, done: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a run whose buckets differ from those the output's shards were cut to, naming both and where the old
    ones are recorded; record this run's in _settings.json where the output recorded none.

    Args:
        output: output.path, whose _settings.json is written (outputs.check_settings runs first).
        image: this run's image settings, whose shapes() are the buckets it cuts to.
        done: the done shards' records, by name.
    """
    settings_path = join(output, SETTINGS_FILE)
    settings = _read_json(settings_path)
    new = [[int(height), int(width)] for height, width in image.shapes()]
    recorded: list[list[int]] | None
    where: str | None
    if BUCKETS_KEY in settings:
        recorded, where = settings[BUCKETS_KEY], settings_path
    else:  # written before the buckets were recorded: its shards' footers say
        recorded, where = shard_buckets(output, done)
    if recorded is not None and recorded != new:
        raise DataError(
            f"image.buckets: {output} holds images cut to the buckets {_describe(recorded)} (height x width, as "
            f"{where} records), but this run cuts image.buckets={image.buckets}, image.resolution={image.resolution}, "
            f"image.bucket_step={image.bucket_step}, image.max_aspect={image.max_aspect} to {_describe(new)}: the "
            "output was written by an earlier sdtrain, whose buckets for these settings differ. Resuming would put "
            "both sets of shapes in one dataset, which training refuses. Write to a new output.path (its images are "
            "encoded again), or finish this output with the sdtrain version that started it"
        )
    if BUCKETS_KEY in settings:
        return
    if recorded is None and any(record.get("rows_written") for record in done.values()):
        log.warning(
            f"{output} records no buckets ({settings_path} has no {BUCKETS_KEY}, and no done shard's file could be "
            f"read): cannot check that this run's buckets {_describe(new)} are those its shards were cut to. They "
            "are recorded now, so later runs are checked against them"
        )
    write_bytes(settings_path, json.dumps({**settings, BUCKETS_KEY: new}, indent=2).encode())


def shard_buckets(output: str, done: Mapping[str, Mapping[str, Any]]) -> tuple[list[list[int]] | None, str | None]:
    """The pixel buckets the first done shard with rows was cut to, from its file's footer, and where they were read;
    (None, None) where no such file is there to read. One footer: every shard of an output written by one sdtrain at its
    settings shares its buckets."""
    for name in sorted(name for name, record in done.items() if record.get("rows_written")):
        # Its file, or one a killed job left waiting under _shards/ (settle_shards moves it later).
        for path in (join(output, f"{name}.parquet"), join(output, SHARDS_DIR, f"{name}.parquet")):
            fs, local = filesystem_for(path)
            if fs.get_file_info(local).type == pafs.FileType.File:
                return footer_buckets(pq.read_metadata(local, filesystem=fs).metadata, path), f"the footer of {path}"
    return None, None


def footer_buckets(metadata: Mapping[bytes, bytes] | None, where: str) -> list[list[int]] | None:
    """The pixel buckets a shard's schema metadata records: its bucket latent shapes times the VAE's downsampling,
    or, for a file of one shape, the square of its resolution; None where it records neither."""
    shapes = bucket_shapes(metadata, where)
    if shapes is not None:
        downsampling = vae_downsampling(metadata)
        return [[height * downsampling, width * downsampling] for _, height, width in shapes]
    resolution = (metadata or {}).get(RESOLUTION.encode())
    return None if resolution is None else [[int(resolution), int(resolution)]]


def _read_json(path: str) -> dict[str, Any]:
    fs, local = filesystem_for(path)
    with fs.open_input_stream(local) as f:
        return json.loads(f.read())


def _describe(buckets: list[list[int]]) -> str:
    return "[" + ", ".join(f"{height}x{width}" for height, width in buckets) + "]"
