"""Validation loss that is comparable across steps, runs and restarts.

Training loss is noisy: each step draws fresh timesteps and noise. Here sample ``i`` of the
validation set always gets the same timestep (a fixed grid over the schedule) and the same
noise (a generator seeded by ``seed`` and ``i``), so the number moves only when the weights do,
and a checkpoint reloaded anywhere reproduces it.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel

NUM_TIMESTEPS = 10


@torch.no_grad()
def validation_loss(
    unet: UNet2DConditionModel,
    noise_scheduler: DDPMScheduler,
    batches: Iterable[dict[str, torch.Tensor]],
    seed: int = 0,
) -> float:
    """Mean epsilon-prediction MSE over every sample in ``batches`` (in the order given)."""
    was_training = unet.training
    unet.eval()
    device = next(unet.parameters()).device
    total_steps = noise_scheduler.config.num_train_timesteps
    grid = torch.linspace(0, total_steps - 1, NUM_TIMESTEPS).round().long()
    loss_sum, count = 0.0, 0
    for batch in batches:
        latents = batch["latents"].to(device).float()
        captions = batch["captions"].to(device).float()
        indices = range(count, count + latents.shape[0])
        noise = torch.stack(
            [torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(seed * 1_000_003 + i)) for i in indices]
        ).to(device)
        timesteps = grid[torch.tensor([i % NUM_TIMESTEPS for i in indices])].to(device)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=captions).sample
        per_sample = F.mse_loss(prediction.float(), noise, reduction="none").mean(dim=(1, 2, 3))
        loss_sum += per_sample.sum().item()
        count += latents.shape[0]
    unet.train(was_training)
    if count == 0:
        raise ValueError("the validation set yielded no samples")
    return loss_sum / count
