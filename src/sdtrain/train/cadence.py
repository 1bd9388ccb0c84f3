"""Which optimizer steps report, validate and checkpoint: one schedule that every rank follows.

A report is a barrier (``ray.train.report``), and validation and the preemption check are collectives: every
rank must take them at the same steps, so the callbacks that do them all ask this one object.
"""

from __future__ import annotations

import lightning.pytorch as pl

from sdtrain.config.schema import Config


class ReportCadence:
    """Args:
    config: the run's config: the checkpoint, log and validation intervals, and train.max_steps (the last step
        always reports, validates and checkpoints).
    """

    def __init__(self, config: Config):
        self.checkpoint_every = config.checkpoint.every_n_steps
        self.log_every = config.run.log_every_n_steps
        self.val_every = config.run.val_every_n_steps or config.checkpoint.every_n_steps
        self.max_steps = config.train.max_steps
        self._checkpoint_at: int | None = None

    def checkpoint_now(self, step: int) -> None:
        """Checkpoint at ``step`` whatever the interval (a preemption notice: the restart resumes from it)."""
        self._checkpoint_at = step

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step >= self.max_steps or step == self._checkpoint_at

    def report_due(self, step: int) -> bool:
        return self.checkpoint_due(step) or step % self.log_every == 0

    def validation_due(self, step: int) -> bool:
        return self.report_due(step) and (step % self.val_every == 0 or step >= self.max_steps)


class OptimizerStepCallback(pl.Callback):
    """A callback called once per optimizer step (``on_step``), not per micro-batch of an accumulation."""

    _last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.on_step(trainer, pl_module, trainer.global_step)

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        raise NotImplementedError
