"""The CPU stage: encoded image bytes to an RGB array of its bucket's shape (sdtrain.preprocess.buckets: a square of
the output resolution, or the aspect-ratio bucket nearest the image's), with where it went, or the reason the image
is skipped. Never raises on bad input: every failure becomes a counted skip reason."""

from __future__ import annotations

import io
import math
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
UNPROCESSABLE = "unprocessable_image"


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
    try:
        return crop(to_rgb(image), resized, buckets[placement.bucket], placement.crop_top_left), placement
    except Exception:  # raised here (a MemoryError, a mode PIL cannot convert), it failed the image's whole shard
        return None, UNPROCESSABLE


def to_rgb(image):
    """Any PIL mode as RGB: alpha composited on white (not dropped to black), and so is a colour-key transparency (the
    ``transparency`` of an L, RGB, P or 1 image: PNG's tRNS, GIF's transparent index); palette and CMYK converted;
    16-bit and float grayscale scaled to 8 bits (:func:`_grayscale_to_8bit`)."""
    from PIL import Image

    if image.mode in HIGH_DEPTH_MODES:
        image = _grayscale_to_8bit(image)
    if image.mode in ("1", "L", "RGB", "P") and "transparency" in image.info:
        image = image.convert("RGBA")  # the colour (or palette index) named transparent becomes alpha 0
    if image.mode in ("RGBA", "LA", "PA"):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image)
    return image.convert("RGB")


HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I", "F")


def _grayscale_to_8bit(image):
    """A 16-bit, 32-bit integer or float grayscale image as L (LA with its colour-key transparency), where PIL's
    convert would clip every value at 255. Integers are on 16-bit PNG's scale, 0..65535, whatever the image's own
    range (a dark image stays dark; "I" is what older PIL opens a 16-bit PNG as; above 65535 is white). Floats
    ("F", a float TIFF) are on the unit scale, 0..1, when every value lies in it, else on PIL's scale for F,
    0..255 (what its convert("L") reads them as; outside it clipped); NaN is black."""
    from PIL import Image

    array = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        array = np.nan_to_num(array, nan=0.0)
        unit = array.size > 0 and array.min() >= 0.0 and array.max() <= 1.0
        array = array * 255.0 if unit else array
    else:
        array = array / 65535.0 * 255.0
    gray = np.clip(array, 0, 255).round().astype(np.uint8)
    key = image.info.get("transparency")
    if image.mode != "F" and isinstance(key, int):
        alpha = np.where(np.asarray(image) == key, 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([gray, alpha], axis=-1))
    return Image.fromarray(gray)


def crop(image, resized: tuple[int, int], bucket: tuple[int, int], top_left: tuple[int, int]) -> np.ndarray:
    """The ``bucket`` (height, width) at ``top_left`` of the image resized to ``resized`` (height, width; bicubic,
    antialiased), only that part resampled: resized whole first, a 6 KB 1 x 2000 strip at 512 px was 512 x 1,024,000
    pixels (2 GiB) before its crop."""
    from PIL import Image

    top, left = top_left
    height, width = bucket
    scale_y, scale_x = resized[0] / image.height, resized[1] / image.width
    x0, x1 = left / scale_x, (left + width) / scale_x
    y0, y1 = top / scale_y, (top + height) / scale_y
    cubic = Image.Resampling.BICUBIC
    # A pass at a time, in the order Pillow 13 takes for the whole image: it clips to 0..255 between its two passes,
    # so their order changes pixels (by up to 20 on an upscale, given both at once with a box).
    shrink_y, shrink_x = image.height - resized[0], image.width - resized[1]
    if shrink_y > 0 and shrink_y > 2 * shrink_x:  # vertical first
        image = image.resize((image.width, height), cubic, box=(0, y0, image.width, y1), reducing_gap=None)
        return np.asarray(image.resize((width, height), cubic, box=(x0, 0, x1, height), reducing_gap=None))
    # Horizontal first, on only the rows the vertical pass reads (bicubic's reach of 2 source rows, widened as much as
    # it downscales, and one to spare): all of a tall strip's rows at the bucket's width could be gigabytes too.
    reach = 2 * max(1.0, 1 / scale_y) + 1
    first, last = max(0, int(y0 - reach)), min(image.height, math.ceil(y1 + reach))
    image = image.crop((0, first, image.width, last))
    image = image.resize((width, last - first), cubic, box=(x0, 0, x1, last - first), reducing_gap=None)
    image = image.resize((width, height), cubic, box=(0, y0 - first, width, y1 - first), reducing_gap=None)
    return np.asarray(image, np.uint8)


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
