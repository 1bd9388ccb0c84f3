"""A Lightning callback that times optimizer steps after a warm-up, for the benchmarks that run the worker's own
step without Ray (``sdtrain.train.build.fit_without_ray``)."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


class StepTimer(pl.Callback):
    """Wall time of each optimizer step after the first ``warmup`` (compilation, autotuning), and
    the GPU's peak allocated and reserved memory after them: what bench/gpu_throughput.py reports.
    Synchronizes the device at the clock's start and end only."""

    def __init__(self, warmup: int):
        self.warmup = warmup
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

    def on_train_end(self, trainer, pl_module) -> None:
        _synchronize(pl_module.device)
        if self._start is not None:
            self.seconds = time.perf_counter() - self._start
            self.timed_steps = trainer.global_step - self.warmup
        if pl_module.device.type == "cuda":
            self.peak_memory = torch.cuda.max_memory_allocated(pl_module.device)
            self.peak_reserved = torch.cuda.max_memory_reserved(pl_module.device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
