"""The LightningModule: a diffusers UNet trained on a DDPM schedule, with the recipe of sdtrain.model.recipe
(epsilon or v-prediction, min-SNR weighting, offset noise, input perturbation, caption dropout) and
an optional EMA of its weights (sdtrain.model.ema)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from diffusers import UNet2DConditionModel
from diffusers.optimization import get_constant_schedule_with_warmup

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_META_KEY, CheckpointMeta, resume_refusal
from sdtrain.config.schema import TrainConfig
from sdtrain.errors import ConfigError
from sdtrain.model.conditioning import Conditioner, Conditioning
from sdtrain.model.ema import ema_update_, local_tensor, make_ema, take_ema_start
from sdtrain.model.recipe import diffusion_loss, step_inputs
from sdtrain.model.token_captions import CaptionEncoder
from sdtrain.model.unet import build_noise_scheduler
from sdtrain.model.validation import validation_loss, validation_sums
from sdtrain.train.device_settings import LATENT_DTYPE
from sdtrain.train.strategy import apply_options, is_sharded

_WINDOW_BUFFERS = (
    "loss_sum",
    "loss_count",
    "skipped_steps",
    "skipped_samples",
    "grad_norm_sum",
    "grad_norm_steps",
    "grad_norm_max",
)
"""The buffers a report's window sums (take_window_stats), reset at each report."""


