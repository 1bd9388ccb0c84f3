"""End-to-end images/s of the preprocessing job (entrypoints/preprocess.py's run_preprocess): JPEG crops of
scikit-learn's sample photographs in img2dataset-style parquet -> decode, RGB, resize, center-crop (Ray Data
tasks) -> VAE + CLIP text encoder (an actor pool) -> parquet latents. Tiny models built from configs (nothing
downloaded), so on a CPU machine this measures the pipeline's own cost around small encoders.

    python bench/preprocess_throughput.py                   # 512 images at 64 px, 2 CPUs
    python bench/preprocess_throughput.py --smoke           # seconds: checks that it runs
Figures: bench/results/.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # support.tiny_models


def write_input(directory: Path, images: int, files: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    per_file = images // files
    for f in range(files):
        jpgs, captions = [], []
        for i in range(per_file):
            photo = photos[i % len(photos)]
            side = int(rng.integers(96, 256))  # random crops, as varied in size as web images are
            top, left = (int(rng.integers(0, n - side)) for n in photo.shape[:2])
            buffer = io.BytesIO()
            Image.fromarray(photo[top : top + side, left : left + side]).save(buffer, "JPEG", quality=90)
            jpgs.append(buffer.getvalue())
            captions.append(f"a crop of a photograph, number {f * per_file + i}")
        pq.write_table(pa.table({"jpg": pa.array(jpgs, pa.binary()), "caption": captions}), directory / f"{f}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--files", type=int, default=4, help="input files (shards of --images / --files rows)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--smoke", action="store_true", help="32 images: seconds, the figure means nothing")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.files = 32, 2

    import ray
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.config.loader import load_config
    from sdtrain.preprocess.config import PreprocessConfig
    from sdtrain.preprocess.job import run_preprocess

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_input(root / "input", args.images, args.files)
        model = write_tiny_sd_model(str(root / "model"))
        config = load_config(
            None,
            [
                f"input.paths={root / 'input'}",
                f"input.rows_per_shard={args.images // args.files}",
                f"encode.model={model}",
                f"encode.batch_size={args.batch_size}",
                f"image.resolution={args.resolution}",
                f"output.path={root / 'latents'}",
            ],
            PreprocessConfig,
        )
        # address="local": a cluster of its own, not one a `ray start` left on this machine (ray.init's default).
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            summary = run_preprocess(config)  # timed from the shard listing to the manifest: Ray's start excluded
        finally:
            ray.shutdown()
    rows = summary.manifest["rows_written"]
    print(
        f"images {summary.manifest['inputs_read']}, rows written {rows}, resolution {args.resolution}, "
        f"cpus {args.num_cpus}, {summary.seconds:.1f} s"
    )
    print(f"RATIO images/s end to end = {rows / summary.seconds:.1f}")


if __name__ == "__main__":
    main()
