"""The refusal of the shipped configs' placeholder bucket: configs/small.yaml, sd2-base.yaml, sdxl-base.yaml and
retrain.yaml name their data ``s3://YOUR-BUCKET/...``, for the job file or the command line to replace. A run that
kept one would fail on the driver with whatever the store answers for a bucket that is not there (no such bucket,
access denied, a timeout), or on every worker; refused instead before anything is listed or Ray starts, naming the
key and what to set. Not refused when a config is loaded: the shipped configs load as they are (``--help``, the
memory model, the performance report)."""

from __future__ import annotations

from sdtrain.errors import ConfigError

PLACEHOLDER_BUCKET = "YOUR-BUCKET"
"""The shipped configs' stand-in for a bucket, refused in any letter case anywhere in a path."""

_EXPECTED = {
    "data.train": "the training latents: parquet files (a file, a directory or a glob, local or s3://), such as "
    "what entrypoints/preprocess.py wrote to its output.path",
    "data.val": "the held-out latents: parquet files (a file, a directory or a glob, local or s3://), never trained on",
    "data.unconditional_caption": "the empty prompt's embedding (preprocessing's unconditional_caption.npy), or zeros",
    "model.pretrained": "a diffusers model directory (local or s3://) or a hub id to start from, or null",
    "run.storage_path": "where runs are written: an s3:// prefix or a directory every node shares",
    "retrain.data_root": "the directory of date=YYYY-MM-DD partitions that new data arrives in",
    "retrain.models_root": "where the model registry is kept: an s3:// prefix or a directory every node shares",
}
_ANY = "a location that exists: s3://<bucket>/<prefix>, or a path every node can read"


def refuse_placeholder(key: str, path: str | None) -> None:
    """Raise a ConfigError naming ``key``, ``path`` and what to set when ``path`` holds the placeholder bucket.

    Args:
        key: the config key in full, e.g. ``data.train[0]``.
        path: its value (None: nothing to check).
    """
    if path is None or PLACEHOLDER_BUCKET.lower() not in path.lower():
        return
    name = key.partition("[")[0]
    raise ConfigError(
        f"{key}: {path} names the shipped configs' placeholder bucket ({PLACEHOLDER_BUCKET}), not a real one; set "
        f"{name} to {_EXPECTED.get(name, _ANY)}, in the config or on the command line ({name}=s3://<bucket>/<prefix>)"
    )
