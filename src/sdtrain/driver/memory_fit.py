"""train.micro_batch_size against the memory of the cluster's GPUs, decided by the driver before any worker starts.

The GPU model comes from the cluster's ``accelerator_type:<model>`` resources, which Ray sets on every GPU node; its
memory from the hardware table (:func:`sdtrain.model.hardware.memory_range`). A model sold with more than one memory
size (an A100 has 40 or 80 GB, and Ray names both "A100") is taken at its smallest to choose a size and at its
largest to refuse one: auto never picks what may not fit, and no size that fits some variant is refused. Where no
GPU node is up yet (an autoscaling cluster at start), or the nodes hold different models, nothing is known: auto
falls back to null's size and nothing is refused. The prediction is the memory model's (sdtrain.model.memory) for a
rank at the fewest workers allowed (FSDP shards least there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.model.hardware import GIB, memory_range
from sdtrain.model.memory import Precision, Strategy, TrainingMemory, predict_training_memory
from sdtrain.model.unet import unet_config

AUTO_FILL = 0.9
"""The share of the GPU's memory auto fills (the rest: fragmentation and what the model leaves out)."""


def cluster_gpu(resources: Mapping[str, float]) -> str | None:
    """The one GPU model the cluster's nodes report (``ray.cluster_resources()``), or None: none up, several, or
    one the hardware table does not know.

    Args:
        resources: the cluster's resources by name.
    """
    models = {name.split(":", 1)[1] for name in resources if name.startswith("accelerator_type:")}
    if len(models) != 1:
        return None
    (model,) = models
    return model if memory_range(model) is not None else None


def fit_micro_batch(
    config: Config,
    gpu: str | None,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    precision: str,
) -> tuple[Config, str | None]:
    """``config`` with train.micro_batch_size resolved for ``gpu`` and a line saying what was decided (None if there
    was nothing to decide); a ConfigError naming the numbers if the configured size is predicted not to fit.

    Args:
        config: the run.
        gpu: the cluster's GPU model (:func:`cluster_gpu`); None for CPU workers or an unknown GPU.
        latent_shape: one sample's latents (C, H, W).
        caption_shape: one sample's caption embeddings (L, D), as the UNet takes them.
        precision: the precision the run resolved to.
    """
    configured = config.train.micro_batch_size
    if gpu is None:
        return _with_micro_batch(config, config.common_micro_batch()) if configured == "auto" else config, None
    known = memory_range(gpu)
    assert known is not None  # cluster_gpu names only GPUs the table knows
    smallest, largest = known
    world = config.scaling.min_workers

    def needs(micro_batch: int) -> int:
        memory = predict_run_memory(config, latent_shape, caption_shape, world, precision, micro_batch)
        return memory.with_runtime_margin

    if configured == "auto":
        common = config.common_micro_batch()
        for micro_batch in sorted((d for d in range(1, common + 1) if common % d == 0), reverse=True):
            if needs(micro_batch) <= AUTO_FILL * smallest:
                return _with_micro_batch(config, micro_batch), (
                    f"train.micro_batch_size=auto: {micro_batch}, predicted {needs(micro_batch) / GIB:.1f} GiB a rank "
                    f"on {gpu} ({smallest / GIB:.0f} GiB)"
                )
        raise ConfigError(
            f"train.micro_batch_size=auto: not even 1 sample a rank is predicted to fit a {gpu} "
            f"({needs(1) / GIB:.1f} GiB against {smallest / GIB:.0f} GiB); set train.gradient_checkpointing=true or "
            "train.strategy=fsdp, or use GPUs with more memory"
        )
    micro_batch = config.batch_layout(world).micro_batch
    need = needs(micro_batch)
    if need > largest:
        raise ConfigError(
            f"train.micro_batch_size: {micro_batch} samples a rank are predicted to need {need / GIB:.1f} GiB "
            f"(sdtrain.model.memory, with 1 GiB for the CUDA runtime), more than a {gpu}'s {largest / GIB:.0f} GiB; "
            "use a smaller train.micro_batch_size (or auto), train.gradient_checkpointing=true or train.strategy=fsdp"
        )
    return config, None


def predict_run_memory(
    config: Config,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    world_size: int,
    precision: str,
    micro_batch: int | None = None,
) -> TrainingMemory:
    """The memory model's peak for one rank of ``config`` (sdtrain.model.memory) at ``world_size``.

    Args:
        config: the run (model, strategy, EMA, gradient checkpointing, batch).
        latent_shape: one sample's latents (C, H, W).
        caption_shape: one sample's caption embeddings (L, D), as the UNet takes them.
        world_size: ranks.
        precision: Lightning's precision the run resolves to (16-mixed holds what bf16-mixed holds).
        micro_batch: samples per forward pass; default: the config's at ``world_size``.
    """
    return _traced(
        json.dumps(unet_config(config.model), sort_keys=True),
        latent_shape,
        caption_shape,
        micro_batch or config.batch_layout(world_size).micro_batch,
        "32-true" if precision.startswith("32") else "bf16-mixed",
        config.train.strategy,
        world_size,
        config.train.ema_decay is not None,
        config.train.gradient_checkpointing,
    )


@functools.lru_cache(maxsize=64)
def _traced(
    unet: str,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    precision: Precision,
    strategy: Strategy,
    world_size: int,
    ema: bool,
    gradient_checkpointing: bool,
) -> TrainingMemory:
    """A trace takes seconds: auto tries sizes again, and the check predicts each phase."""
    return predict_training_memory(
        json.loads(unet),
        latent_shape,
        caption_shape,
        micro_batch,
        precision=precision,
        strategy=strategy,
        world_size=world_size,
        ema=ema,
        gradient_checkpointing=gradient_checkpointing,
    )


def _with_micro_batch(config: Config, micro_batch: int) -> Config:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=micro_batch))
