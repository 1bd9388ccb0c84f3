"""train.micro_batch_size against the memory of the cluster's GPUs, decided by the driver before any worker starts.

The GPU model comes from the cluster's ``accelerator_type:<model>`` resources, which Ray sets on every GPU node; its
memory from the hardware table (:func:`sdtrain.model.hardware.memory_range`): the memory the device reports, not the
size it is sold as (an A10G's 24 GB is 22.5 GiB), since the driver's machine has no GPU to ask. A model sold with
more than one memory size (an A100 has 40 or 80 GB, and Ray names both "A100") is taken at its smallest to choose a
size and at its largest to refuse one: auto never picks what may not fit, and no size that fits some variant is
refused. Where every such node also carries Ray's label of its size (``accelerator_type:A100-80G``, which Ray leaves
to the cluster to add), that size is the one. Where no GPU node is up yet (an autoscaling cluster at start), or the
nodes hold different models, nothing is known: auto falls back to null's size and nothing is refused. The
prediction is the memory model's (sdtrain.model.memory) for a rank at the fewest workers allowed (FSDP shards least
there), with the frozen text encoders every rank holds where the data's captions are token ids
(:func:`caption_encoders`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.model.hardware import GIB, memory_range, variants
from sdtrain.model.memory import TrainingMemory, predict_training_memory
from sdtrain.model.token_captions import encoder_dtype, text_encoder_configs
from sdtrain.model.unet import unet_config

if TYPE_CHECKING:  # its module imports Ray Data; the GPU benchmark predicts memory without Ray
    from sdtrain.data.inspection import DatasetSpec

AUTO_FILL = 0.9
"""The share of the GPU's memory auto fills (the rest: fragmentation and what the model leaves out)."""


def cluster_gpu(resources: Mapping[str, float]) -> str | None:
    """The one GPU model the cluster's nodes report (``ray.cluster_resources()``), or None: none up, several, or
    one the hardware table does not know.

    Args:
        resources: the cluster's resources by name.
    """
    labels = {name.split(":", 1)[1]: count for name, count in resources.items() if name.startswith("accelerator_type:")}
    if not labels or not all(variants(label) for label in labels):
        return None
    types = {variants(label)[0][0].accelerator_type for label in labels}
    if len(types) != 1:
        return None
    (model,) = types
    # A size label ("A100-80G", added by hand beside the "A100" Ray sets, one a node as Ray's) names the variant
    # where it is on every node of the model; several sizes, or some nodes without one, leave the model's range.
    sized = [label for label in labels if label != model]
    return sized[0] if len(sized) == 1 and labels[sized[0]] >= labels.get(model, 0) else model


def caption_encoders(spec: DatasetSpec) -> tuple[Any, ...]:
    """The configs of the text encoders every rank holds to encode ``spec``'s caption token ids in the step (read from
    the source the files name: config.json alone, no weights); none for data of embeddings."""
    if spec.token_ids is None:
        return ()
    return tuple(text_encoder_configs(spec.token_ids.text_encoder))


def fit_micro_batch(
    config: Config,
    gpu: str | None,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    precision: str,
    text_encoders: Sequence[Any] = (),
) -> tuple[Config, str | None]:
    """``config`` with train.micro_batch_size resolved for ``gpu`` and a line saying what was decided (None if there
    was nothing to decide); a ConfigError naming the numbers if the configured size is predicted not to fit.

    Args:
        config: the run.
        gpu: the cluster's GPU model (:func:`cluster_gpu`); None for CPU workers or an unknown GPU.
        latent_shape: one sample's latents (C, H, W).
        caption_shape: one sample's caption embeddings (L, D), as the UNet takes them.
        precision: the precision the run resolved to.
        text_encoders: the configs of the frozen text encoders a rank holds for token-id captions
            (:func:`caption_encoders`).
    """
    configured = config.train.micro_batch_size
    if gpu is None:
        return _with_micro_batch(config, config.common_micro_batch()) if configured == "auto" else config, None
    known = memory_range(gpu)
    assert known is not None  # cluster_gpu names only GPUs the table knows
    smallest, largest = known
    world = config.scaling.min_workers

    def needs(micro_batch: int) -> TrainingMemory:
        return predict_run_memory(config, latent_shape, caption_shape, world, precision, micro_batch, text_encoders)

    if configured == "auto":
        common = config.common_micro_batch()
        for micro_batch in sorted((d for d in range(1, common + 1) if common % d == 0), reverse=True):
            if (memory := needs(micro_batch)).with_runtime_margin <= AUTO_FILL * smallest:
                return _with_micro_batch(config, micro_batch), (
                    f"train.micro_batch_size=auto: {micro_batch}, predicted {_gib(memory)} a rank on {gpu} "
                    f"({smallest / GIB:.1f} GiB)"
                )
        raise ConfigError(
            f"train.micro_batch_size=auto: not even 1 sample a rank is predicted to fit a {gpu} ({_gib(needs(1))} "
            f"against {smallest / GIB:.1f} GiB); set train.gradient_checkpointing=true or train.strategy=fsdp, or use "
            "GPUs with more memory"
        )
    micro_batch = config.batch_layout(world).micro_batch
    return config, _configured_size(needs(micro_batch), micro_batch, gpu, smallest, largest)


