"""Shared fixtures: parquet writers for every encoding, and one small real Ray cluster per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
ENCODINGS = ("list", "fixed_size_list", "tensor")


def column(values: np.ndarray, encoding: str) -> pa.Array:
    """Rows of ``values`` (N, *shape) as one arrow column in the given encoding."""
    n = len(values)
    if encoding == "tensor":
        from ray.data.extensions import ArrowTensorArray

        return ArrowTensorArray.from_numpy(values)
    width = int(np.prod(values.shape[1:]))
    flat = pa.array(values.reshape(n, width).ravel())
    if encoding == "fixed_size_list":
        return pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), flat)


def write_latents(
    path: Path,
    rows: int = 8,
    encoding: str = "list",
    latent_shape=(4, 16, 16),
    caption_shape=(77, 32),
    dtype=np.float16,
    image_column: str = "image_latents_256",
    caption_column: str = "caption_latents",
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Write a parquet file of random latents and captions; return what was written."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((rows, *latent_shape)).astype(dtype)
    captions = rng.standard_normal((rows, *caption_shape)).astype(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows)),
            image_column: column(latents, encoding),
            caption_column: column(captions, encoding),
        }
    )
    pq.write_table(table, path)
    return latents, captions


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster this session starts and stops (2 CPUs, like the machines we test on)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()
