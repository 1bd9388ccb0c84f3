"""The diffusion training recipe as pure functions: what the UNet is asked to predict, and how
each sample's error is weighted and perturbed.

Every formula follows diffusers' ``examples/text_to_image/train_text_to_image.py`` (the anchor
the tests compare against) and the papers it cites:

- ``training_target``: epsilon -> the added noise; v_prediction -> the scheduler's own
  ``get_velocity`` (v = sqrt(a_t) * eps - sqrt(1 - a_t) * x0, Salimans & Ho 2022).
- ``min_snr_weights``: min-SNR-gamma (Hang et al. 2023, arXiv 2303.09556): per-sample loss
  weights min(SNR(t), gamma) / SNR(t) for epsilon and min(SNR(t), gamma) / (SNR(t) + 1) for
  v-prediction, SNR(t) = a_t / (1 - a_t) as in diffusers' ``compute_snr``.
- ``offset_noise``: noise += offset * N(0, 1) drawn per sample and channel (B, C, 1, 1).
- input perturbation (Ning et al. 2023): the UNet input is noised with
  ``noise + perturbation * N(0, 1)`` while the target keeps ``noise``.
- ``drop_captions``: each sample's caption is replaced by the unconditional embedding with
  probability p, so one model predicts both, which classifier-free guidance needs at sampling.

Random draws take an explicit generator (the module's per-step generator), so they are a pure
function of (seed, rank, step) like the noise, and resumed runs draw what uninterrupted ones would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from sdtrain.data.metadata import LATENT_SCALING_FACTOR, describe_scaling, latent_scaling
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.conditioning import Conditioning

PREDICTION_TYPES = ("epsilon", "v_prediction")


def snr(noise_scheduler: DDPMScheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio a_t / (1 - a_t) at each timestep, computed as diffusers' compute_snr does."""
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)
    alpha = (alphas_cumprod**0.5)[timesteps].float()
    sigma = ((1.0 - alphas_cumprod) ** 0.5)[timesteps].float()
    return (alpha / sigma) ** 2


