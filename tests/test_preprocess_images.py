"""The CPU stage's images (sdtrain.preprocess.images) without Ray: only the crop of the resized image is resampled
(same pixels and placement as resizing whole, then cropping), and an image that fails after decoding is a counted
skip, not its shard's failure."""

from __future__ import annotations

import io
import json
import resource
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdtrain.preprocess import images
from sdtrain.preprocess.buckets import Placement, aspect_buckets, place
from sdtrain.preprocess.config import ImageConfig, InputConfig
from sdtrain.preprocess.images import UNPROCESSABLE, prepare_image, to_rgb


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _photo(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth gradients with some noise, as a photograph's pixels vary."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def _resized_whole_then_cropped(data: bytes, buckets: list[tuple[int, int]]) -> tuple[np.ndarray, Placement]:
    """What the CPU stage did before: the whole image resized to cover its bucket, then the bucket cropped."""
    image = to_rgb(Image.open(io.BytesIO(data)))
    placement, resized = place(image.height, image.width, buckets)
    top, left = placement.crop_top_left
    height, width = buckets[placement.bucket]
    whole = image.resize((resized[1], resized[0]), Image.Resampling.BICUBIC, reducing_gap=None)
    return np.asarray(whole.crop((left, top, left + width, top + height))), placement


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize(
    "height, width, crop_top_left",
    [
        (600, 800, (0, 10)),
        (800, 600, (10, 0)),
        (300, 200, (0, 21)),  # upscaled both ways: Pillow's passes horizontal first
        (4000, 1000, (448, 0)),  # the height shrunk more than twice the width: vertical first
        (513, 1999, (0, 428)),
        (2000, 3, (127_680, 0)),  # beyond image.max_aspect, upscaled 128 times
    ],
)
def test_only_the_crop_is_resampled_with_the_pixels_and_placement_of_resizing_whole(
    height, width, crop_top_left, noise
):
    buckets = aspect_buckets(512, 64, 2.0)
    rng = np.random.default_rng(height + width)
    data = _png(rng.integers(0, 256, (height, width, 3), np.uint8) if noise else _photo(height, width, height + width))
    pixels, placed = prepare_image(data, buckets, "upscale")
    expected, placement = _resized_whole_then_cropped(data, buckets)
    assert placed == placement and placement.original_size == (height, width)  # SDXL's conditioning, as before
    assert placement.crop_top_left == crop_top_left
    assert pixels is not None and pixels.shape == expected.shape == (*buckets[placement.bucket], 3)
    # A rounding's worth (Pillow takes a box's edges as float32); on noise, one between the passes, through bicubic's
    # overshoot, can make 2.
    most = 2 if noise else 1
    differ = np.abs(pixels.astype(int) - expected)
    assert differ.max() <= most and (differ > 0).mean() < 0.005

    square, _ = prepare_image(data, [(256, 256)], "upscale")
    expected, _ = _resized_whole_then_cropped(data, [(256, 256)])
    assert square is not None
    differ = np.abs(square.astype(int) - expected)
    assert differ.max() <= most and (differ > 0).mean() < 0.005


def test_a_thin_strip_upscaled_takes_its_buckets_memory_not_the_enlarged_images():
    """Resized whole, this 1 x 2000 strip was 256 x 512,000 pixels (0.5 GiB) before its 256 x 256 crop (at 512 px,
    2 GiB; a 1 x 20000 one, 14.6 GiB)."""
    strip = (np.random.default_rng(0).random((1, 2000, 3)) * 255).astype(np.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's peak so far
    pixels, placed = prepare_image(_png(strip), [(256, 256)], "upscale")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert placed == Placement(0, (1, 2000), (0, 255_872), True)
    assert pixels is not None and pixels.shape == (256, 256, 3)
    assert (pixels == pixels[:1]).all()  # one row stretched: every row alike
    assert grown < 64 << 10, f"peak RSS grew {grown >> 10} MiB"


def _folder(root: Path, names: list[str]) -> None:
    root.mkdir()
    for i, name in enumerate(names):
        Image.fromarray(_photo(70 + i, 90, seed=i)).save(root / name)
    lines = [json.dumps({"file_name": name, "caption": f"photo {name}"}) for name in names]
    (root / "captions.jsonl").write_text("\n".join(lines))


def test_an_image_that_fails_after_decoding_is_a_counted_skip_and_the_rest_of_its_shard_is_written(
    tmp_path, monkeypatch
):
    from sdtrain.preprocess.job import _Prepare
    from sdtrain.preprocess.sources import list_shards

    names = [f"img{i}.png" for i in range(5)]
    _folder(tmp_path / "folder", names)
    real = images.to_rgb

    def failing(image):  # the third image (72 px tall) runs out of memory, as a huge one would
        if image.height == 72:
            raise MemoryError
        return real(image)

    monkeypatch.setattr(images, "to_rgb", failing)
    config = InputConfig(paths=[str(tmp_path / "folder")], format="folder")
    prepare = _Prepare(config, ImageConfig(resolution=64, small_images="upscale"), None)
    *rows, counts = prepare._shard(list_shards(config)[0])
    stats = json.loads(counts["stats"])
    assert "error" not in stats, stats["error"]
    assert stats["skipped"] == {UNPROCESSABLE: 1} and stats["inputs_read"] == 5 and stats["rows_written"] == 4
    assert [row["caption"] for row in rows] == [f"photo {name}" for name in names if name != "img2.png"]
