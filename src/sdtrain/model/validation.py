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

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.model.recipe import training_target

NUM_TIMESTEPS = 10


def validation_loss(
    unet: UNet2DConditionModel,
    noise_scheduler: DDPMScheduler,
    batches: Iterable[dict[str, torch.Tensor]],
    seed: int = 0,
    latent_scale: float = 1.0,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean prediction MSE over every sample in ``batches`` (in the order given), the stored latents
    multiplied by ``latent_scale`` first (as training does); ``embed``: as for :func:`validation_sums`."""
    loss_sum, count = validation_sums(unet, noise_scheduler, batches, seed, latent_scale, embed=embed)
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
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, int]:
    """(sum of per-sample losses, samples) over the samples ``rank``, ``rank + world_size``, ... of ``batches``;
    ``embed`` turns a batch's stored captions (on the device) into float embeddings (token ids: the text encoder,
    sdtrain.model.token_captions); default: they are embeddings.

    A sample's noise and timestep depend on its index in the whole set only, so the ranks' sums add up
    to the single-process sum, whatever the world size.
    """
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
        captions = batch["captions"][rows].to(device)
        captions = embed(captions) if embed is not None else captions.float()
        noise = torch.stack(
            [
                torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
                for i in indices
            ]
        ).to(device)
        timesteps = grid[torch.tensor([i % NUM_TIMESTEPS for i in indices])].to(device)
        noisy = noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=captions).sample
        target = training_target(noise_scheduler, latents, noise, timesteps)
        per_sample = F.mse_loss(prediction.float(), target, reduction="none").mean(dim=(1, 2, 3))
        loss_sum += per_sample.sum().item()
        count += len(indices)
    unet.train(was_training)
    return loss_sum, count
