"""Image quality of generated images: the Fréchet distance between two sets of image features (the FID formula; on
DINOv2's features it is FD_DINOv2, Stein et al. 2023; on the Inception network's, FID) and the CLIP score (Hessel et al.
2021). Features are held as running sums (:class:`FeatureStats`), so a reference set is computed once and stored in a
few kilobytes to megabytes, whatever its size; the models load from a local directory, a storage URI or a hub id."""

from __future__ import annotations

import io
import os
import re
import warnings
import zipfile
from typing import Any

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer, CLIPModel, Dinov2Model

from sdtrain.errors import DataError
from sdtrain.storage.filesystems import local_copy
from sdtrain.storage.uris import is_uri

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# The offset pytorch-fid and dgm-eval add to both covariances when their product is singular.
_EPS = 1e-6


class FeatureStats:
    """Running mean and covariance of feature vectors (float64 sums), so a set of any size is held as D + D*D numbers.

    Args:
        dim: the width D of a feature vector.
    """

    def __init__(self, dim: int):
        if dim < 1:
            raise ValueError(f"FeatureStats: dim must be at least 1, got {dim}")
        self.dim = dim
        self._count = 0
        self._sum = np.zeros(dim, dtype=np.float64)
        self._outer = np.zeros((dim, dim), dtype=np.float64)

    def add(self, features: np.ndarray) -> None:
        """Accumulate ``features`` (N, dim) of any float dtype."""
        if not isinstance(features, np.ndarray) or features.ndim != 2 or features.shape[1] != self.dim:
            got = f"shape {features.shape}" if isinstance(features, np.ndarray) else type(features).__name__
            raise ValueError(f"FeatureStats.add: expected an array of shape (N, {self.dim}), got {got}")
        if not np.issubdtype(features.dtype, np.floating):
            raise ValueError(f"FeatureStats.add: expected float features, got dtype {features.dtype}")
        x = features.astype(np.float64)
        if not np.isfinite(x).all():  # one NaN would poison every later mean and covariance, silently
            raise ValueError(f"FeatureStats.add: {int((~np.isfinite(x)).sum())} feature value(s) are NaN or inf")
        self._count += len(x)
        self._sum += x.sum(axis=0)
        self._outer += x.T @ x

    def merge(self, other: FeatureStats) -> None:
        """Accumulate the statistics of another set of features (as if its features were added here): a set measured
        in parts is the sum of its parts."""
        if other.dim != self.dim:
            raise ValueError(f"FeatureStats.merge: features {other.dim} wide into stats {self.dim} wide")
        self._count += other._count
        self._sum += other._sum
        self._outer += other._outer

    @property
    def count(self) -> int:
        return self._count

    @property
    def mean(self) -> np.ndarray:
        if self._count == 0:
            raise ValueError("FeatureStats: no features added, the mean is undefined")
        return self._sum / self._count

    @property
    def cov(self) -> np.ndarray:
        """Unbiased (N - 1), as ``np.cov(features, rowvar=False)``."""
        if self._count < 2:
            raise ValueError(f"FeatureStats: a covariance needs at least 2 feature vectors, got {self._count}")
        mean = self.mean
        cov = (self._outer - self._count * np.outer(mean, mean)) / (self._count - 1)
        return (cov + cov.T) / 2  # exactly symmetric, whatever the rounding of the sums

    def to_bytes(self) -> bytes:
        """An .npz of the count and the two sums (:meth:`from_bytes` restores them), the same sums the same bytes."""
        with zipfile.ZipFile(buffer := io.BytesIO(), "w") as npz:
            for name, value in {"count": np.int64(self._count), "sum": self._sum, "outer": self._outer}.items():
                with npz.open(zipfile.ZipInfo(f"{name}.npy"), "w", force_zip64=True) as f:  # dated 1980, not now
                    np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> FeatureStats:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                count, total, outer = int(npz["count"]), npz["sum"], npz["outer"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"FeatureStats.from_bytes: not the output of FeatureStats.to_bytes ({e})") from None
        if total.ndim != 1 or outer.shape != (len(total), len(total)) or count < 0:
            raise ValueError(
                f"FeatureStats.from_bytes: inconsistent stats (count {count}, sum {total.shape}, outer {outer.shape})"
            )
        stats = cls(len(total))
        stats._count, stats._sum, stats._outer = count, total.astype(np.float64), outer.astype(np.float64)
        return stats


