"""GPU training throughput: images/s, model FLOPs utilization (MFU) and peak memory of sdtrain's
training step for the tiny, small and sd2-base UNets at 256 px (4x32x32 latents) and 512 px
(4x64x64), bf16-mixed, with compile and channels_last off and on.

The step is the Ray worker's own: ``sdtrain.train.build.fit_without_ray`` builds the module and the
Lightning Trainer (precision, the module's clipping and non-finite skip, the fused AdamW, compile,
channels_last) and applies the worker's GPU settings (sdtrain.train.device_settings: TF32, cuDNN
autotuning, pinned host batches copied non_blocking, the step's input dtypes) through the same
functions a Ray Train worker calls, and trains on one fixed float16 batch held in host memory, as
Ray Data delivers it (reading and decoding are bench/ingest.py's). Ray is not imported: this runs on
a GPU machine where Ray cannot be installed. Multi-GPU scaling is not measured here.

Batch size: per (preset, size), the largest power-of-two multiple of a start size that trains
without running out of memory and leaves room (peak under half the GPU before a doubling), found
once with the eager variant and used for every variant, so the variants compare at one batch.

FLOPs: ``sdtrain.model.flops`` counts the UNet's forward pass with torch's FlopCounterMode on the meta
device; a training step is 3 forward passes. MFU = model FLOP/s / the GPU's dense bf16 peak
(--peak-tflops, or the device's entry in sdtrain.train.efficiency, the table the workers' MFU uses).

    python bench/gpu_throughput.py                                  # needs a CUDA GPU; every preset, size, variant
    python bench/gpu_throughput.py --presets sd2-base --resolutions 256 --variants compile+channels_last
    python bench/gpu_throughput.py --config configs/small.yaml      # what that config's workers run, on one GPU
    python bench/gpu_throughput.py --smoke                          # CPU, tiny UNet, 3 steps: checks that it runs (CI)

With --config, one variant, "config": the config's own options (compile, channels_last, gradient checkpointing,
EMA) at the micro-batch and accumulation its workers run at its most workers, so a step trains one worker's share
of the global batch; the peak memory is printed beside the memory model's prediction (sdtrain.model.memory).
What one process cannot show is DDP's all-reduce: entrypoints/check.py measures that on a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

MOSAIC_IMG_PER_S_PER_A100_256 = 1100 / 8  # ~137: MosaicML's SD2 UNet on precomputed 256 px latents
START_BATCH = {"tiny": 256, "small": 64, "sd2-base": 32}
MAX_DOUBLINGS = 4
VARIANTS = ("eager", "channels_last", "compile", "compile+channels_last")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny UNet at 128 px, 3 steps: checks that it runs")
    parser.add_argument("--presets", default="tiny,small,sd2-base")
    parser.add_argument("--resolutions", default="256,512", help="image sizes in px (latents are 1/8 of it)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=int, help="per GPU (default: the largest that fits, see above)")
    parser.add_argument("--config", help="a training config: run what its workers run (see above)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, autotuning)")
    parser.add_argument(
        "--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: sdtrain.train.efficiency)"
    )
    args = parser.parse_args()

    import torch

    from sdtrain.model.flops import mfu
    from sdtrain.model.hardware import device_gpu

    if args.smoke:
        use_gpu, presets, resolutions, variants = False, ["tiny"], [128], ["eager"]
        args.steps, args.warmup, args.batch_size = 3, 1, args.batch_size or 4
        peak = args.peak_tflops or 1.0  # a nominal peak: CPU figures only show that the arithmetic runs
        device_name = "CPU (smoke: not a GPU figure)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: this benchmark measures GPU training throughput (use --smoke on CPU)")
        use_gpu = True
        device_name = torch.cuda.get_device_name()
        # The workers' own table (sdtrain.train.efficiency), so the bench's MFU is the progress line's.
        known = device_gpu(device_name)
        peak = args.peak_tflops or (known.bf16 / 1e12 if known is not None else None)
        if peak is None:
            raise SystemExit(f"unknown peak for {device_name}: pass --peak-tflops (dense bf16)")
        presets = args.presets.split(",")
        resolutions = [int(r) for r in args.resolutions.split(",")]
        variants = args.variants.split(",")
    worker = WorkerShare.of(args.config, micro_batch=args.batch_size if args.smoke else None) if args.config else None
    if worker is not None:
        variants = ["config"]
        if not args.smoke:  # the smoke keeps its tiny UNet at 128 px
            presets, resolutions = [worker.preset], [worker.resolution]
        # No flags of its own: fit_without_ray applies the worker's (sdtrain.train.device_settings: TF32, cuDNN
        # autotuning, pinned batches), so this measures what the workers run.

    print(f"# machine: {benchlib.machine()}; device: {device_name}, peak {peak:g} TFLOP/s bf16")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    print(
        f"# {args.steps} timed steps after {args.warmup} warm-up steps, bf16-mixed, through "
        f"sdtrain.train.build.fit_without_ray"
    )
    print(
        f"{'preset':9} {'px':>4} {'variant':22} {'batch':>5} {'img/s':>8} {'fwd GFLOP/img':>13} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'peak mem GiB':>12}"
    )
    results = {}
    for preset in presets:
        for px in resolutions:
            batch = worker.micro_batch if worker else args.batch_size or fitting_batch(preset, px, use_gpu)
            if batch is None:
                print(f"{preset:9} {px:4} out of memory down to batch 1")
                continue
            for variant in variants:
                r = measure(preset, px, variant, batch, args.steps, args.warmup, use_gpu, worker)
                _release()
                flops = r["train_flops_per_img"]
                achieved = r["img_per_s"] * flops
                results[preset, px, variant] = r
                print(
                    f"{preset:9} {px:4} {variant:22} {batch:5} {r['img_per_s']:8.1f} {flops / 3e9:13.1f} "
                    f"{achieved / 1e12:8.2f} {achieved / (peak * 1e12):6.1%} {r['peak_mem'] / 2**30:12.1f}",
                    flush=True,
                )
                if r["predicted_mem"] is not None:
                    print(f"# {preset} {px}px config: predicted peak {r['predicted_mem'] / 2**30:.2f} GiB")
                    if r["peak_mem"]:  # CUDA only: a CPU has no allocator statistics
                        print(
                            f"RATIO peak memory / predicted {preset} {px}px = {r['peak_mem'] / r['predicted_mem']:.3f}"
                        )
    for (preset, px, variant), r in results.items():
        utilization = mfu(r["img_per_s"], r["train_flops_per_img"], peak * 1e12)
        target = (
            "(target >= 0.40: " + ("met)" if utilization >= 0.4 else "MISSED)")
            if preset in ("small", "sd2-base") and px == 256
            else ""
        )
        print(f"RATIO MFU {preset} {px}px {variant} = {utilization:.6f}  {target}".rstrip())  # CPU smoke: ~1e-3
        if px in (256, 128):
            print(
                benchlib.ratio_line(
                    f"img/s per GPU {preset} {px}px {variant}",
                    r["img_per_s"],
                    "MosaicML SD2 per A100 at 256px",
                    MOSAIC_IMG_PER_S_PER_A100_256,
                )
            )


def fitting_batch(preset: str, px: int, use_gpu: bool):
    """The largest start x 2^k batch (k <= MAX_DOUBLINGS) that trains a few eager steps with peak
    memory under half the GPU before each doubling; halves from the start on out-of-memory."""
    import torch

    batch, best = START_BATCH.get(preset, 16), None
    total = torch.cuda.get_device_properties(0).total_memory
    for _ in range(MAX_DOUBLINGS + 1):
        try:
            r = measure(preset, px, "eager", batch, steps=1, warmup=1, use_gpu=use_gpu)
        except torch.cuda.OutOfMemoryError:
            if best is not None:
                return best
            batch //= 2
            if batch < 1:
                return None
            continue
        finally:
            _release()
        best = batch
        if r["peak_mem"] > total / 2:
            return best
        batch *= 2
    return best


class WorkerShare:
    """What one worker of a training config runs: its options and its share of the global batch at the config's
    most workers.

    Args:
        overrides: the config's options as overrides of measure()'s config.
        preset: model.preset.
        resolution: image side in pixels (from the latent column's name, image_latents_<px>).
        micro_batch: samples per forward and backward pass.
        accumulation: micro-batches per optimizer step.
    """

    def __init__(self, overrides: list[str], preset: str, resolution: int, micro_batch: int, accumulation: int):
        self.overrides, self.preset, self.resolution = overrides, preset, resolution
        self.micro_batch, self.accumulation = micro_batch, accumulation

    @classmethod
    def of(cls, path: str, micro_batch: int | None = None) -> WorkerShare:
        """The config at ``path``; ``micro_batch`` replaces its micro-batch, keeping its accumulation (the smoke)."""
        from sdtrain.config.loader import load_config

        config = load_config(path, ["data.train=/unused"])
        layout = config.batch_layout(config.scaling.max_workers)
        if micro_batch is not None:
            layout = dataclasses.replace(layout, micro_batch=micro_batch)
        train = config.train
        overrides = [
            f"train.compile={train.compile}",
            f"train.channels_last={train.channels_last}",
            f"train.gradient_checkpointing={train.gradient_checkpointing}",
            *([f"train.ema_decay={train.ema_decay}"] if train.ema_decay is not None else []),
            f"train.global_batch_size={layout.rows_per_step}",
            f"train.micro_batch_size={layout.micro_batch}",
        ]
        resolution = int(config.data.latent_column.rsplit("_", 1)[-1])
        return cls(overrides, config.model.preset, resolution, layout.micro_batch, layout.accumulation)


def measure(
    preset: str,
    px: int,
    variant: str,
    batch: int,
    steps: int,
    warmup: int,
    use_gpu: bool,
    worker: WorkerShare | None = None,
) -> dict:
    import torch
    from step_timer import StepTimer

    from sdtrain.config.loader import load_config
    from sdtrain.model.flops import unet_train_step_flops
    from sdtrain.model.unet import unet_config
    from sdtrain.train.build import checkpoint_meta, fit_without_ray

    config = load_config(
        None,
        [
            "data.train=/unused",
            f"model.preset={preset}",
            f"train.max_steps={warmup + steps}",
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
    batch_data = {"latents": latents, "captions": torch.randn(batch, *caption_shape, dtype=torch.float16)}
    timer = StepTimer(warmup)
    micro_batches = [batch_data] * ((warmup + steps) * accumulation)
    fit_without_ray(config, micro_batches, meta, use_gpu=use_gpu, callbacks=[timer])
    train_flops_per_img = unet_train_step_flops(unet, latent_shape, caption_shape)
    return dict(
        img_per_s=batch * accumulation * timer.timed_steps / timer.seconds,
        train_flops_per_img=train_flops_per_img,
        peak_mem=timer.peak_memory,
        predicted_mem=_predicted_memory(config, latent_shape, caption_shape) if worker else None,
    )


def _predicted_memory(config, latent_shape, caption_shape) -> int:
    """The memory model's peak for this process's step (one rank: fit_without_ray has no DDP)."""
    from sdtrain.driver.memory_fit import predict_run_memory

    return predict_run_memory(config, latent_shape, caption_shape, 1, config.train.precision).total_peak


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
