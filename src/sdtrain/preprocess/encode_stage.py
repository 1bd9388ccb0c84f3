"""The encode stage: the Ray Data callable class that runs a Stable Diffusion model's VAE and text encoder
(sdtrain.model.encoders) in an actor pool."""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np
import torch

from sdtrain.model.encoders import (
    encode_images,
    encode_prompts,
    load_text_encoder,
    load_tokenizer,
    load_vae,
    resolve_dtype,
    tokenize,
)
from sdtrain.storage.s3 import S3Settings, apply_s3_settings


def row_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & (2**63 - 1)


class Encoder:
    """Ray Data callable class (one per actor): loads the models once, then encodes batches.

    Input columns: pixels (N, H, W, 3 uint8), caption (str), valid (bool), key (str), plus any others, passed
    through. Output: the same without pixels and caption, plus ``latents`` as flat float16 rows and, by
    ``captions`` (output.captions), ``embeddings`` as flat float16 rows and/or ``token_ids`` as int32 rows (zeros
    where valid is false: those rows carry only a shard's statistics). For token ids alone the text encoder is
    not loaded: the tokenizer makes them.
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
    ):
        if s3 is not None:  # the driver's endpoint and retries, for a model on s3://
            apply_s3_settings(s3)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = resolve_dtype(dtype, self.device)
        self.vae = load_vae(model, self.device, torch_dtype)
        self.captions = captions
        self.text_encoder = None
        if captions == "token_ids":
            self.tokenizer = load_tokenizer(model)
        else:
            self.tokenizer, self.text_encoder = load_text_encoder(model, self.device, torch_dtype)
        self.latent, self.seed = latent, seed
        # Fixed row widths, also for a batch with no valid row (every batch's columns must have one shape).
        side = resolution // 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_width = self.vae.config.latent_channels * side * side
        self.ids_width = self.tokenizer.model_max_length
        if self.text_encoder is not None:
            self.embedding_width = self.ids_width * self.text_encoder.config.hidden_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        valid = np.asarray(batch["valid"], dtype=bool)
        pixels = batch.pop("pixels")
        captions = batch.pop("caption")
        n = len(valid)
        keep = np.flatnonzero(valid)
        latents = embeddings = ids = None
        if len(keep):
            prompts = [str(captions[i]) for i in keep]
            if self.text_encoder is not None:
                embeddings = encode_prompts(self.tokenizer, self.text_encoder, prompts).flatten(1).numpy()
            ids = tokenize(self.tokenizer, prompts).input_ids.numpy()
        if isinstance(pixels, np.ndarray) and pixels.dtype != object:  # one shape: one pass of the VAE
            if len(keep):
                latents = self._latents(pixels[keep], keep, batch)
            batch["latents"] = _scatter(latents, keep, n, self.latent_width, np.float16)
        else:  # aspect-ratio buckets: Ray Data hands a batch of several shapes as an array of arrays
            batch["latents"] = self._bucketed_latents(pixels, keep, batch, n)
        if self.captions != "token_ids":
            batch["embeddings"] = _scatter(embeddings, keep, n, self.embedding_width, np.float16)
        if self.captions != "embeddings":
            batch["token_ids"] = _scatter(ids, keep, n, self.ids_width, np.int32)
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
