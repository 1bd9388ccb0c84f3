"""Image quality metrics (sdtrain.evaluation.image_metrics): running feature statistics, the Fréchet distance against
an independent implementation, and DINOv2 features and CLIP scores from tiny real models with random weights, on
real photographs (scikit-learn's china.jpg and flower.jpg)."""

from __future__ import annotations

import io
import warnings
import zipfile

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from sklearn.datasets import load_sample_images
from support.tiny_models import write_tiny_clip, write_tiny_dinov2
from transformers import (
    AutoTokenizer,
    CLIPModel,
)

from sdtrain.errors import DataError
from sdtrain.evaluation.image_metrics import (
    CLIP_MEAN,
    CLIP_STD,
    ClipScore,
    DinoFeatures,
    FeatureStats,
    frechet_distance,
)


def _stats(features: np.ndarray) -> FeatureStats:
    stats = FeatureStats(features.shape[1])
    stats.add(features)
    return stats


def _crops(image: np.ndarray, n: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys = rng.integers(0, image.shape[0] - size, n)
    xs = rng.integers(0, image.shape[1] - size, n)
    return np.stack([image[y : y + size, x : x + size] for y, x in zip(ys, xs, strict=True)])


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    sample = load_sample_images()
    return {name.rsplit("/", 1)[-1]: image for name, image in zip(sample.filenames, sample.images, strict=True)}


@pytest.fixture(scope="module")
def dino_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_dinov2(str(tmp_path_factory.mktemp("models") / "dinov2"))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Its seeded weights make some of the test's pairs score above 0 and some clamped to 0.
    return write_tiny_clip(str(tmp_path_factory.mktemp("models") / "clip"))


def test_streamed_stats_equal_those_of_the_whole_set():
    rng = np.random.default_rng(0)
    # float32 values, so that a chunk added as float32 adds exactly these numbers
    features = (rng.normal(size=(250, 6)) * np.arange(1, 7) + np.arange(6)).astype(np.float32).astype(np.float64)
    stats = FeatureStats(6)
    for i, chunk in enumerate(np.split(features, [1, 40, 41, 190])):  # uneven chunks, two of them a single row
        stats.add(chunk.astype(np.float32) if i % 2 else chunk)
    assert stats.count == 250
    np.testing.assert_allclose(stats.mean, features.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.cov, np.cov(features, rowvar=False), rtol=1e-10, atol=1e-12)

    restored = FeatureStats.from_bytes(stats.to_bytes())
    assert restored.count == stats.count
    assert np.array_equal(restored.mean, stats.mean) and np.array_equal(restored.cov, stats.cov)
    assert restored.to_bytes() == stats.to_bytes()
    # Dated 1980, not when written: bytes made seconds apart (np.savez's) differed, and a test comparing them failed.
    with zipfile.ZipFile(io.BytesIO(stats.to_bytes())) as npz:
        assert {entry.date_time for entry in npz.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_stats_refuse_what_they_cannot_hold():
    stats = FeatureStats(4)
    stats.add(np.ones((1, 4)))
    with pytest.raises(ValueError, match="at least 2 feature vectors, got 1"):
        _ = stats.cov
    with pytest.raises(ValueError, match=r"expected an array of shape \(N, 4\), got shape \(3, 5\)"):
        stats.add(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="expected float features, got dtype int64"):
        stats.add(np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.add(np.full((2, 4), np.nan))
    assert stats.count == 1  # the refused arrays added nothing
    with pytest.raises(ValueError, match="not the output of FeatureStats.to_bytes"):
        FeatureStats.from_bytes(b"not an npz")


def _reference_frechet(mu1: np.ndarray, s1: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    """Tr((S1 S2)^(1/2)) by another route: S1 S2 is similar to S1^(1/2) S2 S1^(1/2), which is symmetric positive
    semi-definite, so the trace is the sum of the square roots of that matrix's eigenvalues."""
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = np.linalg.eigvalsh(root1 @ s2 @ root1)
    trace = np.sqrt(np.clip(inner, 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * trace)


def test_frechet_distance_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(1)
    stats = _stats(rng.normal(size=(500, 8)) @ rng.normal(size=(8, 8)) + 3.0)
    assert abs(frechet_distance(stats, stats)) < 1e-6


def test_frechet_distance_matches_an_independent_implementation():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(4000, 8)) * np.sqrt(np.linspace(0.5, 4.0, 8))
    uncorrelated = rng.normal(size=(4000, 8)) * np.sqrt(np.linspace(2.0, 1.0, 8)) + np.linspace(-1, 1, 8)
    b = uncorrelated.copy()
    b[:, 1] += 0.8 * b[:, 0]  # one correlation: the covariances do not commute
    sa, sb = _stats(a), _stats(b)
    expected = _reference_frechet(sa.mean, sa.cov, sb.mean, sb.cov)
    assert frechet_distance(sa, sb) == pytest.approx(expected, rel=1e-9)
    assert frechet_distance(sb, sa) == pytest.approx(expected, rel=1e-9)

    # The population distance of the two diagonal Gaussians, where Tr((S1 S2)^(1/2)) = sum(sqrt(s1 s2)): the sample
    # estimate is close to it (4000 samples).
    d1, d2 = np.linspace(0.5, 4.0, 8), np.linspace(2.0, 1.0, 8)
    population = (np.linspace(-1, 1, 8) ** 2).sum() + ((np.sqrt(d1) - np.sqrt(d2)) ** 2).sum()
    assert frechet_distance(sa, _stats(uncorrelated)) == pytest.approx(population, abs=0.15)


def test_frechet_distance_of_singular_covariances():
    # A feature that is always 0 (a dead unit) makes both covariances, and their product, exactly singular: scipy
    # warns that its square root may be inaccurate, and the eps * I offset gives a well-defined one.
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(40, 8)), rng.normal(size=(50, 8)) + 0.3
    a[:, 3] = b[:, 3] = 0.0
    sa, sb = _stats(a), _stats(b)
    with pytest.warns(scipy.linalg.LinAlgWarning, match="singular"):
        scipy.linalg.sqrtm(sa.cov @ sb.cov)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distance = frechet_distance(sa, sb)
    assert distance == pytest.approx(_reference_frechet(sa.mean, sa.cov, sb.mean, sb.cov), rel=1e-4)


def test_frechet_distance_refuses_sets_of_different_widths():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match=r"differ in width \(3 and 5\)"):
        frechet_distance(_stats(rng.normal(size=(10, 3))), _stats(rng.normal(size=(10, 5))))


def test_dino_features_separate_two_photographs(dino_dir: str, photos: dict[str, np.ndarray]):
    features = DinoFeatures(dino_dir)
    assert features.dim == 32
    china = _crops(photos["china.jpg"], 60, 96, seed=0)
    flower = _crops(photos["flower.jpg"], 30, 96, seed=1)

    out = features(china, batch_size=32)
    assert out.shape == (60, 32) and out.dtype == np.float64
    assert np.array_equal(features(china, batch_size=32), out)  # deterministic
    np.testing.assert_allclose(features(china, batch_size=7), out, rtol=1e-5, atol=1e-5)  # batches do not interact

    half_a, half_b = _stats(out[:30]), _stats(out[30:])
    same_photo = frechet_distance(half_a, half_b)
    other_photo = frechet_distance(half_a, _stats(features(flower)))
    assert same_photo < other_photo, (same_photo, other_photo)


def test_dino_features_check_their_input(dino_dir: str):
    features = DinoFeatures(dino_dir)
    with pytest.raises(ValueError, match=r"expected images of shape \(N, H, W, 3\) \(RGB\), got shape \(2, 3, 8, 8\)"):
        features(np.zeros((2, 3, 8, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="expected uint8 images .*, got dtype float32"):
        features(np.zeros((2, 8, 8, 3), dtype=np.float32))
    assert features(np.zeros((0, 8, 8, 3), dtype=np.uint8)).shape == (0, 32)


def test_clip_score_is_the_clamped_cosine_of_clip_embeddings(clip_dir: str, photos: dict[str, np.ndarray]):
    score = ClipScore(clip_dir)
    images = np.concatenate([_crops(photos["china.jpg"], 3, 80, seed=2), _crops(photos["flower.jpg"], 3, 80, seed=3)])
    captions = ["a temple", "a pagoda in a park", "china", "a flower", "a red flower with a bee", ""]

    scores = score(images, captions, batch_size=4)
    assert scores.shape == (6,) and scores.dtype == np.float64
    assert ((scores >= 0) & (scores <= 100)).all()
    assert (scores > 0).any() and (scores == 0).any()  # the check below covers both the cosine and the clamp
    assert np.array_equal(score(images, captions, batch_size=4), scores)
    np.testing.assert_allclose(score(images, captions, batch_size=1), scores, rtol=1e-5, atol=1e-4)

    # The same score straight from the model's own embeddings, for each image.
    model = CLIPModel.from_pretrained(clip_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(clip_dir)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    pixels = F.interpolate(pixels, size=(32, 32), mode="bicubic", antialias=True).clamp(0, 1)
    pixels = (pixels - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]
    tokens = tokenizer(captions, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels)
        text = model.get_text_features(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
    image = image if isinstance(image, torch.Tensor) else image.pooler_output
    text = text if isinstance(text, torch.Tensor) else text.pooler_output
    assert image.shape == (6, 16) and text.shape == (6, 16)
    expected = (100 * F.cosine_similarity(image, text, dim=-1).clamp(min=0)).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-4)

    with pytest.raises(ValueError, match="got 6 images but 5 captions"):
        score(images, captions[:5])


def test_a_missing_model_is_a_data_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(DataError, match=f"{missing} is not a directory"):
        DinoFeatures(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=f"{empty} has no config.json"):
        ClipScore(str(empty))


def test_a_model_of_another_kind_is_a_data_error(clip_dir: str):
    with pytest.raises(DataError, match=f"{clip_dir} is a 'clip' model; expected a DINOv2 model"):
        DinoFeatures(clip_dir)
