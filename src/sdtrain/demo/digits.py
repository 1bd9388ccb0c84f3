"""The demo dataset: class-conditional pseudo-latents made from handwritten digits.

assets/digits.csv.gz is the UCI optical handwritten digits test set (1797 8x8 images, 64
pixel values 0..16 and the digit, a row), as bundled with scikit-learn. Each image is
upsampled to 16x16 and spread over 4 latent channels; each digit gets one fixed caption
embedding (``class_captions``). A tiny UNet learns it on two CPU cores in minutes, and a sample
conditioned on a digit's caption should look like that digit.

Rows are stored the way the Anyscale notebook's files store real latents: flat float16
lists in ``image_latents_256`` and ``caption_latents``, plus ``id`` and ``label`` columns.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.data.footer import read_schema
from sdtrain.data.metadata import LATENT_CLASSIFIER
from sdtrain.errors import DataError

NUM_CLASSES = 10
CAPTION_LENGTH = 77
LATENT_SIZE = 16
VAL_ROWS = 197
TRAIN_FILES = 4
DIGIT_WEIGHT = 0.85
"""The digit's share of each caption token (the rest is the token's position, the same for every digit)."""
LAYOUT = "3"
"""The demo files' layout (their parquet metadata sdtrain.demo_layout); files without it are an older sdtrain's."""
LAYOUT_KEY = b"sdtrain.demo_layout"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) in 0..16, labels (1797,))."""
    raw = resources.files("sdtrain").joinpath("assets/digits.csv.gz").read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.int64)
    return table[:, :64].reshape(-1, 8, 8), table[:, 64]


def pseudo_latents(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) digits -> (N, 4, 16, 16) float32 with roughly zero mean and unit variance."""
    channels = _channels(images)
    return (channels - channels.mean()) / channels.std()


def digits_from_latents(latents: np.ndarray) -> np.ndarray:
    """The inverse of ``pseudo_latents`` for the demo dataset: (N, 4, 16, 16) -> (N, 16, 16) digit
    images in 0..16 (ink high), averaging the four channels' copies of the image. Used to preview
    samples of a model trained on the demo, which has no VAE to decode with."""
    mean, std = _demo_normalization()
    c = np.asarray(latents, dtype=np.float32) * std + mean
    up = (c[:, 0] + c[:, 1, :, ::-1] + c[:, 2].transpose(0, 2, 1) - c[:, 3]) / 4
    return (up + 1.0) * 8.0


def classify_digits(images: np.ndarray) -> np.ndarray:
    """(N, 16, 16) digit images (ink high, 0..16, as ``digits_from_latents`` returns) -> (N,) predicted digit, or -1
    for a blank image (no variation, so no shape).

    Each image is clipped to 0..16 (what the preview shows) and averaged over its 2x2 blocks back to the 8x8 of the
    real digits, then read by an RBF support vector classifier fitted on the demo's training digits. It reads 0.95 of
    the real validation digits as their digit (``real_digits_agreement``): the ceiling a model's samples can reach.
    """
    x = np.clip(np.asarray(images, dtype=np.float64), 0, 16)
    small = x.reshape(len(x), 8, 2, 8, 2).mean(axis=(2, 4)).reshape(len(x), 64)
    predicted = _digit_classifier().predict(small) if len(x) else np.zeros(0, dtype=np.int64)
    return np.where(small.std(axis=1) > 1e-6, predicted, -1)


@functools.lru_cache(maxsize=1)
def _digit_classifier():
    """scikit-learn's digits classifier (SVC, RBF kernel, gamma 0.001) fitted on the demo's training split (a
    fraction of a second). A nearest-class-mean classifier reads only 0.87 of the real digits and cannot see a
    model's samples improve past that."""
    try:
        from sklearn.svm import SVC
    except ImportError:
        raise ImportError(
            "the digits demo's class agreement needs scikit-learn: pip install 'sdtrain[preprocess]'"
        ) from None
    images, labels = _split("train")
    return SVC(gamma=0.001).fit(images.reshape(len(images), -1).astype(np.float64), labels)


