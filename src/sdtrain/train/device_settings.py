"""The GPU settings of a training process, derived from the train config and the device in one place: TF32, cuDNN
autotuning, pinned host batches, the dtypes the training step feeds the UNet, and the autocast that validation and
sample grids share with training. The Ray worker, ``fit_without_ray`` and every training benchmark take them from
here; docs/gpu.md ("GPU settings") says why each is what it is.

Attention needs no setting: under bf16-mixed or 16-mixed the UNet's queries, keys and values reach
``scaled_dot_product_attention`` in half precision with no mask and no dropout, which is what PyTorch's default
backend order (flash, then memory-efficient, then math) needs to pick the flash kernel on Ampere and later.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from sdtrain.config.schema import TrainConfig

CAPTION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
"""The dtype the step hands the UNet its captions in, by Lightning precision: autocast's own for the mixed ones."""

LATENT_DTYPE = torch.float32
"""The noisy latents and the target are computed in float32 whatever the precision: the scheduler's
sqrt(alpha) x + sqrt(1 - alpha) noise and the MSE target lose accuracy in half precision; autocast casts the noisy
latents to half precision once, at conv_in, their only reader."""

CHANNELS_LAST_WITHOUT_COMPILE = (
    "train.channels_last without train.compile: on CUDA a GroupNorm copies a channels-last input back to NCHW and "
    "cuDNN copies it back to channels-last for the next convolution (30 and 51 copies a forward in sd2-base and "
    "small), which may cost more than channels-last convolutions gain (docs/gpu.md, channels_last). Turn on "
    "train.compile, where the copy fuses into the norm, or turn channels_last off"
)


@dataclass(frozen=True)
class DeviceSettings:
    """What a training process on ``device_type`` sets, and how its step feeds the UNet.

    Args:
        device_type: cuda or cpu.
        tf32: float32 matmuls and convolutions left outside autocast run on tensor cores (TF32).
        cudnn_benchmark: cuDNN times its convolution algorithms for each new shape and keeps the fastest.
        pin_memory: host batches are page-locked, so their copy to the device is asynchronous (non_blocking).
        caption_dtype: the dtype the step casts the captions to (:data:`CAPTION_DTYPES`).
        advice: warnings for the run's log (a setting measured or predicted to cost on this device).
    """

    device_type: str
    tf32: bool
    cudnn_benchmark: bool
    pin_memory: bool
    caption_dtype: torch.dtype
    advice: tuple[str, ...] = ()

    def apply(self) -> dict[str, Any]:
        """Set this process's flags; returns what it set (nothing on CPU, where they would do nothing).

        TF32 goes through the legacy global API, which sets every backend consistently: setting only a
        backend's ``fp32_precision`` (the new API) leaves the backends mixed, and then
        ``torch.get_float32_matmul_precision()``, which Lightning calls on Ampere and later GPUs, raises."""
        applied: dict[str, Any] = {}
        if self.tf32:
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
            applied["float32_matmul_precision"] = "high"
            applied["cudnn.allow_tf32"] = True
        if self.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
            applied["cudnn.benchmark"] = True
        return applied


def device_settings(train: TrainConfig, precision: str, use_gpu: bool) -> DeviceSettings:
    """The settings of a process training ``train`` at Lightning ``precision`` (already resolved, e.g. by
    sdtrain.train.build.resolve_precision) on a GPU or the CPU.

    Args:
        train: the run's train config.
        precision: bf16-mixed, 16-mixed or 32-true.
        use_gpu: the process trains on a CUDA GPU.
    """
    if precision not in CAPTION_DTYPES:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(CAPTION_DTYPES)}")
    advice = (CHANNELS_LAST_WITHOUT_COMPILE,) if use_gpu and train.channels_last and not train.compile else ()
    return DeviceSettings(
        device_type="cuda" if use_gpu else "cpu",
        # The CPU keeps its defaults: the flags are CUDA's, and the global matmul precision would also switch
        # oneDNN's float32 matmuls on CPU.
        tf32=use_gpu,
        # A run's shapes are fixed (one micro-batch, one resolution), so one autotuning per shape pays for itself.
        cudnn_benchmark=use_gpu,
        # Pinning on a machine without CUDA is an error in Ray Data and a warning in torch's DataLoader.
        pin_memory=use_gpu,
        caption_dtype=CAPTION_DTYPES[precision],
        advice=advice,
    )


def training_autocast(trainer: Any) -> contextlib.AbstractContextManager:
    """The autocast a Lightning ``trainer`` runs the training step under (its precision plugin's: bf16 or fp16
    autocast on the trainer's device, nothing for 32-true), for validation and sample grids: the EMA's weights are
    then evaluated at the precision they trained at, at training's speed."""
    if trainer is None:
        return contextlib.nullcontext()
    return trainer.precision_plugin.forward_context()
