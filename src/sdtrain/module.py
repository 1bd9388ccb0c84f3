"""The LightningModule: a diffusers UNet trained to predict the noise added by a DDPM schedule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
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

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents = batch["latents"].float()
        captions = batch["captions"].float()
        noise = torch.randn_like(latents)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
        )
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=captions).sample
        loss = F.mse_loss(prediction.float(), noise)
        self.loss_sum += loss.detach()
        self.loss_count += 1
        return loss

    def take_mean_loss(self) -> torch.Tensor:
        """Mean training loss since the last call (on the device), and reset the window."""
        mean = self.loss_sum / self.loss_count.clamp(min=1)
        self.loss_sum.zero_()
        self.loss_count.zero_()
        return mean

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.unet.parameters(), lr=self.train_config.lr, weight_decay=self.train_config.weight_decay
        )
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=self.train_config.warmup_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_META_KEY] = self.checkpoint_meta