def class_agreement(latents: np.ndarray, labels) -> dict:
    """How often samples of the demo look like the digit they were conditioned on.

    ``latents`` (N, 4, 16, 16) in the demo's latent space, ``labels`` (N,) the conditioned digit.
    Returns ``class_agreement`` (the fraction of samples whose ``classify_digits`` class is the
    conditioned one; chance is 0.1), ``samples``, ``agreeing``, and ``per_class`` (digit -> fraction)."""
    labels = np.asarray(labels)
    predicted = classify_digits(digits_from_latents(latents))
    agree = predicted == labels
    return {
        "class_agreement": float(agree.mean()),
        "samples": int(len(agree)),
        "agreeing": int(agree.sum()),
        "per_class": {int(c): float(agree[labels == c].mean()) for c in np.unique(labels)},
    }


def real_digits_agreement() -> float:
    """``classify_digits``'s agreement on the real digits of the demo's validation split: what a
    perfect model's samples would score."""
    images, labels = _split("val")
    return float((classify_digits(_upsampled(images)) == labels).mean())


def _split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of the demo's train or val split, as ensure_demo_data writes them."""
    images, labels = load_digits()
    rows = _SPLITS[split](len(labels))
    return images[rows], labels[rows]


_SPLITS = {"train": lambda n: slice(0, n - VAL_ROWS), "val": lambda n: slice(n - VAL_ROWS, None)}


