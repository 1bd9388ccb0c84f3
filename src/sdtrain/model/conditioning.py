"""What the UNet is conditioned on besides the noisy latents and the timestep.

Every UNet cross-attends to the caption's hidden states (L x D). An SDXL-shaped UNet (``addition_embed_type:
text_time``) also takes, through its added embedding, the pooled text embedding of its second text encoder and six
micro-conditioning "time ids" per sample (Podell et al. 2023, section 2.2): the image's original height and width,
the top and left of its crop, and the target height and width, all in pixels. sdtrain takes the first four from the
columns aspect-ratio preprocessing writes (``original_height``, ``original_width``, ``crop_top``, ``crop_left``); for
data without them, the image is taken to be its latents' own size, uncropped. The target is the latents' size in
pixels (the bucket's).

Every forward pass of the UNet in sdtrain (training, validation, sampling, evaluation, the FLOP and memory models)
takes a :class:`Conditioning`, whose :meth:`Conditioning.kwargs` are what it passes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from sdtrain.errors import ConfigError

TIME_IDS = 6
"""Micro-conditioning values per sample: original (height, width), crop (top, left), target (height, width)."""
PLACEMENT = 4
"""Of those, the ones a row records (the first four); the target is its latents' size."""


def pooled_width(unet_config: Mapping[str, Any]) -> int | None:
    """The pooled text embedding's width an SDXL-shaped UNet takes (its ``projection_class_embeddings_input_dim``
    less the time ids' embeddings); None for a UNet without added conditioning (SD 1 and 2)."""
    kind = unet_config.get("addition_embed_type")
    if kind is None:
        return None
    if kind != "text_time":
        raise ConfigError(
            f"model.unet: addition_embed_type {kind!r} is not supported; sdtrain trains UNets without added "
            "conditioning (SD 1 and 2) and SDXL's text_time"
        )
    projection = unet_config.get("projection_class_embeddings_input_dim")
    time_dim = unet_config.get("addition_time_embed_dim")
    if not projection or not time_dim or projection <= TIME_IDS * time_dim:
        raise ConfigError(
            "model.unet: addition_embed_type text_time needs projection_class_embeddings_input_dim = the pooled text "
            f"embedding's width + {TIME_IDS} x addition_time_embed_dim, got {projection} and {time_dim}"
        )
    return int(projection - TIME_IDS * time_dim)


def time_ids(
    latents_hw: tuple[int, int], downsampling: int, rows: int, placement: torch.Tensor | None = None
) -> torch.Tensor:
    """(rows, 6) int64 time ids of ``rows`` samples of latents of ``latents_hw``: each row's recorded placement
    (rows, 4: original height, width, crop top, left), or the latents' own size uncropped; the target is
    ``latents_hw`` times the VAE's ``downsampling``.

    Whole pixel counts, as integers: the UNet's time-id embedding takes them to float32 itself, and FSDP2's
    mixed-precision policy casts the floating inputs of the forward to its bf16 parameter dtype, which rounds sizes
    above 256 (2047 to 2048, a crop of 341 to 340): the model would learn sizes no pipeline gives it."""
    device = placement.device if placement is not None else None
    target = torch.tensor([latents_hw[0] * downsampling, latents_hw[1] * downsampling], dtype=torch.long, device=device)
    if placement is None:
        placement = torch.cat([target, torch.zeros(2, dtype=torch.long)]).expand(rows, PLACEMENT)
    return torch.cat([placement.long(), target.expand(rows, 2)], dim=1)


@dataclass(frozen=True)
class Conditioning:
    """A batch's conditioning. ``pooled`` and ``time_ids`` are set exactly for an SDXL-shaped UNet."""

    hidden: torch.Tensor
    """(N, L, D) caption hidden states the cross-attentions read."""
    pooled: torch.Tensor | None = None
    """(N, P) pooled text embeddings."""
    time_ids: torch.Tensor | None = None
    """(N, 6) micro-conditioning (module docstring)."""

    def kwargs(self) -> dict[str, Any]:
        """The UNet's keyword arguments for this conditioning."""
        if self.pooled is None:
            return {"encoder_hidden_states": self.hidden}
        return {
            "encoder_hidden_states": self.hidden,
            "added_cond_kwargs": {"text_embeds": self.pooled, "time_ids": self.time_ids},
        }

    def __len__(self) -> int:
        return len(self.hidden)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Conditioning:
        """On ``device``; the text embeddings in ``dtype`` (the time ids stay whole numbers: they are sizes)."""
        return Conditioning(
            self.hidden.to(device, dtype),
            None if self.pooled is None else self.pooled.to(device, dtype),
            None if self.time_ids is None else self.time_ids.to(device),
        )

    def rows(self, index: torch.Tensor | slice) -> Conditioning:
        return Conditioning(
            self.hidden[index],
            None if self.pooled is None else self.pooled[index],
            None if self.time_ids is None else self.time_ids[index],
        )

    def cat(self, other: Conditioning) -> Conditioning:
        """This batch's rows, then ``other``'s."""
        return Conditioning(
            torch.cat([self.hidden, other.hidden]),
            None if self.pooled is None or other.pooled is None else torch.cat([self.pooled, other.pooled]),
            None if self.time_ids is None or other.time_ids is None else torch.cat([self.time_ids, other.time_ids]),
        )

    def with_text(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> Conditioning:
        """The same micro-conditioning with other text: what caption dropout and classifier-free guidance's
        unconditional half use (SDXL keeps the sizes when it drops the text)."""
        return replace(self, hidden=hidden, pooled=pooled)


def dummy_conditioning(
    unet_config: Mapping[str, Any], rows: int, caption_shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Conditioning:
    """Empty tensors of the shapes the UNet of ``unet_config`` takes (on the current default device: the meta device
    or a fake tensor mode), for the models that trace it (FLOPs, memory, the per-op model, the driver's check)."""
    width = pooled_width(unet_config)
    hidden = torch.empty(rows, *caption_shape, dtype=dtype)
    if width is None:
        return Conditioning(hidden)
    return Conditioning(hidden, torch.empty(rows, width, dtype=dtype), torch.empty(rows, TIME_IDS))


class Conditioner:
    """Turns a batch as the data streams carry it (``captions``: embeddings or token ids; ``pooled`` and
    ``placement`` where sdtrain.data.added_columns reads them) into the UNet's :class:`Conditioning`.

    Args:
        unet_config: the UNet's config: whether it takes added conditioning, and the pooled width.
        downsampling: pixels per latent of the data's VAE (the time ids are in pixels).
        encoder: for captions stored as token ids, the frozen text encoders (sdtrain.model.token_captions).
    """

    def __init__(self, unet_config: Mapping[str, Any], downsampling: int = 8, encoder: Any = None):
        self.pooled_width = pooled_width(unet_config)
        self.downsampling = downsampling
        self.encoder = encoder

    def __call__(
        self, batch: Mapping[str, torch.Tensor], latents_hw: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> Conditioning:
        captions = batch["captions"]
        if self.encoder is not None:
            hidden, pooled = self.encoder.encode(captions)
        else:
            hidden, pooled = captions, batch.get("pooled")
        if self.pooled_width is None:
            return Conditioning(hidden.to(dtype))
        assert pooled is not None, "an SDXL-shaped UNet's batch carries a pooled embedding (the data check sees to it)"
        placement = batch.get("placement")
        ids = time_ids(latents_hw, self.downsampling, len(hidden), placement)
        return Conditioning(hidden.to(dtype), pooled.to(hidden.device, dtype), ids.to(hidden.device))
