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
        accumulation: int = 1,
        record_samples: bool = False,
    ):
        """``checkpoint_meta`` (plain JSON data) is stored in every checkpoint, so the model can be
        rebuilt from the checkpoint alone: UNet and scheduler configs, data shapes, the run config.
        ``accumulation`` is the number of micro-batches per optimizer step; ``record_samples`` keeps
        the ``sample_index`` of every row trained on, for :meth:`take_sample_record`."""
        super().__init__()
        self.accumulation = accumulation
        self.sample_record: list[torch.Tensor] | None = [] if record_samples else None
        self._micro_batch = 0
        self.unet = unet
        self.noise_scheduler = build_noise_scheduler(noise_scheduler_config)
        self.train_config = train
        self.checkpoint_meta = checkpoint_meta
        # Summed on the device and read only when a log line is due: no per-step host sync.
        self.register_buffer("loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("loss_count", torch.zeros(()), persistent=False)
        self.register_buffer("skipped_steps", torch.zeros(()), persistent=False)
        self.register_buffer("skipped_samples", torch.zeros(()), persistent=False)
        self.register_buffer("bad_streak", torch.zeros(()), persistent=False)
        self.register_buffer("longest_bad_streak", torch.zeros(()), persistent=False)

    def noise_and_timesteps(self, latents: torch.Tensor, micro_batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's noise and timesteps, a pure function of (seed, rank, global step, micro-batch).

        Nothing random carries over from earlier steps, so a run resumed from a checkpoint draws
        exactly what the uninterrupted run would have drawn at the same step.
        """
        key = np.random.SeedSequence([self.train_config.seed, self.global_rank, self.global_step, micro_batch])
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
        noise, timesteps = self.noise_and_timesteps(latents, self._micro_batch)
        self._micro_batch = (self._micro_batch + 1) % self.accumulation
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=captions).sample
        per_sample = F.mse_loss(prediction.float(), noise, reduction="none").mean(dim=(1, 2, 3))
        # Rows of an unreadable file skipped under data.on_read_error=skip carry valid=False.
        valid = batch["valid"].float() if "valid" in batch else torch.ones_like(per_sample)
        loss = (per_sample * valid).sum() / valid.sum().clamp(min=1)
        self.skipped_samples += valid.numel() - valid.sum()
        if self.sample_record is not None:
            self.sample_record.append(batch["sample_index"])
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
        """Mean finite training loss, skipped steps and samples, and the longest run of consecutive
        skipped steps since the last call (tensors on the device), and reset the window."""
        stats = {
            "loss": torch.where(self.loss_count > 0, self.loss_sum / self.loss_count.clamp(min=1), float("nan")),
            "skipped_steps": self.skipped_steps.clone(),
            "skipped_samples": self.skipped_samples.clone(),
            "longest_bad_streak": self.longest_bad_streak.clone(),
        }
        for buffer in (self.loss_sum, self.loss_count, self.skipped_steps, self.skipped_samples):
            buffer.zero_()
        self.longest_bad_streak.copy_(self.bad_streak)
        return stats

    def take_sample_record(self) -> torch.Tensor:
        """Sample indices trained on since the last call, in order, and reset the record."""
        record = torch.cat(self.sample_record) if self.sample_record else torch.zeros(0, dtype=torch.int64)
        self.sample_record = []
        return record

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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning decides where an optimizer step falls from the micro-batches counted in the
        # current epoch. A resumed run starts a new data stream (sdtrain.sampling), possibly with
        # another accumulation: count from 0, or the first step would take too few micro-batches.
        # Checkpoints are saved at an optimizer step's last micro-batch, before Lightning marks it
        # completed: mark it, or Lightning would count it again on resume.
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if progress is not None:
            progress["current"] = {key: 0 for key in progress["current"]}
            progress["total"] = {key: progress["total"]["ready"] for key in progress["total"]}
            progress["is_last_batch"] = False
