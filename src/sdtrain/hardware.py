"""GPU options of the train config: the distributed strategy, torch.compile, channels_last,
gradient checkpointing and the attention kernel, applied to a built DiffusionModule."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from sdtrain.config import TrainConfig


def build_strategy(train: TrainConfig):
    """Ray's Lightning strategy for ``train.strategy``.

    FSDP shards the UNet per transformer/resnet block with the original parameters kept
    visible (``use_orig_params``), so the optimizer, gradient clipping and the non-finite check
    see the UNet's own parameters; the checkpoint is gathered into one full state dict on rank 0
    (RayFSDPStrategy), the same file format as DDP's.
    """
    from ray.train.lightning import RayDDPStrategy, RayFSDPStrategy

    if train.strategy == "ddp":
        return RayDDPStrategy()
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    return RayFSDPStrategy(
        auto_wrap_policy={ResnetBlock2D, Transformer2DModel},
        use_orig_params=True,
        state_dict_type="full",
    )


def apply_options(module, train: TrainConfig) -> None:
    """Set the attention kernel, memory format, gradient checkpointing and compilation of
    ``module.unet`` (and its EMA, which only runs inference) in place. Call before fitting."""
    unets = [module.unet] + ([module.ema_unet] if getattr(module, "ema_unet", None) is not None else [])
    for unet in unets:
        unet.set_attn_processor(AttnProcessor2_0() if train.attention == "sdpa" else AttnProcessor())
        if train.channels_last:
            unet.to(memory_format=torch.channels_last)
    if train.gradient_checkpointing:
        module.unet.enable_gradient_checkpointing()
    if train.compile:
        # In place (nn.Module.compile): parameter names, and so checkpoints, stay those of the UNet.
        module.unet.compile()
