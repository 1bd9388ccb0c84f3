"""docs/performance.md: what the UNets cost and what the shipped jobs are predicted to do on GPUs, generated.

    python -m tools.performance_report > docs/performance.md      # in the checkout

Every op of the real models is counted on fake tensors (sdtrain.model.op_costs) and timed by the per-op model
(tools/performance_model.py, calibrated on MosaicML's published figure and a GPU session), memory traced from a real
training step on fake tensors (sdtrain.model.memory), and the step of each shipped job predicted from its config and
its nodes. tests/test_performance_report.py checks that the checked-in page is what this renders.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from sdtrain.config.loader import load_config
from sdtrain.config.schema import Config
from sdtrain.model.hardware import A10G, A100, H100_SXM, NODE_TYPES, Gpu, NodeType
from tools import communication_model as communication
from tools import performance_model as model
from tools.calibration_report import calibration_section
from tools.communication_model import LINK_EFFICIENCY, StepPrediction
from tools.memory_table import linear_memory, memory_section
from tools.sdxl_report import sdxl_section

REGENERATE = "python -m tools.performance_report > docs/performance.md"
JOB_FILES = ("job.yaml", "schedule.yaml", "sdxl_job.yaml")
SD2_CONFIG = "configs/sd2-base.yaml"
RESOLUTIONS = (256, 512)
PRESETS = ("small", "sd2-base")
MICRO_BATCHES = (32, 64)
GPUS = ((A10G, 24), (A100, 40), (H100_SXM, 80))
CHOICES = ((384, 32), (768, 64), (1152, 96))  # job.yaml's global batch and micro-batch candidates
TABLE_HEADER = (
    "| job | config | nodes | GPUs | per GPU / micro | compiled | gradients sent | buckets | compute | all-reduce |"
    " window | exposed | share | images/s per GPU | memory |"
)
TABLE_RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"


def images_per_s(preset: str, resolution: int, micro_batch: int, gpu: Gpu, memory_gib: float, compiled: bool) -> float:
    """One GPU training ``micro_batch`` samples an optimizer step, predicted (no communication)."""
    ops = model.step_ops(preset, resolution, micro_batch)
    one = model.micro_batch(ops, gpu, memory_gib, model.efficiency(gpu), compiled)
    optimizer = model.optimizer_seconds(model.ops_parameters(preset), gpu, memory_gib, 1)
    return micro_batch / (one.forward_s + one.backward_s + optimizer)


def train_flops(preset: str, resolution: int) -> float:
    """Model FLOPs of one image's training step by the MFU convention (3x the forward: sdtrain.model.flops)."""
    forward = sum(op.flops for op in model.step_ops(preset, resolution, 32).ops if not op.backward)
    return 3 * forward / 32


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
    name, nodes = Path(path).name, (group["min_nodes"], group["max_nodes"])
    return ShippedJob(name, config_file, config_path, tuple(overrides), config, node, *nodes)


def resolution_of(config: Config) -> int:
    """The image side a config trains at (the latent column's name says it: image_latents_256)."""
    return int(config.data.latent_column.rsplit("_", 1)[-1])


def predict_job(job: ShippedJob, nodes: int) -> StepPrediction:
    """The predicted step of ``job`` on ``nodes`` of its nodes, compiled or not as its config says."""
    config, node = job.config, job.node
    train, world = config.train, nodes * job.node.gpus
    layout = config.batch_layout(world)
    preset = config.model.preset
    ops = model.step_ops(preset, resolution_of(config), layout.micro_batch, train.gradient_checkpointing)
    one = model.micro_batch(ops, node.gpu, node.gpu_memory_gib, model.efficiency(node.gpu), train.compile)
    parameters = model.ops_parameters(preset)
    optimizer = model.optimizer_seconds(
        parameters,
        node.gpu,
        node.gpu_memory_gib,
        world,
        layout.accumulation,
        ema=train.ema_decay is not None,
        gradient_compression=train.gradient_compression,
        strategy=train.strategy,
    )
    return communication.predict_step(
        one,
        optimizer,
        parameters,
        node,
        nodes,
        train.global_batch_size,
        layout.micro_batch,
        strategy=train.strategy,
        gradient_compression=train.gradient_compression,
        bucket_mb=train.ddp_bucket_mb,
        fsdp_units=model.fsdp_unit_parameters(preset) if train.strategy == "fsdp" else None,
    )


