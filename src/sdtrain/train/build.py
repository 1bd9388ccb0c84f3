"""The one place that turns a config into a module and a Lightning Trainer's settings (precision,
clipping, strategy, GPU options), for the Ray worker and for a run without Ray alike.

The Ray Train worker (sdtrain.train.worker) adds Ray's data stream, reporting and checkpoints around
it; :func:`fit_without_ray` runs it on batches in memory, on one device, with Ray not even
imported, which is how the GPU tests (``pytest -m gpu``) and bench/gpu_throughput.py run the very
code a Ray worker runs on a machine where Ray cannot be installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from sdtrain import __version__
from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.config.schema import Config, TrainConfig
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.model.token_captions import CaptionEncoder
from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
from sdtrain.train.device_settings import DeviceSettings, device_settings
from sdtrain.train.module import DiffusionModule
from sdtrain.train.strategy import build_strategy


def resolve_precision(train: TrainConfig, use_gpu: bool) -> str:
    """Lightning's precision for ``train.precision`` on this machine (auto: bf16-mixed on GPUs that
    have bf16, else 16-mixed; 32-true on CPU), refusing what cannot run here. A worker's, on its own GPU."""
    if not use_gpu or train.precision != "auto":
        return _precision(train, use_gpu, bf16=False, gpu="")
    bf16 = torch.cuda.is_bf16_supported()
    return _precision(train, use_gpu, bf16, "" if bf16 else torch.cuda.get_device_name())


def driver_precision(train: TrainConfig, use_gpu: bool, gpu: str | None) -> str:
    """The precision the workers will resolve (:func:`resolve_precision`), decided on the driver from the cluster's
    GPU model: the driver's own machine may have no GPU (job.yaml's head node). A GPU with a bf16 peak in the
    hardware table has bf16; one not known yet (no GPU node up) counts as bf16: the driver only predicts memory
    with it, and 16-mixed holds what bf16-mixed holds.

    Args:
        train: the run's train config.
        use_gpu: the workers train on GPUs.
        gpu: the cluster's GPU model as Ray names it (sdtrain.driver.memory_fit.cluster_gpu), or None.
    """
    from sdtrain.model.hardware import has_bf16

    bf16 = gpu is None or has_bf16(gpu) is not False
    return _precision(train, use_gpu, bf16, gpu or "")


def _precision(train: TrainConfig, use_gpu: bool, bf16: bool, gpu: str) -> str:
    """:func:`resolve_precision`'s rules on a GPU named ``gpu`` that has ``bf16`` or not."""
    if train.precision == "16-mixed" and not use_gpu:  # scaling.use_gpu=auto found no GPU
        raise ConfigError(
            "train.precision: 16-mixed needs GPUs (CPUs have no fp16 autocast); use bf16-mixed or 32-true"
        )
    if train.precision != "auto":
        return train.precision
    if not use_gpu:
        return "32-true"
    if bf16:
        return "bf16-mixed"
    if train.strategy == "fsdp":
        raise ConfigError(
            f"train.precision: auto would be 16-mixed on this GPU ({gpu}, no bf16), which "
            "cannot run with train.strategy=fsdp; use ddp, or GPUs with bf16 (A100, L4, H100 and later)"
        )
    return "16-mixed"


def run_device_settings(train: TrainConfig, use_gpu: bool) -> DeviceSettings:
    """The GPU settings of a process training ``train`` (sdtrain.train.device_settings), at the precision
    :func:`resolve_precision` gives it here.

    Args:
        train: the run's train config.
        use_gpu: one GPU per process, else CPU.
    """
    return device_settings(train, resolve_precision(train, use_gpu), use_gpu)


def checkpoint_meta(
    config: Config,
    latent_shape: Sequence[int],
    caption_shape: Sequence[int],
    latent_scaling_factor: float | None = None,
    text_encoder: str | None = None,
    latent_classifier: str | None = None,
    bucket_shapes: Sequence[Sequence[int]] | None = None,
    vae_downsampling: int = 8,
) -> CheckpointMeta:
    """The metadata every checkpoint of a run of ``config`` stores.

    Args:
        latent_shape: C x H x W of the data's latents.
        caption_shape: L x D of its caption embeddings (for token ids: of the text encoder's output).
        latent_scaling_factor: the factor the stored latents already carry (parquet metadata), if known.
        text_encoder: for data of token ids, the text encoder they name (the workers encode them with it).
        latent_classifier: the module the data names as the reader of its latents, if any.
        bucket_shapes: aspect-ratio buckets: each bucket's latent shape.
        vae_downsampling: pixels per latent side of the data's VAE.
    """
    return CheckpointMeta(
        sdtrain_version=__version__,
        unet_config=unet_config(config.model),
        noise_scheduler_config=noise_scheduler_config(config.model, config.train.zero_terminal_snr),
        latent_shape=tuple(latent_shape),
        caption_shape=tuple(caption_shape),
        latent_scale=config.data.latent_scaling_factor or 1.0,
        latent_scaling_factor=config.data.latent_scaling_factor or latent_scaling_factor,
        config=config.to_dict(),
        text_encoder=text_encoder,
        latent_classifier=latent_classifier,
        bucket_shapes=[list(shape) for shape in bucket_shapes] if bucket_shapes else None,
        vae_downsampling=vae_downsampling,
    )


