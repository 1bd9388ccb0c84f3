"""docs/performance.md: what the UNets cost and what the shipped jobs are predicted to do on GPUs, generated.

    python -m tools.performance_report > docs/performance.md      # in the checkout

FLOPs and parameters are counted from the real models (sdtrain.model.flops), memory traced from a real training
step on fake tensors (sdtrain.model.memory), and the step of each shipped job predicted from its config and its
nodes (tools/performance_model.py). tests/test_performance_report.py checks that the checked-in page is what
this renders.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, cast

import torch
import yaml

from sdtrain.config.loader import load_config
from sdtrain.config.schema import Config, ModelConfig
from sdtrain.model.hardware import A100, H100_SXM, NODE_TYPES
from tools.performance_model import (
    LINK_EFFICIENCY,
    NodeType,
    StepPrediction,
    compute_bound_images_per_s,
    predict_step,
)

REGENERATE = "python -m tools.performance_report > docs/performance.md"
JOB_FILES = ("job.yaml", "schedule.yaml")
SD2_CONFIG = "configs/sd2-base.yaml"
TABLE_HEADER = (
    "| job | config | nodes | GPUs | per GPU / micro | gradients | compute | all-reduce | exposed | share |"
    " images/s per GPU | memory |"
)
TABLE_RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|"
MFUS = (0.3, 0.4, 0.5)
SHIPPED_MFU = 0.4
MOSAIC_IMAGES_PER_S_PER_A100 = 137  # SD 2's UNet at 256 px, ~1,100 images/s on 8 A100s (../shared/GPU.md)
RESOLUTIONS = (256, 512)
PRESETS = ("small", "sd2-base")
MEMORY_MICRO_BATCHES = (16, 32, 64, 128, 256)
MEMORY_ROWS = (
    ("small", 256, False),
    ("small", 512, False),
    ("sd2-base", 256, False),
    ("sd2-base", 512, False),
    ("sd2-base", 512, True),
)
GIB = 2**30


@dataclass(frozen=True)
class UNetCost:
    """What one preset costs at one resolution.

    Args:
        preset: model.preset.
        resolution: image side in pixels (latents are an eighth of it).
        parameters: trainable parameters.
        train_flops: forward and backward FLOPs of one sample.
    """

    preset: str
    resolution: int
    parameters: int
    train_flops: float


@cache
def unet_cost(preset: str, resolution: int) -> UNetCost:
    """The cost of ``preset`` at ``resolution``, counted on the meta device.

    Args:
        preset: model.preset.
        resolution: image side in pixels.
    """
    from sdtrain.model.flops import unet_train_step_flops
    from sdtrain.model.unet import build_unet

    with torch.device("meta"):
        unet = build_unet(ModelConfig(preset=cast(Any, preset)))  # ModelConfig checks the name
    config = dict(unet.config)
    side = resolution // 8
    flops = unet_train_step_flops(config, (4, side, side), (77, config["cross_attention_dim"]))
    return UNetCost(preset, resolution, sum(p.numel() for p in unet.parameters()), flops)


@dataclass(frozen=True)
class ShippedJob:
    """A job file's training config on its GPU nodes.

    Args:
        job_file: the Anyscale job or schedule file.
        config_file: the config its entrypoint trains with, as the entrypoint names it.
        config_path: where that file is.
        overrides: the entrypoint's overrides that change the step (not where the run writes).
        config: the config they make.
        node: its GPU worker group's node type.
        min_nodes: the group's fewest nodes.
        max_nodes: the group's most nodes.
    """

    job_file: str
    config_file: str
    config_path: Path
    overrides: tuple[str, ...]
    config: Config
    node: NodeType
    min_nodes: int
    max_nodes: int


def read_job(path: str) -> ShippedJob:
    """The training config and GPU nodes of an Anyscale job file (job.yaml) or schedule file (its job_config).

    Args:
        path: the job or schedule file; the config it names is read relative to the file's directory.
    """
    document = yaml.safe_load(Path(path).read_text())
    job = document.get("job_config", document)
    argv = shlex.split(job["entrypoint"])
    at = argv.index("--config")
    # Overrides naming cluster-side variables ($ANYSCALE_ARTIFACT_STORAGE) change where a run writes, not its step.
    overrides = [arg for arg in argv[at + 2 :] if "$" not in arg]
    config_file = argv[at + 1]
    config_path = Path(path).parent / config_file
    config = load_config(config_path, overrides)
    (group,) = job["compute_config"]["worker_nodes"]
    if group["instance_type"] not in NODE_TYPES:
        raise ValueError(f"{path}: instance type {group['instance_type']!r} is not in the hardware table's NODE_TYPES")
    node = NODE_TYPES[group["instance_type"]]
    return ShippedJob(
        Path(path).name,
        config_file,
        config_path,
        tuple(overrides),
        config,
        node,
        group["min_nodes"],
        group["max_nodes"],
    )


def predict_job(job: ShippedJob, nodes: int) -> StepPrediction:
    """The predicted step of ``job`` on ``nodes`` of its nodes, at :data:`SHIPPED_MFU`.

    Args:
        job: the shipped job.
        nodes: nodes in the group.
    """
    config = job.config
    layout = config.batch_layout(nodes * job.node.gpus)
    cost = _job_cost(config)
    return predict_step(
        cost.train_flops,
        cost.parameters,
        job.node,
        nodes,
        config.train.global_batch_size,
        layout.micro_batch,
        SHIPPED_MFU,
        strategy=config.train.strategy,
        gradient_compression=config.train.gradient_compression,
        bucket_mb=config.train.ddp_bucket_mb,
    )


def _job_cost(config: Config) -> UNetCost:
    """The cost of a config's UNet at its data's resolution (the latent column's name says it: image_latents_256)."""
    resolution = int(config.data.latent_column.rsplit("_", 1)[-1])
    return unet_cost(config.model.preset, resolution)


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


TRACED_MICRO_BATCH = 32


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


def _memory_section() -> list[str]:
    gpus = (("A10G", 24), ("A100 40GB", 40), ("H100", 80))
    lines = [
        "## Memory of a rank",
        "",
        "Predicted peak GiB of one rank's training step (sdtrain.model.memory: weights, gradients and AdamW state",
        "counted, activations traced from the real UNet under CUDA autocast's rules), bf16-mixed, DDP, no EMA (EMA",
        f"adds one float32 copy of the weights), traced at micro-batch {TRACED_MICRO_BATCH} and linear in it; then the",
        "largest micro-batch that fits each GPU with 1 GiB left for the CUDA context, workspaces and fragmentation.",
        "",
        "| preset | px | checkpointing | "
        + " | ".join(str(b) for b in MEMORY_MICRO_BATCHES)
        + " | "
        + " | ".join(f"fits {name}" for name, _ in gpus)
        + " |",
        "|---|---|---|" + "---|" * (len(MEMORY_MICRO_BATCHES) + len(gpus)),
    ]
    for preset, px, checkpointing in MEMORY_ROWS:
        memory = linear_memory(preset, px, checkpointing)
        lines.append(
            f"| {preset} | {px} | {'yes' if checkpointing else 'no'} | "
            + " | ".join(f"{memory.gib(b):.1f}" for b in MEMORY_MICRO_BATCHES)
            + " | "
            + " | ".join(str(memory.largest_fitting(gib)) for _, gib in gpus)
            + " |"
        )
    return [*lines, ""]


def render_markdown(repo: Path) -> str:
    """The whole page, as Markdown.

    Args:
        repo: the checkout, holding :data:`JOB_FILES` and :data:`SD2_CONFIG`.
    """
    lines = [
        "# Performance: what the UNets cost and what the shipped jobs should do",
        "",
        f"<!-- Generated: do not edit by hand. Regenerate with: {REGENERATE} -->",
        "",
        "Every GPU figure on this page is a **prediction** from counted FLOPs and bytes and an assumed MFU, until",
        "`entrypoints/check.py` has measured it on your cluster. FLOPs and parameters are counted from the real",
        "models on the meta device (`sdtrain.model.flops`: matmuls, convolutions and attention; forward and",
        "backward by the 3x rule). What carries over from a CPU and what does not: docs/gpu.md.",
        "",
        "## The UNets",
        "",
        "| preset | px | parameters | GFLOP per image | "
        + " | ".join(f"H100 SXM @ {m:.0%}" for m in MFUS)
        + " | "
        + " | ".join(f"A100 @ {m:.0%}" for m in MFUS)
        + " |",
        "|---|---|---|---|" + "---|" * (2 * len(MFUS)),
    ]
    for preset in PRESETS:
        for px in RESOLUTIONS:
            cost = unet_cost(preset, px)
            rates = [
                compute_bound_images_per_s(cost.train_flops, d.bf16_peak, m) for d in (H100_SXM, A100) for m in MFUS
            ]
            lines.append(
                f"| {preset} | {px} | {cost.parameters / 1e6:.1f}M | {cost.train_flops / 1e9:,.0f} | "
                + " | ".join(f"{r:,.0f}" for r in rates)
                + " |"
            )
    sd2 = unet_cost("sd2-base", 256)
    anchor = MOSAIC_IMAGES_PER_S_PER_A100 * sd2.train_flops / A100.bf16_peak
    lines += [
        "",
        "Images/s per GPU, compute-bound (bf16, dense peak x MFU). For scale: MosaicML trained the SD 2 UNet on 256 px",
        f"latents at ~{MOSAIC_IMAGES_PER_S_PER_A100} images/s per A100 on 8 A100s, which by these FLOPs is "
        f"{anchor:.0%} MFU.",
        "",
        *_memory_section(),
        "## The shipped jobs: communication against compute",
        "",
        f"Predicted at {SHIPPED_MFU:.0%} MFU, NCCL reaching {LINK_EFFICIENCY:.0%} of each link's rate",
        "(`tools/performance_model.py`: the model and what it leaves out). DDP all-reduces the gradients once an",
        "optimizer step, during the backward pass; only what the backward pass does not hide (exposed) costs time.",
        "",
        TABLE_HEADER,
        TABLE_RULE,
    ]
    jobs = {name: read_job(str(repo / name)) for name in JOB_FILES}
    for job in jobs.values():
        lines += [_job_row(job, nodes) for nodes in sorted({job.min_nodes, job.max_nodes})]
    sd2_job = _on_nodes(repo / SD2_CONFIG, SD2_CONFIG, NODE_TYPES["p4d.24xlarge"])
    lines += [
        *(_job_row(replace(sd2_job, node=NODE_TYPES[name]), 1) for name in ("p4d.24xlarge", "p5.48xlarge")),
        "",
        f"{SD2_CONFIG} has no job file: its rows are one node of 8 GPUs, what its 8 workers are sized for.",
        "",
        "Before 2026-11-25, job.yaml trained configs/small.yaml with global batch 48 on 2-4 single-A10G g5.2xlarge",
        "nodes (up to 10 Gbit/s each), float32 gradients: the network, not the GPUs, set the pace:",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *(_job_row(_before(jobs["job.yaml"]), nodes) for nodes in (2, 4)),
    ]
    return "\n".join(lines) + "\n"


def _on_nodes(config_path: Path, config_file: str, node: NodeType) -> ShippedJob:
    """A config with no job file on one node of ``node``."""
    config = load_config(config_path)
    nodes = config.scaling.max_workers // node.gpus
    return ShippedJob("-", config_file, config_path, (), config, node, nodes, nodes)


def _before(job: ShippedJob) -> ShippedJob:
    """job.yaml as it shipped before the communication model chose its nodes and batch."""
    overrides = [
        "train.global_batch_size=48",
        "train.micro_batch_size=null",
        "train.gradient_compression=none",
        "scaling.num_workers=[2,4]",
    ]
    config = load_config(job.config_path, [*job.overrides, *overrides])
    return replace(job, config=config, node=NODE_TYPES["g5.2xlarge"], min_nodes=2, max_nodes=4)


def _job_row(job: ShippedJob, nodes: int) -> str:
    step = predict_job(job, nodes)
    layout = job.config.batch_layout(nodes * job.node.gpus)
    return (
        f"| {job.job_file} | {job.config_file} | {nodes} x {job.node.name} | {nodes * job.node.gpus} | "
        f"{step.samples_per_rank} / {layout.micro_batch} | {step.gradient_bytes / 1e9:.2f} GB | "
        f"{step.compute_s * 1e3:.0f} ms | {step.communication_s * 1e3:.0f} ms | "
        f"{step.exposed_communication_s * 1e3:.0f} ms | {step.communication_share:.0%} | "
        f"{step.images_per_s_per_gpu:.0f} | {_job_memory(job, layout.micro_batch)} |"
    )


def _job_memory(job: ShippedJob, micro_batch: int) -> str:
    """The predicted peak of a job's rank against its GPU's memory (traced without EMA: say so where it has one)."""
    config = job.config
    memory = linear_memory(config.model.preset, _job_cost(config).resolution, config.train.gradient_checkpointing)
    ema = "+ EMA " if config.train.ema_decay is not None else ""
    return f"{memory.gib(micro_batch):.1f} {ema}of {job.node.gpu_memory_gib:.0f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path("."), help="the checkout (default: here)")
    print(render_markdown(parser.parse_args().repo), end="")


if __name__ == "__main__":
    main()
