"""The whole sampling command: a trained model and captions in, a grid of samples out (latents, images when a VAE is
given, else a latent preview; the class agreement of labelled rows when the model's data named a latent classifier)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from sdtrain.artifacts.export import model_sources
from sdtrain.artifacts.loading import LoadedModel, Weights, load_model
from sdtrain.errors import DataError
from sdtrain.logs import log
from sdtrain.model.encoders import load_vae, vae_downsampling
from sdtrain.model.unet import default_guidance_rescale
from sdtrain.sampling.captions import Captions, read_captions
from sdtrain.sampling.images import channels_preview, decode, decode_shape, grid_image, latent_preview
from sdtrain.sampling.latent_classifier import load_latent_classifier
from sdtrain.sampling.sampler import sample_latents

LATENTS_FILE = "latents.npy"
PREVIEW_FILE = "preview.png"
GRID_FILE = "grid.png"
INFO_FILE = "generate.json"
CLASS_AGREEMENT_FILE = "class_agreement.json"


@dataclass
class GenerateRequest:
    model: str
    captions: str | None = None
    out: str = "samples"
    caption_column: str = "caption_latents"
    rows: int = 8
    samples_per_caption: int = 8
    sampler: Literal["ddim", "dpm"] = "ddim"
    steps: int = 25
    guidance_scale: float | None = None
    """Classifier-free guidance; None: 3, or for an SDXL-shaped model 5 (StableDiffusionXLPipeline's default)."""
    seed: int = 0
    vae: str | None = None
    weights: Weights = "auto"
    preview: Literal["auto", "classifier", "channels"] = "auto"
    batch_size: int = 64
    guidance_rescale: float | None = None
    """Guidance rescale (diffusers' guidance_rescale); None: 0.7 for a zero-terminal-SNR model, else none."""
    pooled_caption_column: str = "caption_pooled"
    """SDXL-shaped models: the parquet column of the captions' pooled embeddings."""
    height: int | None = None
    """Pixels; None: what the model trained at (the data's one shape, or the aspect-ratio bucket most rows had)."""
    width: int | None = None
    """Pixels; None: as height."""
    prompts: list[str] = field(default_factory=list)
    """Prompts in words, encoded with request.text_encoder or the one the model's data records (instead of
    captions)."""
    text_encoder: str | None = None
    notes: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)


