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
    python bench/gpu_throughput.py --smoke                          # CPU, tiny UNet, 3 steps: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, autotuning)")
    parser.add_argument(
        "--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: sdtrain.train.efficiency)"
    )
    args = parser.parse_args()

    import torch

    from sdtrain.model.flops import mfu
    from sdtrain.train.efficiency import device_peak

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
        known = device_peak(device_name)
        peak = args.peak_tflops or (known.bf16 / 1e12 if known is not None else None)
        if peak is None:
            raise SystemExit(f"unknown peak for {device_name}: pass --peak-tflops (dense bf16)")
        presets = args.presets.split(",")
        resolutions = [int(r) for r in args.resolutions.split(",")]
        variants = args.variants.split(",")
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
            batch = args.batch_size or fitting_batch(preset, px, use_gpu)
            if batch is None:
                print(f"{preset:9} {px:4} out of memory down to batch 1")
                continue
            for variant in variants:
                r = measure(preset, px, variant, batch, args.steps, args.warmup, use_gpu)
                _release()
                flops = r["train_flops_per_img"]
                achieved = r["img_per_s"] * flops
                results[preset, px, variant] = r
                print(
                    f"{preset:9} {px:4} {variant:22} {batch:5} {r['img_per_s']:8.1f} {flops / 3e9:13.1f} "
                    f"{achieved / 1e12:8.2f} {achieved / (peak * 1e12):6.1%} {r['peak_mem'] / 2**30:12.1f}",
                    flush=True,
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


def measure(preset: str, px: int, variant: str, batch: int, steps: int, warmup: int, use_gpu: bool) -> dict:
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
        ],
    )
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
    fit_without_ray(config, [batch_data] * (warmup + steps), meta, use_gpu=use_gpu, callbacks=[timer])
    train_flops_per_img = unet_train_step_flops(unet, latent_shape, caption_shape)
    return dict(
        img_per_s=batch * timer.timed_steps / timer.seconds,
        train_flops_per_img=train_flops_per_img,
        peak_mem=timer.peak_memory,
    )


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
