"""sample_grid.prompts: prompts in words for the sample grids, a list or a file (local or s3://), encoded once on the
driver by the run's text encoder (the one data.train's files record, or model.pretrained's) and refused there, naming
the key, when they cannot be; the grids drawn with them, their text as the rows' labels; generate.py's default
prompts for the run. Real parquet files, tiny CLIP text encoders, VAEs and UNets built from configs, Lightning in this
process; no Ray."""

import dataclasses
import json
import logging

import lightning.pytorch as pl
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_config, token_id_table, write_latents
from PIL import Image, ImageDraw
from support.tiny_models import write_tiny_sd_model

from sdtrain.artifacts.loading import load_model
from sdtrain.config.schema import ModelConfig
from sdtrain.data.metadata import TEXT_ENCODER_SOURCE
from sdtrain.driver.cli import generate_main
from sdtrain.driver.run import check_run
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.encoders import encode_prompts, load_text_encoder
from sdtrain.model.unet import build_unet
from sdtrain.sampling.generate import GenerateRequest, generate
from sdtrain.sampling.prompts import grid_prompts
from sdtrain.train.build import build_training, checkpoint_meta, fit_without_ray
from sdtrain.train.sample_grids import SampleGrids, grid_captions

PROMPTS = ["a red fox in the snow, photographed at dawn with a long lens", "a lighthouse"]
CAPTIONS = (77, 32)  # the tiny SD model's tokenizer pads to 77 tokens; its text encoder is 32 wide


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd_model(str(tmp_path_factory.mktemp("sd") / "tiny-sd"))


def _data(tmp_path, text_encoder: str | None = None, token_ids: bool = False) -> str:
    """data.train: 8 rows of random latents, captions as (77, 32) embeddings whose files record ``text_encoder`` (as
    preprocessing records its encoder), or as token ids for it."""
    path = tmp_path / "train" / "a.parquet"
    latents, _ = write_latents(path, rows=8)
    table = token_id_table(latents, text_encoder) if token_ids else pq.read_table(path)
    if text_encoder is not None and not token_ids:
        table = table.replace_schema_metadata({TEXT_ENCODER_SOURCE: text_encoder})
    pq.write_table(table, path)
    return str(path.parent)


def _config(tmp_path, data: str, *options: str):
    # export.enabled=false: what the export needs of the data is not what is tested here.
    keys = [f"data.train={data}", "export.enabled=false", *options]
    return tiny_config(*keys, tmp_path=tmp_path, name="prompts", batch=4)


def _by_hand(text_encoder: str, prompts: list[str]) -> torch.Tensor:
    tokenizer, model = load_text_encoder(text_encoder)
    return encode_prompts(tokenizer, model, prompts)


def test_prompts_are_a_list_or_a_file_and_name_at_least_one_prompt():
    assert tiny_config("data.train=/d", "sample_grid.prompts=[a red fox, a lighthouse]").sample_grid.prompts == [
        "a red fox",
        "a lighthouse",
    ]
    assert tiny_config("data.train=/d", "sample_grid.prompts=prompts.txt").sample_grid.prompts == "prompts.txt"
    refused = {
        "sample_grid.prompts=[]": r"sample_grid\.prompts: must name prompts .*got \[\]",
        "sample_grid.prompts=[a fox, ' ']": r"sample_grid\.prompts: must name prompts",
        "sample_grid.prompts=''": r"sample_grid\.prompts: must name prompts",
    }
    for option, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            tiny_config("data.train=/d", option)
    with pytest.raises(ConfigError, match=r"sample_grid\.prompts: and sample_grid\.captions both name the grid's rows"):
        tiny_config("data.train=/d", "sample_grid.prompts=[a fox]", "sample_grid.captions=c.npy")


