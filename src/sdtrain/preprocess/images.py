"""The CPU stage: encoded image bytes to an RGB array of its bucket's shape (sdtrain.preprocess.buckets: a square of
the output resolution, or the aspect-ratio bucket nearest the image's), with where it went, or the reason the image
is skipped. Never raises on bad input: every failure becomes a counted skip reason."""

from __future__ import annotations

import io
import warnings
from typing import Literal

import numpy as np

from sdtrain.preprocess.buckets import Placement, place

# Skip reasons, as counted in the manifest.
UNDECODABLE = "undecodable_image"
EMPTY_IMAGE = "empty_image"
TOO_SMALL = "image_too_small"
NO_CAPTION = "missing_caption"
NO_IMAGE = "missing_image"


def prepare_image(
    data: bytes | None, buckets: list[tuple[int, int]], small_images: Literal["skip", "upscale"]
) -> tuple[np.ndarray | None, Placement | str]:
    """(H x W x 3 uint8 array of its bucket's shape, where it went) or (None, skip reason).

    Args:
        data: the encoded image file (JPEG, PNG, WebP, ...).
        buckets: the (height, width) shapes an image may become (one square for image.buckets: square); the image
            goes to the one of its aspect ratio, resized to cover it and center-cropped.
        small_images: what to do when covering its bucket takes enlarging the image.
    """
    from PIL import Image, ImageOps

    if not data:
        return None, NO_IMAGE
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL warns on odd EXIF and huge images; the result decides
            opened = Image.open(io.BytesIO(data))
            opened.load()  # a truncated file fails here, not at open
            image = ImageOps.exif_transpose(opened)
    except Exception:  # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBombError)
        return None, UNDECODABLE
    if image.width == 0 or image.height == 0:
        return None, EMPTY_IMAGE
    placement, resized = place(image.height, image.width, buckets)
    if placement.upscaled and small_images == "skip":
        return None, TOO_SMALL
    return crop(to_rgb(image), resized, buckets[placement.bucket], placement.crop_top_left), placement


def to_rgb(image):
    """Any PIL mode as RGB: alpha composited on white (not dropped to black), palette and CMYK converted."""
    from PIL import Image

    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: PIL's convert("RGB") would clip at 255; scale to 8 bits instead.
        array = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if array.max() > 255 else 255.0
        image = Image.fromarray((array / peak * 255).round().astype(np.uint8), "L")
    return image.convert("RGB")


def crop(image, resized: tuple[int, int], bucket: tuple[int, int], top_left: tuple[int, int]) -> np.ndarray:
    """Resize to ``resized`` (height, width; bicubic, antialiased) and crop ``bucket`` at ``top_left``."""
    from PIL import Image

    image = image.resize((resized[1], resized[0]), Image.Resampling.BICUBIC, reducing_gap=None)
    top, left = top_left
    return np.asarray(image.crop((left, top, left + bucket[1], top + bucket[0])), dtype=np.uint8)


def clean_caption(caption: object) -> str | None:
    """The caption as a stripped string, or None when it is missing or empty."""
    if caption is None:
        return None
    if isinstance(caption, bytes):
        caption = caption.decode("utf-8", errors="replace")
    if not isinstance(caption, str):
        return None
    caption = caption.strip()
    return caption or None
