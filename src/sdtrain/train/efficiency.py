"""Model FLOPs utilization (MFU) and cost of a run: rank 0's live figures at each report and the run's totals.

MFU = images/s per GPU x model FLOPs per image / the GPU's dense peak FLOP/s at the run's precision. The FLOPs are
:mod:`sdtrain.model.flops`'s (matmuls, convolutions and attention of the UNet, forward and backward by PaLM's 3x
rule; elementwise work, the optimizer, EMA and recomputation under gradient checkpointing left out), counted once
per run on the meta device. The peaks are the vendors' datasheet figures without 2:4 sparsity. Where there is no
peak to divide by (a CPU, a GPU this table does not know), there is no MFU: never a guessed one.

Cost needs only the throughput and ``run.gpu_hour_cost`` (a worker's hour: each worker holds one GPU), so it is
shown on CPU workers too when the user priced them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdtrain.model.flops import mfu, text_encoder_forward_flops, unet_train_step_flops

log = logging.getLogger("sdtrain")

TERA = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """One GPU model's dense peak FLOP/s (no 2:4 structured sparsity) per math mode, from its datasheet.

    Args:
        name: the model as the datasheet names it.
        bf16: bfloat16 tensor-core peak (FP32 accumulate).
        fp16: float16 tensor-core peak (FP32 accumulate).
        tf32: TF32 tensor-core peak (float32 matmuls and convolutions with TF32 allowed).
        fp32: float32 peak without tensor cores.
    """

    name: str
    bf16: float
    fp16: float
    tf32: float
    fp32: float


# Datasheets print tensor-core peaks with sparsity (marked *), often beside the dense figure; the dense one, half
# the sparse, is the one training reaches. Each entry: the datasheet, then its figures as printed (TFLOP/s).

# NVIDIA A10G for AWS (d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf):
# FP32 35; TF32 35 | 70*; BF16 70 | 140*; FP16 70 | 140*. Not the A10's figures: its tensor cores are clocked lower.
A10G = DevicePeak("A10G", bf16=70 * TERA, fp16=70 * TERA, tf32=35 * TERA, fp32=35 * TERA)
# NVIDIA A10 datasheet: FP32 31.2; TF32 62.5 | 125*; BF16 125 | 250*; FP16 125 | 250*.
A10 = DevicePeak("A10", bf16=125 * TERA, fp16=125 * TERA, tf32=62.5 * TERA, fp32=31.2 * TERA)
# NVIDIA L4 datasheet: FP32 30.3; TF32 120*; BF16 242*; FP16 242* (dense: half).
L4 = DevicePeak("L4", bf16=121 * TERA, fp16=121 * TERA, tf32=60 * TERA, fp32=30.3 * TERA)
# NVIDIA L40S datasheet: FP32 91.6; TF32 183 | 366*; BF16 362.05 | 733*; FP16 362.05 | 733*.
L40S = DevicePeak("L40S", bf16=362.05 * TERA, fp16=362.05 * TERA, tf32=183 * TERA, fp32=91.6 * TERA)
# NVIDIA A100 datasheet (the same figures for 40GB and 80GB, PCIe and SXM; they differ in power, 250-300 W against
# 400 W, so a PCIe card sustains less of the peak): FP32 19.5; TF32 156 | 312*; BF16 312 | 624*; FP16 312 | 624*.
A100 = DevicePeak("A100", bf16=312 * TERA, fp16=312 * TERA, tf32=156 * TERA, fp32=19.5 * TERA)
# NVIDIA H100 datasheet, H100 SXM column: FP32 67; TF32 989*; BF16 1,979*; FP16 1,979*.
H100_SXM = DevicePeak("H100 SXM", bf16=989.5 * TERA, fp16=989.5 * TERA, tf32=494.5 * TERA, fp32=67 * TERA)
# The same datasheet, H100 NVL column: FP32 60; TF32 835*; BF16 1,671*; FP16 1,671*.
H100_NVL = DevicePeak("H100 NVL", bf16=835.5 * TERA, fp16=835.5 * TERA, tf32=417.5 * TERA, fp32=60 * TERA)
# NVIDIA H100 datasheet (2022 edition), H100 PCIe column: FP32 51; TF32 756*; BF16 1,513*; FP16 1,513*.
H100_PCIE = DevicePeak("H100 PCIe", bf16=756.5 * TERA, fp16=756.5 * TERA, tf32=378 * TERA, fp32=51 * TERA)
# NVIDIA H200 datasheet, H200 SXM column: FP32 67; TF32 989*; BF16 1,979*; FP16 1,979* (the H100 SXM's compute).
H200_SXM = DevicePeak("H200 SXM", bf16=989.5 * TERA, fp16=989.5 * TERA, tf32=494.5 * TERA, fp32=67 * TERA)
# The same datasheet, H200 NVL column: FP32 60; TF32 835*; BF16 1,671*; FP16 1,671*.
H200_NVL = DevicePeak("H200 NVL", bf16=835.5 * TERA, fp16=835.5 * TERA, tf32=417.5 * TERA, fp32=60 * TERA)
# NVIDIA Blackwell datasheet (GB200 NVL72 / HGX B200), HGX B200 per GPU at up to 1,000 W: FP32 75; TF32 2.2 PF*;
# FP16/BF16 4.5 PF*. (A B200 in a GB200 runs at up to 1,200 W and is faster: it shows as GB200, not in this table.)
B200 = DevicePeak("B200", bf16=2250 * TERA, fp16=2250 * TERA, tf32=1100 * TERA, fp32=75 * TERA)


def device_peak(device_name: str) -> DevicePeak | None:
    """The peak of the GPU ``torch.cuda.get_device_name`` calls ``device_name`` ("NVIDIA H100 80GB HBM3"), or None
    for a device this table does not know, or whose variant the name leaves open.

    Args:
        device_name: the device's name as torch reports it.
    """
    # Whole words: "L4" must not match "L40S", nor "A10" "A100", nor "H200" "GH200".
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for word, peak in (("A10G", A10G), ("A10", A10), ("L4", L4), ("L40S", L40S), ("A100", A100), ("B200", B200)):
        if word in words:
            return peak
    if "H100" in words:
        if "NVL" in words:
            return H100_NVL
        if "PCIE" in words:
            return H100_PCIE
        # The SXM module reports its memory ("NVIDIA H100 80GB HBM3"; the PCIe card has HBM2e and says PCIe).
        if words & {"SXM", "SXM5", "HBM3"}:
            return H100_SXM
        return None  # an H100 that names no variant: SXM and PCIe are 24% apart, and guessing is inventing
    if "H200" in words:
        # "NVIDIA H200" is the SXM module; the PCIe card says "NVIDIA H200 NVL".
        return H200_NVL if "NVL" in words else H200_SXM
    return None


def peak_flops(peak: DevicePeak, precision: str, tf32: bool) -> float | None:
    """The peak FLOP/s that bounds a run at Lightning's ``precision``: the tensor cores' at bf16 or fp16 for mixed
    precision; at 32-true, TF32's when ``tf32`` is allowed, else plain float32's. None for other precisions.

    Args:
        peak: the device's peaks.
        precision: Lightning's precision (bf16-mixed, 16-mixed, 32-true, ...).
        tf32: float32 matmuls or convolutions may run as TF32.
    """
    if precision.startswith("bf16"):
        return peak.bf16
    if precision.startswith("16"):
        return peak.fp16
    if precision.startswith("32"):
        return peak.tf32 if tf32 else peak.fp32
    return None


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
        flops_per_image: model FLOPs of one image's training step, forward and backward (None: not counted).
        peak_flops: the device's dense peak FLOP/s at the run's precision (None: no MFU: a CPU, an unknown GPU).
        gpu_hour_cost: run.gpu_hour_cost (None: no cost).
        on_gpu: the workers train on GPUs (hours are GPU-hours, else worker-hours).
    """

    flops_per_image: float | None
    peak_flops: float | None
    gpu_hour_cost: float | None
    on_gpu: bool

    @property
    def hours_key(self) -> str:
        """The metric of the run's cumulative hours: gpu_hours, or worker_hours on CPU workers."""
        return "gpu_hours" if self.on_gpu else "worker_hours"

    def window(self, samples_per_s: float, workers: int) -> dict[str, float]:
        """``mfu`` and ``cost_per_million_images`` for a report window that trained ``samples_per_s`` images per
        second on ``workers`` workers; each left out where it has no basis.

        Args:
            samples_per_s: images per second of all workers together over the window.
            workers: workers (one GPU each) in the group.
        """
        figures: dict[str, float] = {}
        if not samples_per_s > 0:  # a window without a step: no rate to judge
            return figures
        if self.flops_per_image is not None and self.peak_flops is not None:
            figures["mfu"] = mfu(samples_per_s / workers, self.flops_per_image, self.peak_flops)
        if self.gpu_hour_cost is not None:
            figures["cost_per_million_images"] = cost_per_million_images(samples_per_s, workers, self.gpu_hour_cost)
        return figures

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
        try:
            counted = unet_train_step_flops(meta.unet_config, tuple(meta.latent_shape), tuple(meta.caption_shape))
            if module.caption_encoder is not None:  # token-id captions: the text encoder's forward is model work too
                config = module.caption_encoder.text_encoder.config
                counted += text_encoder_forward_flops(config, int(meta.caption_shape[0]))
            flops: float | None = float(counted)
        except Exception as error:  # MFU is a view of the run: a count that fails must not stop training
            log.warning("no MFU: could not count the model's FLOPs on the meta device: %s", error)
            flops = None
        device = module.device
        on_gpu = device.type == "cuda"
        peak = None
        if on_gpu:
            name = torch.cuda.get_device_name(device)
            known = device_peak(name)
            peak = peak_flops(known, precision, tf32_allowed()) if known is not None else None
            if known is None:
                log.info("no MFU: %s is not in the table of GPU peaks (sdtrain.train.efficiency.device_peak)", name)
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
        return cls(flops, peak, gpu_hour_cost, on_gpu)


