"""Latents to pictures: decoded by a VAE, or previewed without one (by the latent classifier the training data named,
else three channels as RGB), and laid out as a grid with a row per caption."""

from __future__ import annotations

import math

import numpy as np
import torch

from sdtrain.sampling.latent_classifier import load_latent_classifier


def latent_preview(latents: np.ndarray, classifier: str | None) -> np.ndarray:
    """(N, C, H, W) latents -> pictures without a VAE: the latent classifier's preview when the training data named one
    (sdtrain.sampling.latent_classifier), else :func:`channels_preview`."""
    if classifier is None:
        return channels_preview(latents)
    return load_latent_classifier(classifier, "the model's latent classifier").preview(latents)


def channels_preview(latents: np.ndarray) -> np.ndarray:
    """(N, C, H, W) latents -> (N, H, W, 3) uint8: the first three channels as RGB, [-3, 3] mapped to [0, 255]
    (SD latents, scaled by 0.18215, have roughly unit variance)."""
    rgb = latents[:, :3] if latents.shape[1] >= 3 else np.repeat(latents[:, :1], 3, axis=1)
    return (255 * np.clip((rgb + 3) / 6, 0, 1)).transpose(0, 2, 3, 1).astype(np.uint8)


LABEL_CHARS = 40
"""A grid row's label, its caption's name or prompt, is cut to this many characters."""


def grid_image(tiles: np.ndarray, names: list[str], zoom: int = 1):
    """(R, K, H, W[, 3]) uint8 tiles -> one PIL image, a row per caption with its name (a prompt's text) on the left,
    in a margin as wide as the longest."""
    from PIL import Image, ImageDraw

    rows, cols, h, w = tiles.shape[:4]
    h, w = h * zoom, w * zoom
    labels = [name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 3] + "..." for name in names]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    pad, margin = 2, max(60, 8 + math.ceil(max((measure.textlength(label) for label in labels), default=0)))
    canvas = Image.new("RGB", (margin + cols * (w + pad) + pad, rows * (h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        draw.text((4, pad + r * (h + pad) + h // 2 - 5), labels[r], fill="black")
        for k in range(cols):
            tile = Image.fromarray(tiles[r, k]).convert("RGB").resize((w, h), Image.Resampling.NEAREST)
            canvas.paste(tile, (margin + pad + k * (w + pad), pad + r * (h + pad)))
    return canvas


@torch.no_grad()
def decode(vae, latents: torch.Tensor, scaling_factor: float, batch_size: int = 8) -> np.ndarray:
    """Model-space latents -> (N, H, W, 3) uint8 images: divided by the scaling factor once, then decoded."""
    device = next(vae.parameters()).device
    images: np.ndarray | None = None  # each batch written into place: the images are held once, not twice
    for start in range(0, len(latents), batch_size):
        batch = latents[start : start + batch_size].to(device, vae.dtype) / scaling_factor
        decoded = ((vae.decode(batch).sample.float().cpu() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        if images is None:
            images = np.empty((len(latents), *decoded.shape[2:], decoded.shape[1]), np.uint8)
        images[start : start + len(batch)] = decoded.permute(0, 2, 3, 1).numpy()
    return images if images is not None else np.zeros((0, 0, 0, 3), np.uint8)


def decode_shape(latents: torch.Tensor, vae) -> tuple[int, int, int]:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return (latents.shape[-2] * factor, latents.shape[-1] * factor, 3)
