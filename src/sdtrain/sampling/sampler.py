"""Latents from a trained UNet with a fast scheduler and classifier-free guidance.

The sampling loop is StableDiffusionPipeline's (initial noise ``randn * init_noise_sigma`` from
one seeded CPU generator, conditional and unconditional halves in one batch, guidance
``uncond + scale * (cond - uncond)`` above scale 1, optionally rescaled; the conditional prediction alone at 1 or
below), so a model exported by sdtrain gives the same latents here and inside a diffusers pipeline; for an
SDXL-shaped UNet, StableDiffusionXLPipeline's (the pooled embedding and the size conditioning beside the hidden
states, zeros for the unconditional text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, UNet2DConditionModel

from sdtrain.errors import ConfigError, DataError
from sdtrain.model.conditioning import Conditioning, pooled_width, time_ids

SAMPLERS = ("ddim", "dpm")


def make_sampler(noise_scheduler_config: dict[str, Any], name: Literal["ddim", "dpm"], steps: int):
    """DDIM or DPM-Solver++ (multistep) on the training schedule (same betas and prediction type),
    with DDIM's ``clip_sample`` off even if the stored config has it on: it would clip each predicted
    latent to [-1, 1], which wrecks samples."""
    cls = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}[name]
    scheduler = cls.from_config({**noise_scheduler_config, "clip_sample": False})
    scheduler.set_timesteps(steps)
    return scheduler


def check_sampler_steps(
    steps: int,
    sampler: str,
    noise_scheduler_config: dict[str, Any],
    key: str,
    schedule: str = "a noise schedule",
    fails: str = "the sample grids and evaluations that sample with it would fail at the first checkpoint step",
) -> None:
    """Refuse ``steps`` (the config's ``key``) that ``sampler`` cannot take on ``schedule`` (the training one, or a
    loaded model's): a sampler takes fewer steps than the schedule has timesteps (DDIM refuses more, and at as many
    both index past the schedule's end), which fails only when something samples (``fails``)."""
    timesteps = int(noise_scheduler_config["num_train_timesteps"])
    if steps >= timesteps:
        raise ConfigError(
            f"{key}: {steps} steps with sample_grid.sampler={sampler} on {schedule} of {timesteps} timesteps "
            f"(num_train_timesteps): a sampler takes fewer steps than the schedule has, and {fails}; set {key} "
            f"below {timesteps} (20 to 50 is usual)"
        )


def guided_prediction(
    unet: UNet2DConditionModel,
    latents: torch.Tensor,
    t,
    cond: torch.Tensor | Conditioning,
    uncond: torch.Tensor | Conditioning | None,
    scale: float,
    rescale: float = 0.0,
) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond); at scale 1 or below, the conditional prediction
    itself, without the unconditional half computed: diffusers' pipelines guide only above 1 (their
    do_classifier_free_guidance), and an export must sample there as here. ``rescale`` blends in the guided
    prediction rescaled to the conditional one's standard deviation, as diffusers' pipelines do
    (``guidance_rescale``). The prediction comes back in the latents' dtype: under autocast (sample grids) the UNet
    answers in bf16 or fp16, and the guidance difference and the scheduler's step want the latents' precision.
    ``cond`` and ``uncond``: hidden states, or a whole :class:`Conditioning` (an SDXL-shaped UNet)."""
    cond = cond if isinstance(cond, Conditioning) else Conditioning(cond)
    if scale <= 1.0 or uncond is None:
        return unet(latents, t, **cond.kwargs()).sample.to(latents.dtype)
    uncond = uncond if isinstance(uncond, Conditioning) else Conditioning(uncond)
    out = unet(torch.cat([latents, latents]), t, **uncond.cat(cond).kwargs()).sample
    pred_uncond, pred_cond = out.to(latents.dtype).chunk(2)
    guided = pred_uncond + scale * (pred_cond - pred_uncond)
    return _rescaled(guided, pred_cond, rescale) if rescale else guided


def _rescaled(guided: torch.Tensor, conditional: torch.Tensor, rescale: float) -> torch.Tensor:
    """diffusers' rescale_noise_cfg (Lin et al. 2023, section 3.4), written out: importing it imports
    StableDiffusionPipeline's module, whose transformers imports warn on every run where torchvision is missing."""
    dims = list(range(1, guided.ndim))
    matched = guided * (conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * matched + (1 - rescale) * guided


def shape_seed(seed: int, latent_shape: tuple[int, ...]) -> int:
    """The seed of the initial noise of a set sampled at ``latent_shape`` with the run's ``seed``: each aspect-ratio
    bucket's own, so row i of one bucket does not start from the same values as row i of another (one generator
    seeded alike fills both from the same stream).

    Args:
        seed: the run's seed (train.seed).
        latent_shape: (C, H, W) of the set's samples.
    """
    digest = hashlib.sha256(json.dumps([int(seed), [int(side) for side in latent_shape]]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63: what torch.Generator.manual_seed takes


def initial_noise(
    latent_shape: tuple[int, ...], total: int, seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The initial noise (unscaled) of a set of ``total`` samples at ``latent_shape`` (C, H, W), seeded ``seed``.

    All of it drawn at once from one CPU generator: a row's noise does not depend on batch size or device, nor (the
    whole set's drawn, then sliced) on how the set is split or chunked.

    Args:
        latent_shape: (C, H, W) of one sample.
        total: the rows in the set.
        seed: the generator's seed.
        dtype: the noise's dtype (the UNet's: the same values sample_latents has always drawn).
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((total, *latent_shape), generator=generator, dtype=dtype)


def initial_noise_pieces(
    latent_shape: tuple[int, ...], total: int, seed: int, first: int, sizes: list[int], dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """Rows ``first``.. of :func:`initial_noise` (``latent_shape``, ``total``, ``seed``, ``dtype``), in consecutive
    pieces of ``sizes`` rows, each drawn when asked for: the same values, without the set's noise held whole (30k SD2
    samples at 512 px: ~1.9 GiB).

    torch's CPU normal fill draws in blocks of 16 values, so a row of whole blocks gets the same values drawn piece by
    piece as drawn with its set (tests/test_evaluation.py holds this); other shapes are drawn whole and sliced.
    """
    if math.prod(latent_shape) % 16:
        whole, at = initial_noise(latent_shape, total, seed, dtype), first
        for size in sizes:
            yield whole[at : at + size].clone()
            at += size
        return
    generator, skip = torch.Generator().manual_seed(seed), first
    while skip:  # the rows before ``first``, drawn and dropped a few at a time
        drawn = min(skip, _SKIPPED_AT_ONCE)
        torch.randn((drawn, *latent_shape), generator=generator, dtype=dtype)
        skip -= drawn
    for size in sizes:
        yield torch.randn((size, *latent_shape), generator=generator, dtype=dtype)


_SKIPPED_AT_ONCE = 256


@torch.no_grad()
def sample_latents(
    unet: UNet2DConditionModel,
    noise_scheduler_config: dict[str, Any],
    captions: torch.Tensor | Conditioning,
    unconditional: torch.Tensor | None,
    latent_shape: tuple[int, ...],  # (C, H, W)
    *,
    sampler: Literal["ddim", "dpm"] = "ddim",
    steps: int = 25,
    guidance_scale: float = 3.0,
    guidance_rescale: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
    within: tuple[int, int] | None = None,
    vae_downsampling: int = 8,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sample per row of ``captions`` (N, L, D) (or a :class:`Conditioning`: an SDXL-shaped UNet also needs the
    pooled embeddings; without time ids, each sample is of original size = target size = ``latent_shape`` in pixels,
    uncropped, as SDXL's pipeline defaults): (N, C, H, W) latents in the model's space. Guidance's unconditional half
    is ``unconditional`` (L, D), and zeros for the pooled embedding (SDXL's force_zeros_for_empty_prompt).

    Args:
        within: (first, total): the captions are rows first.. of a set of ``total`` sampled with ``seed``, and each
            gets the noise it gets there (a set split among tasks samples what it samples whole); None: (0, N).
        vae_downsampling: pixels per latent side, for SDXL's size conditioning.
        noise: the rows' initial noise, unscaled (their rows of :func:`initial_noise`); None: drawn here (``within``).
    """
    device = next(unet.parameters()).device
    dtype = next(unet.parameters()).dtype
    conditioning = _conditioning(unet, captions, latent_shape, vae_downsampling)
    scheduler = make_sampler(noise_scheduler_config, sampler, steps)
    if noise is None:
        first, total = within or (0, len(conditioning))
        if first < 0 or first + len(conditioning) > total:
            raise ValueError(
                f"sample_latents: rows {first}..{first + len(conditioning)} are not within a set of {total}"
            )
        noise = initial_noise(latent_shape, total, seed, dtype)[first : first + len(conditioning)]
    elif noise.shape != (len(conditioning), *latent_shape):
        raise ValueError(f"sample_latents: noise {tuple(noise.shape)} for {len(conditioning)} rows of {latent_shape}")
    noise = noise.to(dtype) * scheduler.init_noise_sigma
    out = []
    for start in range(0, len(conditioning), batch_size):
        scheduler = make_sampler(noise_scheduler_config, sampler, steps)  # multistep solvers keep state
        latents = noise[start : start + batch_size].to(device)
        cond = conditioning.rows(slice(start, start + batch_size)).to(device, dtype)
        uncond = None
        if unconditional is not None:
            pooled = None if cond.pooled is None else torch.zeros_like(cond.pooled)
            uncond = cond.with_text(unconditional.to(device, dtype).expand_as(cond.hidden), pooled)
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(latents, t)
            prediction = guided_prediction(unet, model_input, t, cond, uncond, guidance_scale, guidance_rescale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
        out.append(latents.float().cpu())
    return torch.cat(out)


def _conditioning(
    unet: UNet2DConditionModel, captions: torch.Tensor | Conditioning, latent_shape: tuple[int, ...], downsampling: int
) -> Conditioning:
    conditioning = captions if isinstance(captions, Conditioning) else Conditioning(captions)
    if pooled_width(unet.config) is None:
        return Conditioning(conditioning.hidden)
    if conditioning.pooled is None:
        raise DataError(
            "an SDXL-shaped UNet samples from each caption's pooled text embedding beside its hidden states: encode "
            "the prompts with both of its text encoders, or read the captions' pooled column"
        )
    if conditioning.time_ids is None:
        ids = time_ids((latent_shape[-2], latent_shape[-1]), downsampling, len(conditioning))
        conditioning = dataclasses.replace(conditioning, time_ids=ids)
    return conditioning
