"""Model FLOPs of a UNet2DConditionModel, for model FLOPs utilization (MFU).

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls, convolutions and attention
(multiply-add = 2 FLOPs) and leaves out elementwise work (norms, activations, softmax): the usual MFU
convention. The forward pass runs on the meta device, where tensors have shapes but no data, so even
the SD 2 UNet at 512 px costs no memory and well under a second. A training step is
``TRAIN_STEP_FACTOR`` forward passes (PaLM's MFU definition: the backward pass is 2x the forward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from sdtrain.model.conditioning import dummy_conditioning

TRAIN_STEP_FACTOR = 3


def _cpu_flash_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


# On meta, scaled_dot_product_attention falls back to explicit bmm's, which the counter counts. On CPU it
# runs a fused kernel the counter has no formula for (it would count no attention at all): give it sdpa's,
# so a count never depends on which kernel the device picked.
_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops}


def forward_flops(model: nn.Module, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``model(*args, **kwargs)``, run once without gradients."""
    with FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as counter, torch.no_grad():
        model(*args, **kwargs)
    return counter.get_total_flops()


def unet_forward_flops(
    unet_config: Mapping[str, Any],
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    batch_size: int = 1,
) -> int:
    """FLOPs of one forward pass of ``UNet2DConditionModel(**unet_config)`` on ``batch_size`` samples
    of latents (C, H, W) and caption embeddings (L, D), counted on the meta device."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
        latents = torch.empty(batch_size, *latent_shape)
        conditioning = dummy_conditioning(unet_config, batch_size, caption_shape)
        timesteps = torch.zeros(batch_size, dtype=torch.long)
    return forward_flops(unet, latents, timesteps, **conditioning.kwargs())


def unet_train_step_flops(
    unet_config: Mapping[str, Any],
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    batch_size: int = 1,
) -> int:
    """Model FLOPs of a training step (forward and backward) on ``batch_size`` samples."""
    return TRAIN_STEP_FACTOR * unet_forward_flops(unet_config, latent_shape, caption_shape, batch_size)


def text_encoder_forward_flops(text_encoder_config: Any, length: int = 77, batch_size: int = 1) -> int:
    """FLOPs of one forward pass of ``CLIPTextModel(text_encoder_config)`` on ``batch_size`` rows of ``length`` token
    ids, counted on the meta device: the in-step encoding of token-id captions (sdtrain.model.token_captions), a
    forward only (the encoder is frozen)."""
    from transformers import CLIPTextModel

    with torch.device("meta"):
        encoder = CLIPTextModel(text_encoder_config)
        ids = torch.zeros(batch_size, length, dtype=torch.long)
    return forward_flops(encoder, ids)


def mfu(images_per_s: float, train_step_flops_per_image: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the hardware's peak FLOP/s."""
    return images_per_s * train_step_flops_per_image / peak_flops
