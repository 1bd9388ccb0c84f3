"""Shards too large for one S3 request, refused at preprocessing's start, without Ray: a shard is one object, and
S3 takes none over 5 GiB in one PutObject, so input.rows_per_shard beyond it is refused before any row is encoded
(and before it is recorded in the output, where it could no longer be lowered); a local output has no such limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdtrain.config.loader import load_config
from sdtrain.errors import ConfigError, DataError
from sdtrain.preprocess import job
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.shard_size import S3_SINGLE_PUT_BYTES, SHARD_TARGET_BYTES, check_shard_size, row_shape

# SDXL at 1024 px: latents 4x128x128, embeddings 77x(768+1280), pooled 1280, all float16; 32 bytes of placement
# and list offsets.
SDXL_ROW_BYTES = 2 * (4 * 128 * 128 + 77 * 2048 + 1280) + 32


class _WorkStarted(Exception):
    """Raised where the job goes on past the shard size check (its output read): the check let the run through."""


def _sdxl_configs(root: Path) -> str:
    """An SDXL-sized model of configs alone (no weights: the check reads none): a VAE downsampling by 8 to 4
    channels, CLIP ViT-L (768 wide) and OpenCLIP bigG (1280 wide, 1280-wide projection)."""
    vae = {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512], "latent_channels": 4}
    encoders = {
        "text_encoder": {"model_type": "clip_text_model", "hidden_size": 768, "max_position_embeddings": 77},
        "text_encoder_2": {
            "model_type": "clip_text_model",
            "hidden_size": 1280,
            "projection_dim": 1280,
            "max_position_embeddings": 77,
        },
    }
    for name, config in {"vae": {**vae, "scaling_factor": 0.13025}, **encoders}.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
    return str(root)


def _config(tmp_path: Path, output: str, *overrides: str) -> PreprocessConfig:
    model = _sdxl_configs(tmp_path / "sdxl")
    return load_config(
        None,
        [f"input.paths={tmp_path / 'input'}", f"output.path={output}", f"encode.model={model}", "image.resolution=1024"]
        + list(overrides),
        PreprocessConfig,
    )


def _run_until_work(config: PreprocessConfig, monkeypatch) -> None:
    monkeypatch.setattr(job, "done_shards", _started)
    job.run_preprocess(config)


def _started(output: str):
    raise _WorkStarted(output)


def test_an_sdxl_row_is_its_latents_embeddings_and_pooled_embedding_in_float16(tmp_path):
    """What a row stores: the latents, both encoders' hidden states side by side and the pooled embedding, float16
    whatever encode.dtype; token ids add 77 int32 per tokenizer."""
    config = _config(tmp_path, "s3://bucket/latents", "encode.dtype=float32")
    assert row_shape(config).bytes() == SDXL_ROW_BYTES
    both = _config(tmp_path / "both", "s3://bucket/latents", "output.captions=both")
    assert row_shape(both).bytes() == SDXL_ROW_BYTES + 2 * 77 * 4
    ids = row_shape(_config(tmp_path / "ids", "s3://bucket/latents", "output.captions=token_ids"))
    assert ids.bytes() == 2 * 4 * 128 * 128 + 2 * 77 * 4 + 32


def test_aspect_buckets_are_estimated_by_their_largest_latents(tmp_path):
    """A shard's rows may all fall in one bucket: the largest bucket's latents are counted."""
    config = _config(tmp_path, "s3://bucket/latents", "image.buckets=aspect", "image.bucket_step=64")
    largest = max((h // 8) * (w // 8) for h, w in config.image.shapes())
    channels, height, width = row_shape(config).latents
    assert (channels, height * width) == (4, largest)


def test_shards_over_s3s_single_put_limit_are_refused_before_any_work(tmp_path, monkeypatch):
    """12000 SDXL rows of 1024 px are ~5.0 GiB a shard: refused at the start, naming the key, the estimate, the
    limit and the rows_per_shard that fits; nothing of the output is read or written."""
    config = _config(tmp_path, "s3://bucket/latents", "input.rows_per_shard=12000")
    assert 12000 * SDXL_ROW_BYTES > S3_SINGLE_PUT_BYTES
    with pytest.raises(ConfigError) as refused:
        _run_until_work(config, monkeypatch)
    message = str(refused.value)
    fits = SHARD_TARGET_BYTES // SDXL_ROW_BYTES
    assert message.startswith(f"input.rows_per_shard: 12000 rows of {SDXL_ROW_BYTES:,} bytes each (latents 4x128x128")
    assert "caption embeddings 77x2048 float16, pooled 1280 float16" in message
    assert "make shards of about 5.0 GiB" in message and "S3 refuses over 5 GiB" in message
    assert "output.path=s3://bucket/latents" in message
    assert message.endswith(f"set input.rows_per_shard to at most {fits} (shards under 4 GiB)")
    assert fits == 9564
    check_shard_size(_config(tmp_path / "fits", "s3://bucket/latents", f"input.rows_per_shard={fits}"))


def test_shards_under_the_limit_go_on_to_the_work(tmp_path, monkeypatch):
    """10000 SDXL rows (~4.2 GiB) fit in one PutObject: the job goes on."""
    config = _config(tmp_path, "s3://bucket/latents", "input.rows_per_shard=10000")
    with pytest.raises(_WorkStarted):
        _run_until_work(config, monkeypatch)


def test_a_local_output_has_no_limit(tmp_path, monkeypatch):
    """A local file is written whole at any size: the same 12000 rows go on."""
    config = _config(tmp_path, str(tmp_path / "latents"), "input.rows_per_shard=12000")
    with pytest.raises(_WorkStarted):
        _run_until_work(config, monkeypatch)


def test_a_webdataset_input_is_not_checked(tmp_path, monkeypatch):
    """Each tar is one shard of however many samples it holds: input.rows_per_shard does not set its size."""
    config = _config(tmp_path, "s3://bucket/latents", "input.format=webdataset", "input.rows_per_shard=12000")
    with pytest.raises(_WorkStarted):
        _run_until_work(config, monkeypatch)


def test_the_estimate_is_what_the_encoder_stores(tmp_path):
    """The widths read from the configs are the encode stage's (a tiny SDXL model, loaded on the CPU)."""
    from support.tiny_models import write_tiny_sdxl_model

    from sdtrain.preprocess.encode_stage import Encoder

    model = write_tiny_sdxl_model(str(tmp_path / "tiny"))
    config = load_config(
        None,
        [f"input.paths={tmp_path}", "output.path=s3://b/o", f"encode.model={model}", "image.resolution=32"]
        + ["output.captions=both"],
        PreprocessConfig,
    )
    shape = row_shape(config)
    encoder = Encoder(model, "mean", 0, "float32", 32, captions="both")
    channels, height, width = shape.latents
    assert channels * height * width == encoder.latent_width
    assert shape.length * shape.width == encoder.embedding_width
    assert shape.pooled == encoder.pooled_width
    assert shape.length * shape.tokenizers == encoder.ids_width


