"""GPU throughput benchmark (issue #7, part 4): images/s per GPU and model FLOPs utilization (MFU)
of sdtrain's training step, for the small and sd2-base UNets at 256 px (4x32x32 latents) and
512 px (4x64x64), bf16 autocast (what ``train.precision: auto`` picks on GPUs), eager and with
torch.compile and/or channels_last.

The step is the package's own: ``DiffusionModule.training_step`` (seeded noise and timesteps,
DDPM ``add_noise``, the UNet, MSE loss) under bf16 autocast, backward, the module's non-finite
gradient check (``on_before_optimizer_step``), gradient clipping at 1.0 and the module's fused
AdamW, on one GPU with a fixed in-memory batch of float16 latents and 77x1024 captions (the
data path is measured by bench/ingest.py; multi-GPU DDP scaling is not measured here).

FLOPs: ``sdtrain.flops`` counts the UNet forward pass from its structure (convolutions, linear
layers, attention matmuls; multiply-add = 2); a training step is 3 forward passes. MFU = model
FLOP/s / the GPU's peak dense bf16 FLOP/s (A100 312 TFLOP/s, H100 SXM 989; --peak-tflops).

Baseline: MosaicML's published SD 2 UNet training throughput with precomputed latents, about
1100 img/s on 8 A100s at 256 px, i.e. ~137 img/s per A100.

    python bench/gpu_throughput.py                     # needs a CUDA GPU
    python bench/gpu_throughput.py --smoke             # CPU, tiny UNet, a few steps: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

MOSAIC_IMG_PER_S_PER_A100_256 = 1100 / 8  # ~137
KNOWN_PEAKS_TFLOPS = {"A100": 312.0, "H100": 989.0, "A10G": 125.0, "L4": 121.0, "L40S": 362.0}
DEFAULT_BATCH = {("small", 256): 128, ("small", 512): 32, ("sd2-base", 256): 64, ("sd2-base", 512): 16}
VARIANTS = ("eager", "channels_last", "compile", "compile+channels_last")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny UNet at 128 px, 3 steps: checks that it runs")
    parser.add_argument("--presets", default="small,sd2-base")
    parser.add_argument("--resolutions", default="256,512", help="image sizes in px (latents are 1/8 of it)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=int, help="per GPU (default: by preset and size, halved on out-of-memory)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s (default: known A100/H100/...)")
    args = parser.parse_args()

    import torch

    if args.smoke:
        device = torch.device("cpu")
        presets, resolutions, variants = ["tiny"], [128], ["eager"]
        args.steps, args.warmup = 3, 1
        peak = args.peak_tflops or 1.0  # a nominal peak: CPU figures only show that the arithmetic runs
        gpu_name = "CPU (smoke: not a GPU figure)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: this benchmark measures GPU training throughput (use --smoke on CPU)")
        device = torch.device("cuda")
        gpu_name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or next((v for k, v in KNOWN_PEAKS_TFLOPS.items() if k in gpu_name), None)
        if peak is None:
            raise SystemExit(f"unknown peak for {gpu_name}: pass --peak-tflops (dense bf16)")
        presets = args.presets.split(",")
        resolutions = [int(r) for r in args.resolutions.split(",")]
        variants = args.variants.split(",")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True

    print(f"# machine: {benchlib.machine()}; device: {gpu_name}, peak {peak:g} TFLOP/s bf16")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    print(f"# {args.steps} timed steps after {args.warmup} warm-up steps; FLOPs: sdtrain.flops, train step = 3 x forward")
    print(f"{'preset':9} {'px':>4} {'variant':22} {'batch':>5} {'img/s':>8} {'fwd GFLOP/img':>13} {'TFLOP/s':>8} {'MFU':>6} {'peak mem GiB':>12}")
    results = {}
    for preset in presets:
        for px in resolutions:
            for variant in variants:
                batch = args.batch_size or DEFAULT_BATCH.get((preset, px), 8)
                r = measure_with_backoff(preset, px, variant, batch, args.steps, args.warmup, device)
                if r is None:
                    print(f"{preset:9} {px:4} {variant:22} out of memory down to batch 1")
                    continue
                flops = r["train_flops_per_img"]
                achieved = r["img_per_s"] * flops
                results[preset, px, variant] = r
                print(f"{preset:9} {px:4} {variant:22} {r['batch']:5} {r['img_per_s']:8.1f} {flops / 3e9:13.1f} "
                      f"{achieved / 1e12:8.2f} {achieved / (peak * 1e12):6.1%} {r['peak_mem'] / 2**30:12.1f}", flush=True)
    for (preset, px, variant), r in results.items():
        mfu = r["img_per_s"] * r["train_flops_per_img"] / (peak * 1e12)
        print(f"RATIO MFU {preset} {px}px {variant} = {mfu:.3f}")
        if px in (256, 128):
            print(benchlib.ratio_line(f"img/s per GPU {preset} {px}px {variant}", r["img_per_s"],
                                      "MosaicML SD2 per A100 at 256px", MOSAIC_IMG_PER_S_PER_A100_256,
                                      "> 1 (sd2-base, 256px)" if preset == "sd2-base" else None,
                                      r["img_per_s"] > MOSAIC_IMG_PER_S_PER_A100_256 if preset == "sd2-base" else None))


def measure_with_backoff(preset, px, variant, batch, steps, warmup, device):
    import torch

    while batch >= 1:
        try:
            return measure(preset, px, variant, batch, steps, warmup, device)
        except torch.cuda.OutOfMemoryError:
            print(f"  {preset} {px}px {variant}: out of memory at batch {batch}, halving", flush=True)
            batch //= 2
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return None


def measure(preset: str, px: int, variant: str, batch: int, steps: int, warmup: int, device) -> dict:
    import torch

    from sdtrain.config import ModelConfig, TrainConfig
    from sdtrain.flops import unet_forward_flops
    from sdtrain.model import build_unet, noise_scheduler_config, unet_config
    from sdtrain.module import DiffusionModule

    model_config = ModelConfig(preset=preset)
    config = unet_config(model_config)
    side = px // 8
    latent_shape, caption_shape = (config["in_channels"], side, side), (77, config["cross_attention_dim"])
    train_flops_per_img = unet_forward_flops(config, latent_shape, caption_shape).train_step

    torch.manual_seed(0)
    module = DiffusionModule(
        build_unet(model_config), noise_scheduler_config(model_config),
        TrainConfig(lr=1e-4, warmup_steps=0), checkpoint_meta={},
    ).to(device)
    module.train()
    optimizer = module.configure_optimizers()["optimizer"]  # the module's own fused AdamW
    channels_last = "channels_last" in variant
    if channels_last:
        module.unet.to(memory_format=torch.channels_last)
    if variant.startswith("compile"):
        module.unet = torch.compile(module.unet)
    latents = torch.randn(batch, *latent_shape, device=device, dtype=torch.float16)
    if channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    captions = torch.randn(batch, *caption_shape, device=device, dtype=torch.float16)
    batch_data = {"latents": latents, "captions": captions}
    parameters = list(module.unet.parameters())

    def step(index: int) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module.training_step(batch_data, index)
        loss.backward()
        module.on_before_optimizer_step(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    sync()
    seconds = time.perf_counter() - start
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del module, optimizer, batch_data, latents, captions, parameters
    return dict(batch=batch, img_per_s=batch * steps / seconds, train_flops_per_img=train_flops_per_img, peak_mem=peak_mem)


if __name__ == "__main__":
    main()
