"""Latents from a trained UNet with a fast scheduler and classifier-free guidance.

The sampling loop is StableDiffusionPipeline's (initial noise ``randn * init_noise_sigma`` from
one seeded CPU generator, conditional and unconditional halves in one batch, guidance
``uncond + scale * (cond - uncond)``), so a model exported by sdtrain gives the same latents here
and inside a diffusers pipeline.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, UNet2DConditionModel

SAMPLERS = ("ddim", "dpm")


def make_sampler(noise_scheduler_config: dict[str, Any], name: Literal["ddim", "dpm"], steps: int):
    """DDIM or DPM-Solver++ (multistep) on the training schedule (same betas and prediction type),
    with DDIM's ``clip_sample`` off even if the stored config has it on: it would clip each predicted
    latent to [-1, 1], which wrecks samples."""
    cls = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}[name]
    scheduler = cls.from_config({**noise_scheduler_config, "clip_sample": False})
    scheduler.set_timesteps(steps)
    return scheduler


def guided_prediction(
    unet: UNet2DConditionModel, latents: torch.Tensor, t, cond: torch.Tensor, uncond: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond); at scale 1, the conditional prediction itself.
    The prediction comes back in the latents' dtype: under autocast (sample grids) the UNet answers in bf16 or
    fp16, and the guidance difference and the scheduler's step want the latents' precision."""
    if scale == 1.0 or uncond is None:
        return unet(latents, t, encoder_hidden_states=cond).sample.to(latents.dtype)
    out = unet(torch.cat([latents, latents]), t, encoder_hidden_states=torch.cat([uncond, cond])).sample
    pred_uncond, pred_cond = out.to(latents.dtype).chunk(2)
    return pred_uncond + scale * (pred_cond - pred_uncond)


@torch.no_grad()
def sample_latents(
    unet: UNet2DConditionModel,
    noise_scheduler_config: dict[str, Any],
    captions: torch.Tensor,
    unconditional: torch.Tensor | None,
    latent_shape: tuple[int, ...],  # (C, H, W)
    *,
    sampler: Literal["ddim", "dpm"] = "ddim",
    steps: int = 25,
    guidance_scale: float = 3.0,
    seed: int = 0,
    batch_size: int = 64,
    within: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One sample per row of ``captions`` (N, L, D): (N, C, H, W) latents in the model's space.

    Args:
        within: (first, total): the captions are rows first.. of a set of ``total`` sampled with ``seed``, and each
            gets the noise it gets there (a set split among tasks samples what it samples whole); None: (0, N).
    """
    device = next(unet.parameters()).device
    dtype = next(unet.parameters()).dtype
    scheduler = make_sampler(noise_scheduler_config, sampler, steps)
    generator = torch.Generator().manual_seed(seed)
    first, total = within or (0, len(captions))
    if first < 0 or first + len(captions) > total:
        raise ValueError(f"sample_latents: rows {first}..{first + len(captions)} are not within a set of {total}")
    # All the initial noise first, from one CPU generator: the result does not depend on batch_size or device, nor
    # (the whole set's noise drawn, then sliced) on how the set is split.
    noise = torch.randn((total, *latent_shape), generator=generator, dtype=dtype)[first : first + len(captions)]
    noise = noise * scheduler.init_noise_sigma
    out = []
    for start in range(0, len(captions), batch_size):
        scheduler = make_sampler(noise_scheduler_config, sampler, steps)  # multistep solvers keep state
        latents = noise[start : start + batch_size].to(device)
        cond = captions[start : start + batch_size].to(device, dtype)
        uncond = None if unconditional is None else unconditional.to(device, dtype).expand_as(cond)
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(latents, t)
            prediction = guided_prediction(unet, model_input, t, cond, uncond, guidance_scale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
        out.append(latents.float().cpu())
    return torch.cat(out)
