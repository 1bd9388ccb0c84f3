"""Validation loss that is comparable across steps, runs and restarts.

Training loss is noisy: each step draws fresh timesteps and noise. Here sample ``i`` of the
validation set always gets the same timestep (a fixed grid over the schedule) and the same
noise (a generator seeded by ``seed`` and ``i``), so the number moves only when the weights do,
and a checkpoint reloaded anywhere reproduces it.

The loss is the plain MSE against the scheduler's own training target (the noise for epsilon,
``get_velocity`` for v_prediction), with none of the training recipe's randomness or weighting:
no offset noise, perturbation, caption dropout or min-SNR weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.model.conditioning import Conditioner, Conditioning
from sdtrain.model.recipe import training_target

Condition = Callable[[Mapping[str, torch.Tensor], tuple[int, int]], Conditioning]
"""A batch's rows (on the device) and its latents' (H, W) -> the UNet's conditioning (sdtrain.model.conditioning)."""

NUM_TIMESTEPS = 10
_CONDITIONING = ("captions", "pooled", "placement")


def validation_loss(
    unet: UNet2DConditionModel,
    noise_scheduler: DDPMScheduler,
    batches: Iterable[dict[str, torch.Tensor]],
    seed: int = 0,
    latent_scale: float = 1.0,
    condition: Condition | None = None,
) -> float:
    """Mean prediction MSE over every sample in ``batches`` (in the order given), the stored latents
    multiplied by ``latent_scale`` first (as training does); ``condition``: as for :func:`validation_sums`."""
    loss_sum, count = validation_sums(unet, noise_scheduler, batches, seed, latent_scale, condition=condition)
    if count == 0:
        raise ValueError("the validation set yielded no samples")
    return loss_sum / count


@torch.no_grad()
def validation_sums(
    unet: UNet2DConditionModel,
    noise_scheduler: DDPMScheduler,
    batches: Iterable[dict[str, torch.Tensor]],
    seed: int = 0,
    latent_scale: float = 1.0,
    rank: int = 0,
    world_size: int = 1,
    condition: Condition | None = None,
) -> tuple[float, int]:
    """(sum of per-sample losses, samples) over the samples ``rank``, ``rank + world_size``, ... of ``batches``;
    ``condition`` turns a batch's rows (on the device) into the UNet's conditioning (token ids: through the text
    encoders, sdtrain.model.token_captions); default: the stored embeddings, and for an SDXL-shaped UNet the stored
    pooled embeddings and placement (:class:`sdtrain.model.conditioning.Conditioner`).

    A sample's noise and timestep depend on its index in the whole set only, so the ranks' sums add up
    to the single-process sum, whatever the world size.
    """
    condition = condition or Conditioner(unet.config)
    was_training = unet.training
    unet.eval()
    device = next(unet.parameters()).device
    total_steps = noise_scheduler.config.num_train_timesteps
    grid = torch.linspace(0, total_steps - 1, NUM_TIMESTEPS).round().long()
    loss_sum, count, seen = 0.0, 0, 0
    for batch in batches:
        size = batch["latents"].shape[0]
        indices = [i for i in range(seen, seen + size) if i % world_size == rank]
        rows = torch.tensor([i - seen for i in indices], dtype=torch.long)
        seen += size
        if not indices:
            continue
        latents = batch["latents"][rows].to(device).float()
        if latent_scale != 1.0:
            latents = latents * latent_scale
        hw = (latents.shape[-2], latents.shape[-1])
        conditioning = condition({key: batch[key][rows].to(device) for key in _CONDITIONING if key in batch}, hw)
        noise = torch.stack(
            [
                torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
                for i in indices
            ]
        ).to(device)
        timesteps = grid[torch.tensor([i % NUM_TIMESTEPS for i in indices])].to(device)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, **conditioning.kwargs()).sample
        target = training_target(noise_scheduler, latents, noise, timesteps)
        per_sample = F.mse_loss(prediction.float(), target, reduction="none").mean(dim=(1, 2, 3))
        loss_sum += per_sample.sum().item()
        count += len(indices)
    unet.train(was_training)
    return loss_sum, count