def _model_section() -> list[str]:
    lines = [
        "## The per-op model",
        "",
        "Each op of a training micro-batch (forward, loss, backward of the real UNet under CUDA's bf16 autocast",
        "rules, counted on fake tensors: `sdtrain.model.op_costs`) takes the longer of its FLOPs at a share of the",
        "GPU's dense bf16 peak and its bytes at a share of the datasheet memory bandwidth (`sdtrain.model.hardware`);",
        "memory-bound ops (casts, GroupNorm, LayerNorm, SiLU, GELU, adds, copies) their bytes, each its own kernel",
        "(eager) or, compiled, only the bytes that cross between fused code and the matmul, convolution and attention",
        "kernels (an assumption: inductor fuses every elementwise op and norm into its neighbours). Once an optimizer",
        "step, the fused AdamW (with the clipping folded in), the gradient norm and DDP's copies pass over the float32",
        "parameters. An eager pass takes at least the host's time to dispatch its ops. The model and what it leaves",
        "out: `tools/performance_model.py`.",
        "",
        "Calibrated on MosaicML's published figure and on a GPU session's eager steps: the next section.",
        "",
        "| preset | px | parameters | GFLOP per image (3x forward) | counted TFLOP per image | GB moved per image,"
        " eager | compiled | predicted H100 eager time: matmul | conv | attention | memory-bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        for px in RESOLUTIONS:
            ops = model.step_ops(preset, px, 32)
            per = 32
            totals = {kind: ops.totals(kind) for kind in ("matmul", "conv", "attention", "memory")}
            counted = sum(flops for flops, _, _ in totals.values())
            eager_bytes = sum(nbytes for _, nbytes, _ in totals.values())
            compiled_bytes = eager_bytes - totals["memory"][1] + sum(ops.fused_memory_bytes)
            shares_by_kind = _time_shares(ops)
            lines.append(
                f"| {preset} | {px} | {sum(model.ops_parameters(preset)) / 1e6:.1f}M | "
                f"{train_flops(preset, px) / 1e9:,.0f} | {counted / per / 1e12:.3f} | {eager_bytes / per / 1e9:.2f} | "
                f"{compiled_bytes / per / 1e9:.2f} | "
                + " | ".join(f"{shares_by_kind[kind]:.0%}" for kind in ("matmul", "conv", "attention", "memory"))
                + " |"
            )
    lines += [
        "",
        "Per image at micro-batch 32. Counted FLOPs are every matmul, convolution and attention op of the forward and",
        "backward pass, which the 3x rule of MFU approximates; the time shares are of an eager micro-batch on an H100",
        "SXM: what compile can shrink is the memory-bound share.",
        "",
    ]
    return lines


def _time_shares(ops) -> dict[str, float]:
    """Shares of an eager micro-batch's predicted GPU time on an H100 SXM, by kind of op."""
    times = model.kind_seconds(ops, H100_SXM, 80, model.efficiency(H100_SXM), compiled=False)
    total = sum(times.values())
    return {kind: t / total for kind, t in times.items()}


def _throughput_section() -> list[str]:
    lines = [
        "## Images/s per GPU (predicted)",
        "",
        "Predicted images/s of one GPU training one micro-batch an optimizer step (no communication: the jobs'",
        "below), eager and compiled, with MFU (model FLOPs by the 3x rule over the dense bf16 peak) on the H100.",
        "",
        "| preset | px | micro-batch | "
        + " | ".join(f"{gpu.name} {m}GB eager | compiled" for gpu, m in GPUS)
        + " | H100 MFU eager | compiled |",
        "|---|---|---|" + "---|---|" * len(GPUS) + "---|---|",
    ]
    for preset in PRESETS:
        for px in RESOLUTIONS:
            for micro in MICRO_BATCHES:
                rates = [images_per_s(preset, px, micro, gpu, m, c) for gpu, m in GPUS for c in (False, True)]
                mfus = [rate * train_flops(preset, px) / H100_SXM.bf16_peak for rate in rates[-2:]]
                lines.append(
                    f"| {preset} | {px} | {micro} | "
                    + " | ".join(f"{r:,.0f}" for r in rates)
                    + " | "
                    + " | ".join(f"{m:.0%}" for m in mfus)
                    + " |"
                )
    anchor = model.ANCHOR
    lines += [
        f"| MosaicML, measured | {anchor.resolution} | - | | | {anchor.images_per_s:.0f} (the calibration) | | | | | |",
        "",
        "Every figure above is a prediction until a GPU run measures it. Eager, a small micro-batch of either UNet",
        "is bound by the host's dispatch of its ~3,300 ops, not by the GPU (the calibration section): on an H100 the",
        "micro-batch sets eager images/s almost in proportion below 64. The H200 session measured sd2-base at",
        "362 (256 px) and 115 (512 px) images/s eager at 64; an independent roofline of the same kind (fake CUDA",
        "tensors, its own efficiencies per kind of op) found ~370 eager and ~500 compiled on an H100 at 256 px, ~110",
        "and ~155 at 512 px. No compiled step has been measured yet.",
        "",
    ]
    return lines


def _jobs_section(repo: Path) -> list[str]:
    jobs = {name: read_job(str(repo / name)) for name in JOB_FILES}
    lines = [
        "## The shipped jobs: communication against compute (predicted)",
        "",
        f"Predicted by the per-op model, NCCL reaching {LINK_EFFICIENCY:.0%} of each link's rate. DDP all-reduces in",
        "the backward pass of an optimizer step's **last** micro-batch only (the others run under `no_sync`), a",
        "bucket as soon as its gradients are ready (buckets of `train.ddp_bucket_mb` MiB of float32 gradients, sent",
        "at half that in bf16): the window is that one backward pass, and what ends after it is exposed",
        "(`tools/communication_model.py`).",
        "`tests/test_ddp_settings.py` holds the model to what 2 gloo ranks of the real module send.",
        "",
        TABLE_HEADER,
        TABLE_RULE,
    ]
    for job in jobs.values():
        for compiled in (True, False):
            variant = _with(job, f"train.compile={compiled}")
            lines += [_job_row(variant, nodes) for nodes in sorted({job.min_nodes, job.max_nodes})]
    job = jobs["job.yaml"]
    window = predict_job(_with(job, "train.global_batch_size=384", "train.micro_batch_size=32"), 2).window_s
    sd2 = load_config(repo / SD2_CONFIG)
    for name in ("p4d.24xlarge", "p5.48xlarge"):
        node = NODE_TYPES[name]
        lines.append(_job_row(ShippedJob("-", SD2_CONFIG, repo / SD2_CONFIG, (), sd2, node, 1, 1), 1))
    lines += [
        "",
        f"{SD2_CONFIG} has no job file: its rows are one node of 8 GPUs, what its 8 workers are sized for.",
        "Eager is one key away: `train.compile=false` on the command line.",
        "",
        "### Choosing job.yaml's batch (predicted)",
        "",
        "The micro-batch sets the window: on 25 Gbit/s nodes the all-reduce of 446 MB (bf16) takes 0.2-0.3 s, and",
        f"one micro-batch of 32 has ~{window:.2f} s of backward pass to hide it in. Compiled, on job.yaml's nodes,",
        "global batches that divide over 2, 3 and 4 workers:",
        "",
        TABLE_HEADER,
        TABLE_RULE,
    ]
    for batch, micro in CHOICES:
        choice = _with(job, f"train.global_batch_size={batch}", f"train.micro_batch_size={micro}")
        lines += [_job_row(choice, nodes) for nodes in (2, 3, 4)]
    waits = [predict_job(choice, nodes).communication_share for nodes in (2, 3, 4)]
    lines += [
        "",
        f"96 a micro-batch (~18 GiB of the A10G's {A10G.device_bytes(24) / 2**30:.1f} by the memory model) leaves"
        f" {min(waits):.0%}-{max(waits):.0%} of a step waiting; the global",
        "batch is 1152 for it to divide over every world size. Before 2026-11-27 job.yaml trained 384 a step in",
        "micro-batches of 32, eager; before 2026-11-25, 48 a step in micro-batches of 4 on 2-4 g5.2xlarge nodes (up",
        "to 10 Gbit/s), float32 gradients:",
        "",
        TABLE_HEADER,
        TABLE_RULE,
        *(_job_row(_before(job), nodes) for nodes in (2, 4)),
    ]
    return [*lines, ""]


def _with(job: ShippedJob, *overrides: str) -> ShippedJob:
    """``job`` with ``overrides`` after its own."""
    return replace(job, config=load_config(job.config_path, [*job.overrides, *overrides]))


def _before(job: ShippedJob) -> ShippedJob:
    """job.yaml as it shipped before the communication model chose its nodes and batch."""
    before = _with(
        job,
        "train.global_batch_size=48",
        "train.micro_batch_size=4",
        "train.gradient_compression=none",
        "train.compile=false",
    )
    return replace(before, node=NODE_TYPES["g5.2xlarge"], min_nodes=2, max_nodes=4)


def _job_row(job: ShippedJob, nodes: int) -> str:
    step = predict_job(job, nodes)
    layout = job.config.batch_layout(nodes * job.node.gpus)
    return (
        f"| {job.job_file} | {job.config_file} | {nodes} x {job.node.name} | {nodes * job.node.gpus} | "
        f"{step.samples_per_rank} / {layout.micro_batch} | {'yes' if job.config.train.compile else 'no'} | "
        f"{step.gradient_bytes / 1e9:.2f} GB | {step.buckets} | {step.compute_s * 1e3:,.0f} ms | "
        f"{step.communication_s * 1e3:.0f} ms | {step.window_s * 1e3:.0f} ms | "
        f"{step.exposed_communication_s * 1e3:.0f} ms | {step.communication_share:.1%} | "
        f"{step.images_per_s_per_gpu:.0f} | {_job_memory(job, layout.micro_batch, nodes * job.node.gpus)} |"
    )


def _job_memory(job: ShippedJob, micro_batch: int, world: int) -> str:
    """The predicted peak of a job's rank against the memory its GPU reports (not the size it is sold as): DDP's
    from the memory table's line (traced without EMA: say so where it has one); FSDP's traced for its world, EMA
    included."""
    config = job.config
    if config.train.strategy == "fsdp":
        from sdtrain.driver.memory_fit import predict_run_memory
        from sdtrain.model.unet import unet_config

        side = resolution_of(config) // 8
        captions = (77, int(unet_config(config.model)["cross_attention_dim"]))
        traced = predict_run_memory(config, (4, side, side), captions, world, "bf16-mixed", micro_batch)
        return f"{traced.total_peak / 2**30:.1f} of {job.node.gpu_device_bytes / 2**30:.1f} GiB"
    memory = linear_memory(config.model.preset, resolution_of(config), config.train.gradient_checkpointing)
    ema = "+ EMA " if config.train.ema_decay is not None else ""
    return f"{memory.gib(micro_batch):.1f} {ema}of {job.node.gpu_device_bytes / 2**30:.1f} GiB"


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
        "Every GPU figure on this page is a **prediction** from ops counted in the real models and a per-op model",
        "calibrated on one published figure and one GPU session's eager steps, until `entrypoints/check.py` has",
        "measured it on your cluster or `bench/gpu_session.sh` on a GPU (then in `bench/results/`). What carries",
        "over from a CPU and what does not: docs/gpu.md.",
        "",
        *_model_section(),
        *calibration_section(),
        *_throughput_section(),
        *memory_section(),
        *sdxl_section(),
        *_jobs_section(repo),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path("."), help="the checkout (default: here)")
    print(render_markdown(parser.parse_args().repo), end="")


if __name__ == "__main__":
    main()
