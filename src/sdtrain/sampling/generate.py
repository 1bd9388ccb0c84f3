"""The whole sampling command: a trained model and captions in, a grid of samples out (latents,
images when a VAE is given, else a latent preview; class agreement for the digits demo)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from sdtrain.artifacts.loading import Weights, load_model
from sdtrain.errors import DataError
from sdtrain.model.encoders import load_vae
from sdtrain.sampling.captions import read_captions
from sdtrain.sampling.demo_scoring import class_agreement_report, demo_labels
from sdtrain.sampling.images import channels_preview, decode, decode_shape, digits_preview, grid_image
from sdtrain.sampling.sampler import sample_latents

LATENTS_FILE = "latents.npy"
PREVIEW_FILE = "preview.png"
GRID_FILE = "grid.png"
INFO_FILE = "generate.json"
DEMO_ACCURACY_FILE = "demo_accuracy.json"


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
    guidance_scale: float = 3.0
    seed: int = 0
    vae: str | None = None
    weights: Weights = "auto"
    preview: Literal["auto", "digits", "channels"] = "auto"
    batch_size: int = 64
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
    if request.prompts:
        from sdtrain.sampling.prompts import encode_prompt_captions, resolve_sources

        sources = resolve_sources(loaded, request.text_encoder, request.vae)
        captions = encode_prompt_captions(request.prompts, sources.text_encoder, loaded.caption_shape)
        request.vae = sources.vae  # prompts mean pictures: decode with the VAE the data was encoded with
    elif request.captions is not None:

        def encode(ids: torch.Tensor) -> torch.Tensor:  # a column of token ids: the model's text encoder, on demand
            from sdtrain.model.token_captions import CaptionEncoder
            from sdtrain.sampling.prompts import resolve_sources

            source = resolve_sources(loaded, request.text_encoder, request.vae).text_encoder
            return CaptionEncoder.load(source, use_gpu=False)(ids).float()

        captions = read_captions(
            request.captions, unet.config.cross_attention_dim, request.caption_column, request.rows, encode=encode
        )
    else:
        raise DataError("give --captions or --prompt/--prompts-file")
    latent_shape = loaded.latent_shape or (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    unconditional = loaded.unconditional_caption
    if unconditional is not None and tuple(unconditional.shape) != tuple(captions.embeddings.shape[1:]):
        raise DataError(
            f"--captions: embeddings of shape {tuple(captions.embeddings.shape[1:])}, but the model was trained with "
            f"captions of shape {tuple(unconditional.shape)}"
        )
    if unconditional is None:
        unconditional = torch.zeros(captions.embeddings.shape[1:])
    if request.guidance_scale != 1.0 and loaded.caption_dropout_prob == 0:
        request.notes.append(
            "the model was trained without caption dropout (train.caption_dropout_prob: 0), so its unconditional "
            "prediction is untrained; guidance may not help (try --guidance-scale 1)"
        )

    k = request.samples_per_caption
    repeated = captions.embeddings.repeat_interleave(k, dim=0)
    latents = sample_latents(
        unet,
        dict(loaded.noise_scheduler.config),
        repeated,
        unconditional,
        latent_shape,
        sampler=request.sampler,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        seed=request.seed,
        batch_size=request.batch_size,
    )
    os.makedirs(request.out, exist_ok=True)
    written = []
    grid_latents = latents.numpy().reshape(len(captions.names), k, *latent_shape)
    path = os.path.join(request.out, LATENTS_FILE)
    np.save(path, grid_latents)
    written.append(path)

    if request.vae is not None:
        vae = load_vae(request.vae, device)
        factor = loaded.latent_scaling_factor or vae.config.scaling_factor
        images = decode(vae, latents, factor).reshape(len(captions.names), k, *decode_shape(latents, vae))
        image_dir = os.path.join(request.out, "images")
        os.makedirs(image_dir, exist_ok=True)
        from PIL import Image

        for r in range(images.shape[0]):
            for c in range(k):
                path = os.path.join(image_dir, f"row{r:02d}_sample{c:02d}.png")
                Image.fromarray(images[r, c]).save(path)
                written.append(path)
        path = os.path.join(request.out, GRID_FILE)
        grid_image(images, captions.names).save(path)
        written.append(path)
    else:
        mode = request.preview
        if mode == "auto":
            mode = "digits" if loaded.trained_on_demo else "channels"
        flat = latents.numpy()
        tiles = digits_preview(flat) if mode == "digits" else channels_preview(flat)
        tiles = tiles.reshape(len(captions.names), k, *tiles.shape[1:])
        path = os.path.join(request.out, PREVIEW_FILE)
        grid_image(tiles, captions.names, zoom=max(1, 64 // latent_shape[-1])).save(path)
        written.append(path)

    labels = demo_labels(loaded, captions)
    if labels is not None:
        accuracy = class_agreement_report(latents.numpy(), labels, k)
        path = os.path.join(request.out, DEMO_ACCURACY_FILE)
        with open(path, "w") as f:
            json.dump(accuracy, f, indent=2)
        written.append(path)
        request.results.append(
            f"class agreement {accuracy['class_agreement']:.2f}: {accuracy['agreeing']} of "
            f"{accuracy['samples']} samples "
            f"look like the digit they were conditioned on (an SVC of the training digits; chance 0.10, real digits "
            f"{accuracy['real_digits']:.2f})"
        )

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
                "samples_per_caption": k,
                "sampler": request.sampler,
                "steps": request.steps,
                "guidance_scale": request.guidance_scale,
                "seed": request.seed,
                "vae": request.vae,
                "latents": f"{LATENTS_FILE}: shape {list(grid_latents.shape)} (rows, samples, C, H, W), model space",
            },
            f,
            indent=2,
        )
    written.append(path)
    return written
