"""docs/performance.md's memory table: one trace of the memory model (sdtrain.model.memory) per preset and resolution,
linear in the micro-batch, and the largest micro-batch each GPU holds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from sdtrain.config.schema import ModelConfig
from sdtrain.model.hardware import A10G, A100, H100_SXM

GIB = 2**30
TRACED_MICRO_BATCH = 32
MEMORY_MICRO_BATCHES = (16, 32, 64, 96, 128, 256)
MEMORY_ROWS = (
    ("small", 256, False),
    ("small", 512, False),
    ("sd2-base", 256, False),
    ("sd2-base", 512, False),
    ("sd2-base", 512, True),
)
# Each GPU's memory as the device reports it (sdtrain.model.hardware), not its datasheet size: an A10G's 24 GB is 22.5
# GiB.
FIT_GPUS = (
    ("A10G", A10G.device_bytes(24) / GIB),
    ("A100 40GB", A100.device_bytes(40) / GIB),
    ("H100", H100_SXM.device_bytes(80) / GIB),
)


@dataclass(frozen=True)
class LinearMemory:
    """A rank's predicted peak, bf16-mixed DDP without EMA, as ``base + per_sample x micro-batch`` bytes.

    ``base`` is what does not grow with the batch: the float32 weights, gradients and AdamW state, and autocast's
    bf16 copy of the weights (2 bytes a parameter), which the backward pass keeps; ``per_sample`` is the rest of one
    trace by sdtrain.model.memory, divided by its micro-batch. tests/test_performance_report.py holds this line to a
    direct trace at another micro-batch.

    Args:
        base: bytes that do not grow with the micro-batch.
        per_sample: bytes a sample adds.
    """

    base: float
    per_sample: float

    def gib(self, micro_batch: int) -> float:
        return (self.base + self.per_sample * micro_batch) / GIB

    def largest_fitting(self, gpu_gib: float) -> int:
        """The largest micro-batch under ``gpu_gib`` less the runtime margin (sdtrain.model.memory)."""
        from sdtrain.model.memory import CUDA_RUNTIME_MARGIN

        return max(0, int((gpu_gib * GIB - CUDA_RUNTIME_MARGIN - self.base) // self.per_sample))


@cache
def linear_memory(preset: str, resolution: int, gradient_checkpointing: bool) -> LinearMemory:
    """The memory of ``preset`` at ``resolution``, traced at :data:`TRACED_MICRO_BATCH`.

    Args:
        preset: model.preset.
        resolution: image side in pixels.
        gradient_checkpointing: train.gradient_checkpointing.
    """
    from sdtrain.model.memory import predict_training_memory
    from sdtrain.model.unet import unet_config

    unet = unet_config(ModelConfig(preset=cast(Any, preset)))
    side = resolution // 8
    traced = predict_training_memory(
        unet,
        (4, side, side),
        (77, unet["cross_attention_dim"]),
        TRACED_MICRO_BATCH,
        gradient_checkpointing=gradient_checkpointing,
    )
    base = traced.parameters + traced.gradients + traced.optimizer_state + traced.parameters // 2
    return LinearMemory(base, (traced.total_peak - base) / TRACED_MICRO_BATCH)


def memory_section() -> list[str]:
    lines = [
        "## Memory of a rank (predicted)",
        "",
        "Predicted peak GiB of one rank's training step (sdtrain.model.memory: weights, gradients and AdamW state",
        "counted, activations traced from the real UNet under CUDA autocast's rules), bf16-mixed, DDP, no EMA (EMA",
        f"adds one float32 copy of the weights), eager, traced at micro-batch {TRACED_MICRO_BATCH} and linear in it;",
        "then the largest micro-batch that fits each GPU with 1 GiB left for the CUDA context, workspaces and",
        "fragmentation. A compiled step usually holds less (inductor saves fewer activations); the check job prints",
        "the peak allocated and reserved memory it measures beside this prediction.",
        "",
        "| preset | px | checkpointing | "
        + " | ".join(str(b) for b in MEMORY_MICRO_BATCHES)
        + " | "
        + " | ".join(f"fits {name}" for name, _ in FIT_GPUS)
        + " |",
        "|---|---|---|" + "---|" * (len(MEMORY_MICRO_BATCHES) + len(FIT_GPUS)),
    ]
    for preset, px, checkpointing in MEMORY_ROWS:
        memory = linear_memory(preset, px, checkpointing)
        lines.append(
            f"| {preset} | {px} | {'yes' if checkpointing else 'no'} | "
            + " | ".join(f"{memory.gib(b):.1f}" for b in MEMORY_MICRO_BATCHES)
            + " | "
            + " | ".join(str(memory.largest_fitting(gib)) for _, gib in FIT_GPUS)
            + " |"
        )
    return [*lines, ""]
