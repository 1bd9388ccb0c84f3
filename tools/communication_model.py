"""The collectives of a data-parallel training step as DDP and FSDP2 run them, and how much of them the step's
compute hides; the compute is tools/performance_model.py's. Every figure is a prediction until a GPU run measures it
(``entrypoints/check.py`` on the user's cluster; ../shared/GPU.md).

**Communication**, per optimizer step and rank:

- DDP all-reduces the gradients only in the backward pass of an optimizer step's **last** micro-batch (the others run
  under ``no_sync``), bucket by bucket as each fills: buckets are cut at ``train.ddp_bucket_mb`` MiB of the
  parameters' float32 bytes (torch's reducer counts the parameters' dtype), so with bf16 compression each sends half
  its cap. The backward of that one micro-batch is the window that hides them: each bucket starts once its last
  gradient is ready (the order and the times from tools/performance_model.py's trace) and the bucket before it is
  sent, one collective at a time; what ends after the backward shows. (The first step after a start sends one
  bucket of everything at the backward's end: once a run, left out.)
- FSDP2 all-gathers every unit's parameters in each micro-batch's forward and again in its backward (the root's
  once: it stays gathered from forward to backward), and reduce-scatters the gradients in the last micro-batch's
  backward. Each micro-batch's collectives hide under its compute, except the root's gather, which precedes it.
- A collective over ``n`` ranks moves ``phases x (n - 1) / n`` of its bytes through each rank's slowest link: within
  a node over NVLink or PCIe, then between nodes over the network (each NIC carrying its node's GPUs), the two
  phases added (no pipelining between them: an upper bound), at :data:`LINK_EFFICIENCY` of each link's rate.

Left out: NCCL's latency per bucket and stragglers (the check job measures the share they leave).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sdtrain.model.hardware import NodeType
from tools.performance_model import MicroBatch

GB = 1e9
GBIT = 1e9 / 8  # bytes/s in a Gbit/s
MIB = 2**20

LINK_EFFICIENCY = 0.7
"""The share of a link's rate NCCL's collectives are assumed to reach (bus bandwidth over the link's rate): nccl-tests
reach ~0.7-0.8 on NVLink and EFA at large messages; a check job measures it."""


@dataclass(frozen=True)
class StepPrediction:
    """One optimizer step of one rank, predicted.

    Args:
        compute_s: every micro-batch's forward and backward, and the optimizer step.
        window_s: the compute that can hide the step's communication (DDP: the last micro-batch's backward).
        communication_s: every collective of the step, hidden or not.
        exposed_communication_s: the part of it the compute does not hide.
        samples_per_rank: samples a rank trains per optimizer step.
        gradient_bytes: bytes of one all-reduce (DDP) or reduce-scatter (FSDP) of the gradients, as sent.
        buckets: DDP's gradient buckets (FSDP: units reduce-scattered).
    """

    compute_s: float
    window_s: float
    communication_s: float
    exposed_communication_s: float
    samples_per_rank: int
    gradient_bytes: float
    buckets: int

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
        nbytes: the bytes each rank holds of the collective's tensor (a whole bucket for an all-reduce).
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


def ddp_buckets(
    parameters: Sequence[int], ready: Sequence[int], bucket_mb: float, compression: str = "none"
) -> list[tuple[int, int]]:
    """DDP's buckets as its reducer cuts them once it has seen a backward pass: (bytes it sends, the position in
    ``ready`` of its last gradient), in the order they are all-reduced. The parameters in the order their gradients
    became ready; a bucket closed once it holds ``bucket_mb`` MiB of float32 gradients (the parameters' dtype); sent
    as float32 or, with bf16 compression, half. (The first step after a start sends one bucket of everything, at the
    backward's end: DDP has not seen the order yet.)

    Args:
        parameters: each parameter's elements, in registration order.
        ready: parameter indices in the order their gradients become ready (sdtrain.model.op_costs).
        bucket_mb: train.ddp_bucket_mb.
        compression: train.gradient_compression.
    """
    cap, wire = bucket_mb * MIB, 2 if compression == "bf16" else 4
    buckets, filled = [], 0
    for position, index in enumerate(ready):
        filled += parameters[index] * 4
        if filled >= cap or position == len(ready) - 1:
            buckets.append((filled // 4 * wire, position))
            filled = 0
    return buckets


def predict_step(
    micro: MicroBatch,
    optimizer_s: float,
    parameters: Sequence[int],
    node: NodeType,
    nodes: int,
    global_batch: int,
    micro_batch_size: int,
    strategy: Literal["ddp", "fsdp"] = "ddp",
    gradient_compression: Literal["none", "bf16"] = "none",
    bucket_mb: float = 25,
    fsdp_units: tuple[int, tuple[int, ...]] | None = None,
    fsdp_param_bytes: int = 2,
) -> StepPrediction:
    """The predicted optimizer step of a rank of ``nodes`` nodes of ``node`` (every GPU a rank).

    Args:
        micro: one micro-batch on one GPU (:func:`micro_batch`).
        optimizer_s: the optimizer step's passes (:func:`optimizer_seconds`).
        parameters: each parameter's elements, in registration order.
        node: the node type.
        nodes: nodes in the group.
        global_batch: train.global_batch_size.
        micro_batch_size: train.micro_batch_size (samples per forward and backward).
        strategy: train.strategy.
        gradient_compression: train.gradient_compression.
        bucket_mb: train.ddp_bucket_mb.
        fsdp_units: under FSDP, (the root unit's elements, each other unit's) (:func:`fsdp_unit_parameters`).
        fsdp_param_bytes: bytes of a parameter as FSDP all-gathers it (train.fsdp_param_dtype: 2 for bf16).
    """
    world = node.gpus * nodes
    if global_batch % world or (global_batch // world) % micro_batch_size:
        raise ValueError(f"global batch {global_batch} does not fall in micro-batches of {micro_batch_size} on {world}")
    per_rank = global_batch // world
    accumulation = per_rank // micro_batch_size
    compute = accumulation * (micro.forward_s + micro.backward_s) + optimizer_s
    if strategy == "ddp":
        return _ddp_step(micro, compute, per_rank, parameters, node, nodes, gradient_compression, bucket_mb)
    assert fsdp_units is not None, "FSDP needs its units' sizes"
    root, units = fsdp_units
    reduce_bytes = 2 if gradient_compression == "bf16" else 4
    root_gather = collective_seconds(root * fsdp_param_bytes, node, nodes, phases=1)
    gathers = root_gather + 2 * sum(collective_seconds(n * fsdp_param_bytes, node, nodes, 1) for n in units)
    scatters = sum(collective_seconds(n * reduce_bytes, node, nodes, 1) for n in (root, *units))
    communication = accumulation * gathers + scatters
    one = micro.forward_s + micro.backward_s
    exposed = 0.0
    if world > 1:
        exposed = (accumulation - 1) * max(gathers - one, root_gather) + max(gathers + scatters - one, root_gather)
    gradient_bytes = sum(parameters) * reduce_bytes
    return StepPrediction(compute, one, communication, exposed, per_rank, gradient_bytes, 1 + len(units))


def _ddp_step(
    micro: MicroBatch,
    compute: float,
    per_rank: int,
    parameters: Sequence[int],
    node: NodeType,
    nodes: int,
    compression: str,
    bucket_mb: float,
) -> StepPrediction:
    """DDP's all-reduces in the last micro-batch's backward: each bucket starts once its last gradient is ready and
    the bucket before it is sent (one collective at a time); what ends after the backward is exposed."""
    order = [index for index, _ in micro.ready_s]
    buckets = ddp_buckets(parameters, order, bucket_mb, compression)
    times = [collective_seconds(size, node, nodes, phases=2) for size, _ in buckets]
    end = 0.0
    for (_, last), seconds in zip(buckets, times, strict=True):
        end = max(end, micro.ready_s[last][1]) + seconds
    exposed = max(0.0, end - micro.backward_s) if node.gpus * nodes > 1 else 0.0
    wire = sum(size for size, _ in buckets)
    return StepPrediction(compute, micro.backward_s, sum(times), exposed, per_rank, wire, len(buckets))


def fsdp_collectives(units: int, accumulation: int) -> list[dict[str, int]]:
    """The collectives FSDP2 runs in each micro-batch of an optimizer step, with ``units`` units besides the root
    (sdtrain.train.strategy.shard_unet): the root's parameters gathered once (they stay gathered from forward to
    backward), every other unit's in the forward and again in the backward (resharded after its forward), and every
    unit's gradients reduce-scattered in the last micro-batch's backward only (FSDP2Strategy.block_backward_sync)."""
    return [
        {
            "forward gathers": 1 + units,
            "backward gathers": units,
            "reduce-scatters": 1 + units if batch == accumulation - 1 else 0,
        }
        for batch in range(accumulation)
    ]
