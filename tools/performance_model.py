"""Predicted step time of a data-parallel training run on GPU nodes: compute from the model's FLOPs, communication
from the gradient bytes and the nodes' links, and how much of the communication the backward pass hides.

Every figure here is a prediction: kernel speed (the MFU a run reaches) and what NCCL gets out of a link are
assumptions, named below, until ``entrypoints/check.py`` measures them on the user's cluster (../shared/GPU.md).

The model, per optimizer step and rank:

- **compute** = samples per rank x the UNet's training FLOPs per sample (:mod:`sdtrain.model.flops`, forward and
  backward) / (the GPU's dense peak x an assumed MFU). The backward pass is two thirds of it.
- **communication** (DDP) = one all-reduce of the gradients per optimizer step (accumulation micro-batches skip it),
  float32, or bf16 with ``train.gradient_compression=bf16``. NCCL's all-reduce over ``n`` ranks moves
  ``2 (n - 1) / n`` times the bytes through each rank's slowest link. Across nodes it is hierarchical: within a node
  over NVLink or PCIe (``k`` GPUs), then between nodes over the network, each node's NIC carrying its share for
  its ``k`` GPUs; the two phases are added (no pipelining between them: an upper bound).
- **FSDP** adds what sharding costs: each micro-batch all-gathers the parameters twice (forward and backward, in
  ``train.fsdp_param_dtype``) and the last reduce-scatters the gradients (float32): ``(n - 1) / n`` of the bytes
  each (the gradients in bf16 with ``train.gradient_compression=bf16``).
- **overlap**: DDP all-reduces a bucket as soon as its gradients are ready, during the backward pass, so only the
  communication beyond the backward time shows, and at least the last bucket's (it starts when the backward ends).
  FSDP's all-gathers of the next unit overlap the current unit's compute the same way (prefetching).

What is left out: the optimizer, clipping and EMA (a few ms a step, per parameter), the host-to-device copy of the
batch (pinned, non-blocking: hidden), stragglers, and NCCL's latency per bucket (small against bandwidth at these
sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from sdtrain.model.hardware import NodeType

GB = 1e9
GBIT = 1e9 / 8  # bytes/s in a Gbit/s

LINK_EFFICIENCY = 0.7
"""The share of a link's rate NCCL's all-reduce is assumed to reach (its bus bandwidth over the link's rate):
nccl-tests reach ~0.7-0.8 on NVLink and EFA at large messages; a check job measures it."""


@dataclass(frozen=True)
class StepPrediction:
    """One optimizer step of one rank, predicted.

    Args:
        compute_s: forward and backward of the rank's samples.
        communication_s: every collective of the step, whether hidden or not.
        exposed_communication_s: the part of it the backward pass does not hide.
        samples_per_rank: samples a rank trains per optimizer step.
        gradient_bytes: bytes of one all-reduce (DDP) or reduce-scatter (FSDP) of the gradients.
    """

    compute_s: float
    communication_s: float
    exposed_communication_s: float
    samples_per_rank: int
    gradient_bytes: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_communication_s

    @property
    def images_per_s_per_gpu(self) -> float:
        return self.samples_per_rank / self.step_s

    @property
    def communication_share(self) -> float:
        """The share of the step spent waiting for communication."""
        return self.exposed_communication_s / self.step_s


def collective_seconds(nbytes: float, node: NodeType, nodes: int, phases: float) -> float:
    """Seconds for a ring collective that moves ``phases x (n - 1) / n`` of ``nbytes`` through each rank (2 for an
    all-reduce, 1 for a reduce-scatter or all-gather) over ``nodes`` nodes of ``node``: within each node over its GPU
    links, then between nodes over the network (each node's NIC carries the bytes of all its GPUs).

    Args:
        nbytes: the bytes each rank holds of the collective's tensor (a whole gradient for an all-reduce).
        node: the node type.
        nodes: nodes in the group.
        phases: 2 for an all-reduce, 1 for a reduce-scatter or an all-gather.
    """
    k = node.gpus
    seconds = 0.0
    if k > 1:
        seconds += phases * (k - 1) / k * nbytes / (node.intra_gbyte_s * GB * LINK_EFFICIENCY)
    if nodes > 1:
        seconds += phases * (nodes - 1) / nodes * nbytes / (node.network_gbit_s * GBIT * LINK_EFFICIENCY)
    return seconds


def predict_step(
    train_flops_per_sample: float,
    parameters: int,
    node: NodeType,
    nodes: int,
    global_batch: int,
    micro_batch: int,
    mfu: float,
    strategy: Literal["ddp", "fsdp"] = "ddp",
    gradient_compression: Literal["none", "bf16"] = "none",
    fsdp_param_bytes: int = 2,
    bucket_mb: float = 25,
) -> StepPrediction:
    """The predicted optimizer step of a run of ``nodes`` nodes of ``node`` (every GPU a rank), bf16 mixed precision.

    Args:
        train_flops_per_sample: the UNet's forward and backward FLOPs of one sample (sdtrain.model.flops).
        parameters: the UNet's trainable parameters.
        node: the node type.
        nodes: nodes in the group.
        global_batch: train.global_batch_size.
        micro_batch: train.micro_batch_size (samples per forward and backward).
        mfu: the model FLOPs utilization assumed for the compute.
        strategy: train.strategy.
        gradient_compression: train.gradient_compression.
        fsdp_param_bytes: bytes of a parameter as FSDP all-gathers it (train.fsdp_param_dtype: 2 for bf16).
        bucket_mb: train.ddp_bucket_mb (the last bucket's all-reduce shows after the backward pass).
    """
    world = node.gpus * nodes
    if global_batch % world or (global_batch // world) % micro_batch:
        raise ValueError(f"global batch {global_batch} does not fall in micro-batches of {micro_batch} on {world}")
    per_rank = global_batch // world
    accumulation = per_rank // micro_batch
    compute = per_rank * train_flops_per_sample / (node.gpu.bf16_peak * mfu)
    backward = compute * 2 / 3
    if strategy == "ddp":
        gradient_bytes = parameters * (2 if gradient_compression == "bf16" else 4)
        communication = collective_seconds(gradient_bytes, node, nodes, phases=2)
        last_bucket = collective_seconds(min(bucket_mb * 1e6, gradient_bytes), node, nodes, phases=2)
        exposed = max(communication - backward, last_bucket) if world > 1 else 0.0
    else:
        gradient_bytes = parameters * (2 if gradient_compression == "bf16" else 4)  # the reduce-scatter's dtype
        gathers = 2 * accumulation * collective_seconds(parameters * fsdp_param_bytes, node, nodes, phases=1)
        communication = gathers + collective_seconds(gradient_bytes, node, nodes, phases=1)
        exposed = max(communication - compute, 0.0) if world > 1 else 0.0  # prefetching hides gathers under compute
    return StepPrediction(compute, communication, exposed, per_rank, gradient_bytes)


def compute_bound_images_per_s(train_flops_per_sample: float, peak_flops: float, mfu: float) -> float:
    """Images/s of one GPU whose every second is compute at ``mfu`` of ``peak_flops``.

    Args:
        train_flops_per_sample: forward and backward FLOPs of one sample.
        peak_flops: the GPU's dense peak FLOP/s at the run's precision.
        mfu: the model FLOPs utilization assumed.
    """
    return peak_flops * mfu / train_flops_per_sample


def nodes_for(workers: int, node: NodeType) -> int:
    """Nodes of ``node`` that hold ``workers`` one-GPU workers."""
    return math.ceil(workers / node.gpus)