def hours_so_far(history: Sequence[Mapping[str, float]]) -> float:
    """The cumulative hours the rows of a checkpoint end with (0 for a fresh run, or rows that predate them)."""
    if not history:
        return 0.0
    last = history[-1]
    return float(last.get("gpu_hours", last.get("worker_hours", 0.0)))


@dataclass(frozen=True)
class RunTotals:
    """What a run's final summary says of its cost.

    Args:
        images: images trained (optimizer steps x train.global_batch_size).
        hours: GPU-hours (worker-hours on CPU) of the steps the final checkpoint kept; None if its rows have none.
        on_gpu: hours are GPU-hours.
        mfu: model FLOPs utilization over those hours (None: no MFU: CPU, an unknown GPU).
        cost: run.gpu_hour_cost x hours (None: no price set).
    """

    images: int
    hours: float | None
    on_gpu: bool
    mfu: float | None
    cost: float | None

    def line(self) -> str:
        """The summary as one line of text."""
        unit = "GPU-hours" if self.on_gpu else "worker-hours"
        parts = [f"{self.images:,} images trained"]
        if self.hours is not None:
            parts[0] += f" in {self.hours:.4g} {unit}"
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        elif not self.on_gpu:
            parts.append("no MFU on CPU workers")
        if self.cost is not None:
            parts.append(f"cost {money(self.cost)} (run.gpu_hour_cost x {unit})")
        return ", ".join(parts)