@pytest.mark.slow  # moto's server
def test_a_model_in_a_bucket_is_read_by_its_configs_alone(tmp_path, s3_bucket):
    """The driver sizes shards and reads the VAE's geometry from the configs of a model in a bucket, never its weights:
    vae_geometry once downloaded all of vae/ to the driver (~335 MB for SD 2's and SDXL's VAE)."""
    import boto3

    from sdtrain.model import encoders
    from sdtrain.preprocess.model_outputs import vae_geometry

    local = _config(tmp_path, "s3://bucket/latents")
    s3 = boto3.client("s3")
    for path in Path(local.encode.model).rglob("config.json"):
        s3.upload_file(str(path), "sdtrain-test", f"models/sdxl/{path.relative_to(local.encode.model).as_posix()}")
    # Weights the driver must not fetch: an object that is no safetensors file at all.
    s3.put_object(Bucket="sdtrain-test", Key="models/sdxl/vae/diffusion_pytorch_model.safetensors", Body=b"x" * 2**20)
    model = f"{s3_bucket}/models/sdxl"
    remote = load_config(None, [*_overrides(local), f"encode.model={model}"], PreprocessConfig)
    assert vae_geometry(model) == vae_geometry(local.encode.model) == (0.13025, 4, 8)
    assert row_shape(remote) == row_shape(local)
    assert model not in encoders._MODELS  # nothing of the model was downloaded to this process

    # A config missing: one line naming encode.model, the model and the file.
    s3.delete_object(Bucket="sdtrain-test", Key="models/sdxl/text_encoder/config.json")
    with pytest.raises(DataError, match=f"^encode.model: {model} has no text_encoder/config.json: expected a diffus"):
        row_shape(remote)
    s3.delete_object(Bucket="sdtrain-test", Key="models/sdxl/vae/config.json")
    with pytest.raises(DataError, match=f"^encode.model: {model} has no vae/config.json: expected a diffusers model"):
        row_shape(remote)


def _overrides(config: PreprocessConfig) -> list[str]:
    return [f"input.paths={config.input.paths[0]}", f"output.path={config.output.path}", "image.resolution=1024"]
