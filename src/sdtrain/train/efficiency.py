"""Model FLOPs utilization (MFU) and cost of a run: rank 0's live figures at each report and the run's totals.

MFU = images/s per GPU x model FLOPs per image / the GPU's dense peak FLOP/s at the run's precision. The FLOPs are
:mod:`sdtrain.model.flops`'s (matmuls, convolutions and attention of the UNet, forward and backward by PaLM's 3x
rule; elementwise work, the optimizer, EMA and recomputation under gradient checkpointing left out), counted once
per run on the meta device. The peaks are the vendors' datasheet figures without 2:4 sparsity (sdtrain.model.hardware).
Where there is no peak to divide by (a CPU, a GPU that table does not know), there is no MFU: never a guessed one.

Cost needs only the throughput and ``run.gpu_hour_cost`` (a worker's hour: each worker holds one GPU), so it is
shown on CPU workers too when the user priced them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sdtrain.logs import log
from sdtrain.model.flops import mfu, text_encoder_forward_flops, unet_train_step_flops
from sdtrain.model.hardware import TERA, device_gpu, peak_flops


def tf32_allowed() -> bool:
    """Whether this process lets float32 matmuls or convolutions run as TF32. cuDNN allows it for convolutions by
    default, so 32-true on a GPU is nearly always bounded by the TF32 peak: taking the higher peak when only one of
    the two may use TF32 understates MFU rather than overstating it."""
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def cost_per_million_images(samples_per_s: float, workers: int, gpu_hour_cost: float) -> float:
    """What a million images cost at ``samples_per_s`` (the whole group's) on ``workers`` workers (one GPU each),
    each hour of a worker costing ``gpu_hour_cost``.

    Args:
        samples_per_s: images per second of all workers together.
        workers: workers (GPUs) training.
        gpu_hour_cost: the price of one worker's (GPU's) hour.
    """
    return workers * gpu_hour_cost / (samples_per_s * 3600) * 1e6


@dataclass(frozen=True)
class Efficiency:
    """What rank 0 turns each report's throughput into MFU and cost with, worked out once when training starts.

    Args:
        flops_per_image: model FLOPs of one image's training step, forward and backward, at the data's latent shape
            (aspect-ratio buckets: the bucket most rows had); None: not counted.
        peak_flops: the device's dense peak FLOP/s at the run's precision (None: no MFU: a CPU, an unknown GPU).
        gpu_hour_cost: run.gpu_hour_cost (None: no cost).
        on_gpu: the workers train on GPUs (hours are GPU-hours, else worker-hours).
        count: aspect-ratio buckets: the FLOPs of one image's step at a latent shape, counted the first time a bucket
            is trained on; None: every image costs flops_per_image.
    """

    flops_per_image: float | None
    peak_flops: float | None
    gpu_hour_cost: float | None
    on_gpu: bool
    count: Callable[[tuple[int, ...]], float] | None = None
    by_shape: dict[tuple[int, ...], float | None] = field(default_factory=dict, compare=False)
    """The buckets' FLOPs per image counted so far (None: the count failed)."""

    @property
    def hours_key(self) -> str:
        """The metric of the run's cumulative hours: gpu_hours, or worker_hours on CPU workers."""
        return "gpu_hours" if self.on_gpu else "worker_hours"

    def window(self, samples_per_s: float, workers: int, shapes: Mapping[tuple[int, ...], int]) -> dict[str, float]:
        """``mfu`` and ``cost_per_million_images`` for a report window that trained ``samples_per_s`` images per
        second on ``workers`` workers; each left out where it has no basis.

        Args:
            samples_per_s: images per second of all workers together over the window.
            workers: workers (one GPU each) in the group.
            shapes: the window's samples by latent shape (a rank's: every step is one bucket on all ranks; the
                module's take_window_shapes). Required: bucketed data's MFU without it was a single bucket's.
        """
        figures: dict[str, float] = {}
        if not samples_per_s > 0:  # a window without a step: no rate to judge
            return figures
        flops = self.flops_per_image if self.count is None or not shapes else self._mean_flops(shapes)
        if flops is not None and self.peak_flops is not None:
            figures["mfu"] = mfu(samples_per_s / workers, flops, self.peak_flops)
        if self.gpu_hour_cost is not None:
            figures["cost_per_million_images"] = cost_per_million_images(samples_per_s, workers, self.gpu_hour_cost)
        return figures

    def _mean_flops(self, shapes: Mapping[tuple[int, ...], int]) -> float | None:
        """The mean FLOPs per image of a window's samples, each at its bucket's FLOPs; None if a count failed."""
        assert self.count is not None
        for shape in shapes:
            if shape not in self.by_shape:
                try:
                    flops = self.by_shape[shape] = self.count(shape)
                    log.info("bucket %s: %.3f GFLOP per image (forward and backward)", _shape(shape), flops / 1e9)
                except Exception as error:  # MFU is a view of the run: a count that fails must not stop training
                    log.warning("no MFU for bucket %s: could not count its FLOPs: %s", shape, error)
                    self.by_shape[shape] = None
        counted = [(self.by_shape[shape], n) for shape, n in shapes.items()]
        if any(flops is None for flops, _ in counted):
            return None
        return sum(flops * n for flops, n in counted if flops is not None) / sum(shapes.values())

    @classmethod
    def of_run(cls, module: Any, precision: str, gpu_hour_cost: float | None) -> Efficiency:
        """The efficiency of training ``module`` (a DiffusionModule, on its device) at Lightning's ``precision``;
        logs what MFU is measured against, or why there is none.

        Args:
            module: the DiffusionModule, already on its training device.
            precision: Lightning's precision of the run.
            gpu_hour_cost: run.gpu_hour_cost.
        """
        meta = module.checkpoint_meta
        encoders = [e.config for e in module.caption_encoder.encoders.encoders] if module.caption_encoder else []

        def count(latent_shape: tuple[int, ...]) -> float:
            channels, height, width = latent_shape
            counted = unet_train_step_flops(meta.unet_config, (channels, height, width), tuple(meta.caption_shape))
            for encoder in encoders:  # token-id captions: the text encoders' forward is model work too
                counted += text_encoder_forward_flops(encoder, int(meta.caption_shape[0]))
            return float(counted)

        try:
            flops: float | None = count(tuple(meta.latent_shape))
        except Exception as error:  # MFU is a view of the run: a count that fails must not stop training
            log.warning("no MFU: could not count the model's FLOPs on the meta device: %s", error)
            flops = None
        device = module.device
        on_gpu = device.type == "cuda"
        peak = None
        if on_gpu:
            name = torch.cuda.get_device_name(device)
            known = device_gpu(name)
            peak = peak_flops(known, precision, tf32_allowed()) if known is not None else None
            if known is None:
                log.info("no MFU: %s is not in the table of GPU peaks (sdtrain.model.hardware)", name)
            elif peak is not None and flops is not None:
                log.info(
                    "MFU against the %s's dense peak of %.1f TFLOP/s at %s; %.1f GFLOP per image (forward and "
                    "backward)",
                    known.name,
                    peak / TERA,
                    precision,
                    flops / 1e9,
                )
        elif flops is not None:
            log.info("%.3f GFLOP per image (forward and backward); no MFU on CPU workers", flops / 1e9)
        return cls(flops, peak, gpu_hour_cost, on_gpu, count if meta.bucket_shapes else None)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
