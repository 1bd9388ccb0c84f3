"""Aspect-ratio buckets (image.buckets: aspect): the shapes images are resized and cropped to, about
``image.resolution`` squared pixels each, and which one an image goes to.

Each image goes to the bucket whose aspect ratio is nearest its own (in log ratio, so 1:2 and 2:1 are as far from
1:1), is resized to cover it and center-cropped to it: it loses at most what a bucket's ratio differs from its own,
not everything outside a square. What it was and where it was cropped are recorded with its row (SDXL conditions on
both). ``image.buckets: square`` is the one bucket of side ``image.resolution``: today's resize and center crop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where an image went: its bucket, its size before resizing, and the top-left corner of the crop in the resized
    image."""

    bucket: int
    original_size: tuple[int, int]
    """(height, width) of the decoded image."""
    crop_top_left: tuple[int, int]
    """(top, left) of the crop, in pixels of the image resized to cover the bucket."""
    upscaled: bool
    """Whether covering the bucket took enlarging the image."""


def aspect_buckets(resolution: int, step: int, max_aspect: float) -> list[tuple[int, int]]:
    """The (height, width) buckets of about ``resolution``² pixels (never more, at least 90% of it), sides multiples of
    ``step``, ratios up to ``max_aspect`` either way, from the tallest to the widest; the square ``resolution`` x
    ``resolution`` is one of them, every bucket's transpose is one too, and no two share a ratio.

    The tall ones (and the square) are made, the wide ones are their transposes: made separately, a tall shape could
    lose its height to another while its transpose kept its own, and a 1:2 image be cropped more than a 2:1.

    Args:
        resolution: image.resolution, a multiple of ``step``.
        step: image.bucket_step: every side is a multiple of it (the VAE's and the UNet's downsampling).
        max_aspect: image.max_aspect (>= 1).
    """
    area = resolution * resolution
    tall = [(resolution, resolution)]
    for width in range(step, resolution + 1, step):
        height = (area // width) // step * step  # the largest multiple of step within the area
        if height / width > max_aspect + 1e-9:  # too tall: the tallest allowed, if it is still about the area
            height = int(width * max_aspect) // step * step
        if height * width >= 0.9 * area:
            tall.append((height, width))
    # Largest first: a shape is kept unless a larger one has its height or its ratio (of two 2:1 shapes, or two of
    # one height, the one nearest the area).
    kept: list[tuple[int, int]] = []
    heights: set[int] = set()
    ratios: set[tuple[int, int]] = set()
    for height, width in sorted(set(tall), key=lambda hw: (hw[0] * hw[1], hw[0]), reverse=True):
        ratio = (height // math.gcd(height, width), width // math.gcd(height, width))
        if height not in heights and ratio not in ratios:
            kept.append((height, width))
            heights.add(height)
            ratios.add(ratio)
    # The only one of ratio 1 is the square (the largest): the transposes, all wider, share no ratio with the others.
    found = set(kept) | {(width, height) for height, width in kept}
    return sorted(found, key=lambda hw: hw[0] / hw[1], reverse=True)


def nearest_bucket(height: int, width: int, buckets: list[tuple[int, int]]) -> int:
    """The bucket whose aspect ratio is nearest ``height``/``width`` in log ratio; of two as near, the one nearer
    square (then the first). Computed alike for an image and its transpose (log height - log width, which negates
    exactly), so of buckets closed under transposition, an image's transpose goes to its bucket's transpose."""
    ratio = math.log(height) - math.log(width)

    def distance(index: int) -> tuple[float, float]:
        bucket = math.log(buckets[index][0]) - math.log(buckets[index][1])
        return abs(ratio - bucket), abs(bucket)

    return min(range(len(buckets)), key=distance)


def place(height: int, width: int, buckets: list[tuple[int, int]]) -> tuple[Placement, tuple[int, int]]:
    """Where an image of ``height`` x ``width`` goes, and the (height, width) it is resized to (covering its bucket;
    the crop then takes the bucket's center)."""
    bucket = nearest_bucket(height, width, buckets)
    bucket_h, bucket_w = buckets[bucket]
    scale = max(bucket_h / height, bucket_w / width)
    resized = (max(bucket_h, round(height * scale)), max(bucket_w, round(width * scale)))
    top, left = (resized[0] - bucket_h) // 2, (resized[1] - bucket_w) // 2
    return Placement(bucket, (height, width), (top, left), scale > 1), resized