def _configured_size(memory: TrainingMemory, micro_batch: int, gpu: str, smallest: float, largest: float) -> str | None:
    """A ConfigError where a configured micro-batch is predicted not to fit even the GPU's largest variant; a line
    where it leaves too little headroom, or fits only the larger variant; None where it fits with room."""
    if memory.with_runtime_margin > largest:
        raise ConfigError(
            f"train.micro_batch_size: {micro_batch} samples a rank are predicted to need {_gib(memory)} "
            f"(sdtrain.model.memory, with 1 GiB for the CUDA runtime), more than a {gpu}'s {largest / GIB:.1f} GiB; "
            "use a smaller train.micro_batch_size (or auto), train.gradient_checkpointing=true or train.strategy=fsdp"
        )
    if memory.with_runtime_margin > smallest:
        return (
            f"train.micro_batch_size: {micro_batch} samples a rank are predicted to need {_gib(memory)}, more than a "
            f"{smallest / GIB:.1f} GiB {gpu} holds: only its {largest / GIB:.1f} GiB variant fits them"
        )
    if memory.with_runtime_margin > AUTO_FILL * smallest:
        # A GPU session measured the caching allocator reserving 3-9% over the model's tensors
        # (bench/results/2026-11-27-h200.md): auto's 10% is what covers it.
        return (
            f"train.micro_batch_size: {micro_batch} samples a rank are predicted to need {_gib(memory)}, over "
            f"{AUTO_FILL:.0%} of a {smallest / GIB:.1f} GiB {gpu}: what the caching allocator reserves beyond the "
            "tensors may not fit in the rest (an out-of-memory error on the first steps); "
            "train.micro_batch_size=auto keeps under it"
        )
    return None


def _gib(memory: TrainingMemory) -> str:
    """A prediction with its runtime margin in GiB, and the frozen text encoders' share where a rank holds them."""
    said = f"{memory.with_runtime_margin / GIB:.1f} GiB"
    return said + (f" (the text encoders' {memory.text_encoders / GIB:.1f} included)" if memory.text_encoders else "")


def predict_run_memory(
    config: Config,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    world_size: int,
    precision: str,
    micro_batch: int | None = None,
    text_encoders: Sequence[Any] = (),
    on_gpu: bool = True,
) -> TrainingMemory:
    """The memory model's peak for one rank of ``config`` (sdtrain.model.memory) at ``world_size``.

    Args:
        config: the run (model, strategy, EMA, gradient checkpointing, batch).
        latent_shape: one sample's latents (C, H, W).
        caption_shape: one sample's caption embeddings (L, D), as the UNet takes them.
        world_size: ranks.
        precision: Lightning's precision the run resolves to (16-mixed holds what bf16-mixed holds).
        micro_batch: samples per forward pass; default: the config's at ``world_size``.
        text_encoders: the configs of the frozen text encoders a rank holds for token-id captions.
        on_gpu: the ranks train on GPUs (the encoders' dtype: sdtrain.model.token_captions.encoder_dtype).
    """
    return predict_training_memory(
        unet_config(config.model),
        latent_shape,
        caption_shape,
        micro_batch or config.batch_layout(world_size).micro_batch,
        precision="32-true" if precision.startswith("32") else "bf16-mixed",
        strategy=config.train.strategy,
        world_size=world_size,
        ema=config.train.ema_decay is not None,
        gradient_checkpointing=config.train.gradient_checkpointing,
        text_encoders=text_encoders,
        text_encoder_dtype=encoder_dtype(on_gpu),
    )


def _with_micro_batch(config: Config, micro_batch: int) -> Config:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=micro_batch))
