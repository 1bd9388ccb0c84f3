"""scikit-learn's two sample photographs (china.jpg, flower.jpg: 427 x 640) cut tall, wide and square, as the input
of a preprocessing job: real images of three aspect ratios."""

from __future__ import annotations

import io
from pathlib import Path


def write_photograph_cuts(directory: Path) -> tuple[list[str], list[tuple[int, int]]]:
    """Write the six cuts as JPEG bytes (column ``jpg``) with their captions (``caption``) to
    ``directory``/p.parquet; returns the captions and each cut's (height, width), in the file's order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from sklearn.datasets import load_sample_images

    crops, captions, sizes = [], [], []
    for name, image in zip(("china", "flower"), load_sample_images().images, strict=True):
        height, width = image.shape[:2]
        cuts = {"tall": (height, height // 2), "wide": (height // 2, width), "square": (300, 300)}
        for shape, (h, w) in cuts.items():
            buffer = io.BytesIO()
            Image.fromarray(image[:h, :w]).save(buffer, "JPEG", quality=90)
            crops.append(buffer.getvalue())
            captions.append(f"a {shape} photograph of a {name}")
            sizes.append((h, w))
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"jpg": pa.array(crops, pa.binary()), "caption": captions}), directory / "p.parquet")
    return captions, sizes
