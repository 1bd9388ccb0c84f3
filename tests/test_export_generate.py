"""Export in diffusers format, sampling, and entrypoints/generate.py end to end, on a tiny model
trained for a few steps on the demo data with plain Lightning (no Ray)."""

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys

import fsspec
import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image
from pyarrow.fs import FSSpecHandler
from support.datasets import inspect_dataset

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.artifacts.export import export_checkpoint
from sdtrain.artifacts.loading import load_model
from sdtrain.config.schema import DataConfig, ModelConfig, TrainConfig
from sdtrain.data.local_read import iter_local_batches
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.demo.digits import digits_from_latents, ensure_demo_data, load_digits, pseudo_latents
from sdtrain.errors import SdtrainError
from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
from sdtrain.sampling.sampler import guided_prediction, sample_latents
from sdtrain.train.module import DiffusionModule

GENERATE = [sys.executable, str(REPO / "entrypoints" / "generate.py")]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}  # this checkout's package, whatever the cwd


EXPORT_FILES = [
    "scheduler/scheduler_config.json",
    "sdtrain.json",
    "unconditional_caption.npy",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
]
"""What an export without a pipeline holds (no VAE or text encoder found)."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of the tiny UNet after 4 steps on the digits demo, with EMA and caption dropout."""
    root = tmp_path_factory.mktemp("trained")
    ensure_demo_data(str(root / "train"), str(root / "val"), caption_dim=32)
    data = DataConfig(train=[str(root / "train")], val=[str(root / "val")])
    spec = inspect_dataset(resolve_parquet_files(data.train, "data.train"), "data.train", data.columns, 4, 32)
    batches = []
    for batch in iter_local_batches(spec, data, 16):
        batches.append(batch)
        if len(batches) == 4:
            break
    model = ModelConfig(preset="tiny", prediction_type="v_prediction")
    train = TrainConfig(lr=1e-3, warmup_steps=0, ema_decay=0.5, caption_dropout_prob=0.2)
    meta = CheckpointMeta(
        "test",
        unet_config(model),
        noise_scheduler_config(model),
        latent_shape=(4, 16, 16),
        caption_shape=(77, 32),
        config={"train": {"caption_dropout_prob": 0.2}},
        latent_classifier="sdtrain.demo.digits",  # what the demo's files name (a run's driver reads it from them)
    )
    torch.manual_seed(0)
    module = DiffusionModule(build_unet(model), meta.noise_scheduler_config, train, meta)
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    checkpoint = root / "checkpoint_000000004"
    trainer.save_checkpoint(checkpoint / "checkpoint.ckpt", weights_only=False)
    return {"root": root, "checkpoint": str(checkpoint), "module": module}


def _tiny_vae(path):
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    vae.save_pretrained(path)
    return vae


