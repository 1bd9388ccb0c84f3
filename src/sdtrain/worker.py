"""The function every Ray Train worker runs: build the module, stream this worker's shard, fit."""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any, Iterator

import lightning.pytorch as pl
import ray.train
import ray.train.torch
import torch
from ray.train.lightning import RayLightningEnvironment, prepare_trainer

from sdtrain.callbacks import StepReporter, log
from sdtrain.checkpoint import CHECKPOINT_FILE, HISTORY_FILE
from sdtrain.config import Config
from sdtrain.errors import ConfigError
from sdtrain.hardware import apply_options, build_strategy
from sdtrain.model import build_unet
from sdtrain.module import DiffusionModule
from sdtrain.recipe import load_unconditional_caption


class EpochBatches:
    """This worker's shard as an iterable Lightning can take: each ``iter()`` is a new epoch.

    ``drop_last`` keeps every rank at the same number of steps per epoch (the shards are
    split equally), so no rank waits forever in an all-reduce the others never reach.
    """

    def __init__(self, shard: ray.data.DataIterator, batch_size: int, prefetch_batches: int):
        self.shard = shard
        self.batch_size = batch_size
        self.prefetch_batches = prefetch_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(
            self.shard.iter_torch_batches(
                batch_size=self.batch_size,
                drop_last=True,
                prefetch_batches=self.prefetch_batches,
                device=ray.train.torch.get_device(),
            )
        )


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    _configure_logging()
    config = Config.from_dict(loop_config["config"])
    use_gpu: bool = loop_config["use_gpu"]
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    if config.train.global_batch_size % world_size:
        raise ConfigError(
            f"train.global_batch_size: {config.train.global_batch_size} does not divide over {world_size} workers"
        )
    batch_size = config.train.global_batch_size // world_size
    if rank == 0:
        log.info("world size %d, %d samples per worker per step", world_size, batch_size)

    # Same initial weights on every rank (DDP also broadcasts rank 0's). Per-step noise is
    # seeded by (seed, rank, step) in the module, not by this global seed.
    pl.seed_everything(config.train.seed, verbose=False)
    unet = build_unet(config.model)
    meta = loop_config["checkpoint_meta"]
    uncond = load_unconditional_caption(config.data.unconditional_caption, meta["caption_shape"])
    module = DiffusionModule(unet, loop_config["noise_scheduler_config"], config.train, meta, unconditional_caption=uncond)
    apply_options(module, config.train)

    val_shard = ray.train.get_dataset_shard("val") if config.data.val else None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        _fit(config, module, use_gpu, batch_size, val_shard, history=[], ckpt_path=None)
        return
    with checkpoint.as_directory() as directory:
        with open(os.path.join(directory, HISTORY_FILE)) as f:
            history = json.load(f)
        _fit(config, module, use_gpu, batch_size, val_shard, history, os.path.join(directory, CHECKPOINT_FILE))


def _fit(config: Config, module, use_gpu, batch_size, val_shard, history, ckpt_path) -> None:
    val_batches = None
    if val_shard is not None:
        def val_batches():
            return val_shard.iter_torch_batches(batch_size=batch_size, device=ray.train.torch.get_device())

    reporter = StepReporter(
        config.run,
        max_steps=config.train.max_steps,
        samples_per_step=config.train.global_batch_size,
        max_bad_steps=config.train.max_bad_steps,
        history=history,
        val_batches=val_batches,
        val_seed=config.train.seed,
    )
    trainer = pl.Trainer(
        max_steps=config.train.max_steps,
        max_epochs=-1,
        accelerator="gpu" if use_gpu else "cpu",
        devices="auto",
        strategy=build_strategy(config.train),
        plugins=[RayLightningEnvironment()],
        precision=resolve_precision(config.train.precision, use_gpu),
        gradient_clip_val=config.train.grad_clip_norm or None,
        callbacks=[reporter],
        # Checkpoints go through Ray Train (StepReporter); Lightning's own would bypass it.
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer = prepare_trainer(trainer)
    train_batches = EpochBatches(ray.train.get_dataset_shard("train"), batch_size, config.data.prefetch_batches)
    trainer.fit(module, train_dataloaders=train_batches, ckpt_path=ckpt_path, weights_only=True)


def _configure_logging() -> None:
    """Our progress lines at INFO; Lightning's start-up chatter and Ray Train's per-report lines off."""
    from ray.train.v2._internal.execution import context as ray_train_context

    logging.getLogger("sdtrain").setLevel(logging.INFO)
    # Ray Train logs every report at INFO under a logger named by its file path, outside
    # "ray.train", where RunConfig's LoggingConfig does not reach.
    logging.getLogger(ray_train_context.__file__).setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # Lightning internals, not actionable


def resolve_precision(precision: str, use_gpu: bool) -> str:
    if precision != "auto":
        return precision
    if not use_gpu:
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