def test_the_driver_encodes_the_prompts_once_with_the_encoder_the_data_or_model_pretrained_names(
    tiny_sd, tmp_path, without_ray
):
    """From a file (comments and blank lines left out), with the encoder data.train's files record: exactly what the
    encoder gives by hand. Token-id data: the encoder its ids are for. Data that records none: model.pretrained's."""
    import ray

    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"# the grid's rows\n{PROMPTS[0]}\n\n  {PROMPTS[1]}  \n")
    run = check_run(_config(tmp_path, _data(tmp_path, tiny_sd), f"sample_grid.prompts={prompts_file}"))
    assert run.grid_prompts is not None and not ray.is_initialized()
    assert run.grid_prompts.prompts == PROMPTS and run.grid_prompts.text_encoder == tiny_sd
    assert torch.equal(run.grid_prompts.embeddings, _by_hand(tiny_sd, PROMPTS))
    assert run.grid_prompts.captions().names == PROMPTS

    ids = _data(tmp_path / "ids", tiny_sd, token_ids=True)
    options = ("data.caption_column=caption_ids", "sample_grid.prompts=[a lighthouse]")
    run = check_run(_config(tmp_path / "ids", ids, *options))
    assert run.grid_prompts is not None and run.grid_prompts.text_encoder == tiny_sd
    assert torch.equal(run.grid_prompts.embeddings, _by_hand(tiny_sd, ["a lighthouse"]))

    # A pretrained Stable Diffusion model: its UNet beside its tokenizer and text encoder.
    pretrained = write_tiny_sd_model(str(tmp_path / "pretrained"))
    build_unet(ModelConfig(preset="tiny")).save_pretrained(f"{pretrained}/unet")
    plain = _data(tmp_path / "plain")
    run = check_run(_config(tmp_path / "plain", plain, f"model.pretrained={pretrained}", "sample_grid.prompts=[a fox]"))
    assert run.grid_prompts is not None and run.grid_prompts.text_encoder == pretrained
    assert run.config.sample_grid.prompts == ["a fox"]
    # No prompts: nothing encoded.
    assert check_run(_config(tmp_path / "plain", plain)).grid_prompts is None


def test_prompts_that_cannot_be_encoded_are_refused_before_ray_naming_the_key_and_the_fix(
    tiny_sd, tmp_path, without_ray
):
    import ray

    plain = _data(tmp_path / "plain")
    with pytest.raises(ConfigError) as refused:
        check_run(_config(tmp_path / "plain", plain, "sample_grid.prompts=[a fox]"))
    message = str(refused.value)
    assert message.startswith("sample_grid.prompts: no text encoder is known to encode the prompts with")
    assert "sdtrain.text_encoder_source" in message and "model.pretrained" in message
    assert "sample_grid.captions" in message  # the other way to give a grid

    recorded = _data(tmp_path, tiny_sd)
    with pytest.raises(ConfigError, match=r"sample_grid\.prompts: no file .*nowhere\.txt\. A string names a text file"):
        check_run(_config(tmp_path, recorded, f"sample_grid.prompts={tmp_path}/nowhere.txt"))
    (tmp_path / "empty.txt").write_text("# nothing yet\n\n")
    with pytest.raises(DataError, match=r"sample_grid\.prompts: .*empty\.txt holds no prompts \(one a line\)"):
        check_run(_config(tmp_path, recorded, f"sample_grid.prompts={tmp_path}/empty.txt"))

    # Captions made by a 16-wide encoder cannot be what a 32-wide UNet trained on: the files name the wrong one.
    narrow = write_tiny_sd_model(str(tmp_path / "narrow"), caption_dim=16)
    wrong = _data(tmp_path / "wrong", narrow)
    with pytest.raises(ConfigError, match=r"sample_grid\.prompts: .*narrow encodes prompts 16 wide, but the UNet's "):
        check_run(_config(tmp_path / "wrong", wrong, "sample_grid.prompts=[a fox]"))
    assert not ray.is_initialized()


def test_grid_captions_that_rank_0_could_not_read_are_refused_before_ray(tmp_path, without_ray):
    """sample_grid.captions is read on the driver as rank 0 reads it: a missing file, or embeddings of another width
    than the UNet's, stop the run naming the key before a worker starts (a worker would fail on them after Ray's
    start and the model's build, every restart alike). Token ids are read there too, not encoded."""
    import numpy as np
    import ray

    plain = _data(tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"sample_grid\.captions: cannot read .*nowhere\.npy"):
        check_run(_config(tmp_path, plain, f"sample_grid.captions={tmp_path}/nowhere.npy"))
    np.save(tmp_path / "narrow.npy", np.zeros((2, 77, 16), np.float32))
    with pytest.raises(ConfigError, match=r"sample_grid\.captions: .*narrow\.npy holds shape \(2, 77, 16\); expected"):
        check_run(_config(tmp_path, plain, f"sample_grid.captions={tmp_path}/narrow.npy"))
    np.save(tmp_path / "grid.npy", np.zeros((2, 77, 32), np.float32))
    assert check_run(_config(tmp_path, plain, f"sample_grid.captions={tmp_path}/grid.npy")).grid_prompts is None
    assert not ray.is_initialized()