def generate(request: GenerateRequest) -> list[str]:
    """Sample a grid (a row per caption, ``samples_per_caption`` columns) and write it to ``request.out``.
    Returns the paths written."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(request.model, request.weights)
    unet = loaded.unet.to(device).eval()
    if request.guidance_scale is None:
        request.guidance_scale = 5.0 if loaded.pooled_width else 3.0
    scheduler_config = dict(loaded.noise_scheduler.config)
    if request.guidance_rescale is None:
        request.guidance_rescale = default_guidance_rescale(scheduler_config)
    captions = _captions(request, loaded, unet.config.cross_attention_dim)
    latent_shape = _latent_shape(request, loaded, unet.config)
    unconditional = loaded.unconditional_caption
    if unconditional is not None and tuple(unconditional.shape) != tuple(captions.embeddings.shape[1:]):
        raise DataError(
            f"--captions: embeddings of shape {tuple(captions.embeddings.shape[1:])}, but the model was trained with "
            f"captions of shape {tuple(unconditional.shape)}"
        )
    if unconditional is None:
        unconditional = torch.zeros(captions.embeddings.shape[1:])
    if request.guidance_scale > 1.0 and loaded.caption_dropout_prob == 0:  # at 1 or below there is no guidance
        request.notes.append(
            "the model was trained without caption dropout (train.caption_dropout_prob: 0), so its unconditional "
            "prediction is untrained; guidance may not help (try --guidance-scale 1)"
        )
    k = request.samples_per_caption
    latents = sample_latents(
        unet,
        scheduler_config,
        captions.conditioning(k),
        unconditional,
        latent_shape,
        sampler=request.sampler,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        guidance_rescale=request.guidance_rescale,
        seed=request.seed,
        batch_size=request.batch_size,
        vae_downsampling=loaded.vae_downsampling,
    )
    os.makedirs(request.out, exist_ok=True)
    grid_latents = latents.numpy().reshape(len(captions.names), k, *latent_shape)
    path = os.path.join(request.out, LATENTS_FILE)
    np.save(path, grid_latents)
    written = [path]
    if request.vae is not None:
        written += _write_images(request, loaded, latents, captions, device)
    else:
        written.append(_write_preview(request, loaded, latents, captions, latent_shape))
    written += _write_class_agreement(request, loaded, latents, captions)
    written.append(_write_info(request, loaded, captions, list(grid_latents.shape)))
    return written


def _latent_shape(request: GenerateRequest, loaded: LoadedModel, unet_config: Any) -> tuple[int, int, int]:
    """(C, H, W) to sample at: the model's own (its data's shape, or the bucket most rows had), or request.height and
    request.width in pixels, through the VAE's downsampling; a note when that is no shape the model trained at."""
    channels, height, width = loaded.latent_shape or (
        unet_config.in_channels,
        unet_config.sample_size,
        unet_config.sample_size,
    )
    if request.height is None and request.width is None:
        return channels, height, width
    vae = request.vae or (sources.vae if (sources := model_sources(loaded)) else None)
    if vae is None:
        raise DataError(
            f"--height/--width are pixels, and {loaded.source} records no VAE to say how many make a latent: give --vae"
        )
    factor = vae_downsampling(vae)
    multiple = factor * 2 ** (len(unet_config.block_out_channels) - 1)
    pixels = {"height": request.height or height * factor, "width": request.width or width * factor}
    for name, value in pixels.items():
        if value < multiple or value % multiple:
            raise DataError(
                f"--{name} {value}: must be a positive multiple of {multiple} (the VAE's downsampling {factor} x the "
                f"UNet's {multiple // factor})"
            )
    shape = (channels, pixels["height"] // factor, pixels["width"] // factor)
    trained = loaded.bucket_shapes or ((channels, height, width),)
    if shape not in {tuple(b) for b in trained}:
        sizes = ", ".join(f"{b[1] * factor}x{b[2] * factor}" for b in trained)
        request.notes.append(
            f"{pixels['height']}x{pixels['width']} px is no shape the model trained at ({sizes}): expect it to do "
            "worse there"
        )
    return shape


def _captions(request: GenerateRequest, loaded: LoadedModel, caption_dim: int) -> Captions:
    """The grid's rows: prompts encoded with the model's text encoder, or captions read from a file; given neither,
    the prompts of the run's sample grids (sample_grid.prompts) with the text encoder that encoded them."""
    if not request.prompts and request.captions is None:
        meta = loaded.meta
        if meta is None or not meta.grid_prompts:
            raise DataError(f"give --captions or --prompt/--prompts-file ({request.model} has no sample_grid.prompts)")
        log.info(f"no --captions or --prompt: sampling the run's sample_grid.prompts ({len(meta.grid_prompts)})")
        request.prompts = list(meta.grid_prompts)
        request.text_encoder = request.text_encoder or meta.grid_text_encoder
    if request.prompts:
        from sdtrain.sampling.prompts import encode_prompt_captions, resolve_sources

        sources = resolve_sources(loaded, request.text_encoder, request.vae)
        request.vae = sources.vae  # prompts mean pictures: decode with the VAE the data was encoded with
        return encode_prompt_captions(request.prompts, sources.text_encoder, loaded.caption_shape)
    assert request.captions is not None

    def encode(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # token ids: the model's encoders
        from sdtrain.model.token_captions import CaptionEncoder
        from sdtrain.sampling.prompts import resolve_sources

        source = resolve_sources(loaded, request.text_encoder, request.vae).text_encoder
        return CaptionEncoder.load(source, use_gpu=False).encode(ids)

    pooled = request.pooled_caption_column if loaded.pooled_width else None
    return read_captions(request.captions, caption_dim, request.caption_column, request.rows, encode, pooled)


def _write_images(
    request: GenerateRequest, loaded: LoadedModel, latents: torch.Tensor, captions: Captions, device: str
) -> list[str]:
    """Each sample decoded by the VAE, and the grid of them."""
    from PIL import Image

    assert request.vae is not None
    vae = load_vae(request.vae, device)
    factor = loaded.latent_scaling_factor or vae.config.scaling_factor
    k = request.samples_per_caption
    images = decode(vae, latents, factor).reshape(len(captions.names), k, *decode_shape(latents, vae))
    image_dir = os.path.join(request.out, "images")
    os.makedirs(image_dir, exist_ok=True)
    written = []
    for r in range(images.shape[0]):
        for c in range(k):
            path = os.path.join(image_dir, f"row{r:02d}_sample{c:02d}.png")
            Image.fromarray(images[r, c]).save(path)
            written.append(path)
    path = os.path.join(request.out, GRID_FILE)
    grid_image(images, captions.names).save(path)
    return [*written, path]


def _write_preview(
    request: GenerateRequest, loaded: LoadedModel, latents: torch.Tensor, captions: Captions, latent_shape
) -> str:
    """The grid without a VAE: the latent classifier's pictures (auto, where the model's data named one), else three
    channels as RGB."""
    flat = latents.numpy()
    if request.preview == "channels" or (request.preview == "auto" and loaded.latent_classifier is None):
        tiles = channels_preview(flat)
    elif loaded.latent_classifier is None:
        raise DataError(f"--preview classifier: {request.model} names no latent classifier (its data named none)")
    else:
        tiles = latent_preview(flat, loaded.latent_classifier)
    tiles = tiles.reshape(len(captions.names), request.samples_per_caption, *tiles.shape[1:])
    path = os.path.join(request.out, PREVIEW_FILE)
    grid_image(tiles, captions.names, zoom=max(1, 64 // latent_shape[-1])).save(path)
    return path


def _write_class_agreement(
    request: GenerateRequest, loaded: LoadedModel, latents: torch.Tensor, captions: Captions
) -> list[str]:
    """With labelled rows and a model whose data named a latent classifier that reports: its report, one line of it
    among the results."""
    if captions.labels is None or loaded.latent_classifier is None:
        return []
    classifier = load_latent_classifier(loaded.latent_classifier, f"{request.model}'s latent classifier")
    report = getattr(classifier, "report", None)
    if report is None:
        return []
    agreement = report(latents.numpy(), list(captions.labels), request.samples_per_caption, captions.embeddings.numpy())
    if agreement is None:
        return []
    path = os.path.join(request.out, CLASS_AGREEMENT_FILE)
    with open(path, "w") as f:
        json.dump(agreement, f, indent=2)
    request.results.append(agreement.get("summary", f"class agreement {agreement['class_agreement']:.2f}"))
    return [path]


def _write_info(request: GenerateRequest, loaded: LoadedModel, captions: Captions, shape: list[int]) -> str:
    path = os.path.join(request.out, INFO_FILE)
    with open(path, "w") as f:
        json.dump(
            {
                "model": request.model,
                "weights": loaded.weights,
                "global_step": loaded.global_step,
                "prediction_type": loaded.noise_scheduler.config.prediction_type,
                "captions": request.captions,
                "prompts": request.prompts,
                "text_encoder": request.text_encoder,
                "rows": captions.names,
                "samples_per_caption": request.samples_per_caption,
                "sampler": request.sampler,
                "steps": request.steps,
                "guidance_scale": request.guidance_scale,
                "guidance_rescale": request.guidance_rescale,
                "seed": request.seed,
                "vae": request.vae,
                "latents": f"{LATENTS_FILE}: shape {shape} (rows, samples, C, H, W), model space",
            },
            f,
            indent=2,
        )
    return path
