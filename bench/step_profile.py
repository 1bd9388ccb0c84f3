"""A Lightning callback that profiles one optimizer step of the worker's own training step and splits its time by
kind of op (matmul, convolution, attention, memory-bound, optimizer), as the per-op model (tools/performance_model.py)
splits its prediction: what bench/gpu_throughput.py --profile prints beside the model's figures.

On a GPU each kernel's time is its launching aten op's (torch.profiler ties a kernel to the op that launched it);
kernels no aten op launched (inductor's fused Triton kernels) count as memory-bound. On a CPU (the smoke) an op's
own CPU time is its time."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch

from sdtrain.model.op_costs import op_kind

PROFILE_KINDS = ("matmul", "conv", "attention", "memory", "optimizer")


def profile_kind(name: str) -> str:
    """The kind of the profiled op ``name`` (``aten::addmm``): the optimizer step's fused and foreach ops apart (the
    model predicts them in its optimizer term), the rest by sdtrain.model.op_costs."""
    if "_fused_adam" in name or "_foreach_" in name:
        return "optimizer"
    return op_kind(name)


class StepProfile(pl.Callback):
    """Profiles optimizer step ``step`` (counted from 0): its wall time, and its seconds by kind of op.

    Args:
        step: the optimizer step to profile; the fit must run past it.
    """

    def __init__(self, step: int):
        self.step = step
        self.seconds_by_kind: dict[str, float] = {}
        self.wall_s = float("nan")
        self._profiler: torch.profiler.profile | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self._profiler is None:
            cuda = pl_module.device.type == "cuda"
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize(pl_module.device)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1 and self._profiler is not None and not self.seconds_by_kind:
            cuda = pl_module.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(pl_module.device)
            self.wall_s = time.perf_counter() - self._start
            self._profiler.stop()
            self.seconds_by_kind = _split(self._profiler.events(), cuda)


def _split(events, cuda: bool) -> dict[str, float]:
    """Seconds by kind: on a GPU the kernels each aten op launched (and the rest, fused, as memory-bound); on a CPU
    each aten op's own CPU time."""
    seconds = dict.fromkeys(PROFILE_KINDS, 0.0)
    attributed = 0.0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        own = sum(kernel.duration for kernel in event.kernels) if cuda else event.self_cpu_time_total
        seconds[profile_kind(event.name)] += own / 1e6
        attributed += own / 1e6
    if cuda:
        device = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        seconds["memory"] += max(0.0, device / 1e6 - attributed)
    return seconds
