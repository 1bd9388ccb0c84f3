"""What load_model and generate.py take from an export, and what a diffusers pipeline loads from it: an export cut
short or with truncated weights is refused (not loaded with nothing recorded), the weights asked for are those the
export records, guidance at a scale of 1 or below samples as diffusers' pipelines do, and the base model's tokenizer
folders are exported as they are. Real tiny models and exports, no Ray."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from diffusers import DDPMScheduler, DiffusionPipeline, UNet2DConditionModel
from support.tiny_models import write_tiny_sd_model, write_tiny_sdxl_model
from transformers import AutoTokenizer

from sdtrain.artifacts.export import EXPORT_INCOMPLETE_FILE, write_export
from sdtrain.artifacts.loading import LoadedModel, load_model
from sdtrain.config.schema import ModelConfig
from sdtrain.errors import SdtrainError
from sdtrain.model.unet import build_noise_scheduler, build_unet, noise_scheduler_config
from sdtrain.sampling.generate import LATENTS_FILE, GenerateRequest, generate
from sdtrain.sampling.sampler import guided_prediction

GENERATE = [sys.executable, str(REPO / "entrypoints" / "generate.py")]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}
WEIGHTS_FILE = "unet/diffusion_pytorch_model.safetensors"


def _loaded(source: str, weights: str = "ema", preset: str = "tiny", **fields) -> LoadedModel:
    """A tiny model (random weights, seeded) as load_model gives one, for write_export."""
    model = ModelConfig(preset=preset, prediction_type="v_prediction")
    torch.manual_seed(0)
    width = 80 if preset == "tiny-sdxl" else 32
    values = dict(
        unet=build_unet(model).eval(),
        noise_scheduler=build_noise_scheduler(noise_scheduler_config(model)),
        unconditional_caption=torch.zeros(77, width),
        source=source,
        weights=weights,
        global_step=4,
        latent_shape=(4, 16, 16),
        caption_shape=(77, width),
        latent_scaling_factor=None,
        latent_classifier="sdtrain.demo.digits",  # latents read without a VAE: an export of the UNet alone
        meta=None,
    )
    return LoadedModel(**{**values, **fields})  # type: ignore[arg-type]


def _unet_export(tmp_path: Path, weights: str = "ema") -> str:
    return write_export(_loaded(str(tmp_path / "checkpoint"), weights), str(tmp_path / f"export-{weights}"))


@pytest.fixture(scope="module")
def sd_export(tmp_path_factory) -> dict[str, str]:
    """A whole StableDiffusionPipeline export of a tiny model on a tiny SD base model."""
    root = tmp_path_factory.mktemp("sd")
    base = write_tiny_sd_model(str(root / "base"))
    loaded = _loaded(str(root / "checkpoint"), latent_classifier=None, latent_scaling_factor=0.18215)
    loaded.vae_downsampling = 2
    return {"base": base, "export": write_export(loaded, str(root / "export"), base_model=base)}


def test_an_export_cut_short_is_refused_naming_it_and_a_plain_diffusers_model_still_loads(tmp_path):
    """An export whose writer was killed (sdtrain.incomplete left; or sdtrain.json, written last, missing beside
    sdtrain's other files) used to load with nothing recorded (no latent scaling, no trained shapes, weights None)."""
    export = Path(_unet_export(tmp_path))
    assert load_model(str(export)).latent_shape == (4, 16, 16)
    (export / EXPORT_INCOMPLETE_FILE).write_text("being written")
    cut_short = rf"model: {re.escape(str(export))} is an sdtrain export that was cut short"
    with pytest.raises(SdtrainError, match=rf"{cut_short} \(it holds sdtrain.incomplete, .*Export it again"):
        load_model(str(export))
    (export / EXPORT_INCOMPLETE_FILE).unlink()
    (export / "sdtrain.json").unlink()
    with pytest.raises(
        SdtrainError, match=rf"{cut_short} \(it holds sdtrain's unconditional_caption.npy but not sdtrain"
    ):
        load_model(str(export))

    # A diffusers model saved elsewhere: no sdtrain files, loaded with nothing recorded, as before.
    plain = tmp_path / "plain"
    UNet2DConditionModel.from_pretrained(str(export / "unet")).save_pretrained(plain / "unet")
    DDPMScheduler.from_pretrained(str(export / "scheduler")).save_pretrained(plain / "scheduler")
    loaded = load_model(str(plain))
    assert loaded.weights is None and loaded.latent_shape is None


def test_truncated_export_weights_are_refused_naming_the_path_and_generate_exits_2_in_one_paragraph(tmp_path):
    export = Path(_unet_export(tmp_path))
    weights = export / WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a copy cut short
    with pytest.raises(
        SdtrainError, match=rf"model: {re.escape(str(export))}: its unet/ could not be loaded .*export the model again"
    ):
        load_model(str(export))
    np.save(tmp_path / "captions.npy", np.zeros((77, 32), np.float32))
    result = subprocess.run(
        [*GENERATE, str(export), "--captions", str(tmp_path / "captions.npy"), "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and f"{export}: its unet/ could not be loaded" in result.stderr


def test_the_weights_asked_of_an_export_are_those_its_sdtrain_json_records(tmp_path):
    """weights=ema of an export of raw weights (a run without an EMA) used to return the raw ones without a word,
    and weights=raw of it was refused."""
    raw = _unet_export(tmp_path, "raw")
    with pytest.raises(
        SdtrainError, match=rf"model: {re.escape(raw)} holds the raw \(trained\) weights alone .*use weights raw"
    ):
        load_model(raw, "ema")
    assert load_model(raw, "raw").weights == "raw" and load_model(raw).weights == "raw"
    ema = _unet_export(tmp_path, "ema")
    with pytest.raises(
        SdtrainError, match=rf"model: {re.escape(ema)} is an export or version that holds the EMA weights alone"
    ):
        load_model(ema, "raw")
    assert load_model(ema, "ema").weights == "ema" and load_model(ema).weights == "ema"


def test_guidance_at_or_below_one_is_the_conditional_prediction_alone_in_one_unet_pass():
    """diffusers' pipelines guide only above 1; sdtrain extrapolated away from the conditional prediction below it."""
    unet = _loaded("memory").unet
    x, t = torch.randn(2, 4, 16, 16), torch.tensor(400)
    cond, uncond = torch.randn(2, 77, 32), torch.zeros(2, 77, 32)
    batches: list[int] = []
    unet.register_forward_pre_hook(lambda _, args: batches.append(args[0].shape[0]))
    with torch.no_grad():
        conditional = unet(x, t, encoder_hidden_states=cond).sample
        for scale in (0.0, 0.5, 1.0):
            assert torch.equal(guided_prediction(unet, x, t, cond, uncond, scale), conditional)
    assert batches == [2] * 4  # no unconditional half


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_generate_samples_an_export_as_its_diffusers_pipeline_does_at_any_guidance_scale(sd_export, scale, tmp_path):
    export = sd_export["export"]
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    empty = torch.from_numpy(np.load(os.path.join(export, "unconditional_caption.npy")))[None]
    theirs = pipe(
        ["a red fox"],
        negative_prompt_embeds=empty,
        guidance_scale=scale,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images
    out = str(tmp_path / "samples")
    request = GenerateRequest(export, prompts=["a red fox"], out=out, samples_per_caption=1, sampler="dpm", steps=3)
    request.guidance_scale = scale
    generate(request)
    ours = torch.from_numpy(np.load(os.path.join(out, LATENTS_FILE))).reshape(theirs.shape)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _files(folder: str) -> dict[str, bytes]:
    return {name: Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))}


def test_an_exports_tokenizer_is_the_base_models_byte_for_byte(sd_export):
    """Re-saved through transformers it lost vocab.json and merges.txt, which the slow CLIPTokenizer that
    model_index.json names reads (transformers 4)."""
    exported = _files(os.path.join(sd_export["export"], "tokenizer"))
    assert exported == _files(os.path.join(sd_export["base"], "tokenizer"))
    assert {"vocab.json", "merges.txt"} <= set(exported)
    pipe = DiffusionPipeline.from_pretrained(sd_export["export"])
    base = AutoTokenizer.from_pretrained(os.path.join(sd_export["base"], "tokenizer"))
    assert pipe.tokenizer("a red fox").input_ids == base("a red fox").input_ids


def test_an_sdxl_exports_two_tokenizers_are_the_base_models_byte_for_byte(tmp_path):
    base = write_tiny_sdxl_model(str(tmp_path / "base"))
    loaded = _loaded(str(tmp_path / "checkpoint"), preset="tiny-sdxl", latent_classifier=None)
    loaded.vae_downsampling = 2
    export = write_export(loaded, str(tmp_path / "export"), base_model=base)
    for name in ("tokenizer", "tokenizer_2"):
        assert _files(os.path.join(export, name)) == _files(os.path.join(base, name)), name
    pipe = DiffusionPipeline.from_pretrained(export, add_watermarker=False)
    assert pipe.tokenizer_2.pad_token == "!"  # the second tokenizer's own padding, kept


def test_an_export_to_a_directory_left_by_one_cut_short_replaces_it_and_loads(tmp_path):
    """The refusal is of loading: exporting again into the directory replaces what was cut short."""
    export = _unet_export(tmp_path)
    Path(export, EXPORT_INCOMPLETE_FILE).write_text("being written")
    shutil.rmtree(Path(export, "scheduler"))
    assert write_export(_loaded(str(tmp_path / "checkpoint")), export) == export
    assert not Path(export, EXPORT_INCOMPLETE_FILE).exists() and load_model(export).weights == "ema"