def test_export_round_trips_through_from_pretrained(trained, tmp_path):
    out = export_checkpoint(trained["checkpoint"], str(tmp_path / "export"))
    files = sorted(str(p.relative_to(tmp_path / "export")) for p in (tmp_path / "export").rglob("*") if p.is_file())
    assert files == EXPORT_FILES
    unet = UNet2DConditionModel.from_pretrained(out, subfolder="unet").eval()
    scheduler = DDPMScheduler.from_pretrained(out, subfolder="scheduler")
    assert scheduler.config.prediction_type == "v_prediction" and scheduler.config.clip_sample is False
    info = json.loads((tmp_path / "export" / "sdtrain.json").read_text())
    assert info["weights"] == "ema" and info["global_step"] == 4 and info["latent_classifier"] == "sdtrain.demo.digits"

    module = trained["module"]
    x, t, c = torch.randn(2, 4, 16, 16), torch.tensor([5, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        want = module.ema_unet(x, t, c).sample
        got = unet(x, t, c).sample
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # identical outputs: the EMA weights, exactly
    with torch.no_grad():
        assert not torch.equal(module.unet(x, t, c).sample, want)  # and not the raw weights
    assert torch.equal(load_model(out).unconditional_caption, torch.zeros(77, 32))

    # An export replaces an earlier one; any other directory that holds something (a typo naming the run) is refused
    # before anything in it is touched, and so is one that holds the model exported.
    assert export_checkpoint(trained["checkpoint"], out) == out
    run = tmp_path / "run"
    shutil.copytree(trained["checkpoint"], run / "checkpoint_000000004")
    (run / "metrics.csv").write_text("step,loss\n")
    for destination, refused in (
        (run, r"holds 2 file\(s\) or folder\(s\) \(e\.g\. checkpoint_000000004\) and is no export"),
        (run / "metrics.csv", r"is a file; name a directory"),
    ):
        with pytest.raises(SdtrainError, match=rf"^export: {destination} {refused}"):
            export_checkpoint(str(run / "checkpoint_000000004"), str(destination))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_000000004", "metrics.csv"]
    # A pipeline's default size is its UNet's sample_size: the trained latents' side, not the preset's.
    smaller = torch.load(run / "checkpoint_000000004" / "checkpoint.ckpt", weights_only=True)
    smaller["sdtrain"]["latent_shape"] = [4, 8, 8]
    torch.save(smaller, run / "checkpoint_000000004" / "checkpoint.ckpt")
    small = export_checkpoint(str(run / "checkpoint_000000004"), str(tmp_path / "small"))
    assert UNet2DConditionModel.load_config(small, subfolder="unet")["sample_size"] == 8
    # Bucketed: latent_shape is the most common bucket (here a wide one); the default is the square bucket's side.
    smaller["sdtrain"]["latent_shape"] = [4, 8, 12]
    smaller["sdtrain"]["bucket_shapes"] = [[4, 8, 12], [4, 10, 10], [4, 12, 8]]
    torch.save(smaller, run / "checkpoint_000000004" / "checkpoint.ckpt")
    bucketed = export_checkpoint(str(run / "checkpoint_000000004"), str(tmp_path / "bucketed"))
    assert UNet2DConditionModel.load_config(bucketed, subfolder="unet")["sample_size"] == 10
    (run / "sdtrain.json").write_text("{}")  # even were it an export: the model is inside it
    with pytest.raises(SdtrainError, match=r"holds the model it would export"):
        export_checkpoint(str(run / "checkpoint_000000004"), str(run))


class _KilledWritingWeights(FSSpecHandler):
    """Local disk as an export's copy sees it when the driver is killed while the weights are written: the weights
    land half written and the copy stops (pyarrow's copy_files finishes the other files first, as the small files
    of a real copy land long before the weights). Records what is written and deleted, in order."""

    def __init__(self, root: str, events: list[tuple[str, str]]):
        super().__init__(fsspec.filesystem("file"))
        self.root, self.events = root, events

    def _note(self, what: str, path: str) -> None:
        self.events.append((what, os.path.relpath(path, self.root)))

    def open_output_stream(self, path, metadata):
        self._note("write", path)
        if not path.endswith(".safetensors"):
            return super().open_output_stream(path, metadata)
        target = self.fs.open(path, mode="wb")

        class Cut(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data) -> int:
                target.write(bytes(data)[: len(data) // 2])
                target.close()
                raise OSError("killed")

        return pa.PythonFile(Cut(), mode="w")

    def delete_file(self, path):
        self._note("delete", path)
        super().delete_file(path)

    def delete_dir(self, path):
        self._note("delete", path + "/")
        super().delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok):
        self._note("delete", path + "/*")
        super().delete_dir_contents(path, missing_dir_ok)


def test_an_export_cut_short_is_no_export_and_the_next_replaces_it(trained, tmp_path, monkeypatch):
    """sdtrain.json is an export's commit: written alone after every other file, and an earlier export's deleted before
    any other file of it, so a driver killed while it exports (its weights half written) leaves no export that
    export_source names (the re-run's finish would skip the export for good), and the next export replaces it."""
    from sdtrain.artifacts import export

    out = str(tmp_path / "export")
    earlier = export.export_checkpoint(trained["checkpoint"], out)
    assert export.export_source(earlier) == trained["checkpoint"]  # a completed export is found
    whole = (tmp_path / "export" / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size
    later = str(tmp_path / "run" / "checkpoint_000000008")
    shutil.copytree(trained["checkpoint"], later)
    events: list[tuple[str, str]] = []
    real_filesystem_for, real_write, real_delete = export.filesystem_for, export.write_bytes, export.delete_file
    with monkeypatch.context() as patched:
        killed = pafs.PyFileSystem(_KilledWritingWeights(out, events))
        patched.setattr(export, "filesystem_for", lambda p: (killed, out) if p == out else real_filesystem_for(p))
        patched.setattr(
            export,
            "write_bytes",
            lambda uri, data: (events.append(("write", os.path.relpath(uri, out))), real_write(uri, data)),
        )
        patched.setattr(
            export, "delete_file", lambda uri: (events.append(("delete", os.path.relpath(uri, out))), real_delete(uri))
        )
        with pytest.raises(OSError, match="killed"):
            export.export_checkpoint(later, out)
    weights = tmp_path / "export" / "unet" / "diffusion_pytorch_model.safetensors"
    assert (tmp_path / "export" / "unet" / "config.json").is_file() and 0 < weights.stat().st_size < whole
    assert export.export_source(out) is None
    # The earlier export's sdtrain.json went before any other file was touched; the new one was never written.
    touched = [event for event in events if event != ("write", export.EXPORT_INCOMPLETE_FILE)]
    assert touched[0] == ("delete", "sdtrain.json") and ("write", "sdtrain.json") not in touched

    # The re-run's export replaces what was cut short (no refusal: it is an export's, unfinished), and is found.
    assert export.export_checkpoint(later, out) == out
    assert export.export_source(out) == later
    files = sorted(str(p.relative_to(out)) for p in (tmp_path / "export").rglob("*") if p.is_file())
    assert files == EXPORT_FILES
    UNet2DConditionModel.from_pretrained(out, subfolder="unet")  # whole weights


def test_an_export_to_s3_replaces_one_cut_short_and_commits_with_sdtrain_json(trained, s3_bucket):
    """On S3 too (single-request writes and deletes, no multipart upload left behind): an export cut short (its
    sdtrain.incomplete mark, no sdtrain.json) is no export and is replaced; the export's objects are its files alone."""
    import boto3

    from sdtrain.artifacts.export import EXPORT_INCOMPLETE_FILE, export_source

    client, bucket = boto3.client("s3"), s3_bucket[len("s3://") :]
    for key in (EXPORT_INCOMPLETE_FILE, "unet/config.json", "unet/diffusion_pytorch_model.safetensors"):
        client.put_object(Bucket=bucket, Key=f"run/export/{key}", Body=b"{}")
    out = f"{s3_bucket}/run/export"
    assert export_source(out) is None
    assert export_checkpoint(trained["checkpoint"], out) == out
    assert export_source(out) == trained["checkpoint"]
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"])
    assert [key for key in keys if not key.endswith("/")] == [
        f"run/export/{name}"
        for name in (
            "scheduler/scheduler_config.json",
            "sdtrain.json",
            "unconditional_caption.npy",
            "unet/config.json",
            "unet/diffusion_pytorch_model.safetensors",
        )
    ]
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_exported_unet_works_inside_a_stable_diffusion_pipeline(trained, tmp_path):
    """The exported UNet as a StableDiffusionPipeline's unet gives the latents our sampler gives."""
    out = export_checkpoint(trained["checkpoint"], str(tmp_path / "export"))
    unet = UNet2DConditionModel.from_pretrained(out, subfolder="unet").eval()
    scheduler = DDIMScheduler.from_pretrained(out, subfolder="scheduler")
    vae = _tiny_vae(tmp_path / "vae")
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    cond = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(1))
    uncond = torch.zeros(1, 77, 32)
    size = 16 * pipe.vae_scale_factor
    theirs = pipe(
        prompt_embeds=cond,
        negative_prompt_embeds=uncond.expand(2, -1, -1),
        guidance_scale=3.0,
        num_inference_steps=5,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        height=size,
        width=size,
    ).images
    ours = sample_latents(
        unet, dict(scheduler.config), cond, uncond[0], (4, 16, 16), sampler="ddim", steps=5, guidance_scale=3.0, seed=0
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert ours.abs().max() < 50  # no blow-up (clip_sample off, v-prediction followed by the sampler)


def test_guidance_scale_one_is_the_conditional_prediction(trained):
    unet = load_model(trained["checkpoint"]).unet
    x, t = torch.randn(3, 4, 16, 16), torch.tensor(400)
    cond, uncond = torch.randn(3, 77, 32), torch.zeros(3, 77, 32)
    with torch.no_grad():
        conditional = unet(x, t, encoder_hidden_states=cond).sample
        unconditional = unet(x, t, encoder_hidden_states=uncond).sample
        assert torch.equal(guided_prediction(unet, x, t, cond, uncond, 1.0), conditional)
        guided = guided_prediction(unet, x, t, cond, uncond, 4.0)
    torch.testing.assert_close(guided, unconditional + 4.0 * (conditional - unconditional), rtol=1e-4, atol=1e-5)


def test_sampling_depends_on_the_seed_only():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config(ModelConfig(preset="tiny"))).eval()
    config = noise_scheduler_config(ModelConfig(preset="tiny"))
    captions = torch.randn(3, 7, 32)
    a = sample_latents(
        unet, config, captions, torch.zeros(7, 32), (4, 16, 16), sampler="dpm", steps=3, seed=5, batch_size=1
    )
    b = sample_latents(
        unet, config, captions, torch.zeros(7, 32), (4, 16, 16), sampler="dpm", steps=3, seed=5, batch_size=3
    )
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)  # batching changes the samples only by float rounding
    assert not torch.allclose(
        a, sample_latents(unet, config, captions, torch.zeros(7, 32), (4, 16, 16), sampler="dpm", steps=3, seed=6)
    )


def test_digit_preview_inverts_the_demo_latents():
    images, _ = load_digits()
    # pseudo_latents of a subset is normalized by that subset; the demo files use the whole set
    recovered = digits_from_latents(pseudo_latents(images)[:20])
    np.testing.assert_allclose(recovered, np.kron(images[:20], np.ones((2, 2))), atol=1e-3)


def _generate(args, tmp_path):
    result = subprocess.run(GENERATE + args, cwd=tmp_path, capture_output=True, text=True, timeout=170, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_generate_end_to_end_writes_a_grid_per_class(trained, tmp_path):
    out = tmp_path / "samples"
    result = _generate(
        [
            trained["checkpoint"],
            "--captions",
            str(trained["root"] / "val"),
            "--out",
            str(out),
            "--samples-per-caption",
            "3",
            "--steps",
            "4",
            "--sampler",
            "dpm",
            "--guidance-scale",
            "2",
        ],
        tmp_path,
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "class_agreement.json",
        "generate.json",
        "latents.npy",
        "preview.png",
    ]
    latents = np.load(out / "latents.npy")
    assert latents.shape == (10, 3, 4, 16, 16) and np.isfinite(latents).all()  # a row per digit class
    info = json.loads((out / "generate.json").read_text())
    assert (
        info["rows"] == [f"label {d}" for d in range(10)]
        and info["weights"] == "ema"
        and info["prediction_type"] == "v_prediction"
    )
    with Image.open(out / "preview.png") as preview:
        width, height = preview.size
    assert height == 10 * (64 + 2) + 2 and width == 60 + 3 * (64 + 2) + 2  # 10 rows of 3 tiles of 64x64
    assert f"wrote {out}/preview.png" in result.stdout
    accuracy = json.loads((out / "class_agreement.json").read_text())  # the demo's class agreement, 30 samples
    assert (
        accuracy["samples"] == 30
        and 0 <= accuracy["class_agreement"] <= 1
        and sorted(accuracy["per_class"]) == [str(d) for d in range(10)]
    )
    assert (
        accuracy["real_digits"] > 0.85
        and f"class agreement {accuracy['class_agreement']:.2f}: {accuracy['agreeing']} of 30 samples" in result.stdout
    )

    # Export with the same entrypoint, then sample from the export with a VAE: decoded images and a grid.
    _generate([trained["checkpoint"], "--export-to", str(tmp_path / "export")], tmp_path)
    _tiny_vae(tmp_path / "vae")
    out = tmp_path / "decoded"
    np.save(tmp_path / "two.npy", np.random.default_rng(0).standard_normal((2, 77, 32)).astype(np.float32))
    _generate(
        [
            str(tmp_path / "export"),
            "--captions",
            str(tmp_path / "two.npy"),
            "--out",
            str(out),
            "--vae",
            str(tmp_path / "vae"),
            "--samples-per-caption",
            "2",
            "--steps",
            "3",
        ],
        tmp_path,
    )
    images = sorted(p.name for p in (out / "images").iterdir())
    assert images == ["row00_sample00.png", "row00_sample01.png", "row01_sample00.png", "row01_sample01.png"]
    with Image.open(out / "images" / images[0]) as image:
        assert image.size == (32, 32) and image.mode == "RGB"  # 16x16 latents, a VAE that upsamples 2x
    assert (out / "grid.png").is_file() and np.load(out / "latents.npy").shape == (2, 2, 4, 16, 16)


@pytest.mark.slow
def test_generate_rejects_bad_input_in_one_line(trained, tmp_path):
    np.save(tmp_path / "wide.npy", np.zeros((77, 64), np.float32))
    result = subprocess.run(
        GENERATE + [trained["checkpoint"], "--captions", str(tmp_path / "wide.npy")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 2 and "error: --captions:" in result.stderr and "(L, 32)" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run(
        GENERATE + [str(tmp_path / "nowhere"), "--captions", "x.npy"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_generate_samples_at_the_pixels_asked_and_notes_a_size_the_model_never_trained_at(trained, tmp_path):
    """A model trained on aspect-ratio buckets (its export names them): --height/--width in pixels through the VAE's
    downsampling, sampled and decoded at that size; a note where it is none of the buckets; a size the UNet cannot
    take refused naming the flag, the value and the multiple."""
    from sdtrain.artifacts.export import write_export
    from sdtrain.errors import DataError
    from sdtrain.sampling.generate import GenerateRequest, generate

    loaded = load_model(trained["checkpoint"])
    loaded.bucket_shapes = ((4, 16, 16), (4, 16, 24))
    write_export(loaded, str(tmp_path / "export"))
    assert load_model(str(tmp_path / "export")).bucket_shapes == loaded.bucket_shapes
    _tiny_vae(tmp_path / "vae")
    np.save(tmp_path / "two.npy", np.random.default_rng(0).standard_normal((2, 77, 32)).astype(np.float32))

    def request(name, **size):
        return GenerateRequest(
            str(tmp_path / "export"),
            captions=str(tmp_path / "two.npy"),
            out=str(tmp_path / name),
            samples_per_caption=1,
            steps=2,
            vae=str(tmp_path / "vae"),
            **size,
        )

    wide = request("wide", height=32, width=48)
    generate(wide)
    assert np.load(tmp_path / "wide" / "latents.npy").shape == (2, 1, 4, 16, 24) and wide.notes == []
    with Image.open(tmp_path / "wide" / "images" / "row00_sample00.png") as image:
        assert image.size == (48, 32)  # width x height
    square = request("square", height=48)  # the width: the model's own (32 px)
    generate(square)
    assert np.load(tmp_path / "square" / "latents.npy").shape == (2, 1, 4, 24, 16)
    assert square.notes == ["48x32 px is no shape the model trained at (32x32, 32x48): expect it to do worse there"]
    with pytest.raises(DataError, match=r"--width 42: must be a positive multiple of 4 \(the VAE's downsampling 2 x"):
        generate(request("odd", width=42))


def _grid_png(colour: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 10), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_pipeline_exports_card_shows_the_latest_training_grid_or_one_rendered_at_export(trained, tmp_path, caplog):
    """Data that names its VAE and text encoder makes the export a pipeline; its card shows sample_grid.png:
    training's latest grid at or before the exported step, else one the pipeline draws from the data's captions."""
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.artifacts.export import write_export
    from sdtrain.data.metadata import LATENT_SCALING_FACTOR, TEXT_ENCODER_SOURCE, VAE_SOURCE
    from sdtrain.preprocess.outputs import shard_table, write_shard
    from sdtrain.storage.run_layout import EXPORT_SAMPLE_GRID_FILE as SAMPLE_GRID_FILE

    model = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    rng = np.random.default_rng(0)
    captions = ["a red fox", "a blue bird", "a red fox", "a green frog"]
    rows = [
        {
            "latents": rng.standard_normal(4 * 16 * 16),
            "embeddings": rng.standard_normal(77 * 32),
            "caption": c,
            "key": c,
        }
        for c in captions
    ]
    metadata = {LATENT_SCALING_FACTOR: "0.18215", VAE_SOURCE: model, TEXT_ENCODER_SOURCE: model}
    table = shard_table(rows, {"latents": "image_latents_256", "embeddings": "caption_latents"}, metadata)
    write_shard(str(tmp_path / "latents"), "part", table, {}, 4)
    run = tmp_path / "run"
    shutil.copytree(trained["checkpoint"], run / "checkpoint_000000004")
    loaded = load_model(str(run / "checkpoint_000000004"))
    assert loaded.meta is not None and loaded.global_step == 4
    config = {
        **loaded.meta.config,
        "data": {"train": [str(tmp_path / "latents")]},
        "sample_grid": {"guidance_scale": 2.5},
    }
    loaded = dataclasses.replace(loaded, meta=dataclasses.replace(loaded.meta, config=config))

    # The run drew no grid: the pipeline renders one, a tile per distinct caption.
    rendered = tmp_path / "rendered"
    with caplog.at_level("WARNING", logger="sdtrain"):
        write_export(loaded, str(rendered))
    # It trained on zeros as its empty prompt, which a plain pipe(prompt) does not guide against: the export says so.
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "data.unconditional_caption: zeros" in warning and "negative_prompt_embeds" in warning
    assert (rendered / "model_index.json").is_file()
    card = (rendered / "README.md").read_text()
    assert f"![Samples]({SAMPLE_GRID_FILE})" in card and "1. a red fox; 2. a blue bird; 3. a green frog" in card
    # What it was trained as: from scratch, its recipe as configured (the prediction type the scheduler's).
    assert (
        "trained from scratch" in card and "- Prediction type: v_prediction; recipe: caption_dropout_prob=0.2\n" in card
    )
    # The card shows how to guide as training did: against the empty prompt it trained with (zeros here), which a
    # Stable Diffusion pipeline would encode from "" instead, at its sample grids' scale. Its code runs as written,
    # for a list of prompts (the empty prompt a row per prompt).
    code = card.split("```python\n")[1].split("```")[0]
    assert "negative_prompt_embeds=empty" in code and "guidance_rescale" not in code  # no zero-terminal SNR here
    assert "guidance_scale=2.5" in code and "add_watermarker" not in code
    scope: dict = {}
    exec(code.replace('path = "."', f"path = {str(rendered)!r}"), scope)  # noqa: S102 - the card's own example
    assert len(scope["prompts"]) == 2 and [image.size for image in scope["images"]] == [(32, 32)] * 2
    with Image.open(rendered / SAMPLE_GRID_FILE) as image:
        assert image.format == "PNG" and image.size == (3 * (32 + 2) + 2, 32 + 4)
        image.verify()

    # Training's grids: the latest at or before step 4 is the one shown (step 6's is of later weights).
    samples = run / "samples"
    samples.mkdir()
    for step, colour in ((2, "red"), (4, "green"), (6, "blue")):
        (samples / f"step_{step}.png").write_bytes(_grid_png(colour))
    shown = tmp_path / "shown"
    write_export(loaded, str(shown))
    assert (shown / SAMPLE_GRID_FILE).read_bytes() == _grid_png("green")
    card = (shown / "README.md").read_text()
    assert f"![Samples]({SAMPLE_GRID_FILE})" in card and "at step 4 (`samples/step_4.png`" in card

    # A model started from another says so.
    model = {**config.get("model", {}), "pretrained": "stabilityai/stable-diffusion-2-base"}
    tuned = dataclasses.replace(loaded, meta=dataclasses.replace(loaded.meta, config={**config, "model": model}))
    write_export(tuned, str(tmp_path / "tuned"))
    assert "fine-tuned from `stabilityai/stable-diffusion-2-base`" in (tmp_path / "tuned" / "README.md").read_text()
    # So does an export of that export (it has no run config: its sdtrain.json records what the card says).
    write_export(load_model(str(tmp_path / "tuned")), str(tmp_path / "tuned-again"))
    card = (tmp_path / "tuned-again" / "README.md").read_text()
    assert "fine-tuned from `stabilityai/stable-diffusion-2-base`" in card
    assert f"- Data: {tmp_path / 'latents'}\n" in card and "recipe: caption_dropout_prob=0.2\n" in card
    assert "guidance_scale=2.5" in card

    # An export of an export keeps its grid; one written before exports recorded how they were trained says so.
    info = json.loads((shown / "sdtrain.json").read_text())
    (shown / "sdtrain.json").write_text(json.dumps({k: v for k, v in info.items() if k != "trained_as"}))
    again = tmp_path / "again"
    write_export(load_model(str(shown)), str(again))
    card = (again / "README.md").read_text()
    assert (again / SAMPLE_GRID_FILE).read_bytes() == _grid_png("green") and SAMPLE_GRID_FILE in card
    assert "origin not recorded" in card and "trained from scratch" not in card and "- Data: not recorded" in card


def test_an_sdxl_exports_card_loads_it_without_the_watermark_diffusers_does_not_record(tmp_path, monkeypatch):
    """An SDXL pipeline is assembled without the invisible watermark, which model_index.json cannot keep: the model
    card's example loads it with add_watermarker=False, so that it stays off where invisible-watermark is installed."""
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl as sdxl_pipeline
    from support.tiny_models import write_tiny_sdxl_model

    from sdtrain.artifacts.export import write_export
    from sdtrain.artifacts.loading import LoadedModel
    from sdtrain.model.unet import build_noise_scheduler

    base = write_tiny_sdxl_model(str(tmp_path / "tiny-sdxl"))
    model = ModelConfig(preset="tiny-sdxl", prediction_type="v_prediction")
    loaded = LoadedModel(
        unet=build_unet(model).eval(),
        noise_scheduler=build_noise_scheduler(noise_scheduler_config(model)),
        unconditional_caption=torch.zeros(77, 80),
        source=str(tmp_path / "no-checkpoint"),
        weights="ema",
        global_step=4,
        latent_shape=(4, 16, 16),
        caption_shape=(77, 80),
        latent_scaling_factor=0.18215,
        latent_classifier=None,
        meta=None,
        vae_downsampling=2,
    )
    export = tmp_path / "export"
    write_export(loaded, str(export), base_model=base)
    code = (export / "README.md").read_text().split("```python\n")[1].split("```")[0]
    assert "add_watermarker=False" in code and "negative_prompt_embeds" not in code  # SDXL's empty prompt is zeros

    # As where `pip install invisible-watermark` was run: diffusers would add its watermarker.
    class Watermarker:
        pass

    monkeypatch.setattr(sdxl_pipeline, "is_invisible_watermark_available", lambda: True)
    monkeypatch.setattr(sdxl_pipeline, "StableDiffusionXLWatermarker", Watermarker, raising=False)
    load = code.split("\nprompts = ")[0].replace('path = "."', f"path = {str(export)!r}")
    scope: dict = {}
    exec(load, scope)  # noqa: S102 - the card's own example, up to its pipeline
    assert scope["pipe"].watermark is None
    from diffusers import DiffusionPipeline

    assert isinstance(DiffusionPipeline.from_pretrained(str(export)).watermark, Watermarker)  # what it guards against


def _checkpoint_of_latents_made_elsewhere(trained, tmp_path, metadata=None, scaling=None, **export) -> str:
    """The trained checkpoint as if its run had trained on latents a user made elsewhere: data.train is parquet of
    random latents whose files record ``metadata`` (by default nothing: no encoders, no latent classifier), the run's
    export section is ``export``, its latents carry the factor ``scaling``."""
    from conftest import write_latents

    from sdtrain.artifacts.loading import read_checkpoint

    data = tmp_path / "latents" / "part.parquet"
    write_latents(data)
    if metadata:
        pq.write_table(pq.read_table(data).replace_schema_metadata(metadata), data)
    checkpoint = read_checkpoint(trained["checkpoint"])
    config = {**checkpoint["sdtrain"]["config"], "data": {"train": [str(data.parent)]}, "export": export}
    checkpoint["sdtrain"].update(latent_classifier=None, latent_scaling_factor=scaling, config=config)
    path = tmp_path / "run" / "checkpoint_000000004"
    path.mkdir(parents=True)
    torch.save(checkpoint, path / "checkpoint.ckpt")
    return str(path)


def _answers_a_prompt(export) -> StableDiffusionPipeline:
    """The export loaded by diffusers as a pipeline, drawing a 32 x 32 image for a prompt in words."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(export))
    assert isinstance(pipeline, StableDiffusionPipeline)
    images = pipeline(
        "a red fox", num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0)
    ).images
    assert len(images) == 1 and images[0].size == (32, 32) and np.asarray(images[0]).std() > 0
    return pipeline


def test_export_base_model_makes_latents_made_elsewhere_a_pipeline_that_answers_a_prompt(trained, tmp_path):
    """Latents a user made elsewhere exported unet/ + scheduler/, which DiffusionPipeline.from_pretrained cannot load.
    The run's export.base_model names the model whose VAE, text encoder and tokenizer made them: the export is that
    pipeline with a model card; the key wins over what the data records (here a path of the machine that
    preprocessed), and the VAE divides by the factor the model's latents carry."""
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, VAE_SOURCE

    model = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    elsewhere = {VAE_SOURCE: "/preprocessing-node/sd", TEXT_ENCODER_SOURCE: "/preprocessing-node/sd"}
    checkpoint = _checkpoint_of_latents_made_elsewhere(trained, tmp_path, elsewhere, scaling=0.5, base_model=model)
    out = export_checkpoint(checkpoint, str(tmp_path / "export"))
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert {"vae", "text_encoder", "tokenizer", "unet", "scheduler"} <= index.keys()
    pipeline = _answers_a_prompt(out)
    assert torch.equal(pipeline.unet.conv_in.weight, load_model(checkpoint).unet.conv_in.weight)  # the EMA weights
    assert pipeline.vae.config.scaling_factor == 0.5  # the tiny VAE's own is 0.18215
    card = (tmp_path / "export" / "README.md").read_text()
    assert f"in a pipeline with the VAE of `{model}` and the text encoder of `{model}`" in card
    info = json.loads((tmp_path / "export" / "sdtrain.json").read_text())
    assert info["vae_source"] == info["text_encoder_source"] == model


def test_generate_export_of_a_checkpoint_that_names_no_encoders_takes_base_model(trained, tmp_path, capsys):
    """generate.py --export-to of a checkpoint whose run named no VAE and text encoder wrote a UNet-only export. It is
    refused, naming --base-model; with --base-model it is the pipeline; a base model whose text encoder is not the
    UNet's width is refused naming both widths."""
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.driver.cli import generate_main

    checkpoint = _checkpoint_of_latents_made_elsewhere(trained, tmp_path)
    out = str(tmp_path / "export")
    assert generate_main([checkpoint, "--export-to", out]) == 2
    error = capsys.readouterr().err
    assert "does not record the VAE and text encoder" in error and "--base-model" in error
    assert not os.path.exists(out)

    model = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    assert generate_main([checkpoint, "--export-to", out, "--base-model", model]) == 0
    _answers_a_prompt(out)

    wide = write_tiny_sd_model(str(tmp_path / "wide-sd"), caption_dim=64)
    assert generate_main([checkpoint, "--export-to", str(tmp_path / "wide"), "--base-model", wide]) == 2
    assert f"the text encoder of {wide} is 64 wide, but the UNet's cross_attention_dim is 32" in capsys.readouterr().err


def test_check_run_refuses_an_export_that_could_not_be_a_pipeline_before_ray(tmp_path, monkeypatch):
    """With export.enabled, a run on data that names no VAE and text encoder trained to the end and exported a UNet
    no pipeline loads. Refused before Ray, naming export.base_model; so is a base model that is not there, whose text
    encoder is not the UNet's width or whose VAE makes latents of other channels, naming both values. A base model
    that fits passes (a relative path made absolute for the checkpoint's config), and so does data whose latents are
    read without a VAE (the demo's: a UNet-only export)."""
    from conftest import tiny_config, write_latents
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.data.metadata import LATENT_CLASSIFIER
    from sdtrain.driver.run import check_run
    from sdtrain.errors import ConfigError

    write_latents(tmp_path / "data" / "part.parquet")
    monkeypatch.chdir(tmp_path)

    def check(*keys):
        return check_run(tiny_config(f"data.train={tmp_path}/data", *keys, tmp_path=tmp_path, name="r", batch=4))

    with pytest.raises(
        ConfigError, match=r"^export.base_model: export.enabled is on.*part.parquet has no parquet"
    ) as e:
        check()
    assert "Set export.base_model to that Stable Diffusion model" in str(e.value)
    assert "or export.enabled: false to export nothing" in str(e.value)
    check("export.enabled=false")
    with pytest.raises(ConfigError, match=r"^export.base_model: directory /models/nowhere does not exist"):
        check("export.base_model=/models/nowhere")
    wide = write_tiny_sd_model(str(tmp_path / "wide-sd"), caption_dim=64)
    with pytest.raises(
        ConfigError, match=r"text encoder of .*wide-sd is 64 wide, but the UNet's cross_attention_dim is 32"
    ):
        check(f"export.base_model={wide}")
    eight = write_tiny_sd_model(str(tmp_path / "eight-channels"))
    _tiny_vae_of_channels(tmp_path / "eight-channels" / "vae", 8)
    with pytest.raises(
        ConfigError, match=r"VAE of .*eight-channels makes latents of 8 channels, but the data's latents have 4"
    ):
        check(f"export.base_model={eight}")
    write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    assert check("export.base_model=tiny-sd").config.export.base_model == str(tmp_path / "tiny-sd")

    demo = tmp_path / "demo" / "part.parquet"
    demo.parent.mkdir()
    table = pq.read_table(tmp_path / "data" / "part.parquet")
    pq.write_table(table.replace_schema_metadata({LATENT_CLASSIFIER: "sdtrain.demo.digits"}), demo)
    check_run(tiny_config(f"data.train={demo.parent}", tmp_path=tmp_path, name="demo", batch=4))


def _tiny_vae_of_channels(path, channels: int) -> None:
    AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=channels,
        norm_num_groups=8,
        layers_per_block=1,
    ).save_pretrained(path)