def frechet_distance(a: FeatureStats, b: FeatureStats) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)), computed as pytorch-fid and dgm-eval (FD_DINOv2)
    compute it."""
    if a.dim != b.dim:
        raise ValueError(f"frechet_distance: the two feature sets differ in width ({a.dim} and {b.dim})")
    diff = a.mean - b.mean
    s_a, s_b = a.cov, b.cov
    with warnings.catch_warnings():
        # scipy (>= 1.16) warns, where older versions returned inf, when it finds the product singular or
        # ill-conditioned (a feature that never varies, a set smaller than its width): the offset makes it definite.
        warnings.simplefilter("error", scipy.linalg.LinAlgWarning)
        try:
            covmean = scipy.linalg.sqrtm(s_a @ s_b)
            singular = not np.isfinite(covmean).all()
        except scipy.linalg.LinAlgWarning:
            singular = True
    if singular:
        offset = np.eye(a.dim) * _EPS
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
            covmean = scipy.linalg.sqrtm((s_a + offset) @ (s_b + offset))
    if np.iscomplexobj(covmean):
        # The product of two covariances has real, non-negative eigenvalues: an imaginary part is rounding noise,
        # unless it is large.
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(
                f"frechet_distance: the square root of the covariance product has an imaginary component of "
                f"{np.max(np.abs(covmean.imag)):.3g}; the features are degenerate (too few, or not finite)"
            )
        covmean = covmean.real
    return float(diff @ diff + np.trace(s_a) + np.trace(s_b) - 2 * np.trace(covmean))


class DinoFeatures:
    """Image features of a DINOv2 model (transformers.Dinov2Model): the CLS token of the last layer after the final
    layernorm (``pooler_output``), as FD_DINOv2 uses.

    Args:
        source: a local model directory (config.json and the weights), a storage URI (s3://...) or a hub id.
        device: where the model runs.
        image_size: the side images are resized to: 224, as the FD_DINOv2 reference code (dgm-eval) does whatever
            the checkpoint's own image_size (518 for the hub's), so the numbers compare with published ones.
    """

    def __init__(self, source: str, device: str = "cpu", image_size: int = 224):
        local = _model_directory(source, "DINOv2")
        config = _model_config(local, source, "dinov2", "DINOv2")
        self.device = torch.device(device)
        self.model: Any = _load(Dinov2Model, local, source, config).to(self.device, torch.float32).eval()
        self.image_size = image_size

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """(N, dim) float64 features of ``images``.

        Args:
            images: (N, H, W, 3) uint8 RGB, of any size: each is resized to ``image_size`` (bicubic, antialiased)
                and normalized with ImageNet's mean and std.
            batch_size: images per forward pass.
        """
        _check_images(images, "DinoFeatures")
        _check_batch_size(batch_size, "DinoFeatures")
        features = np.empty((len(images), self.dim), dtype=np.float64)
        for start in range(0, len(images), batch_size):
            pixels = _pixel_values(images[start : start + batch_size], self.image_size, IMAGENET_MEAN, IMAGENET_STD)
            output = self.model(pixel_values=pixels.to(self.device))
            features[start : start + batch_size] = output.pooler_output.double().cpu().numpy()
        return features


class InceptionFeatures:
    """Image features of the Inception network FID is defined on, from a TorchScript file the user supplies (nothing is
    downloaded): the detector StyleGAN2-ADA, StyleGAN3 and clean-fid compute FID with (inception-2015-12-05.pt), called
    as ``model(images, return_features=True)`` on uint8 (N, 3, H, W) images of any size, which it resizes to 299
    itself, and answering (N, 2048) pool features.

    Args:
        source: the TorchScript file: a local path or a storage URI (s3://...).
        device: where the model runs.
    """

    def __init__(self, source: str, device: str = "cpu"):
        from sdtrain.storage.filesystems import read_bytes

        try:
            data = read_bytes(source)
        except OSError as e:
            raise DataError(f"cannot read the Inception feature extractor {source}: {_first_line(e)}") from None
        if data is None:
            raise DataError(
                f"the Inception feature extractor {source} does not exist (a TorchScript .pt file expected)"
            )
        self.source = source
        self.device = torch.device(device)
        try:
            self.model: Any = torch.jit.load(io.BytesIO(data), map_location=self.device).eval()
        except RuntimeError as e:
            raise DataError(
                f"the Inception feature extractor {source} is not a TorchScript file ({_first_line(e)}); expected a "
                "module saved by torch.jit.save, as inception-2015-12-05.pt is"
            ) from None
        self.dim = int(self(np.zeros((1, 64, 64, 3), dtype=np.uint8)).shape[1])

    @torch.no_grad()
    def __call__(self, images: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """(N, dim) float64 features of ``images`` ((N, H, W, 3) uint8 RGB, of any size: the model resizes them)."""
        _check_images(images, "InceptionFeatures")
        _check_batch_size(batch_size, "InceptionFeatures")
        out = []
        for start in range(0, len(images), batch_size):
            pixels = torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size])).permute(0, 3, 1, 2)
            try:
                features = self.model(pixels.contiguous().to(self.device), return_features=True)
            except RuntimeError as e:
                raise DataError(
                    f"the Inception feature extractor {self.source} failed on uint8 images of shape "
                    f"{tuple(pixels.shape)} called with return_features=True: {_first_line(e)}"
                ) from None
            if not isinstance(features, torch.Tensor) or features.ndim != 2 or len(features) != len(pixels):
                got = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
                raise DataError(
                    f"the Inception feature extractor {self.source} answered {got} for {len(pixels)} images; expected "
                    "features of shape (N, D)"
                )
            out.append(features.double().cpu().numpy())
        return np.concatenate(out)


class ClipScore:
    """CLIP score (Hessel et al. 2021): 100 * max(cos(image embedding, text embedding), 0) per image, from a
    transformers.CLIPModel and its tokenizer in the same directory. Each image's score is torchmetrics' CLIPScore of
    that pair (tests/test_offline_evaluation.py holds them equal); over several pairs torchmetrics clamps the mean of
    the cosines, where the paper (and this) averages the clamped scores.

    Args:
        source: a local model directory (config.json, the weights and the tokenizer's files), a storage URI (s3://...)
            or a hub id.
        device: where the model runs.
    """

    def __init__(self, source: str, device: str = "cpu"):
        local = _model_directory(source, "CLIP")
        config = _model_config(local, source, "clip", "CLIP")
        self.device = torch.device(device)
        self.model: Any = _load(CLIPModel, local, source, config).to(self.device, torch.float32).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(local)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot load the CLIP tokenizer of {source}: {_first_line(e)}") from None
        self.image_size = int(config.vision_config.image_size)
        self.max_length = int(config.text_config.max_position_embeddings)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, captions: list[str], batch_size: int = 32) -> np.ndarray:
        """(N,) float64 scores in [0, 100], one per image and its caption.

        Args:
            images: (N, H, W, 3) uint8 RGB, of any size: as CLIP's image processor does, the shorter side of each
                is resized to the vision model's image_size (bicubic, antialiased), the center cropped to a square,
                and normalized with CLIP's mean and std.
            captions: N strings, truncated to the text model's max_position_embeddings tokens.
            batch_size: images per forward pass.
        """
        _check_images(images, "ClipScore")
        _check_batch_size(batch_size, "ClipScore")
        if len(captions) != len(images):
            raise ValueError(f"ClipScore: got {len(images)} images but {len(captions)} captions; expected one each")
        scores = np.empty(len(images), dtype=np.float64)
        for start in range(0, len(images), batch_size):
            pixels = _pixel_values(images[start : start + batch_size], self.image_size, CLIP_MEAN, CLIP_STD, crop=True)
            tokens = self.tokenizer(
                list(captions[start : start + batch_size]),
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            image = _embedding(self.model.get_image_features(pixel_values=pixels.to(self.device)))
            text = _embedding(
                self.model.get_text_features(
                    input_ids=tokens.input_ids.to(self.device), attention_mask=tokens.attention_mask.to(self.device)
                )
            )
            cosine = (F.normalize(image.float(), dim=-1) * F.normalize(text.float(), dim=-1)).sum(dim=-1)
            scores[start : start + batch_size] = (100 * cosine.clamp(min=0)).double().cpu().numpy()
        return scores


def _embedding(output: Any) -> torch.Tensor:
    """The projected embedding from get_image_features / get_text_features: transformers 4 returns the tensor,
    transformers 5 an output whose pooler_output it is."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _check_images(images: Any, where: str) -> None:
    if not isinstance(images, np.ndarray):
        raise ValueError(f"{where}: expected images as a numpy array (N, H, W, 3) uint8, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[-1] != 3 or 0 in images.shape[1:3]:
        raise ValueError(f"{where}: expected images of shape (N, H, W, 3) (RGB), got shape {images.shape}")
    if images.dtype != np.uint8:
        raise ValueError(f"{where}: expected uint8 images (0-255), got dtype {images.dtype}")


def _check_batch_size(batch_size: int, where: str) -> None:
    if batch_size < 1:
        raise ValueError(f"{where}: batch_size must be at least 1, got {batch_size}")


def _pixel_values(
    images: np.ndarray,
    size: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    crop: bool = False,
) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, size, size) float32, resized and normalized: squeezed to a square, or with
    ``crop`` the shorter side resized to ``size`` and the center cropped, as CLIP's own image processor (and so
    torchmetrics' CLIPScore) does it. Square images are the same either way."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255
    height, width = x.shape[-2:]
    resized = (size, size)
    if crop and height != width:  # transformers' get_resize_output_image_size (default_to_square=False)
        resized = (size, int(size * width / height)) if height < width else (int(size * height / width), size)
    # antialias: a bicubic downscale without it aliases, and generated images are usually larger than the model's input
    x = F.interpolate(x, size=resized, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (resized[0] - size) // 2, (resized[1] - size) // 2  # transformers' center_crop
    x = x[..., top : top + size, left : left + size]
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


# A hub id is exactly "owner/name"; anything else that is not a directory is a missing local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _model_directory(source: str, kind: str) -> str:
    """A local directory holding ``source``'s model (a URI is downloaded, once per process), or the hub id itself."""
    if is_uri(source):
        try:
            local = local_copy(source)
        except OSError as e:
            raise DataError(f"cannot download the {kind} model {source}: {_first_line(e)}") from None
    else:
        local = os.path.expanduser(source)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise DataError(
                f"the {kind} model {source} has no config.json; expected a transformers model directory "
                "(save_pretrained output: config.json and the weights)"
            )
        return local
    if is_uri(source) or not _HUB_ID.fullmatch(source) or os.path.isdir(os.path.dirname(local)):
        raise DataError(
            f"the {kind} model {source} is not a directory (relative paths are taken from {os.getcwd()}); expected "
            "a transformers model directory (local or s3://) or a hub id owner/name"
        )
    return source


def _model_config(local: str, source: str, model_type: str, kind: str) -> Any:
    """The model's config, refused unless it is of ``model_type``: another model's weights would load as random."""
    try:
        config = AutoConfig.from_pretrained(local)
    except (OSError, ValueError) as e:  # unreachable hub id, unreadable or unknown config.json
        raise DataError(f"cannot load the config of the {kind} model {source}: {_first_line(e)}") from None
    if config.model_type != model_type:
        raise DataError(
            f"{source} is a {config.model_type!r} model; expected a {kind} model "
            f"(config.json model_type {model_type!r})"
        )
    return config


def _load(model_class: Any, local: str, source: str, config: Any) -> Any:
    try:
        return model_class.from_pretrained(local, config=config)
    except (OSError, ValueError) as e:  # missing or truncated weights
        raise DataError(f"cannot load the weights of {source}: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
