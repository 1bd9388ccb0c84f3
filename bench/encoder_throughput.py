"""Images/s of the preprocessing job's encode stage with Stable Diffusion 2's VAE and OpenCLIP-H text encoder at full
size (their architectures, random weights: the speed is the same), at 256 and 512 px, as an encoder actor runs them
(sdtrain.model.encoders: the VAE's latent mean and the prompts of a batch, float16 on a GPU), and the CPU stage
(decode, RGB, resize, center-crop) per core. Without Ray: a GPU session's machine has none (docs/gpu.md), and
the end-to-end figure on this machine is bench/preprocess_throughput.py's.

    python bench/encoder_throughput.py                       # 256 and 512 px, batch 32, on the GPU if there is one
    python bench/encoder_throughput.py --smoke               # 64 px, batches of 1: checks that it runs
Figures: bench/results/.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # support.tiny_models


def photographs(n: int) -> list[bytes]:
    """``n`` JPEG crops (300-420 px) of scikit-learn's sample photographs: web-sized images to decode."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    crops = []
    for i in range(n):
        photo = photos[i % len(photos)]
        side = int(rng.integers(300, 420))
        top, left = (int(rng.integers(0, size - side)) for size in photo.shape[:2])
        buffer = io.BytesIO()
        Image.fromarray(photo[top : top + side, left : left + side]).save(buffer, "JPEG", quality=90)
        crops.append(buffer.getvalue())
    return crops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=5, help="timed batches per resolution (after one warm-up)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--smoke", action="store_true", help="64 px, 1 batch of 1: seconds, the figure means nothing")
    args = parser.parse_args()
    if args.smoke:
        args.resolutions, args.batch_size, args.batches = [64], 1, 1

    import numpy as np
    import torch
    from support.tiny_models import sd2_shaped_encoders

    from sdtrain.model.encoders import encode_images, encode_prompts, resolve_dtype
    from sdtrain.preprocess.images import prepare_image

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(args.dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, text_encoder, vae = sd2_shaped_encoders(str(Path(tmp) / "tokenizer"))
    text_encoder, vae = text_encoder.to(device, dtype), vae.to(device, dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}, dtype {str(dtype).removeprefix('torch.')}, torch {torch.__version__}")
    images = photographs(args.batch_size)
    prompts = [f"a crop of a photograph of a flower, number {i}, in the style of a botanical print" for i in images]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for resolution in args.resolutions:
        started = time.perf_counter()
        pixels = np.stack([prepare_image(data, [(resolution, resolution)], "upscale")[0] for data in images])
        cpu_rate = len(images) / (time.perf_counter() - started)  # one process: per core
        timings = []
        for b in range(args.batches + 1):  # the first batch warms up (kernels, allocator)
            sync()
            started = time.perf_counter()
            latents = encode_images(vae, pixels, "mean")
            embeddings = encode_prompts(tokenizer, text_encoder, prompts)
            sync()
            if b:
                timings.append(time.perf_counter() - started)
        assert latents.shape == (len(images), 4, resolution // 8, resolution // 8) and embeddings.shape[1:] == (
            77,
            1024,
        )
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        rate = len(images) / float(np.median(timings))
        print(f"{resolution} px, batch {len(images)}: {np.median(timings) * 1000:.0f} ms a batch, peak {peak:.1f} GiB")
        print(f"RATIO encode images/s at {resolution} px = {rate:.1f}")
        print(f"RATIO cpu stage images/s per core at {resolution} px = {cpu_rate:.1f}")


if __name__ == "__main__":
    main()
