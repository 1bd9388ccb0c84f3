"""Predicted compute time of a training step on one GPU: every op of the real UNet's step at a calibrated share of the
GPU's peaks (tools/communication_model.py adds the collectives of a data-parallel run).

Every figure here is a prediction until a GPU run measures it (``entrypoints/check.py`` on the user's cluster,
``bench/gpu_session.sh`` on a lent GPU; ../shared/GPU.md).

**Compute**, one micro-batch on one GPU: the ops of :mod:`sdtrain.model.op_costs` (forward, loss and backward of the
real UNet under CUDA's bf16 autocast rules, counted on fake tensors: tools/step_ops.py), each at a share of the GPU's
datasheet peaks (:class:`Efficiency`): a matmul, convolution or attention op takes the longer of its FLOPs at its
kind's share of the bf16 peak and its bytes at the memory share of the bandwidth; a memory-bound op (casts, GroupNorm,
LayerNorm, SiLU, GELU, adds, copies) its bytes, each op its own kernel (eager) or, compiled, only the bytes that cross
between fused code and the library kernels (op_costs' stated fusion assumption). Once an optimizer step, memory-bound
passes over the float32 parameters (:func:`optimizer_seconds`).

**Calibration**: MosaicML trained the SD 2 UNet on precomputed 256 px latents at ~137 images/s per A100 (8 A100s;
../shared/GPU.md). The memory share is fixed at :data:`MEMORY_EFFICIENCY`; the one compute share (matmul, convolution
and attention alike) is solved so that this model predicts that figure (:data:`ANCHOR`, its assumptions named there).
One figure cannot tell the kinds apart. A GPU session's eager steps (:data:`SESSION_ROWS`) recalibrate the GPU they
ran on (its own compute share) and fit the host's cost per op (:func:`session_fit`).

**Host**: an eager pass cannot go faster than the host dispatches its ops (Python, autocast, autograd and the
launch; a cost per op, fitted: docs/performance.md shows it), so each eager pass takes the longer of its kernels and
its ops' host time. Small micro-batches of small UNets on fast GPUs are host-bound. Compiled, inductor's wrapper
launches fused kernels and the host floor is left out (not measured yet).

**Communication**: tools/communication_model.py, which predicts the step from the micro-batch this model
predicts.

Left out: the compiled step's launch cost, the host-to-device copy of the batch (pinned, non-blocking), stragglers,
NCCL's latency per bucket, and the data pipeline (the check job measures data wait).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import numpy as np

from sdtrain.model.hardware import A100, H200_SXM, Gpu
from sdtrain.model.op_costs import KINDS, StepOps
from tools.step_ops import step_ops

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
    """A measured images/s the model is calibrated on, and what the model assumes about that run.

    Args:
        gpu: the GPU it ran on.
        memory_gib: which variant (its bandwidth).
        preset: the UNet (model.preset).
        resolution: image side in pixels.
        micro_batch: samples per GPU per forward (MosaicML's is not published: assumed).
        images_per_s: the measured images/s per GPU, eager.
        fitted: whether the fit uses it (a GPU session's row the model does not explain is shown, not fitted).
    """

    gpu: Gpu
    memory_gib: float
    preset: str
    resolution: int
    micro_batch: int
    images_per_s: float
    fitted: bool = True


ANCHOR = Anchor(A100, 40, "sd2-base", 256, 32, 137.0)
"""MosaicML's SD 2 UNet at 256 px: ~1,100 images/s on 8 A100s. Assumed: A100 40GB, eager (PyTorch without compile),
32 samples a GPU per step, DDP with float32 gradients hidden under the backward pass (8 GPUs over NVLink), no EMA;
whatever that run did otherwise is folded into the calibrated share."""

SESSION_ROWS = (
    Anchor(H200_SXM, 141, "small", 256, 96, 501.5),
    # Not fitted: far slower than what fits the others predicts (docs/performance.md), which no share common to the
    # presets explains; a per-kind profile (--profile) tells which kernels (small's attention: head dim 20) are slow.
    Anchor(H200_SXM, 141, "small", 512, 96, 182.0, fitted=False),
    Anchor(H200_SXM, 141, "sd2-base", 256, 64, 362.4),
    Anchor(H200_SXM, 141, "sd2-base", 512, 64, 115.0),
)
"""The first GPU session's eager steps (bench/results/2026-11-27-h200.md): bf16-mixed, one GPU, the shipped
micro-batches, 10 timed steps of sdtrain's own training step (bench/gpu_throughput.py) on a 16-CPU host."""


@dataclass(frozen=True)
class SessionFit:
    """What the GPU session's rows calibrate (:func:`session_fit`).

    Args:
        efficiencies: the shares of each GPU the session ran on, by Gpu.name.
        host_s_per_op: the host's seconds an eager op (every GPU: the host's, not the GPU's).
    """

    efficiencies: dict[str, Efficiency]
    host_s_per_op: float


# Bytes a parameter costs once an optimizer step (float32 weights, gradients and moments; bf16 buckets).
ADAMW_BYTES = 28  # the fused step reads weight, gradient and two moments, writes weight and moments
NORM_BYTES = 4  # the gradient norm (clipping and the non-finite check): reads each gradient
EMA_BYTES = 12  # the EMA's lerp: reads both weights, writes the average
BUCKET_COPY_BYTES = 8  # DDP copies each gradient into its bucket on the first micro-batch
ACCUMULATE_BYTES = 12  # every further micro-batch adds its gradient: two reads, one write
COMPRESSION_BYTES = 12  # bf16 compression: float32 bucket to bf16 (6) and back (6)


SAME_COMPUTE = {"H100 SXM": "H200 SXM"}
"""GPUs whose compute a session's GPU shares: the H100 SXM and H200 SXM are the same GH100 die at the same bf16 peak
(989.5 TFLOP/s), the H200 with faster memory (which the model's bandwidth term has)."""


def efficiency(gpu: Gpu) -> Efficiency:
    """The shares the model uses on ``gpu``: a GPU session's on that GPU or one of :data:`SAME_COMPUTE`, else the
    calibrated ones."""
    measured = session_fit().efficiencies
    return measured.get(gpu.name) or measured.get(SAME_COMPUTE.get(gpu.name, "")) or calibrated()


def host_s_per_op() -> float:
    """The host's seconds an eager op, fitted to the GPU session (:func:`session_fit`)."""
    return session_fit().host_s_per_op


def _shares(compute: float) -> Efficiency:
    return Efficiency(compute, compute, compute, MEMORY_EFFICIENCY)


def anchor_images_per_s(anchor: Anchor, shares: Efficiency, host_s: float, world: int = 1) -> float:
    """The model's images/s of ``anchor``'s eager step.

    Args:
        anchor: the measured row.
        shares: the efficiencies.
        host_s: the host's seconds an eager op.
        world: the ranks its optimizer step ran among (DDP's bucket copy).
    """
    ops = step_ops(anchor.preset, anchor.resolution, anchor.micro_batch)
    one = micro_batch(ops, anchor.gpu, anchor.memory_gib, shares, compiled=False, host_s=host_s)
    optimizer = optimizer_seconds(ops_parameters(anchor.preset), anchor.gpu, anchor.memory_gib, world, shares=shares)
    return anchor.micro_batch / (one.forward_s + one.backward_s + optimizer)


@cache
def calibrated() -> Efficiency:
    """The compute share (matmul, convolution and attention alike) at which the model predicts :data:`ANCHOR`'s
    images/s, with the fitted host cost (bisection: the prediction grows with the share)."""
    anchor, host = ANCHOR, host_s_per_op()
    low, high = 0.01, 1.0
    for _ in range(60):
        share = (low + high) / 2
        low, high = (
            (share, high)
            if anchor_images_per_s(anchor, _shares(share), host, 8) < anchor.images_per_s
            else (low, share)
        )
    if abs(anchor_images_per_s(anchor, _shares(low), host, 8) / anchor.images_per_s - 1) > 1e-3:
        raise ValueError(f"no compute share predicts the anchor's {anchor.images_per_s} images/s: host-bound there")
    return _shares(low)


@cache
def session_fit() -> SessionFit:
    """Each session GPU's compute share and the host's seconds an eager op, fitted together to the fitted rows of
    :data:`SESSION_ROWS`: least squares of log(predicted / measured images/s), by alternating golden-section
    searches (with the others fixed, the error is unimodal in each)."""
    rows = [row for row in SESSION_ROWS if row.fitted]
    gpus = {row.gpu.name: [r for r in rows if r.gpu.name == row.gpu.name] for row in rows}
    compute, host = dict.fromkeys(gpus, 0.4), 0.0

    def error(chosen: list[Anchor], shares: dict[str, float], host_s: float) -> float:
        predicted = [anchor_images_per_s(r, _shares(shares[r.gpu.name]), host_s) for r in chosen]
        return sum(math.log(p / r.images_per_s) ** 2 for p, r in zip(predicted, chosen, strict=True))

    def share_of(name: str, host_s: float) -> float:
        return _minimize(lambda share: error(gpus[name], {name: share}, host_s), 0.05, 1.0)

    for _ in range(20):
        before = (dict(compute), host)
        for name in gpus:
            compute[name] = share_of(name, host)
        host = _minimize(lambda h: error(rows, compute, h), 0.0, 500e-6)
        if all(abs(compute[n] - before[0][n]) < 1e-5 for n in gpus) and abs(host - before[1]) < 1e-8:
            break
    return SessionFit({name: _shares(share) for name, share in compute.items()}, host)


def _minimize(f: Callable[[float], float], low: float, high: float, iterations: int = 40) -> float:
    """Golden-section search for the minimum of a unimodal ``f`` on [low, high]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = f(a), f(b)
    for _ in range(iterations):
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = f(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = f(b)
    return (low + high) / 2


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


def micro_batch(
    ops: StepOps, gpu: Gpu, memory_gib: float, shares: Efficiency, compiled: bool, host_s: float | None = None
) -> MicroBatch:
    """The predicted micro-batch of ``ops`` on ``gpu`` (module docstring). Compiled, the memory-bound bytes of each
    pass are its fused bytes, spread over its memory-bound ops in proportion to their eager bytes (which places each
    gradient's readiness in time). Eager, each pass takes at least its ops' host time, a host-bound backward pass
    stretching its gradients' readiness alike.

    Args:
        ops: the traced ops.
        gpu: the GPU.
        memory_gib: its variant (the bandwidth).
        shares: the efficiencies.
        compiled: train.compile (the memory-bound ops fused, no host floor).
        host_s: the host's seconds an eager op (default: :func:`host_s_per_op`).
    """
    seconds = op_seconds(ops, gpu, memory_gib, shares, compiled)
    columns = _columns(ops)
    device_forward = sum(itertools.compress(seconds, columns.forward))
    elapsed = list(itertools.accumulate(seconds, initial=0.0))
    forward, backward = device_forward, elapsed[-1] - device_forward
    stretch = 1.0
    if not compiled:
        host = host_s_per_op() if host_s is None else host_s
        forward_ops = columns.forward_ops
        if backward:
            stretch = max(1.0, (len(ops.ops) - forward_ops) * host / backward)
        forward = max(forward, forward_ops * host)
    ready = tuple((parameter, (elapsed[at] - device_forward) * stretch) for parameter, at in ops.gradients_ready)
    return MicroBatch(forward, backward * stretch, ready)


def op_seconds(ops: StepOps, gpu: Gpu, memory_gib: float, shares: Efficiency, compiled: bool) -> list[float]:
    """Each op's predicted seconds on the GPU (the host floor aside): the longer of its FLOPs and its bytes at
    ``shares``; compiled, a memory-bound op's share of its pass's fused bytes (:func:`micro_batch`).

    Computed on the ops' columns (:func:`_columns`), each op's figure by the same float operations in the same order
    as one op at a time (the fits evaluate thousands of steps of thousands of ops)."""
    peak, bandwidth = gpu.bf16_peak, gpu.bandwidth_bytes(memory_gib) * shares.memory
    columns = _columns(ops)
    scale = [1.0, 1.0]
    if compiled:
        for phase in (0, 1):
            eager = columns.memory_bytes[phase]
            scale[phase] = ops.fused_memory_bytes[phase] / eager if eager else 0.0
    memory = columns.bytes * np.where(columns.backward, scale[1], scale[0]) / bandwidth
    # A memory op's FLOPs (0) at any share: a placeholder its own figure replaces.
    kind_peak = np.array([peak * getattr(shares, kind) if kind != "memory" else 1.0 for kind in KINDS])
    compute = np.maximum(columns.flops / kind_peak[columns.kind], columns.bytes / bandwidth)
    return np.where(columns.is_memory, memory, compute).tolist()


@dataclass(frozen=True)
class _Columns:
    """A traced step's ops as arrays, for :func:`op_seconds`, and what :func:`micro_batch` counts of them.

    Args:
        flops: each op's FLOPs (float64: as a FLOP count divides).
        bytes: each op's bytes (float64).
        kind: each op's index in KINDS.
        is_memory: each op is memory-bound.
        backward: each op runs in the backward pass.
        forward: each op runs in the forward pass (a list: itertools.compress's selectors).
        forward_ops: the forward pass's ops.
        memory_bytes: the eager bytes of the memory-bound ops of the forward and of the backward pass.
    """

    flops: np.ndarray
    bytes: np.ndarray
    kind: np.ndarray
    is_memory: np.ndarray
    backward: np.ndarray
    forward: list[bool]
    forward_ops: int
    memory_bytes: tuple[int, int]


_COLUMNS: dict[int, tuple[StepOps, _Columns]] = {}


def _columns(ops: StepOps) -> _Columns:
    """``ops`` as columns, made once per StepOps (kept with it: an id is only reused once its object is gone)."""
    held = _COLUMNS.get(id(ops))
    if held is None or held[0] is not ops:
        kinds = [KINDS.index(op.kind) for op in ops.ops]
        backward = [op.backward for op in ops.ops]
        memory_bytes = tuple(
            sum(op.bytes for op in ops.ops if op.kind == "memory" and op.backward == phase) for phase in (0, 1)
        )
        columns = _Columns(
            flops=np.array([op.flops for op in ops.ops], dtype=np.int64).astype(np.float64),
            bytes=np.array([op.bytes for op in ops.ops], dtype=np.int64).astype(np.float64),
            kind=np.array(kinds, dtype=np.intp),
            is_memory=np.array(kinds, dtype=np.intp) == KINDS.index("memory"),
            backward=np.array(backward, dtype=bool),
            forward=[not b for b in backward],
            forward_ops=backward.count(False),
            memory_bytes=(memory_bytes[0], memory_bytes[1]),
        )
        held = _COLUMNS[id(ops)] = (ops, columns)
    return held[1]


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
