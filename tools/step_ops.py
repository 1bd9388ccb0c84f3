"""The ops of one training micro-batch of a UNet preset (sdtrain.model.op_costs: forward, loss and backward under
CUDA's bf16 autocast rules, counted on fake tensors), for the per-op model (tools/performance_model.py).

A trace takes seconds (tens for sdxl-base) at any micro-batch. Each step is traced once a process, and once two
micro-batches of the same step are traced, any other is drawn from their line (:func:`affine_step_ops`, exact)
rather than traced: docs/performance.md asks for up to four micro-batches of a step.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any, cast

from sdtrain.model.op_costs import StepOps


def step_ops(preset: str, resolution: int, micro_batch: int, gradient_checkpointing: bool = False) -> StepOps:
    """The ops of one micro-batch of ``preset`` at ``resolution`` (sdtrain.model.op_costs), traced once; once two
    micro-batches of the same step are traced, another is their line (:func:`affine_step_ops`), not a third trace."""
    # One cache key however the flag is passed (functools.cache keys a defaulted argument apart from a given one).
    return _step_ops(preset, resolution, micro_batch, gradient_checkpointing)


_TRACED: dict[tuple[str, int, bool], dict[int, StepOps]] = {}
"""The traced steps (not the derived ones), by (preset, resolution, gradient_checkpointing), then micro-batch."""


@cache
def _step_ops(preset: str, resolution: int, micro_batch: int, gradient_checkpointing: bool) -> StepOps:
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.op_costs import count_step_ops
    from sdtrain.model.unet import unet_config

    traced = _TRACED.setdefault((preset, resolution, gradient_checkpointing), {})
    lines = [(m, ops) for m, ops in sorted(traced.items()) if m >= 2]  # a single sample's step may squeeze its batch
    if len(lines) >= 2 and micro_batch >= 2:
        derived = affine_step_ops(lines[0], lines[1], micro_batch)
        if derived is not None:
            return derived
    unet = unet_config(ModelConfig(preset=cast(Any, preset)))
    side = resolution // 8
    caption = (77, unet["cross_attention_dim"])
    ops = count_step_ops(unet, (4, side, side), caption, micro_batch, gradient_checkpointing=gradient_checkpointing)
    traced[micro_batch] = ops
    return ops


def affine_step_ops(first: tuple[int, StepOps], second: tuple[int, StepOps], micro_batch: int) -> StepOps | None:
    """The ops of ``micro_batch`` samples of the step traced at two other micro-batches (``(micro-batch, ops)``
    each), or None where the traces do not determine them.

    On fake tensors the micro-batch changes no op of the step, only sizes: each op's FLOPs and bytes are a part
    proportional to the samples (activations) and a part that is not (weights, their gradients and casts), and so
    are the bytes that cross into fused code, while the gradients become ready at the same ops. So each figure is on
    the line through the two traces' figures; the traces must have the same ops, in the same order, and the line an
    integer at ``micro_batch`` (tests/test_performance_report.py holds it to a trace)."""
    (m0, a), (m1, b) = first, second
    if m0 == m1 or a.gradients_ready != b.gradients_ready or len(a.ops) != len(b.ops):
        return None

    def at(y0: int, y1: int) -> int | None:
        step, rest = divmod((y1 - y0) * (micro_batch - m0), m1 - m0)
        return None if rest or y0 + step < 0 else y0 + step

    ops = []
    for x, y in zip(a.ops, b.ops, strict=True):
        flops, nbytes = at(x.flops, y.flops), at(x.bytes, y.bytes)
        if (x.name, x.kind, x.backward) != (y.name, y.kind, y.backward) or flops is None or nbytes is None:
            return None
        ops.append(replace(x, flops=flops, bytes=nbytes))
    forward, backward = (at(x, y) for x, y in zip(a.fused_memory_bytes, b.fused_memory_bytes, strict=True))
    if forward is None or backward is None:
        return None
    return StepOps(micro_batch, tuple(ops), (forward, backward), a.gradients_ready)