def run_totals(
    history: Sequence[Mapping[str, float]], global_batch_size: int, gpu_hour_cost: float | None
) -> RunTotals:
    """The totals of a run whose final checkpoint holds the metric rows ``history``.

    The run's MFU is each row's MFU weighted by the hours its window took: the model FLOPs of every image over
    the peak FLOPs of every GPU-hour.

    Args:
        history: the final checkpoint's metric rows.
        global_batch_size: train.global_batch_size.
        gpu_hour_cost: run.gpu_hour_cost.
    """
    images = int(history[-1]["step"]) * global_batch_size if history else 0
    on_gpu = any("gpu_hours" in row for row in history)
    has_hours = any("gpu_hours" in row or "worker_hours" in row for row in history)
    hours = hours_so_far(history) if has_hours else None
    weighted, weight, previous = 0.0, 0.0, 0.0
    for row in history:
        current = row.get("gpu_hours", row.get("worker_hours"))
        if current is None:
            continue
        if "mfu" in row and math.isfinite(row["mfu"]) and current > previous:
            weighted += row["mfu"] * (current - previous)
            weight += current - previous
        previous = current
    cost = gpu_hour_cost * hours if gpu_hour_cost is not None and hours is not None else None
    return RunTotals(images, hours, on_gpu, weighted / weight if weight > 0 else None, cost)


def money(amount: float) -> str:
    """An amount in the user's currency: cents above 1, three significant digits below (a CPU test run's cost)."""
    return f"{amount:,.2f}" if amount >= 1 else f"{amount:.3g}"
