"""FLOPs of a UNet2DConditionModel forward pass, counted from the model's structure.

Counted (multiply-add = 2 FLOPs):

- every ``nn.Conv2d``: 2 x output elements x (input channels / groups) x kernel height x width;
- every ``nn.Linear``: 2 x output elements x input features (attention projections, feed-forward,
  time embedding, linear ``proj_in``/``proj_out``);
- every diffusers ``Attention``'s two matmuls, which are not modules: Q K^T and softmax(.) V,
  each 2 x query tokens x key tokens x inner dimension (summed over heads).

Not counted: normalizations, activations, softmax, bias adds, residual adds, up-sampling, the
sinusoidal timestep features: elementwise work, under 1% of the total for these UNets. This is
the usual convention for model FLOPs utilization (MFU), and the same set of operations that
``torch.utils.flop_counter.FlopCounterMode`` counts (mm, addmm, bmm, convolution, attention).

The count runs the forward pass on PyTorch's ``meta`` device, where tensors have shapes but no
data: instant and memory-free even for the SD 2 UNet at 512 px. A training step is counted as
``TRAIN_STEP_FACTOR`` = 3 forward passes (the backward pass computes gradients for both the
activations and the weights, 2x the forward's matmul FLOPs), the convention of the PaLM MFU
definition; the small noise-schedule, loss and optimizer arithmetic is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: FLOPs of a training step (forward + backward) per forward FLOP.
TRAIN_STEP_FACTOR = 3


@dataclass(frozen=True)
class ForwardFlops:
    conv: int
    linear: int
    attention: int  # the Q K^T and attention-weights x V matmuls

    @property
    def total(self) -> int:
        return self.conv + self.linear + self.attention

    @property
    def train_step(self) -> int:
        return TRAIN_STEP_FACTOR * self.total


def count_forward_flops(model: nn.Module, *args: Any, **kwargs: Any) -> ForwardFlops:
    """Run ``model(*args, **kwargs)`` once and count its conv, linear and attention-matmul FLOPs."""
    from diffusers.models.attention_processor import Attention

    counts = {"conv": 0, "linear": 0, "attention": 0}

    def conv_hook(module: nn.Conv2d, inputs, output) -> None:
        kh, kw = module.kernel_size
        counts["conv"] += 2 * output.numel() * (module.in_channels // module.groups) * kh * kw

    def linear_hook(module: nn.Linear, inputs, output) -> None:
        counts["linear"] += 2 * output.numel() * module.in_features

    def attention_hook(module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        encoder = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        batch = hidden.shape[0]
        queries = hidden.shape[2] * hidden.shape[3] if hidden.ndim == 4 else hidden.shape[1]
        keys = queries if encoder is None else encoder.shape[1]
        # Q K^T: (queries x d) . (d x keys) per head; softmax(.) V: (queries x keys) . (keys x d) per head.
        counts["attention"] += 2 * 2 * batch * queries * keys * module.inner_dim

    handles = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            handles.append(module.register_forward_hook(conv_hook))
        elif isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(linear_hook))
        elif isinstance(module, Attention):
            handles.append(module.register_forward_pre_hook(attention_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return ForwardFlops(**counts)


def unet_forward_flops(
    unet_config: Mapping[str, Any],
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    batch_size: int = 1,
) -> ForwardFlops:
    """FLOPs of one forward pass of ``UNet2DConditionModel(**unet_config)`` on ``batch_size`` samples
    of latents (C, H, W) and caption embeddings (L, D). Built and run on the meta device."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
        latents = torch.empty(batch_size, *latent_shape)
        captions = torch.empty(batch_size, *caption_shape)
        timesteps = torch.zeros(batch_size, dtype=torch.long)
    return count_forward_flops(unet, latents, timesteps, encoder_hidden_states=captions)


def mfu(images_per_s: float, train_step_flops_per_image: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the hardware's peak FLOP/s."""
    return images_per_s * train_step_flops_per_image / peak_flops
