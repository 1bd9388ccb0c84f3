"""GPU training throughput, measured beside what sdtrain predicts: images/s, model FLOPs utilization (MFU), and peak
allocated and reserved memory of sdtrain's training step for the small and sd2-base UNets at 256 px (4x32x32
latents) and 512 px (4x64x64), bf16-mixed, eager and compiled, each beside the per-op model's images/s
(tools/performance_model.py) and the memory model's peak (sdtrain.model.memory). Every figure it prints on a GPU is a
measurement; the predictions beside them are labelled so.

The step is the Ray worker's own: ``sdtrain.train.build.fit_without_ray`` builds the module and the Lightning Trainer
(precision, the module's clipping in the fused AdamW, the non-finite skip, compile) and applies the worker's GPU
settings (sdtrain.train.device_settings) through the same functions a Ray Train worker calls, on one fixed float16
batch held in host memory, as Ray Data delivers it. Ray is not imported: this runs on a GPU machine where Ray cannot
be installed. Multi-GPU communication is not measured here (entrypoints/check.py measures it on a cluster).

Micro-batch: the shipped configs' (configs/small.yaml: 96, configs/sd2-base.yaml: 64), or, where the memory model
predicts it does not fit this GPU, the largest power-of-two fraction of it that does.

    python bench/gpu_throughput.py                                  # needs a CUDA GPU: the grid above
    python bench/gpu_throughput.py --presets sd2-base --resolutions 256 --variants compile
    python bench/gpu_throughput.py --config configs/small.yaml      # one worker's share of that config, as configured
    python bench/gpu_throughput.py --presets small --resolutions 512 --variants eager --profile  # time by kind of op
    python bench/gpu_throughput.py --smoke [--config ...]           # CPU, tiny UNet at 128 px, 2 steps (CI)

With --config, one variant, "config": the config's own options at the micro-batch and accumulation its workers run
at its most workers: the work of the check job's one-GPU phase (entrypoints/check.py), without Ray and its data.
--deadline S stops starting measurements that are not predicted to end within S seconds (bench/gpu_session.sh's
budget); --json PATH writes every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]  # benchlib, step_timer; tools
import benchlib  # noqa: E402

MOSAIC_IMG_PER_S_PER_A100_256 = 1100 / 8  # ~137: MosaicML's SD2 UNet on precomputed 256 px latents
SHIPPED_MICRO_BATCH = {"tiny": 4, "small": 96, "sd2-base": 64}  # configs/small.yaml, configs/sd2-base.yaml
VARIANTS = ("eager", "compile")  # and, asked for by name, "channels_last" and "compile+channels_last"
# Seconds a measurement is expected to take on a lent H100 or H200, compilation included (for --deadline). The
# compiled ones are a floor: the first GPU session's compile of small at 256 px outran its budget
# (bench/results/2026-11-27-h200.md).
EXPECTED_S = {
    ("eager", "small"): 25,
    ("eager", "sd2-base"): 35,
    ("compile", "small"): 240,
    ("compile", "sd2-base"): 300,
}


@dataclasses.dataclass
class Row:
    """One measurement and its predictions (None: not predicted or not measured)."""

    preset: str
    px: int
    variant: str
    batch: int
    img_per_s: float
    mfu: float
    peak_gib: float
    reserved_gib: float
    predicted_gib: float | None
    predicted_img_per_s: float | None
    profile_s: dict[str, float] | None = None  # one profiled step's seconds by kind of op (--profile)
    profile_wall_s: float | None = None
    predicted_profile_s: dict[str, float] | None = None  # the per-op model's, on the GPU's (or an H100's) figures


def main() -> None:
    args = _arguments()
    import torch

    from sdtrain.model.hardware import H100_SXM, device_gpu

    start = time.monotonic()
    if args.smoke:
        use_gpu, presets, resolutions = False, ["tiny"], [128]
        args.steps, args.warmup = 2, 1
        gpu, device_name, peak = None, "CPU (smoke: not a GPU figure)", args.peak_tflops or 1.0
        memory_gib = 80.0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: this benchmark measures GPU training throughput (use --smoke on CPU)")
        use_gpu, presets, resolutions = True, args.presets.split(","), [int(r) for r in args.resolutions.split(",")]
        device_name = torch.cuda.get_device_name()
        gpu = device_gpu(device_name)  # the workers' own table, so the bench's MFU is the progress line's
        peak = args.peak_tflops or (gpu.bf16 / 1e12 if gpu is not None and gpu.bf16 else None)
        if peak is None:
            raise SystemExit(f"unknown peak for {device_name}: pass --peak-tflops (dense bf16)")
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    variants = ["eager"] if args.smoke else args.variants.split(",")  # compiling on CPU is test_options'
    worker = WorkerShare.of(args.config, smoke=args.smoke) if args.config else None
    if worker is not None:
        variants = ["config"]
        if not args.smoke:  # the smoke keeps its tiny UNet at 128 px
            presets, resolutions = [worker.preset], [worker.resolution]
    print(f"# machine: {benchlib.machine()}; device: {device_name}, peak {peak:g} TFLOP/s bf16, {memory_gib:.1f} GiB")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    print(
        f"# {args.steps} timed steps after {args.warmup} warm-up steps, bf16-mixed, sdtrain.train.build.fit_without_ray"
    )
    print(
        f"{'preset':9} {'px':>4} {'variant':8} {'batch':>5} {'img/s':>8} {'MFU':>6} {'alloc GiB':>9} "
        f"{'reserved':>8} {'predicted GiB (memory model, with 1 GiB runtime)':>13}"
    )
    rows = []
    # Every eager measurement first (quick), then the compiled ones, which a --deadline may leave out.
    for variant, preset, px in ((v, p, r) for v in variants for p in presets for r in resolutions):
        batch = worker.micro_batch if worker else args.batch_size or fitting_batch(preset, px, memory_gib)
        expected = EXPECTED_S.get(("compile" if _compiled(variant, worker) else "eager", preset), 30)
        if args.deadline and time.monotonic() - start + expected > args.deadline:
            print(f"# {preset} {px}px {variant}: skipped, not predicted to end within --deadline {args.deadline}s")
            continue
        rows.append(_measure_row(preset, px, variant, batch, args, use_gpu, worker, peak))
        _print_row(rows[-1])
        _release()
    _predict(rows, gpu or H100_SXM, memory_gib if gpu is not None else 80.0, worker)
    _summary(rows, args)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny UNet at 128 px, 2 steps: checks that it runs")
    parser.add_argument("--presets", default="small,sd2-base")
    parser.add_argument("--resolutions", default="256,512", help="image sizes in px (latents are 1/8 of it)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="eager, compile, channels_last, compile+channels_last"
    )
    parser.add_argument("--batch-size", type=int, help="per GPU (default: the shipped micro-batch, if it fits)")
    parser.add_argument("--config", help="a training config: run what its workers run (see above)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--deadline", type=float, help="seconds: start no measurement predicted to end after it")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step: its time by kind of op beside the model's"
    )
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: the table's)")
    return parser.parse_args()


def fitting_batch(preset: str, px: int, memory_gib: float) -> int:
    """The shipped micro-batch, halved until the memory model predicts it fits ``memory_gib`` (with its 1 GiB for
    the CUDA runtime)."""
    from tools.memory_table import linear_memory

    batch = SHIPPED_MICRO_BATCH.get(preset, 32)
    while batch > 1 and linear_memory(preset, px, False).gib(batch) + 1 > memory_gib:
        batch //= 2
    return batch


class WorkerShare:
    """What one worker of a training config runs: its options and its share of the global batch at the config's
    most workers (the check job's one-GPU phase).

    Args:
        overrides: the config's options as overrides of the measurement's config.
        preset: model.preset.
        resolution: image side in pixels (from the latent column's name, image_latents_<px>).
        micro_batch: samples per forward and backward pass.
        accumulation: micro-batches per optimizer step.
    """

    def __init__(self, overrides: list[str], preset: str, resolution: int, micro_batch: int, accumulation: int):
        self.overrides, self.preset, self.resolution = overrides, preset, resolution
        self.micro_batch, self.accumulation = micro_batch, accumulation

    @classmethod
    def of(cls, path: str, smoke: bool = False) -> WorkerShare:
        """The config at ``path``; the smoke trains a micro-batch of 4 at its accumulation, eager (compiling on CPU
        takes minutes: tests/test_options.py compiles the shipped configs' options)."""
        from sdtrain.config.loader import load_config

        config = load_config(path, ["data.train=/unused"])
        layout = config.batch_layout(config.scaling.max_workers)
        if smoke:
            layout = dataclasses.replace(layout, micro_batch=4)
        train = config.train
        overrides = [
            f"train.compile={train.compile and not smoke}",
            f"train.channels_last={train.channels_last}",
            f"train.gradient_checkpointing={train.gradient_checkpointing}",
            f"train.grad_clip_norm={train.grad_clip_norm}",
            *([f"train.ema_decay={train.ema_decay}"] if train.ema_decay is not None else []),
            f"train.global_batch_size={layout.rows_per_step}",
            f"train.micro_batch_size={layout.micro_batch}",
        ]
        resolution = int(config.data.latent_column.rsplit("_", 1)[-1])
        return cls(overrides, config.model.preset, resolution, layout.micro_batch, layout.accumulation)


def _measure_row(preset, px, variant, batch, args, use_gpu, worker, peak) -> Row:
    from sdtrain.model.flops import mfu

    r = measure(preset, px, variant, batch, args.steps, args.warmup, use_gpu, worker, args.profile)
    utilization = mfu(r["img_per_s"], r["train_flops_per_img"], peak * 1e12)
    return Row(
        preset, px, variant, batch, r["img_per_s"], utilization, r["peak"] / 2**30, r["reserved"] / 2**30,
        r["predicted_mem"] / 2**30, None, r["profile_s"], r["profile_wall_s"],
    )  # fmt: skip


def measure(preset, px, variant, batch, steps, warmup, use_gpu, worker=None, profile=False) -> dict:
    """One fit of ``warmup + steps`` optimizer steps of ``batch`` samples (x the worker's accumulation), and one
    more, profiled, with ``profile``."""
    import torch
    from step_profile import StepProfile
    from step_timer import StepTimer

    from sdtrain.config.loader import load_config
    from sdtrain.driver.memory_fit import predict_run_memory
    from sdtrain.model.flops import unet_train_step_flops
    from sdtrain.model.unet import unet_config
    from sdtrain.train.build import checkpoint_meta, fit_without_ray

    config = load_config(
        None,
        [
            "data.train=/unused",
            f"model.preset={preset}",
            f"train.max_steps={warmup + steps + profile}",
            f"train.global_batch_size={batch}",
            "train.precision=bf16-mixed",
            "train.warmup_steps=0",
            f"train.compile={'compile' in variant}",
            f"train.channels_last={'channels_last' in variant}",
            f"scaling.use_gpu={use_gpu}",
            *(worker.overrides if worker else []),  # the config's options and batch, over the variant's
        ],
    )
    accumulation = worker.accumulation if worker else 1
    side = px // 8
    unet = unet_config(config.model)
    latent_shape, caption_shape = (unet["in_channels"], side, side), (77, unet["cross_attention_dim"])
    meta = checkpoint_meta(config, latent_shape, caption_shape)
    # On the host, float16, as the worker's stream hands them over: fit_without_ray pins them and Lightning
    # copies them to the GPU non_blocking each step.
    latents = torch.randn(batch, *latent_shape, dtype=torch.float16)
    if "channels_last" in variant:
        latents = latents.contiguous(memory_format=torch.channels_last)
    batch_data = {
        "latents": latents,
        "captions": torch.randn(batch, *caption_shape, dtype=torch.float16),
    }
    timer, profiler = StepTimer(warmup, steps), StepProfile(warmup + steps)
    callbacks = [timer, profiler] if profile else [timer]
    batches = [batch_data] * ((warmup + steps + profile) * accumulation)
    fit_without_ray(config, batches, meta, use_gpu=use_gpu, callbacks=callbacks)
    # One process: no DDP, gradients freed between steps: the model's world-size-1 peak.
    predicted = predict_run_memory(config, latent_shape, caption_shape, 1, "bf16-mixed", batch).with_runtime_margin
    return dict(
        img_per_s=batch * accumulation * timer.timed_steps / timer.seconds,
        train_flops_per_img=unet_train_step_flops(unet, latent_shape, caption_shape),
        peak=timer.peak_memory,
        reserved=timer.peak_reserved,
        predicted_mem=predicted,
        profile_s=profiler.seconds_by_kind or None,
        profile_wall_s=profiler.wall_s if profile else None,
    )


def _compiled(variant: str, worker: WorkerShare | None) -> bool:
    """Whether a measurement's step is compiled: its variant's, or with --config the config's."""
    return "compile" in variant or (
        variant == "config" and worker is not None and "train.compile=True" in worker.overrides
    )


def _predict(rows: list[Row], gpu, memory_gib: float, worker: WorkerShare | None) -> None:
    """The per-op model's images/s of each row on ``gpu`` (one GPU, its accumulation, no communication): a
    prediction, printed beside the measurement."""
    from tools import performance_model as model

    memory = min(gpu.memory_gib, key=lambda size: abs(size - memory_gib))
    for row in rows:
        ops = model.step_ops(row.preset, row.px, row.batch)
        compiled = _compiled(row.variant, worker)
        one = model.micro_batch(ops, gpu, memory, model.efficiency(gpu), compiled)
        accumulation = worker.accumulation if worker else 1
        optimizer = model.optimizer_seconds(model.ops_parameters(row.preset), gpu, memory, 1, accumulation)
        row.predicted_img_per_s = (
            row.batch * accumulation / (accumulation * (one.forward_s + one.backward_s) + optimizer)
        )
        if row.profile_s is not None:
            kinds = model.kind_seconds(ops, gpu, memory, model.efficiency(gpu), compiled)
            row.predicted_profile_s = {kind: t * accumulation for kind, t in kinds.items()} | {"optimizer": optimizer}
            _print_profile(row)
        print(
            f"# {row.preset} {row.px}px {row.variant}: predicted {row.predicted_img_per_s:.1f} img/s on a {gpu.name} "
            f"(per-op model, a prediction), measured {row.img_per_s:.1f}"
        )


def _print_profile(row: Row) -> None:
    """One profiled step by kind of op beside the per-op model's GPU seconds (eager, the model's host floor is
    apart: a pass whose kernels take less than its ops' host time waits on the host)."""
    assert row.profile_s is not None and row.predicted_profile_s is not None
    measured = ", ".join(
        f"{kind} {row.profile_s[kind]:.4f} s (model {row.predicted_profile_s.get(kind, 0.0):.4f})"
        for kind in row.profile_s
    )
    print(f"# profile {row.preset} {row.px}px {row.variant}: one step {row.profile_wall_s:.4f} s wall; {measured}")
    for kind, seconds in row.profile_s.items():
        if row.predicted_profile_s.get(kind):
            print(
                f"RATIO profile measured / predicted {kind} {row.preset} {row.px}px {row.variant} = "
                f"{seconds / row.predicted_profile_s[kind]:.4f}"
            )


def _print_row(row: Row) -> None:
    predicted = "-" if row.predicted_gib is None else f"{row.predicted_gib:.2f}"
    print(
        f"{row.preset:9} {row.px:4} {row.variant:8} {row.batch:5} {row.img_per_s:8.1f} {row.mfu:6.1%} "
        f"{row.peak_gib:9.2f} {row.reserved_gib:8.2f} {predicted:>13}",
        flush=True,
    )
    if row.variant == "config":
        print(f"# {row.preset} {row.px}px config: predicted peak {row.predicted_gib:.2f} GiB")


def _summary(rows: list[Row], args) -> None:
    for row in rows:
        print(f"RATIO MFU {row.preset} {row.px}px {row.variant} = {row.mfu:.6f}")  # CPU smoke: ~1e-3
        if row.predicted_img_per_s:
            print(
                f"RATIO img/s measured / predicted {row.preset} {row.px}px {row.variant} = "
                f"{row.img_per_s / row.predicted_img_per_s:.4f}"
            )
        if row.peak_gib and row.predicted_gib:  # CUDA only: a CPU has no allocator statistics
            print(
                f"RATIO peak memory / predicted {row.preset} {row.px}px {row.variant} = "
                f"{row.peak_gib / row.predicted_gib:.3f}"
            )
        if row.px in (256, 128):
            print(
                benchlib.ratio_line(
                    f"img/s per GPU {row.preset} {row.px}px {row.variant}",
                    row.img_per_s,
                    "MosaicML SD2 per A100 at 256px",
                    MOSAIC_IMG_PER_S_PER_A100_256,
                )
            )
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=2) + "\n")


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
