"""The validation loss on data.val at the steps the cadence names, on every rank (it is a collective)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import lightning.pytorch as pl
import torch

from sdtrain.errors import TrainingFailed
from sdtrain.logs import log
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence
from sdtrain.train.device_settings import training_autocast
from sdtrain.train.strategy import is_sharded, uncompiled
from sdtrain.train.watchdog import Phase

ValBatches = Callable[[], Iterable[dict[str, torch.Tensor]]]


class HeldValBatches:
    """data.val's batches, read once and then held in this worker's CPU memory while they fit in data.val_memory_gb.

    Every validation scores the same rows in the same order, so later ones read them from memory: no file is read
    again and no Ray Data execution starts, whose read tasks would need a worker process (on a small node Ray ends
    idle ones within a second, and a new one takes seconds to start, all inside the training loop). A set larger than
    the limit is read again at every validation, as it is without the limit. Only a complete pass is held.

    Args:
        read: yields the whole validation set, on the CPU (Ray Data's iterator over the worker's "val" shard).
        limit_bytes: the most it holds (data.val_memory_gb); 0 holds nothing.
    """

    def __init__(self, read: ValBatches, limit_bytes: int):
        self.read = read
        self.limit_bytes = limit_bytes
        self.held: list[dict[str, torch.Tensor]] | None = None
        self.too_large = limit_bytes <= 0

    def __call__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.held is not None:
            yield from self.held  # validation_sums copies the rows it takes: the held tensors are never changed
            return
        held: list[dict[str, torch.Tensor]] | None = None if self.too_large else []
        size = 0
        for batch in self.read():
            if held is not None:
                size += sum(t.nbytes for t in batch.values())
                if size > self.limit_bytes:
                    held, self.too_large = None, True
                    log.info(
                        "data.val takes more than data.val_memory_gb=%.3g GB: it is read again at every validation",
                        self.limit_bytes / 1e9,
                    )
                else:
                    held.append(batch)
            yield batch
        self.held = held


class Validation(OptimizerStepCallback):
    """Validation loss of the EMA weights when the run keeps an EMA (what export and generation use), for the
    report of the same step (:meth:`take`), under the autocast the training step runs under.

    Every rank takes part, so none waits in a collective while another validates (a long wait there outlasts the
    collective's timeout, and the restart validates again). Under DDP rank r computes the samples r, r + W, ...:
    each rank pays 1/W of the set. Under FSDP each forward pass is a collective over the weights' shards, so every
    rank runs every sample.

    Args:
        cadence: the run's schedule.
        batches: yields the whole validation set.
        seed: the seed of the fixed validation noise and timesteps (train.seed).
        enter: told the phase (the stall watchdog's), or a no-op.
    """

    def __init__(self, cadence: ReportCadence, batches: ValBatches, seed: int, enter: Callable[[str], None]):
        self.cadence = cadence
        self.batches = batches
        self.seed = seed
        self.enter = enter
        self._loss: tuple[int, float] | None = None
        self._validated_step = -1

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if self.cadence.validation_due(step):
            self._validate(trainer, pl_module, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Training that ended off the schedule still gets its final report (StepReporter.on_train_end).
        step = trainer.global_step
        if step != self._validated_step and (step % self.cadence.val_every == 0 or step >= self.cadence.max_steps):
            self._validate(trainer, pl_module, step)

    def _validate(self, trainer: pl.Trainer, pl_module, step: int) -> None:
        self._validated_step = step
        self.enter(Phase.VALIDATION)
        # Under training's autocast: the (EMA) weights are scored at the precision they trained at, at its speed.
        # Eager: a compiled UNet would compile a graph per validation batch shape, past its limit an error.
        with training_autocast(trainer), uncompiled():
            if is_sharded(pl_module):
                sums = pl_module.validation_sums(self.batches(), self.seed)
            else:
                shard = pl_module.validation_sums(
                    self.batches(), self.seed, rank=trainer.global_rank, world_size=trainer.world_size
                )
                sums = trainer.strategy.reduce(shard, reduce_op="sum")
        if sums[1] == 0:
            raise TrainingFailed("the validation set (data.val) yielded no samples")
        self._loss = (step, float(sums[0] / sums[1]))

    def take(self, step: int) -> float | None:
        """The validation loss computed at ``step``, if any."""
        loss, self._loss = self._loss, None
        return loss[1] if loss is not None and loss[0] == step else None