class DiffusionModule(pl.LightningModule):
    # The buffers registered in __init__ (register_buffer sets them; declared here for their type).
    loss_sum: torch.Tensor
    loss_count: torch.Tensor
    skipped_steps: torch.Tensor
    skipped_samples: torch.Tensor
    bad_streak: torch.Tensor
    longest_bad_streak: torch.Tensor
    step_loss_nonfinite: torch.Tensor
    step_skipped: torch.Tensor
    grad_norm_sum: torch.Tensor
    grad_norm_steps: torch.Tensor
    grad_norm_max: torch.Tensor

    def __init__(
        self,
        unet: UNet2DConditionModel,
        noise_scheduler_config: dict[str, Any],
        train: TrainConfig,
        checkpoint_meta: CheckpointMeta,
        unconditional_caption: torch.Tensor | None = None,
        accumulation: int = 1,
        record_samples: bool = False,
        caption_dtype: torch.dtype = torch.float32,
        caption_encoder: CaptionEncoder | None = None,
    ):
        """``checkpoint_meta`` is stored in every checkpoint, so the model can be rebuilt from the
        checkpoint alone; its ``latent_scale`` multiplies stored latents as they are read.

        ``unconditional_caption`` (L x D) replaces dropped captions; default: zeros of the meta's
        ``caption_shape``. It is stored in the checkpoint (``unconditional_caption``), so sampling
        with classifier-free guidance uses the embedding the model was trained with.
        ``accumulation`` is the number of micro-batches per optimizer step; ``record_samples`` keeps
        the ``sample_index`` of every row trained on, for :meth:`take_sample_record`. ``caption_dtype``: the
        dtype the step hands the UNet its captions in (sdtrain.train.device_settings.CAPTION_DTYPES: autocast's
        own under mixed precision, so autocast does not cast them again at every cross-attention).
        ``caption_encoder``: for data whose captions are token ids, the frozen text encoder that turns each
        micro-batch's ids into embeddings (sdtrain.model.token_captions); a plain attribute, not a submodule:
        outside the optimizer, the checkpoint, DDP and FSDP.
        """
        super().__init__()
        self.caption_dtype = caption_dtype
        self.caption_encoder = caption_encoder
        self.conditioner = Conditioner(unet.config, checkpoint_meta.vae_downsampling, caption_encoder)
        self.accumulation = accumulation
        self.sample_record: list[torch.Tensor] | None = [] if record_samples else None
        self.window_shapes: Counter[tuple[int, ...]] = Counter()
        """This rank's samples by latent shape since the last report (aspect-ratio buckets: MFU at each's FLOPs)."""
        self._micro_batch = 0
        self.unet = unet
        self.noise_scheduler = build_noise_scheduler(noise_scheduler_config)
        self.train_config = train
        self.checkpoint_meta = checkpoint_meta
        self.latent_scale = float(checkpoint_meta.latent_scale)
        if unconditional_caption is None:
            unconditional_caption = torch.zeros(checkpoint_meta.caption_shape)
        # A frozen parameter rather than a buffer: saved in the checkpoint, but not broadcast by DDP every step.
        self.unconditional_caption = torch.nn.Parameter(unconditional_caption.float(), requires_grad=False)
        # A warm start from weights kept beside their EMA (sdtrain.model.unet.build_unet) continues that EMA.
        ema_start = take_ema_start(unet)
        self.ema_unet = make_ema(unet, ema_start) if train.ema_decay is not None else None
        # That EMA keeps the full decay, no ramp (sdtrain.model.ema): from the config, so the same on resume.
        self.ema_warm_start = ema_start is not None
        # Summed on the device and read only when a log line is due: no per-step host sync. The gradient norm's are
        # of the window's finite steps, before clipping. step_*: this step so far (1.0 once a micro-batch's loss is
        # NaN/inf; whether the step was skipped).
        for name in (*_WINDOW_BUFFERS, "bad_streak", "longest_bad_streak", "step_loss_nonfinite", "step_skipped"):
            self.register_buffer(name, torch.zeros(()), persistent=False)
        self._options_applied = False

    def configure_model(self) -> None:
        """Lightning's hook, run on every rank before the strategy wraps the module: the GPU options
        of the train config, FSDP sharding over the strategy's mesh (None under DDP), compilation."""
        if self._options_applied:  # Lightning calls it again for each new fit/validate
            return
        self._options_applied = True
        mesh = self._device_mesh["data_parallel"] if self._device_mesh is not None else None
        apply_options(self, self.train_config, mesh)

    def on_fit_start(self) -> None:
        if self.caption_encoder is not None:  # the strategy has moved the module to its device by now
            self.caption_encoder.to(self.device)

    def noise_and_timesteps(self, latents: torch.Tensor, micro_batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's noise and timesteps, a pure function of (seed, rank, global step, micro-batch).

        Nothing random carries over from earlier steps, so a run resumed from a checkpoint draws
        exactly what the uninterrupted run would have drawn at the same step.
        """
        return self._draw_noise_and_timesteps(latents, self._step_generator(latents.device, micro_batch))

    def _step_generator(self, device: torch.device, micro_batch: int) -> torch.Generator:
        """A generator freshly seeded from (seed, rank, global step, micro-batch): the source of
        every random draw of this micro-batch (noise, timesteps, then the recipe's offset noise,
        input perturbation and caption-dropout mask, in that order)."""
        key = np.random.SeedSequence([self.train_config.seed, self.global_rank, self.global_step, micro_batch])
        generator = torch.Generator(device=device)
        generator.manual_seed(int(key.generate_state(1, np.uint64)[0]))
        return generator

    def _draw_noise_and_timesteps(
        self, latents: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        timesteps = torch.randint(
            0,
            self.noise_scheduler.config.num_train_timesteps,
            (latents.shape[0],),
            generator=generator,
            device=latents.device,
        )
        return noise, timesteps

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # The latents in float32 for the noise and the target (device_settings.LATENT_DTYPE); the captions only
        # feed the cross-attentions' key and value projections, which autocast runs at caption_dtype anyway.
        latents = batch["latents"].to(LATENT_DTYPE)
        if self.latent_scale != 1.0:
            latents = latents * self.latent_scale
        conditioning = self.conditioner(batch, (latents.shape[-2], latents.shape[-1]), self.caption_dtype)
        self.window_shapes[tuple(latents.shape[1:])] += latents.shape[0]
        generator = self._step_generator(latents.device, self._micro_batch)
        self._micro_batch = (self._micro_batch + 1) % self.accumulation
        noise, timesteps = self._draw_noise_and_timesteps(latents, generator)
        config = self.train_config
        inputs = step_inputs(
            self.noise_scheduler,
            latents,
            conditioning,
            noise,
            timesteps,
            generator,
            noise_offset=config.noise_offset,
            input_perturbation=config.input_perturbation,
            caption_dropout_prob=config.caption_dropout_prob,
            unconditional_caption=self.unconditional_caption,
        )
        prediction = self.unet(inputs.noisy, timesteps, **inputs.conditioning.kwargs()).sample
        # Rows of an unreadable file skipped under data.on_read_error=skip carry valid=False.
        valid = batch.get("valid")
        loss = diffusion_loss(prediction, inputs.target, self.noise_scheduler, timesteps, config.snr_gamma, valid)
        if valid is not None:
            self.skipped_samples += valid.numel() - valid.sum()
        if self.sample_record is not None:
            self.sample_record.append(batch["sample_index"])
        finite = torch.isfinite(loss.detach())
        self.loss_sum += torch.where(finite, loss.detach(), 0.0)
        self.loss_count += finite
        torch.maximum(self.step_loss_nonfinite, (~finite).float(), out=self.step_loss_nonfinite)
        return loss

    def validation_conditioning(self, batch: Mapping[str, torch.Tensor], latents_hw: tuple[int, int]) -> Conditioning:
        """A validation batch's conditioning, in float32: validation runs the UNet under the step's autocast, which
        picks each op's dtype (sdtrain.model.validation)."""
        return self.conditioner(batch, latents_hw)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the gradients and skip the update if any is NaN/inf: on the device, no host sync.

        One norm serves both: the global gradient norm is non-finite exactly when a gradient is,
        and clipping scales by ``grad_clip_norm / norm``. Lightning's own clipping is not used: it
        refuses fused optimizers under mixed precision even without a scaler (Lightning-AI/
        pytorch-lightning#21435), and it would compute the norm a second time.

        The clipping factor is handed to the fused AdamW as its ``grad_scale`` (the divisor GradScaler
        unscales by), so the step scales each gradient as it reads it: one pass over the gradients less than
        scaling them first (equal within float32 rounding: ``g / (1 / f)`` against ``g * f``).

        The skip: without a GradScaler (32-true, bf16-mixed) this sets the fused AdamW's
        ``found_inf``, which leaves weights and optimizer state untouched (GradScaler's mechanism);
        such a step counts toward ``train.max_nonfinite_steps``. With one (16-mixed) the gradients are
        unscaled here first (the fused step would do it later, after clipping), and the scaler
        skips an overflow step and lowers its scale: routine, not divergence, so only a step whose
        loss itself was NaN/inf counts as bad. Under DDP the gradients are all-reduced and under
        FSDP the norm is, so every rank skips the same steps.
        """
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.unscale_(optimizer)
        grads = [local_tensor(p.grad) for p in self.unet.parameters() if p.grad is not None]
        norm = _global_norm(grads, sharded=is_sharded(self))
        finite = torch.isfinite(norm)
        nonfinite = (~finite).float()
        finite_norm = torch.where(finite, norm, 0.0)
        self.grad_norm_sum += finite_norm
        self.grad_norm_steps += finite
        torch.maximum(self.grad_norm_max, finite_norm, out=self.grad_norm_max)
        clip = self.train_config.grad_clip_norm
        factor = torch.clamp(clip / (norm + 1e-6), max=1.0) if clip > 0 else None
        if scaler is None:
            # Not declared by torch's Optimizer: the fused step reads both with getattr, and torch's own GradScaler
            # sets them this same way (with the same ignore). The fused step divides each gradient by grad_scale
            # as it reads it: clipping in the step's own pass over the gradients, not in a pass of its own.
            optimizer.found_inf = nonfinite  # type: ignore[attr-defined]
            optimizer.grad_scale = None if factor is None else 1.0 / factor  # type: ignore[attr-defined]
            bad = nonfinite
        else:
            if factor is not None:  # the scaler's step sets grad_scale itself
                torch._foreach_mul_(grads, factor)
            bad = self.step_loss_nonfinite.clone()
        self.step_skipped.copy_(nonfinite)
        self.step_loss_nonfinite.zero_()
        self.skipped_steps += nonfinite
        self.bad_streak.mul_(bad).add_(bad)
        torch.maximum(self.longest_bad_streak, self.bad_streak, out=self.longest_bad_streak)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.ema_unet is not None:
            decay = self.train_config.ema_decay
            assert decay is not None  # ema_unet exists only when train.ema_decay is set (__init__)
            # global_step still counts the steps before this one here. A skipped step leaves the EMA too.
            ema_update_(
                self.ema_unet.parameters(),
                self.unet.parameters(),
                self.global_step + 1,
                decay,
                self.train_config.ema_start_step,
                self.step_skipped,
                warm_start=self.ema_warm_start,
            )

    @property
    def eval_unet(self) -> UNet2DConditionModel:
        """The weights that validation, export and sampling use: the EMA's when there is one."""
        return self.ema_unet if self.ema_unet is not None else self.unet

    def validation_loss(self, batches: Iterable[dict[str, torch.Tensor]], seed: int) -> float:
        """Validation loss of ``eval_unet`` (see sdtrain.model.validation), on the data as training sees it."""
        return validation_loss(
            self.eval_unet,
            self.noise_scheduler,
            batches,
            seed,
            latent_scale=self.latent_scale,
            condition=self.validation_conditioning,
        )

    def validation_sums(
        self, batches: Iterable[dict[str, torch.Tensor]], seed: int, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        """[loss sum, samples] of ``eval_unet`` over this rank's share of the validation set (float64, on the
        device, to all-reduce): see sdtrain.model.validation.validation_sums."""
        sums = validation_sums(
            self.eval_unet,
            self.noise_scheduler,
            batches,
            seed,
            self.latent_scale,
            rank=rank,
            world_size=world_size,
            condition=self.validation_conditioning,
        )
        return torch.tensor(sums, dtype=torch.float64, device=self.device)

    def take_window_stats(self) -> dict[str, torch.Tensor]:
        """Mean finite training loss, skipped steps and samples, the longest run of consecutive skipped
        steps, and the mean and largest finite gradient norm (before clipping) since the last call (tensors on
        the device), and reset the window."""
        stepped = self.grad_norm_steps > 0
        stats = {
            "loss": torch.where(self.loss_count > 0, self.loss_sum / self.loss_count.clamp(min=1), float("nan")),
            "skipped_steps": self.skipped_steps.clone(),
            "skipped_samples": self.skipped_samples.clone(),
            "longest_bad_streak": self.longest_bad_streak.clone(),
            "grad_norm": torch.where(stepped, self.grad_norm_sum / self.grad_norm_steps.clamp(min=1), float("nan")),
            "grad_norm_max": torch.where(stepped, self.grad_norm_max, float("nan")),
        }
        for name in _WINDOW_BUFFERS:
            getattr(self, name).zero_()
        self.longest_bad_streak.copy_(self.bad_streak)
        return stats

    def take_window_shapes(self) -> Counter[tuple[int, ...]]:
        """This rank's samples by latent shape since the last call, and reset them."""
        shapes, self.window_shapes = self.window_shapes, Counter()
        return shapes

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
        checkpoint[CHECKPOINT_META_KEY] = self.checkpoint_meta.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before it loads the weights: a model the checkpoint cannot fill is refused by name.
        saved, weights = checkpoint.get(CHECKPOINT_META_KEY, {}), checkpoint.get("state_dict")
        names = weights.keys() if weights is not None else None
        refusal = resume_refusal(saved, names, self.checkpoint_meta, self.ema_unet is not None)
        if refusal is not None:
            raise ConfigError(refusal)
        # Lightning decides where an optimizer step falls from the micro-batches counted in the
        # current epoch. A resumed run starts a new data stream (sdtrain.data.read_order), possibly with
        # another accumulation: count from 0, or the first step would take too few micro-batches.
        # Checkpoints are saved at an optimizer step's last micro-batch, before Lightning marks it
        # completed: mark it, or Lightning would count it again on resume.
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if progress is not None:
            progress["current"] = {key: 0 for key in progress["current"]}
            progress["total"] = {key: progress["total"]["ready"] for key in progress["total"]}
            progress["is_last_batch"] = False


def _global_norm(grads: list[torch.Tensor], sharded: bool) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together; ``sharded``: each rank holds a shard of each
    gradient (FSDP), so the squared norms are summed over ranks (one scalar all-reduce)."""
    squares = torch.stack(torch._foreach_norm(grads)).square().sum()
    if sharded:
        torch.distributed.all_reduce(squares)
    return squares.sqrt()
