"""The encode stage: the Ray Data callable class that runs a Stable Diffusion model's VAE and text encoders
(sdtrain.model.encoders: SD 1/2's one, SDXL's two) in an actor pool."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy as np
import torch

from sdtrain.model.encoders import (
    TextEncoders,
    encode_images,
    load_text_encoders,
    load_tokenizers,
    load_vae,
    resolve_dtype,
    tokenize_each,
    vae_dtype,
)
from sdtrain.preprocess.model_outputs import ids_key
from sdtrain.storage.s3 import S3Settings, apply_s3_settings


def row_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & (2**63 - 1)


class Encoder:
    """Ray Data callable class (one per actor): loads the models once, then encodes batches.

    Input columns: pixels (N, H, W, 3 uint8; with ``buckets`` aspect, each row of its bucket's shape), caption
    (str), valid (bool), key (str), plus any others, passed through. Output: the same without pixels and caption,
    plus ``latents`` as flat float16 rows (with aspect buckets, each of its own bucket's length) and, by
    ``captions`` (output.captions), ``embeddings`` as flat float16 rows (L x D: the text encoders' hidden states,
    as sdtrain.model.encoders.TextEncoders.encode makes them) with, for SDXL, ``pooled`` (P float16 a row), and/or
    each tokenizer's ids as int32 rows of L (``token_ids``, then SDXL's second's ``token_ids_2``:
    model_outputs.ids_key); zeros where valid is false (those rows carry only a shard's statistics). For token ids
    alone no text encoder is loaded: the tokenizers make them.
    """

    def __init__(
        self,
        model: str,
        latent: Literal["mean", "sample"],
        seed: int,
        dtype: str,
        resolution: int,
        s3: S3Settings | None = None,
        captions: Literal["embeddings", "token_ids", "both"] = "embeddings",
        buckets: Literal["square", "aspect"] = "square",
        sdxl: bool | None = None,
    ):
        if s3 is not None:  # the driver's endpoint and retries, for a model on s3://
            apply_s3_settings(s3)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = resolve_dtype(dtype, self.device)
        # sdxl: decided on the driver (model_outputs.check_model), not asked of the hub again by every actor.
        self.vae = load_vae(model, self.device, vae_dtype(model, torch_dtype, sdxl))  # SDXL's in float32 (vae_dtype)
        self.captions = captions
        self.text_encoders: TextEncoders | None = None
        if captions == "token_ids":
            self.tokenizers = load_tokenizers(model, sdxl)
        else:
            self.text_encoders = load_text_encoders(model, self.device, torch_dtype, sdxl)
            self.tokenizers = self.text_encoders.tokenizers
        self.latent, self.seed, self.buckets = latent, seed, buckets
        # Fixed row widths, also for a batch with no valid row (every batch's columns must have one shape).
        side = resolution // 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_width = self.vae.config.latent_channels * side * side
        length = int(self.tokenizers[0].model_max_length)
        self.ids_width = length * len(self.tokenizers)
        if self.text_encoders is not None:
            self.embedding_width = length * self.text_encoders.width
            self.pooled_width = int(self.text_encoders.encoders[-1].config.projection_dim)

    @property
    def text_encoder(self) -> Any:
        """The (first) text encoder, or None where only token ids are stored."""
        return None if self.text_encoders is None else self.text_encoders.encoders[0]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        valid = np.asarray(batch["valid"], dtype=bool)
        pixels = batch.pop("pixels")
        captions = batch.pop("caption")
        n = len(valid)
        keep = np.flatnonzero(valid)
        latents = hidden = pooled = ids = None
        if len(keep):
            prompts = [str(captions[i]) for i in keep]
            if self.text_encoders is not None:
                hidden, pooled = self.text_encoders.encode(prompts)
            ids = tokenize_each(self.tokenizers, prompts).numpy()
        # Aspect-ratio buckets take the per-shape path whatever the batch holds: Ray Data hands a batch of several
        # shapes as an array of arrays, but one of a single shape (all one non-square bucket) as a plain uint8
        # array, whose latents are not latent_width (the square's) wide.
        if self.buckets == "square" and isinstance(pixels, np.ndarray) and pixels.dtype != object:
            if len(keep):  # one shape: one pass of the VAE
                latents = self._latents(pixels[keep], keep, batch)
            batch["latents"] = _scatter(latents, keep, n, self.latent_width, np.float16)
        else:
            batch["latents"] = self._bucketed_latents(pixels, keep, batch, n)
        if self.text_encoders is not None and self.captions != "token_ids":
            batch["embeddings"] = _scatter(_flat(hidden), keep, n, self.embedding_width, np.float16)
            if self.text_encoders.pooled:
                batch["pooled"] = _scatter(_flat(pooled), keep, n, self.pooled_width, np.float16)
        if self.captions != "embeddings":
            length = self.ids_width // len(self.tokenizers)
            for t in range(len(self.tokenizers)):
                part = None if ids is None else ids[:, t * length : (t + 1) * length]
                batch[ids_key(t)] = _scatter(part, keep, n, length, np.int32)
        return batch

    def _latents(self, pixels: np.ndarray, rows: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Flat latents of ``pixels`` (N, H, W, 3), the batch's ``rows``."""
        seeds = [row_seed(self.seed, str(batch["key"][i])) for i in rows] if self.latent == "sample" else None
        return encode_images(self.vae, pixels, self.latent, seeds).flatten(1).numpy()

    def _bucketed_latents(
        self, pixels: np.ndarray, keep: np.ndarray, batch: dict[str, np.ndarray], n: int
    ) -> np.ndarray:
        """Each row's flat latents, of its own bucket's size, as an array of arrays: the rows of each shape through
        the VAE together."""
        out = np.empty(n, dtype=object)
        for i in range(n):
            out[i] = np.zeros(0, np.float16)  # rows that carry only a shard's counts
        shapes: dict[tuple[int, ...], list[int]] = {}
        for i in keep.tolist():
            shapes.setdefault(tuple(np.asarray(pixels[i]).shape), []).append(i)
        for rows in shapes.values():
            stacked = np.stack([np.asarray(pixels[i]) for i in rows])
            for i, latent in zip(rows, self._latents(stacked, np.asarray(rows), batch), strict=True):
                out[i] = latent.astype(np.float16)
        return out


def _scatter(values: np.ndarray | None, rows: np.ndarray, n: int, width: int, dtype: type) -> np.ndarray:
    out: np.ndarray = np.zeros((n, width), dtype=dtype)
    if values is not None:
        out[rows] = values.astype(dtype)
    return out


def _flat(values: torch.Tensor | None) -> np.ndarray | None:
    return None if values is None else values.flatten(1).numpy()
