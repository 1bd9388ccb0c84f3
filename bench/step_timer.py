"""A Lightning callback that times optimizer steps after a warm-up, for the benchmarks that run the worker's own
step without Ray (``sdtrain.train.build.fit_without_ray``)."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


class StepTimer(pl.Callback):
    """Wall time of ``steps`` optimizer steps after the first ``warmup`` (compilation, autotuning), or of every step
    after them, and the GPU's peak allocated and reserved memory over them: what bench/gpu_throughput.py reports.
    Synchronizes the device at the clock's start and end only.

    Args:
        warmup: the untimed steps first.
        steps: the timed steps (None: to the fit's end; a profiled step may follow them).
    """

    def __init__(self, warmup: int, steps: int | None = None):
        self.warmup, self.steps = warmup, steps
        self.seconds = float("nan")
        self.timed_steps = 0
        self.peak_memory = 0
        self.peak_reserved = 0
        self._start: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and self._start is None:
            _synchronize(pl_module.device)
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._start = time.perf_counter()
        elif self.steps is not None and trainer.global_step == self.warmup + self.steps:
            self._stop(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop(trainer, pl_module)

    def _stop(self, trainer, pl_module) -> None:
        if self._start is None or self.timed_steps:
            return
        _synchronize(pl_module.device)
        self.seconds = time.perf_counter() - self._start
        self.timed_steps = trainer.global_step - self.warmup
        if pl_module.device.type == "cuda":
            self.peak_memory = torch.cuda.max_memory_allocated(pl_module.device)
            self.peak_reserved = torch.cuda.max_memory_reserved(pl_module.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