def _upsampled(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) -> (N, 16, 16), each pixel a 2x2 block: what the training latents decode to (up to their float16
    rounding)."""
    return np.kron(images.astype(np.float64), np.ones((2, 2)))


def _channels(images: np.ndarray) -> np.ndarray:
    up = np.kron(images.astype(np.float32) / 8.0 - 1.0, np.ones((2, 2), dtype=np.float32))
    return np.stack([up, up[:, :, ::-1], up.transpose(0, 2, 1), -up], axis=1)


@functools.lru_cache(maxsize=1)
def _demo_normalization() -> tuple[float, float]:
    """The mean and std ``ensure_demo_data`` normalized the whole demo set with."""
    channels = _channels(load_digits()[0])
    return float(channels.mean()), float(channels.std())


def class_captions(caption_dim: int, seed: int = 0) -> np.ndarray:
    """(10, 77, caption_dim): one fixed embedding per digit, shaped like a text encoder's output for "a photo of a 3",
    where every token carries the prompt: each token is the digit's own vector over its position's vector, which all
    digits share (the prompt's template), at unit variance. Whichever tokens the UNet attends to tell it the digit;
    77 unrelated random tokens a digit made it learn the digit from their average, slowly."""
    rng = np.random.default_rng(seed)
    digit = rng.standard_normal((NUM_CLASSES, 1, caption_dim))
    position = rng.standard_normal((1, CAPTION_LENGTH, caption_dim))
    return (DIGIT_WEIGHT * digit + np.sqrt(1 - DIGIT_WEIGHT**2) * position).astype(np.float32)


def ensure_demo_data(train_dir: str, val_dir: str | None, caption_dim: int) -> bool:
    """Write the demo dataset into ``train_dir`` (and ``val_dir``) unless they already hold parquet files.

    Returns True if it wrote anything. Each directory is written to a temporary sibling and
    renamed into place, so an interrupted run never leaves a half-written dataset behind.
    """
    wanted = [(d, split) for d, split in ((train_dir, "train"), (val_dir, "val")) if d and not _has_parquet(d)]
    for directory in {train_dir, val_dir} - {d for d, _ in wanted} - {None}:
        _check_layout(str(directory))
    if not wanted:
        return False
    images, labels = load_digits()
    latents = pseudo_latents(images)
    captions = class_captions(caption_dim)
    ids = np.arange(len(labels))
    for directory, split in wanted:
        rows = _SPLITS[split](len(labels))
        table = _table(ids[rows], labels[rows], latents[rows], captions[labels[rows]])
        _write_atomically(table, Path(directory), TRAIN_FILES if split == "train" else 1)
    return True


def _table(ids, labels, latents, captions) -> pa.Table:
    def flat(x):
        x = x.astype(np.float16).reshape(len(x), -1)
        return pa.ListArray.from_arrays(np.arange(0, x.size + 1, x.shape[1], dtype=np.int32), pa.array(x.ravel()))

    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "label": pa.array(labels, pa.int64()),
            "image_latents_256": flat(latents),
            "caption_latents": flat(captions),
        }
    ).replace_schema_metadata({LAYOUT_KEY: LAYOUT, LATENT_CLASSIFIER: __name__})


def _check_layout(directory: str) -> None:
    """The demo files already in ``directory`` are of this layout; else a DataError that says how to renew them."""
    first = sorted(Path(directory).glob("*.parquet"))[0]
    layout = (read_schema(str(first), "the demo's data").metadata or {}).get(LAYOUT_KEY)
    if layout != LAYOUT.encode():
        raise DataError(
            f"the digits demo: {first} holds its data as another sdtrain version wrote it (layout "
            f"{layout.decode() if layout else 1}, this version writes {LAYOUT}); remove {directory} (make clean-runs "
            "removes the demo's data and runs) and it is written again"
        )


def _write_atomically(table: pa.Table, directory: Path, num_files: int) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        for i, rows in enumerate(np.array_split(np.arange(table.num_rows), num_files)):
            pq.write_table(table.take(rows), staging / f"part-{i:05d}.parquet", row_group_size=128)
        if directory.exists():
            directory.rmdir()  # only an empty directory is replaced (_has_parquet was False)
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _has_parquet(directory: str) -> bool:
    return any(Path(directory).glob("*.parquet")) if Path(directory).is_dir() else False


# --- the latent classifier of the demo's files (sdtrain.sampling.latent_classifier) -----------------------------


def check() -> None:
    """Its classifier needs scikit-learn (the preprocess extra)."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        raise ImportError("the digits demo's classifier needs scikit-learn: pip install 'sdtrain[preprocess]'")


def preview(latents: np.ndarray) -> np.ndarray:
    """(N, 4, 16, 16) demo latents -> (N, 16, 16) uint8, dark ink on white: the demo's samples without a VAE."""
    ink = np.clip(digits_from_latents(latents) / 16.0, 0, 1)
    return (255 * (1 - ink)).astype(np.uint8)


def report(latents: np.ndarray, labels: list, samples_per_caption: int, embeddings: np.ndarray) -> dict | None:
    """The class agreement of samples of the grid rows ``labels`` (``samples_per_caption`` a row), with chance and the
    classifier's agreement on real digits for scale; None unless the rows' caption ``embeddings`` (R, L, D) are the
    demo's captions of those digits (then the labels mean digits)."""
    if not all(isinstance(label, int) and 0 <= label < NUM_CLASSES for label in labels):
        return None
    expected = class_captions(embeddings.shape[-1])[labels]
    if expected.shape != tuple(embeddings.shape) or not np.allclose(embeddings, expected, atol=1e-2):
        return None
    agreement = class_agreement(latents, np.repeat(labels, samples_per_caption))
    real = round(real_digits_agreement(), 4)
    return {
        **agreement,
        "chance": 1 / NUM_CLASSES,
        "real_digits": real,
        "summary": (
            f"class agreement {agreement['class_agreement']:.2f}: {agreement['agreeing']} of {agreement['samples']} "
            f"samples look like the digit they were conditioned on (an SVC of the training digits; chance "
            f"{1 / NUM_CLASSES:.2f}, real digits {real:.2f})"
        ),
        "classifier": (
            "an SVC (RBF kernel) fitted on the demo's training digits, on each sample decoded by "
            "sdtrain.demo.digits.digits_from_latents; real_digits = its agreement on the real validation digits"
        ),
    }


# --- the door: the demo's data where its config names it ------------------------------------------------------

DATA_DIR = os.path.join(".sdtrain-data", "digits")
"""Where configs/demo.yaml keeps the demo's data (train/ and val/), relative to the working directory."""


def prepare(train: list[str], val: list[str], caption_dim: int) -> str | None:
    """Write the demo's data if a run names the demo's own directories (configs/demo.yaml's data.train and data.val)
    and they hold none yet; returns the directory written, else None. A run on any other data writes nothing.

    Args:
        train: data.train as the config gives it.
        val: data.val.
        caption_dim: the UNet's cross_attention_dim (the width of the demo's captions).
    """
    ours = os.path.abspath(os.path.join(DATA_DIR, "train")), os.path.abspath(os.path.join(DATA_DIR, "val"))
    named = [os.path.abspath(spec) for spec in (*train, *val) if "://" not in spec]
    if ours[0] not in named:
        return None
    val_dir = ours[1] if ours[1] in named else None
    return ours[0] if ensure_demo_data(ours[0], val_dir, caption_dim=caption_dim) else None
