"""The LightningModule: a diffusers UNet trained to predict the noise added by a DDPM schedule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from transformers import get_constant_schedule_with_warmup

from sdtrain.config import TrainConfig
from sdtrain.model import build_noise_scheduler

CHECKPOINT_META_KEY = "sdtrain"


class DiffusionModule(pl.LightningModule):
    def __init__(
        self,
        unet: UNet2DConditionModel,
        noise_scheduler_config: dict[str, Any],
        train: TrainConfig,
        checkpoint_meta: dict[str, Any],
    ):
        """``checkpoint_meta`` (plain JSON data) is stored in every checkpoint, so the model can be
        rebuilt from the checkpoint alone: UNet and scheduler configs, data shapes, the run config."""
        super().__init__()
        self.unet = unet
        self.noise_scheduler = build_noise_scheduler(noise_scheduler_config)
        self.train_config = train
        self.checkpoint_meta = checkpoint_meta
        # Summed on the device and read only when a log line is due: no per-step host sync.
        self.register_buffer("loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("loss_count", torch.zeros(()), persistent=False)
        self.register_buffer("skipped_steps", torch.zeros(()), persistent=False)
        self.register_buffer("bad_streak", torch.zeros(()), persistent=False)
        self.register_buffer("longest_bad_streak", torch.zeros(()), persistent=False)

    def noise_and_timesteps(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's noise and timesteps, a pure function of (seed, rank, global step).

        Nothing random carries over from earlier steps, so a run resumed from a checkpoint draws
        exactly what the uninterrupted run would have drawn at the same step.
        """
        key = np.random.SeedSequence([self.train_config.seed, self.global_rank, self.global_step])
        generator = torch.Generator(device=latents.device)
        generator.manual_seed(int(key.generate_state(1, np.uint64)[0]))
        noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), generator=generator, device=latents.device
        )
        return noise, timesteps

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents = batch["latents"].float()
        captions = batch["captions"].float()
        noise, timesteps = self.noise_and_timesteps(latents)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=captions).sample
        loss = F.mse_loss(prediction.float(), noise)
        finite = torch.isfinite(loss.detach())
        self.loss_sum += torch.where(finite, loss.detach(), 0.0)
        self.loss_count += finite
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the update if any gradient is NaN/inf: on the device, with no host sync.

        DDP has all-reduced the gradients by now, so one rank's NaN is every rank's NaN and all
        ranks skip together without a collective of their own. The fused AdamW kernel leaves
        weights and optimizer state untouched when ``found_inf`` is set (GradScaler's mechanism).
        """
        grads = [p.grad for p in self.unet.parameters() if p.grad is not None]
        bad = (~torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()).float()
        optimizer.found_inf = bad
        self.skipped_steps += bad
        self.bad_streak.mul_(bad).add_(bad)
        torch.maximum(self.longest_bad_streak, self.bad_streak, out=self.longest_bad_streak)

    def take_window_stats(self) -> dict[str, torch.Tensor]:
        """Mean finite training loss, skipped steps and the longest run of consecutive skipped
        steps since the last call (tensors on the device), and reset the window."""
        stats = {
            "loss": torch.where(self.loss_count > 0, self.loss_sum / self.loss_count.clamp(min=1), float("nan")),
            "skipped_steps": self.skipped_steps.clone(),
            "longest_bad_streak": self.longest_bad_streak.clone(),
        }
        for buffer in (self.loss_sum, self.loss_count, self.skipped_steps):
            buffer.zero_()
        self.longest_bad_streak.copy_(self.bad_streak)
        return stats

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.unet.parameters(),
            lr=self.train_config.lr,
            weight_decay=self.train_config.weight_decay,
            fused=True,  # one kernel; and it honours found_inf (see on_before_optimizer_step)
        )
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=self.train_config.warmup_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_META_KEY] = self.checkpoint_meta