def training_target(
    noise_scheduler: DDPMScheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """What the UNet learns to predict, by the scheduler's ``prediction_type``."""
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction_type {prediction_type!r}; expected one of {', '.join(PREDICTION_TYPES)}")


def min_snr_weights(noise_scheduler: DDPMScheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-sample loss weights of min-SNR-gamma for the scheduler's prediction type. At SNR 0 (a zero-terminal-SNR
    schedule's last timestep) epsilon's min(SNR, gamma) / SNR is 0 / 0: its limit, 1, is taken."""
    ratio = snr(noise_scheduler, timesteps)
    clipped = torch.clamp(ratio, max=gamma)
    if noise_scheduler.config.prediction_type == "v_prediction":
        return clipped / (ratio + 1)
    return torch.where(ratio > 0, clipped / ratio.clamp(min=torch.finfo(ratio.dtype).tiny), 1.0)


def diffusion_loss(
    prediction: torch.Tensor,
    target: torch.Tensor,
    noise_scheduler: DDPMScheduler,
    timesteps: torch.Tensor,
    snr_gamma: float | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error, each sample weighted by min-SNR-gamma when ``snr_gamma`` is set; a sample ``valid`` marks
    False (a row skipped under data.on_read_error=skip) counts as a zero. Divided by the micro-batch's rows, not its
    valid ones: DDP and accumulation average the micro-batches' losses, so every valid row of a step weighs 1/global
    batch wherever it is (over the valid rows alone, a micro-batch's few survivors would outweigh another's rows, and a
    fully skipped micro-batch would still count in the average)."""
    if snr_gamma is None and valid is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(
        dim=tuple(range(1, prediction.ndim))
    )
    if snr_gamma is not None:
        per_sample = per_sample * min_snr_weights(noise_scheduler, timesteps, snr_gamma)
    if valid is None:
        return per_sample.mean()
    valid = valid.to(per_sample.dtype)
    return (per_sample * valid).sum() / valid.numel()


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """noise + offset * N(0, 1) of shape (B, C, 1, 1): shifts each channel's mean (Guttenberg 2023)."""
    shape = (*noise.shape[:2], *([1] * (noise.ndim - 2)))
    return noise + offset * torch.randn(shape, generator=generator, device=noise.device, dtype=noise.dtype)


def perturb(noise: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """The noise the UNet input is made with under input perturbation: noise + scale * N(0, 1)."""
    return noise + scale * torch.randn(noise.shape, generator=generator, device=noise.device, dtype=noise.dtype)


def drop_captions(
    captions: torch.Tensor, unconditional: torch.Tensor, prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(captions with each row replaced by ``unconditional`` with probability ``prob``, the mask)."""
    dropped = torch.rand(captions.shape[0], generator=generator, device=captions.device) < prob
    mixed = torch.where(dropped.view(-1, *([1] * (captions.ndim - 1))), unconditional.to(captions), captions)
    return mixed, dropped


@dataclass(frozen=True)
class StepInputs:
    """What one training step feeds the UNet and compares its output with."""

    noisy: torch.Tensor
    conditioning: Conditioning
    target: torch.Tensor
    dropped: torch.Tensor | None = None


def step_inputs(
    noise_scheduler: DDPMScheduler,
    latents: torch.Tensor,
    conditioning: Conditioning,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    generator: torch.Generator,
    *,
    noise_offset: float = 0.0,
    input_perturbation: float = 0.0,
    caption_dropout_prob: float = 0.0,
    unconditional_caption: torch.Tensor | None = None,
) -> StepInputs:
    """Apply the recipe to a batch whose noise and timesteps are drawn. The extra draws come from
    ``generator`` in this order, each only when its option is on: offset, perturbation, dropout. A dropped
    caption's hidden states become ``unconditional_caption``, and its pooled embedding (SDXL) zeros, as SDXL's
    training zeroes both (its pipelines' force_zeros_for_empty_prompt samples against the same); its size
    conditioning is kept."""
    if noise_offset:
        noise = offset_noise(noise, noise_offset, generator)
    input_noise = perturb(noise, input_perturbation, generator) if input_perturbation else noise
    noisy = noise_scheduler.add_noise(latents, input_noise, timesteps)
    dropped = None
    if caption_dropout_prob:
        if unconditional_caption is None:
            raise ValueError("caption dropout needs an unconditional caption embedding")
        hidden, dropped = drop_captions(conditioning.hidden, unconditional_caption, caption_dropout_prob, generator)
        pooled = conditioning.pooled
        if pooled is not None:
            pooled = torch.where(dropped.view(-1, 1), torch.zeros_like(pooled), pooled)
        conditioning = conditioning.with_text(hidden, pooled)
    return StepInputs(noisy, conditioning, training_target(noise_scheduler, latents, noise, timesteps), dropped)


def load_unconditional_caption(
    source: str, caption_shape: tuple[int, ...] | list[int], token_ids: bool = False
) -> torch.Tensor:
    """What dropped captions are replaced with: zeros, or the empty prompt's embedding from a .npy file; for data of
    token ids (``token_ids``), also the empty prompt's ids (L int values; sdtrain.train.build encodes them with the
    run's text encoder).

    The embedding file holds the text encoder's output for the empty prompt "", (L, D) or (1, L, D), with the
    dataset's caption shape (``caption_shape``: L x D). Read without unpickling (allow_pickle=False).
    """
    shape = tuple(int(n) for n in caption_shape)
    if source == "zeros":
        return torch.zeros(shape)
    from sdtrain.storage.filesystems import filesystem_for
    from sdtrain.storage.s3 import raise_if_unavailable

    fs, path = filesystem_for(source)
    try:
        with fs.open_input_file(path) as f:
            array = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        # Every worker reads this at every start, restarts included: a storage failure that outlasted the client's
        # retries must fail the attempt (Ray Train restarts it), not stop the run as a ConfigError would.
        raise_if_unavailable(e, f"data.unconditional_caption: {source}")
        raise ConfigError(f"data.unconditional_caption: cannot read {source} as a .npy array: {e}") from None
    if array.ndim in (2, 3) and array.shape[0] == 1:
        array = array[0]
    if array.dtype.kind in "iu":
        if not token_ids:
            raise ConfigError(
                f"data.unconditional_caption: {source} holds token ids, but the data holds caption embeddings: give "
                "the empty prompt's embedding (preprocessing's unconditional_caption.npy)"
            )
        if tuple(array.shape) != shape[:1]:
            raise ConfigError(
                f"data.unconditional_caption: {source} holds ids of shape {tuple(array.shape)}, but the dataset's "
                f"captions are {shape[0]} token ids; save the empty prompt's ids from the same tokenizer"
            )
        return torch.from_numpy(array.astype(np.int64))
    if tuple(array.shape) != shape:
        raise ConfigError(
            f"data.unconditional_caption: {source} holds an array of shape {tuple(array.shape)}, but the "
            f"dataset's captions are {shape} (L x D); save the empty prompt's embedding from the same text encoder"
        )
    if not np.isfinite(array).all():
        raise ConfigError(f"data.unconditional_caption: {source} holds NaN or inf values")
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def stored_latent_scaling(schemas: Sequence[tuple[str, Mapping[bytes, bytes] | None]], data) -> float | None:
    """The scaling factor the files say their latents already carry (parquet schema metadata key
    ``sdtrain.latent_scaling_factor``), or None. Datasets that disagree are refused, and so is setting
    data.latent_scaling_factor as well (it would scale them twice), naming the file.

    Args:
        schemas: (file, its arrow schema's metadata) of each dataset: the checked schema its dataset index
            recorded (sdtrain.data.dataset_index, which holds every file of a dataset to it), so no file is
            opened here.
    """
    if not schemas:
        return None
    factors = [(file, latent_scaling(metadata)) for file, metadata in schemas]
    first_file, found = factors[0]
    for file, factor in factors[1:]:
        if factor != found:
            raise DataError(
                f"data.val: {file} records {describe_scaling(factor)} but {first_file} records "
                f"{describe_scaling(found)} (parquet metadata {LATENT_SCALING_FACTOR}); data.train and data.val "
                "must hold latents scaled alike, or the held-out loss compares another scale"
            )
    if found is not None and data.latent_scaling_factor is not None:
        raise ConfigError(
            f"data.latent_scaling_factor: {first_file} records that its latents are already multiplied by "
            f"{found:g} (parquet metadata {LATENT_SCALING_FACTOR}); scaling them by "
            f"{data.latent_scaling_factor:g} again would apply the factor twice. Set data.latent_scaling_factor: null"
        )
    return found