@pytest.mark.parametrize("sampler", ["ddim", "dpm"])
def test_grid_steps_the_noise_schedule_cannot_take_are_refused_before_ray(tmp_path, without_ray, sampler):
    """sample_grid.steps (the grids' and evaluations' denoising steps) at or past the schedule's 1000 timesteps:
    DDIM refuses more, and at 1000 both samplers index past the schedule, at the first grid (a checkpoint step,
    before the checkpoint: every restart alike). The driver refuses it naming the key and the schedule's length."""
    import ray

    plain = _data(tmp_path / "plain")
    options = (f"sample_grid.sampler={sampler}", "sample_grid.steps=1000")
    with pytest.raises(
        ConfigError,
        match=rf"^sample_grid\.steps: 1000 steps with sample_grid\.sampler={sampler} on a "
        r"noise schedule of 1000 timesteps .* set sample_grid\.steps below 1000",
    ):
        check_run(_config(tmp_path, plain, *options))
    check_run(_config(tmp_path, plain, f"sample_grid.sampler={sampler}", "sample_grid.steps=999"))
    assert not ray.is_initialized()


def test_grid_captions_storage_could_not_read_fail_the_attempt_not_the_run(tmp_path, monkeypatch):
    """Rank 0 reads the grid's captions at every start, restarts included, from data.val by default: a storage failure
    that outlasted the S3 client's retries (the OSError pyarrow's S3 filesystem raises), even where the parquet
    footer's reader named it for --captions, is a StorageUnavailable (an OSError) naming the key and the source, which
    the controller's failure callback leaves to Ray Train's restarts; a ConfigError would stop the run. A missing file
    is still a ConfigError naming the key and the file, and an error that is not about the input passes as itself."""
    import re

    import sdtrain.sampling.captions as captions_module
    import sdtrain.train.sample_grids as sample_grids
    from sdtrain.errors import StorageUnavailable, find_sdtrain_error

    def storage_failed(message):
        def fail(*args, **kwargs):
            raise OSError(message)

        return fail

    val = _data(tmp_path / "val")
    with monkeypatch.context() as patch:  # data.val's footer: HeadObject throttled past the client's retries
        patch.setattr(pq, "read_metadata", storage_failed("AWS Error SLOW_DOWN during HeadObject operation"))
        failing = rf"^data\.val: {re.escape(val)}: object storage failed after \d+ attempt\(s\) with backoff \(AWS "
        with pytest.raises(StorageUnavailable, match=failing) as failed:
            grid_captions(_config(tmp_path, val, f"data.val={val}"), 32)
    assert find_sdtrain_error(failed.value) is None and "--captions" not in str(failed.value)  # named once, for its key

    local = captions_module.filesystem_for
    flaky = type("FlakyS3", (), {"open_input_file": storage_failed("AWS Error NETWORK_CONNECTION: curlCode: 28")})
    monkeypatch.setattr(
        captions_module, "filesystem_for", lambda uri: (flaky(), uri[5:]) if uri.startswith("s3://") else local(uri)
    )
    grid = "s3://bucket/grid.npy"
    retried = rf"^sample_grid\.captions: {re.escape(grid)}: object storage failed after \d+ attempt\(s\)"
    with pytest.raises(StorageUnavailable, match=retried) as failed:
        grid_captions(_config(tmp_path, val, f"sample_grid.captions={grid}"), 32)
    assert find_sdtrain_error(failed.value) is None

    with pytest.raises(ConfigError, match=r"sample_grid\.captions: cannot read .* from .*nowhere\.npy"):
        grid_captions(_config(tmp_path, val, f"sample_grid.captions={tmp_path}/nowhere.npy"), 32)

    def out_of_memory(*args, **kwargs):  # the text encoder, encoding token ids on the GPU
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(sample_grids, "read_captions", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        grid_captions(_config(tmp_path, val, f"data.val={val}"), 32)


def test_a_grid_draws_the_prompts_a_row_each_labelled_with_their_text(tiny_sd, tmp_path):
    grid = ("sample_grid.columns=2", "sample_grid.steps=2", f"sample_grid.prompts={PROMPTS}")
    cfg = tiny_config("data.train=/unused", *grid)
    meta = checkpoint_meta(cfg, (4, 16, 16), CAPTIONS)
    prompts = grid_prompts(cfg, {TEXT_ENCODER_SOURCE.encode(): tiny_sd.encode()}, None, CAPTIONS)
    assert prompts is not None
    with pytest.raises(ConfigError, match=r"sample_grid\.prompts: set, but not encoded by the driver"):
        grid_captions(cfg, 32)
    captions = grid_captions(cfg, 32, prompts=prompts.captions())
    assert captions is not None and captions.names == PROMPTS
    module, _ = build_training(cfg, meta, use_gpu=False)
    grids = SampleGrids(cfg, meta, captions, str(tmp_path), torch.zeros(CAPTIONS))
    grid = grids.sample(module.eval_unet, 5)
    assert grid is not None and grid.path == f"{tmp_path}/samples/step_5.png"
    picture = np.asarray(Image.open(grid.path).convert("RGB"))
    tile = 16 * 2 + 2  # 16x16 latents at zoom 2, and the padding
    assert picture.shape[0] == 2 * tile + 2  # a row a prompt
    # The margin holds the longest label whole (cut at 40 characters), at the default font's width.
    label = PROMPTS[0][:37] + "..."
    margin = picture.shape[1] - 2 * tile - 2
    assert margin == 8 + int(np.ceil(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(label))) > 60
    for row in range(2):  # each row's label is drawn: dark pixels in its margin
        assert (picture[2 + row * tile : (row + 1) * tile, :margin] < 128).any()
    # A rank that only takes part (FSDP's other ranks) samples alike and writes nothing.
    quiet = SampleGrids(cfg, meta, captions, str(tmp_path / "other"), torch.zeros(CAPTIONS), writes=False)
    assert quiet.sample(module.eval_unet, 5) is None and not (tmp_path / "other").exists()


def _checkpoint(path, grid_prompts=None, grid_text_encoder=None) -> str:
    """A checkpoint of the tiny UNet after one step on (77, 32) captions, recording ``grid_prompts``."""
    cfg = tiny_config("data.train=/unused", "train.max_steps=1", "train.global_batch_size=2", "scaling.use_gpu=false")
    meta = checkpoint_meta(cfg, (4, 16, 16), CAPTIONS)
    meta = dataclasses.replace(meta, grid_prompts=grid_prompts, grid_text_encoder=grid_text_encoder)
    batch = {"latents": torch.randn(2, 4, 16, 16), "captions": torch.randn(2, *CAPTIONS)}
    _, trainer = fit_without_ray(cfg, [batch], meta, use_gpu=False, default_root_dir=str(path))
    trainer.save_checkpoint(path / "checkpoint.ckpt", weights_only=False)
    return str(path)


def test_generate_samples_the_runs_grid_prompts_when_given_no_captions(tiny_sd, tmp_path, caplog, capsys):
    """With neither --captions nor --prompt: the prompts the run's grids drew, with the encoder that encoded them, said
    in a log line; the same samples as naming them. A model that has none is refused as before."""
    pl.seed_everything(0)
    with_prompts = _checkpoint(tmp_path / "checkpoint_000000001", PROMPTS, tiny_sd)
    assert load_model(with_prompts).meta.grid_prompts == PROMPTS
    common = dict(model=with_prompts, samples_per_caption=2, steps=2, sampler="dpm")
    with caplog.at_level(logging.INFO, logger="sdtrain"):
        generate(GenerateRequest(**common, out=str(tmp_path / "default")))
    assert "no --captions or --prompt: sampling the run's sample_grid.prompts (2)" in caplog.text
    info = json.loads((tmp_path / "default" / "generate.json").read_text())
    assert info["prompts"] == PROMPTS and info["text_encoder"] == tiny_sd and info["vae"] == tiny_sd
    assert (tmp_path / "default" / "grid.png").is_file()  # decoded with the encoder's model's VAE
    named = GenerateRequest(**common, out=str(tmp_path / "named"), prompts=PROMPTS, text_encoder=tiny_sd)
    generate(named)
    assert np.array_equal(np.load(tmp_path / "default/latents.npy"), np.load(tmp_path / "named/latents.npy"))

    without = _checkpoint(tmp_path / "plain" / "checkpoint_000000001")
    assert generate_main([without, "--out", str(tmp_path / "none")]) == 2
    assert "error: give --captions or --prompt/--prompts-file" in capsys.readouterr().err


@pytest.mark.slow  # a moto server
def test_a_prompts_file_on_s3_is_read_and_a_missing_one_refused_naming_the_key(tiny_sd, tmp_path, s3_bucket):
    import boto3

    boto3.client("s3").put_object(Bucket="sdtrain-test", Key="grids/prompts.txt", Body="\n".join(PROMPTS).encode())
    recorded = _data(tmp_path, tiny_sd)
    run = check_run(_config(tmp_path, recorded, f"sample_grid.prompts={s3_bucket}/grids/prompts.txt"))
    assert run.grid_prompts is not None and run.grid_prompts.prompts == PROMPTS
    with pytest.raises(DataError, match=r"sample_grid\.prompts: s3://sdtrain-test/grids/other\.txt: bucket"):
        check_run(_config(tmp_path, recorded, f"sample_grid.prompts={s3_bucket}/grids/other.txt"))
