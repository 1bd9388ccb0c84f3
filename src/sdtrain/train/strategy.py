"""GPU options of the train config: the distributed strategy, torch.compile, channels_last,
gradient checkpointing and the attention kernel, applied to a built DiffusionModule.

FSDP is FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's ``ModelParallelStrategy``:
FSDP1, which Ray's ``RayFSDPStrategy`` wraps, is deprecated upstream, and FSDP2 keeps each
parameter a ``DTensor`` under its own name, so the optimizer, the non-finite check, clipping and
the EMA see the UNet's parameters (their local shards). Checkpoints are gathered into one full
state dict on rank 0: the same file as DDP's, resumable at any world size and by either strategy.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
from lightning.pytorch.strategies import ModelParallelStrategy

from sdtrain.config.schema import TrainConfig

DDP_KWARGS: dict[str, Any] = {
    # The module's buffers are per-rank statistics (loss sums, skipped samples), all-reduced where they are
    # reported: torch's default broadcasts rank 0's over every rank's before each forward (the reported loss
    # was rank 0's, skipped_samples world size x rank 0's), and pays a broadcast a step for it.
    "broadcast_buffers": False,
    # Gradients are views into DDP's all-reduce buckets: no copy in and out of the buckets each step, and
    # one gradient-sized buffer less.
    "gradient_as_bucket_view": True,
}
"""DistributedDataParallel's settings for train.strategy=ddp, with Ray and without."""


def build_strategy(train: TrainConfig, world_size: int, on_ray: bool):
    """Lightning's strategy for ``train.strategy`` at ``world_size`` processes, in Ray's flavour
    (the device Ray Train assigned this worker) when ``on_ray``."""
    if train.strategy == "fsdp":
        # Every process is one data-parallel rank: the whole world shards the UNet.
        strategy = RayModelParallelStrategy if on_ray else ModelParallelStrategy
        return strategy(data_parallel_size=world_size, tensor_parallel_size=1, save_distributed_checkpoint=False)
    if on_ray:
        from ray.train.lightning import RayDDPStrategy

        return RayDDPStrategy(**DDP_KWARGS)
    if world_size > 1:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**DDP_KWARGS)
    return "auto"


class RayModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` on the device Ray Train assigned this worker, as Ray's own
    ``RayDDPStrategy`` does: Ray workers on one node may all see every GPU, and Lightning's
    ``local_rank`` indexes Lightning's device list, not Ray's assignment."""

    @property
    def root_device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()


def apply_options(module, train: TrainConfig, mesh: torch.distributed.device_mesh.DeviceMesh | None = None) -> None:
    """Set the attention kernel, memory format and gradient checkpointing of ``module.unet`` (and
    its EMA, which only runs inference), shard both over ``mesh`` (FSDP), then compile the UNet:
    in place, in that order (compile sees the sharded module). Lightning calls it through
    ``DiffusionModule.configure_model``, on the device, before the strategy wraps the module."""
    unets = [module.unet] + ([module.ema_unet] if getattr(module, "ema_unet", None) is not None else [])
    for unet in unets:
        unet.set_attn_processor(AttnProcessor2_0() if train.attention == "sdpa" else AttnProcessor())
        if train.channels_last:
            unet.to(memory_format=torch.channels_last)
    if train.gradient_checkpointing:
        module.unet.enable_gradient_checkpointing()
    if mesh is not None:
        for unet in unets:
            shard_unet(unet, mesh)
    if train.compile:
        # In place (nn.Module.compile): parameter names, and so checkpoints, stay those of the UNet.
        module.unet.compile()


def shard_unet(unet: torch.nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: each transformer and resnet block is one unit (its parameters are
    gathered for its forward and freed after), the rest (conv in/out, embeddings) the root unit."""
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    from torch.distributed.fsdp import fully_shard

    for block in unet.modules():
        if isinstance(block, (ResnetBlock2D, Transformer2DModel)):
            fully_shard(block, mesh=mesh)
    fully_shard(unet, mesh=mesh)


def is_sharded(module: pl.LightningModule) -> bool:
    """True under FSDP: every rank holds a shard, so every rank takes part in each forward pass."""
    return getattr(module, "_device_mesh", None) is not None
