"""Predicted compute time of a training step on one GPU: every op of the real UNet's step at a calibrated share of the
GPU's peaks (tools/communication_model.py adds the collectives of a data-parallel run).

Every figure here is a prediction until a GPU run measures it (``entrypoints/check.py`` on the user's cluster,
``bench/gpu_session.sh`` on a lent GPU; ../shared/GPU.md).

**Compute**, one micro-batch on one GPU: the ops of :mod:`sdtrain.model.op_costs` (forward, loss and backward of the
real UNet under CUDA's bf16 autocast rules, counted on fake tensors), each at a share of the GPU's datasheet peaks
(:class:`Efficiency`): a matmul, convolution or attention op takes the longer of its FLOPs at its kind's share of the
bf16 peak and its bytes at the memory share of the bandwidth; a memory-bound op (casts, GroupNorm, LayerNorm, SiLU,
GELU, adds, copies) its bytes, each op its own kernel (eager) or, compiled, only the bytes that cross between fused
code and the library kernels (op_costs' stated fusion assumption). Once an optimizer step, memory-bound passes over
the float32 parameters (:func:`optimizer_seconds`).

**Calibration**, once: MosaicML trained the SD 2 UNet on precomputed 256 px latents at ~137 images/s per A100 (8 A100s;
../shared/GPU.md). The memory share is fixed at :data:`MEMORY_EFFICIENCY`; the one compute share (matmul, convolution
and attention alike) is solved so that this model predicts that figure (:data:`ANCHOR`, its assumptions named there).
One figure cannot tell the kinds, or GPUs, apart: every GPU gets the same shares until a GPU run recalibrates one
(:data:`MEASURED_EFFICIENCIES`).

**Communication**: tools/communication_model.py, which predicts the step from the micro-batch this model
predicts.

Left out: kernel launch latency (eager PyTorch dispatches an op in ~5-10 us; hidden while the kernels are longer, as
at these micro-batches most are), the host-to-device copy of the batch (pinned, non-blocking), stragglers, NCCL's
latency per bucket, and the data pipeline (the check job measures data wait).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from sdtrain.model.hardware import A100, Gpu
from sdtrain.model.op_costs import KINDS, StepOps

MEMORY_EFFICIENCY = 0.8
"""The share of the datasheet memory bandwidth a memory-bound kernel is assumed to reach (stream-like kernels reach
~0.8-0.9 of it on A100 and H100; PyTorch's eager norms and casts less). Stated, not calibrated."""


@dataclass(frozen=True)
class Efficiency:
    """Shares of a GPU's datasheet peaks each kind of op reaches: of the bf16 peak for the first three, of the memory
    bandwidth for the last (and for the bytes of the others)."""

    matmul: float
    conv: float
    attention: float
    memory: float


@dataclass(frozen=True)
class Anchor:
    """The published figure the compute share is calibrated on, and what the model assumes about that run.

    Args:
        gpu: the GPU it ran on.
        memory_gib: which variant (its bandwidth).
        preset: the UNet (model.preset).
        resolution: image side in pixels.
        micro_batch: samples per GPU per forward (not published: assumed).
        images_per_s: the published images/s per GPU.
    """

    gpu: Gpu
    memory_gib: float
    preset: str
    resolution: int
    micro_batch: int
    images_per_s: float


ANCHOR = Anchor(A100, 40, "sd2-base", 256, 32, 137.0)
"""MosaicML's SD 2 UNet at 256 px: ~1,100 images/s on 8 A100s. Assumed: A100 40GB, eager (PyTorch without compile),
32 samples a GPU per step, DDP with float32 gradients hidden under the backward pass (8 GPUs over NVLink), no EMA;
whatever that run did otherwise is folded into the calibrated share."""

MEASURED_EFFICIENCIES: dict[str, Efficiency] = {}
"""Shares measured on a GPU (bench/results/), by Gpu.name, replacing the calibrated ones there: none yet."""

# Bytes a parameter costs once an optimizer step (float32 weights, gradients and moments; bf16 buckets).
ADAMW_BYTES = 28  # the fused step reads weight, gradient and two moments, writes weight and moments
NORM_BYTES = 4  # the gradient norm (clipping and the non-finite check): reads each gradient
EMA_BYTES = 12  # the EMA's lerp: reads both weights, writes the average
BUCKET_COPY_BYTES = 8  # DDP copies each gradient into its bucket on the first micro-batch
ACCUMULATE_BYTES = 12  # every further micro-batch adds its gradient: two reads, one write
COMPRESSION_BYTES = 12  # bf16 compression: float32 bucket to bf16 (6) and back (6)


def efficiency(gpu: Gpu) -> Efficiency:
    """The shares the model uses on ``gpu``: measured there, else the calibrated ones."""
    return MEASURED_EFFICIENCIES.get(gpu.name) or calibrated()


@cache
def calibrated() -> Efficiency:
    """The compute share (matmul, convolution and attention alike) at which the model predicts :data:`ANCHOR`'s
    images/s (bisection: the prediction grows with the share)."""
    anchor = ANCHOR
    ops = step_ops(anchor.preset, anchor.resolution, anchor.micro_batch)
    low, high = 0.01, 1.0
    for _ in range(60):
        share = (low + high) / 2
        shares = Efficiency(share, share, share, MEMORY_EFFICIENCY)
        one = micro_batch(ops, anchor.gpu, anchor.memory_gib, shares, compiled=False)
        parameters = ops_parameters(anchor.preset)
        optimizer = optimizer_seconds(parameters, anchor.gpu, anchor.memory_gib, 8, shares=shares)
        step = one.forward_s + one.backward_s + optimizer
        low, high = (share, high) if anchor.micro_batch / step < anchor.images_per_s else (low, share)
    return Efficiency(low, low, low, MEMORY_EFFICIENCY)


@cache
def step_ops(preset: str, resolution: int, micro_batch: int, gradient_checkpointing: bool = False) -> StepOps:
    """The ops of one micro-batch of ``preset`` at ``resolution`` (sdtrain.model.op_costs), traced once."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.op_costs import count_step_ops
    from sdtrain.model.unet import unet_config

    unet = unet_config(ModelConfig(preset=cast(Any, preset)))
    side = resolution // 8
    caption = (77, unet["cross_attention_dim"])
    return count_step_ops(unet, (4, side, side), caption, micro_batch, gradient_checkpointing=gradient_checkpointing)


@cache
def ops_parameters(preset: str) -> tuple[int, ...]:
    """Each parameter's elements, in registration order."""
    import torch

    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.unet import build_unet

    with torch.device("meta"):
        unet = build_unet(ModelConfig(preset=cast(Any, preset)))
    return tuple(p.numel() for p in unet.parameters())


@cache
def fsdp_unit_parameters(preset: str) -> tuple[int, tuple[int, ...]]:
    """(the root unit's elements, each other unit's) as sdtrain.train.strategy.shard_unet cuts the UNet."""
    import torch

    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.unet import build_unet
    from sdtrain.train.strategy import fsdp_units

    with torch.device("meta"):
        unet = build_unet(ModelConfig(preset=cast(Any, preset)))
    units = tuple(sum(p.numel() for p in unit.parameters()) for unit in fsdp_units(unet))
    return sum(p.numel() for p in unet.parameters()) - sum(units), units


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's forward and backward on one GPU, predicted.

    Args:
        forward_s: the forward pass and the loss.
        backward_s: the backward pass.
        ready_s: for each parameter in the order its gradient becomes ready, (its index, seconds into the backward).
    """

    forward_s: float
    backward_s: float
    ready_s: tuple[tuple[int, float], ...]


def micro_batch(ops: StepOps, gpu: Gpu, memory_gib: float, shares: Efficiency, compiled: bool) -> MicroBatch:
    """The predicted micro-batch of ``ops`` on ``gpu`` (module docstring). Compiled, the memory-bound bytes of each
    pass are its fused bytes, spread over its memory-bound ops in proportion to their eager bytes (which places each
    gradient's readiness in time).

    Args:
        ops: the traced ops.
        gpu: the GPU.
        memory_gib: its variant (the bandwidth).
        shares: the efficiencies.
        compiled: train.compile (the memory-bound ops fused).
    """
    seconds = op_seconds(ops, gpu, memory_gib, shares, compiled)
    forward = sum(t for t, op in zip(seconds, ops.ops, strict=True) if not op.backward)
    elapsed = [0.0]
    for t in seconds:
        elapsed.append(elapsed[-1] + t)
    ready = tuple((parameter, elapsed[at] - forward) for parameter, at in ops.gradients_ready)
    return MicroBatch(forward, elapsed[-1] - forward, ready)


def op_seconds(ops: StepOps, gpu: Gpu, memory_gib: float, shares: Efficiency, compiled: bool) -> list[float]:
    """Each op's predicted seconds on the GPU (the host floor aside): the longer of its FLOPs and its bytes at
    ``shares``; compiled, a memory-bound op's share of its pass's fused bytes (:func:`micro_batch`)."""
    peak, bandwidth = gpu.bf16_peak, gpu.bandwidth_bytes(memory_gib) * shares.memory
    scale = [1.0, 1.0]
    if compiled:
        for phase in (0, 1):
            eager = sum(op.bytes for op in ops.ops if op.kind == "memory" and op.backward == phase)
            scale[phase] = ops.fused_memory_bytes[phase] / eager if eager else 0.0
    return [
        op.bytes * scale[op.backward] / bandwidth
        if op.kind == "memory"
        else max(op.flops / (peak * getattr(shares, op.kind)), op.bytes / bandwidth)
        for op in ops.ops
    ]


def kind_seconds(ops: StepOps, gpu: Gpu, memory_gib: float, shares: Efficiency, compiled: bool) -> dict[str, float]:
    """The predicted GPU seconds of each kind of op (sdtrain.model.op_costs.KINDS) in one micro-batch."""
    totals = dict.fromkeys(KINDS, 0.0)
    for seconds, op in zip(op_seconds(ops, gpu, memory_gib, shares, compiled), ops.ops, strict=True):
        totals[op.kind] += seconds
    return totals


def optimizer_seconds(
    parameters: Sequence[int],
    gpu: Gpu,
    memory_gib: float,
    world: int,
    accumulation: int = 1,
    ema: bool = False,
    gradient_compression: str = "none",
    strategy: str = "ddp",
    shares: Efficiency | None = None,
) -> float:
    """The per-parameter passes of one optimizer step (memory-bound, float32): the fused AdamW with the clipping
    folded in, the gradient norm, the EMA, DDP's bucket copy and the accumulation's adds, bf16 compression's casts.
    Under FSDP each rank passes over its shard; FSDP's own copies are left out."""
    per_parameter = ADAMW_BYTES + NORM_BYTES + (EMA_BYTES if ema else 0) + ACCUMULATE_BYTES * (accumulation - 1)
    if strategy == "ddp" and world > 1:
        per_parameter += BUCKET_COPY_BYTES + (COMPRESSION_BYTES if gradient_compression == "bf16" else 0)
    elements = sum(parameters) / (world if strategy == "fsdp" else 1)
    memory = (shares or efficiency(gpu)).memory
    return elements * per_parameter / (gpu.bandwidth_bytes(memory_gib) * memory)