def build_training(
    config: Config,
    meta: CheckpointMeta,
    *,
    use_gpu: bool,
    world_size: int = 1,
    accumulation: int = 1,
    on_ray: bool = False,
    unconditional_caption: torch.Tensor | None = None,
    record_samples: bool = False,
) -> tuple[DiffusionModule, dict[str, Any]]:
    """The module and the ``pl.Trainer`` keyword arguments for a run of ``config``; sets this process's GPU
    flags (:func:`run_device_settings`).

    Args:
        meta: the run's checkpoint metadata (:func:`checkpoint_meta`).
        use_gpu: one GPU per process, else CPU.
        world_size: training processes in all.
        accumulation: micro-batches per optimizer step.
        on_ray: inside a Ray Train worker (Ray's strategy flavour and cluster environment).
        unconditional_caption: L x D empty-prompt embedding (None: zeros); for token-id data (the meta names a
            text encoder) also the empty prompt's L ids, encoded here.
        record_samples: keep the sample index of every row trained on.
    """
    precision = resolve_precision(config.train, use_gpu)
    settings = run_device_settings(config.train, use_gpu)
    settings.apply()
    # Same initial weights on every rank (DDP also broadcasts rank 0's). Per-step noise is
    # seeded by (seed, rank, step, micro-batch) in the module, not by this global seed.
    pl.seed_everything(config.train.seed, verbose=False)
    encoder = None
    if meta.text_encoder is not None:  # the data holds token ids: encoded in each step, by this process's copy
        encoder = CaptionEncoder.load(meta.text_encoder, use_gpu)
        if unconditional_caption is not None and not unconditional_caption.is_floating_point():
            unconditional_caption = encoder(unconditional_caption[None])[0].float()
    module = DiffusionModule(
        build_unet(config.model),
        meta.noise_scheduler_config,
        config.train,
        meta,
        unconditional_caption=unconditional_caption,
        accumulation=accumulation,
        record_samples=record_samples,
        caption_dtype=settings.caption_dtype,
        caption_encoder=encoder,
    )
    trainer_kwargs = trainer_settings(config, precision, world_size, accumulation, on_ray, use_gpu)
    return module, trainer_kwargs


def trainer_settings(
    config: Config, precision: str, world_size: int, accumulation: int, on_ray: bool, use_gpu: bool
) -> dict[str, Any]:
    """The ``pl.Trainer`` keyword arguments of a run of ``config`` (see :func:`build_training`)."""
    plugins = []
    if on_ray:
        from ray.train.lightning import RayLightningEnvironment

        plugins.append(RayLightningEnvironment())
    return dict(
        max_steps=config.train.max_steps,
        max_epochs=-1,
        accelerator="gpu" if use_gpu else "cpu",
        devices="auto" if on_ray else 1,
        strategy=build_strategy(config.train, world_size, on_ray),
        plugins=plugins,
        precision=precision,
        # Clipping is the module's (DiffusionModule.on_before_optimizer_step), by train.grad_clip_norm.
        gradient_clip_val=None,
        accumulate_grad_batches=accumulation,
        # Checkpoints go through Ray Train (StepReporter); Lightning's own would bypass it.
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def fit_without_ray(
    config: Config,
    batches: Iterable[dict[str, torch.Tensor]],
    meta: CheckpointMeta,
    *,
    use_gpu: bool,
    callbacks: Sequence[pl.Callback] = (),
    ckpt_path: str | None = None,
    default_root_dir: str | None = None,
    unconditional_caption: torch.Tensor | None = None,
) -> tuple[DiffusionModule, pl.Trainer]:
    """Train ``config`` on ``batches`` (micro-batches, ``train.max_steps`` optimizer steps' worth) in
    this process, on one GPU or the CPU, through :func:`build_training`; resume from ``ckpt_path``.

    Args:
        batches: dicts of ``latents`` (B x C x H x W) and ``captions`` (B x L x D), B = one worker's micro-batch.
        meta: the run's checkpoint metadata (:func:`checkpoint_meta`).
        callbacks: extra Lightning callbacks.
        default_root_dir: where Lightning may write (FSDP's process group files, nothing else).
        unconditional_caption: as for :func:`build_training`.
    """
    module, trainer_kwargs = build_training(
        config,
        meta,
        use_gpu=use_gpu,
        accumulation=config.batch_layout(1).accumulation,  # train.micro_batch_size, as one worker would run it
        unconditional_caption=unconditional_caption,
    )
    settings = run_device_settings(config.train, use_gpu)
    for advice in settings.advice:
        log.warning(advice)
    trainer = pl.Trainer(callbacks=list(callbacks), default_root_dir=default_root_dir, **trainer_kwargs)
    # Each epoch replays the batches, until train.max_steps.
    # A list is a map-style dataset (__getitem__, __len__), which torch's annotation (Dataset) leaves out.
    loader: torch.utils.data.DataLoader[dict[str, torch.Tensor]] = torch.utils.data.DataLoader(
        list(batches),  # type: ignore[arg-type]
        batch_size=None,
        # Host batches pinned, as the Ray worker's stream pins them: Lightning then copies them non_blocking.
        pin_memory=settings.pin_memory,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path, weights_only=True)
    return module, trainer
