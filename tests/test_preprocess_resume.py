"""Resuming preprocessing into an output an earlier sdtrain wrote, without Ray: a re-run that would cut its images to
other buckets than the output's shards were cut to is refused before any encoding, and the buckets are recorded so
that later runs are checked against them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sdtrain.config.loader import load_config
from sdtrain.data.metadata import BUCKET_SHAPES, RESOLUTION, VAE_DOWNSAMPLING
from sdtrain.errors import DataError
from sdtrain.preprocess import job
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.outputs import RESUME_KEYS, SETTINGS_FILE, check_settings, shard_table, write_shard
from sdtrain.preprocess.recorded_buckets import BUCKETS_KEY, check_buckets
from sdtrain.preprocess.sources import list_shards

SETTINGS = ["image.buckets=aspect", "image.resolution=192", "image.bucket_step=8", "image.max_aspect=1.5"]
# What aspect_buckets made of SETTINGS before the wide buckets became the tall ones' transposes (503c44a): a tenth,
# 152x224, whose transpose it lacked.
OLD_BUCKETS = [(224, 160), (216, 168), (208, 176), (200, 184), (192, 192)]
OLD_BUCKETS += [(184, 200), (176, 208), (168, 216), (160, 224), (152, 224)]


class _EncodingStarted(Exception):
    """Raised where the job's work starts (the VAE's geometry read, the empty caption encoded, Ray): the start-up
    checks are behind it."""


def _config(tmp_path: Path, *overrides: str) -> PreprocessConfig:
    return load_config(
        None,
        [f"input.paths={tmp_path / 'input'}", f"output.path={tmp_path / 'latents'}", *SETTINGS, *overrides],
        PreprocessConfig,
    )


def _old_output(tmp_path: Path, buckets: list[tuple[int, int]] | None) -> PreprocessConfig:
    """An input of one parquet file, and an output an earlier sdtrain wrote of it: its _settings.json (RESUME_KEYS
    only) and its one shard, done, of one row, whose footer names ``buckets`` (None: one square, as before buckets)."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 128, np.uint8)).save(buffer, "PNG")
    (tmp_path / "input").mkdir()
    input_table = pa.table({"jpg": [buffer.getvalue()], "caption": ["a grey picture"]})
    pq.write_table(input_table, tmp_path / "input" / "a.parquet")
    config = _config(tmp_path)
    output = config.output.path
    settings = config.to_dict()
    check_settings(output, {key: settings[key.split(".")[0]][key.split(".")[1]] for key in RESUME_KEYS})
    metadata = {VAE_DOWNSAMPLING: "8", RESOLUTION: "192"}
    if buckets is not None:
        metadata[BUCKET_SHAPES] = json.dumps([[4, height // 8, width // 8] for height, width in buckets])
    height, width = buckets[0] if buckets else (192, 192)
    row = {"latents": np.zeros(4 * (height // 8) * (width // 8), np.float16), "caption": "a", "key": "0", "bucket": 0}
    (shard,) = list_shards(config.input)
    stats = {"shard": shard.name, "source": shard.source, "identity": shard.identity, "inputs_read": 1}
    table = shard_table([row], {"latents": config.output.latent_column}, metadata)
    write_shard(output, shard.name, table, {**stats, "rows_written": 1, "skipped": {}}, 4)
    return config


def _refuses_before_any_work(config: PreprocessConfig, monkeypatch) -> None:
    monkeypatch.setattr(job, "check_model", lambda model: False)  # the default hub model, not downloaded here
    monkeypatch.setattr(job, "vae_geometry", _started)
    job.run_preprocess(config)


def _started(model: str):
    raise _EncodingStarted(model)


def test_a_rerun_into_an_output_cut_to_the_old_buckets_is_refused_before_any_work(tmp_path, monkeypatch):
    """The settings are the same, but this sdtrain cuts them to other buckets than the shard already there: its
    footer's buckets are named beside the new ones, the output path, and what to do; nothing is encoded."""
    new = _config(tmp_path).image.shapes()
    assert new != OLD_BUCKETS and len(new) == 9  # the setting is one whose buckets changed
    config = _old_output(tmp_path, OLD_BUCKETS)
    with pytest.raises(DataError) as refused:
        _refuses_before_any_work(config, monkeypatch)
    message = str(refused.value)
    assert message.startswith(f"image.buckets: {tmp_path / 'latents'} holds images cut to the buckets [224x160, ")
    assert f"152x224] (height x width, as the footer of {tmp_path / 'latents' / 'a-'}" in message
    assert "image.resolution=192, image.bucket_step=8, image.max_aspect=1.5 to [224x160, " in message
    assert message.count("160x224") == 2 and message.count("152x224") == 1
    assert "Write to a new output.path" in message
    assert BUCKETS_KEY not in json.loads((tmp_path / "latents" / SETTINGS_FILE).read_text())  # nor recorded


def test_an_output_cut_to_this_runs_buckets_is_resumed_and_then_checked_by_its_record(tmp_path, monkeypatch):
    """A shard of this run's buckets passes the start-up checks (the job goes on to its work), which record the
    buckets in _settings.json; a later run is checked against that record, without reading a footer."""
    config = _old_output(tmp_path, _config(tmp_path).image.shapes())
    with pytest.raises(_EncodingStarted):
        _refuses_before_any_work(config, monkeypatch)
    settings = tmp_path / "latents" / SETTINGS_FILE
    recorded = json.loads(settings.read_text())
    assert recorded[BUCKETS_KEY] == [list(shape) for shape in config.image.shapes()]
    assert all(key in recorded for key in RESUME_KEYS)
    recorded[BUCKETS_KEY] = [list(shape) for shape in OLD_BUCKETS]
    settings.write_text(json.dumps(recorded))
    with pytest.raises(DataError, match=rf"152x224\] \(height x width, as {settings} records\)"):
        _refuses_before_any_work(config, monkeypatch)


def test_an_output_of_one_square_from_before_buckets_is_checked_by_its_resolution(tmp_path, monkeypatch):
    """A shard whose footer names no buckets was cut to the square of its resolution: resumed as square it goes on,
    resumed as aspect (a _settings.json from before image.buckets was recorded) it is refused."""
    config = _old_output(tmp_path, None)
    settings = tmp_path / "latents" / SETTINGS_FILE
    bucket_keys = ("image.buckets", "image.bucket_step", "image.max_aspect")
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k not in bucket_keys}))
    with pytest.raises(DataError, match=r"holds images cut to the buckets \[192x192\] .* to \[224x160, "):
        _refuses_before_any_work(config, monkeypatch)
    with pytest.raises(_EncodingStarted):
        _refuses_before_any_work(_config(tmp_path, "image.buckets=square"), monkeypatch)
    assert json.loads(settings.read_text())[BUCKETS_KEY] == [[192, 192]]


def test_an_output_that_records_no_buckets_is_warned_of_and_recorded(tmp_path, caplog):
    """Done shards with rows but no file to read (deleted): the buckets cannot be checked, which is said, and this
    run's are recorded; a later run with others is then refused."""
    config = _old_output(tmp_path, OLD_BUCKETS)
    (shard,) = list_shards(config.input)
    (tmp_path / "latents" / f"{shard.name}.parquet").unlink()
    done = {shard.name: {"shard": shard.name, "rows_written": 1}}
    with caplog.at_level("WARNING", logger="sdtrain"):
        check_buckets(config.output.path, config.image, done)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{config.output.path} records no buckets" in warning and "cannot check" in warning
    with pytest.raises(DataError, match=r"as .*_settings.json records\), but this run cuts .* to \[192x192\]"):
        check_buckets(config.output.path, _config(tmp_path, "image.buckets=square").image, done)
