"""docs/performance.md's SDXL section: what SDXL base's UNet costs at 1024 px, which micro-batch each GPU holds under
the shipped FSDP recipe (configs/sdxl-base.yaml) and without its gradient checkpointing, and what the text encoders
add when the captions are token ids. Every figure is traced from the real models on fake tensors
(sdtrain.model.op_costs, sdtrain.model.memory) or is the per-op model's (tools/performance_model.py)."""

from __future__ import annotations

from functools import cache

from sdtrain.config.schema import ModelConfig
from sdtrain.model.hardware import A100, H100_SXM, H200_SXM
from tools import performance_model as model
from tools.memory_table import GIB, LinearMemory
from tools.text_encoders import sdxl_text_encoder_configs

PRESET, RESOLUTION, RANKS = "sdxl-base", 1024, 64
LATENTS, CAPTIONS = (4, RESOLUTION // 8, RESOLUTION // 8), (77, 2048)
# The memory each reports (sdtrain.model.hardware), not its datasheet size.
FIT_SIZES = (("A100 40GB", A100, 40), ("A100 80GB", A100, 80), ("H100", H100_SXM, 80), ("H200", H200_SXM, 141))
FIT = tuple((name, gpu.device_bytes(size) / GIB) for name, gpu, size in FIT_SIZES)
RATE_GPUS = ((A100, 80), (H100_SXM, 80), (H200_SXM, 141))
# The shipped job's micro-batch: the rates' op trace, and the memory table's trace, which is then the jobs section's
# trace of sdxl_job.yaml's rank (FSDP over 64, EMA, checkpointing, embeddings) too.
MICRO_BATCH = 32


@cache
def sdxl_memory(gradient_checkpointing: bool, token_ids: bool) -> LinearMemory:
    """A rank's peak (bf16-mixed, EMA, FSDP over :data:`RANKS` ranks) as base + per sample, from one trace: the
    activations are what grows with the micro-batch (under FSDP's bf16 gathers autocast copies no weights)."""
    from sdtrain.model.memory import predict_training_memory
    from sdtrain.model.unet import unet_config

    unet = unet_config(ModelConfig(preset="sdxl-base"))
    traced = predict_training_memory(
        unet,
        LATENTS,
        CAPTIONS,
        MICRO_BATCH,
        strategy="fsdp",
        world_size=RANKS,
        ema=True,
        gradient_checkpointing=gradient_checkpointing,
        text_encoders=sdxl_text_encoder_configs() if token_ids else (),
    )
    per_sample = traced.activations_peak / MICRO_BATCH
    return LinearMemory(traced.total_peak - traced.activations_peak, per_sample)


def sdxl_section() -> list[str]:
    from sdtrain.model.flops import text_encoder_forward_flops

    ops = model.step_ops(PRESET, RESOLUTION, MICRO_BATCH, True)
    forward = sum(op.flops for op in ops.ops if not op.backward) / MICRO_BATCH
    encoders = sum(text_encoder_forward_flops(config) for config in sdxl_text_encoder_configs())
    lines = [
        "## SDXL base at 1024 px (predicted)",
        "",
        f"SDXL base 1.0's UNet ({sum(model.ops_parameters(PRESET)) / 1e9:.2f}B parameters) at 1024 px (latents"
        f" {LATENTS[1]} x {LATENTS[2]}): **{3 * forward / 1e12:.1f} TFLOP** per image for a training step by the",
        f"3x rule; its two text encoders' forward adds {encoders / 1e9:.0f} GFLOP per image where token-id captions",
        "are encoded in the step (MFU counts both). configs/sdxl-base.yaml trains it with FSDP2 (bf16 gathers) and",
        "gradient checkpointing: a rank holds a 64th of the weights, gradients, AdamW state and EMA, and whole only",
        "FSDP2's unsharded units, the activations and, for token ids, the two frozen text encoders (1.6 GB in bf16).",
        f"A rank's peak over {RANKS} ranks, bf16-mixed, with EMA (one trace at micro-batch {MICRO_BATCH}, the",
        "activations linear in it), and the largest micro-batch each GPU holds with 1 GiB left for the runtime",
        "(`train.micro_batch_size: auto` picks the largest common size under 90% of it):",
        "",
        "| checkpointing | captions | GiB at 1 | GiB a sample | "
        + " | ".join(f"fits {name}" for name, _ in FIT)
        + " |",
        "|---|---|---|---|" + "---|" * len(FIT),
    ]
    for checkpointing, token_ids in ((True, False), (True, True), (False, False)):
        memory = sdxl_memory(checkpointing, token_ids)
        lines.append(
            f"| {'yes' if checkpointing else 'no'} | {'token ids' if token_ids else 'embeddings'} | "
            f"{memory.gib(1):.1f} | {memory.per_sample / GIB:.2f} | "
            + " | ".join(str(memory.largest_fitting(gib)) for _, gib in FIT)
            + " |"
        )
    rates = []
    for gpu, memory_gib in RATE_GPUS:
        one = model.micro_batch(ops, gpu, memory_gib, model.efficiency(gpu), True)
        rate = MICRO_BATCH / (one.forward_s + one.backward_s)
        rates.append(f"{gpu.name} {rate:.1f} images/s ({rate * 3 * forward / gpu.bf16_peak:.0%} MFU)")
    lines += [
        "",
        "Under DDP every rank would hold the float32 weights, gradients, AdamW state and EMA whole, ~48 GiB before",
        "any activation: no 40 GB GPU holds a step. One GPU's compute, compiled and checkpointed, at micro-batch",
        f"{MICRO_BATCH} (no communication or optimizer step: the shipped job's rows below have them):",
        f"{'; '.join(rates)}.",
        "",
    ]
    return lines
