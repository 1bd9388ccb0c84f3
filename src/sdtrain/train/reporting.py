"""Step-based reporting to Ray Train: metrics and progress lines, and when a checkpoint is due, the checkpoint
(written by :mod:`sdtrain.train.checkpointing`).

The other jobs of a step have callbacks of their own, all on one schedule (:mod:`sdtrain.train.cadence`):
the validation loss (:mod:`sdtrain.train.validation`), the preemption check (:mod:`sdtrain.train.preemption`)
and the stall watchdog (:mod:`sdtrain.train.watchdog`).

Ray's own ``RayTrainReportCallback`` reports at epoch end only, which never comes in time for
a 550k-step single-epoch run; this one reports by optimizer step. Every rank calls
``ray.train.report`` at the same steps (it is a barrier).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import lightning.pytorch as pl
import ray.train
import torch

from sdtrain.artifacts.run_totals import hours_so_far, money
from sdtrain.config.schema import TrainConfig
from sdtrain.errors import NonFiniteTraining, TrainingFailed
from sdtrain.evaluation.scores import scored_metrics
from sdtrain.logs import log
from sdtrain.private import torch as torch_private
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence
from sdtrain.train.checkpointing import CheckpointWriter
from sdtrain.train.efficiency import Efficiency
from sdtrain.train.evaluations import CheckpointEvaluations
from sdtrain.train.run_view import RunView
from sdtrain.train.sample_grids import SampleGrids
from sdtrain.train.validation import Validation
from sdtrain.train.watchdog import Phase


class StepReporter(OptimizerStepCallback):
    """Reports metrics to Ray Train at the steps the cadence names, with a checkpoint when one is due, and logs
    the progress line; refuses to go on when NaN/inf gradients skipped too many steps in a row.

    Args:
        cadence: the run's schedule of reports, validations and checkpoints.
        train: the train section (global batch size, max steps, train.max_nonfinite_steps).
        checkpoints: how a checkpoint is written and what it records besides the weights.
        history: the metric rows of the checkpoint being resumed from ([] for a fresh run).
        data_wait_s: the seconds this rank waited for data since its previous call.
        launched_at: the wall-clock time the driver started the run (for time_to_first_step_s).
        validation: the validation callback whose loss joins the report of its step (None: no data.val).
        view: rank 0's live files, trackers and Ray gauges (None on other ranks).
        evaluations: rank 0's checkpoint evaluations (None on other ranks, and without eval).
        enter: told the phase (the stall watchdog's), or a no-op.
        grids: the sample grids this rank draws: rank 0's, and under FSDP every rank's (each holds a shard of the
            weights); None: none here.
    """

    def __init__(
        self,
        cadence: ReportCadence,
        train: TrainConfig,
        checkpoints: CheckpointWriter,
        history: list[dict[str, float]],
        data_wait_s: Callable[[], float],
        launched_at: float,
        validation: Validation | None = None,
        view: RunView | None = None,
        enter: Callable[[str], None] = lambda phase: None,
        evaluations: CheckpointEvaluations | None = None,
        grids: SampleGrids | None = None,
    ):
        self.cadence = cadence
        self.train = train
        self.checkpoints = checkpoints
        # One row per report, saved with each checkpoint so the curve survives restarts exactly:
        # rows after the checkpoint a restart resumes from are dropped with the steps they describe.
        self.history = list(history)
        self.data_wait_s = data_wait_s
        self.launched_at = launched_at
        self.validation = validation
        self.view = view
        self.enter = enter
        self.evaluations = evaluations
        self.grids = grids
        self._score_attribute = view.config.checkpoint.score_attribute if view is not None else None
        self.slowest_steps_per_s = 0.0
        """The slowest rank's step rate at the latest report (the same on every rank)."""
        self._reported_step = -1
        self._checkpoint_stall = 0.0
        self._upload_pending = False  # the latest report's checkpoint uploads in the background: the next waits for it
        self._time_to_first_step = math.nan
        self._efficiency: Efficiency | None = None  # rank 0's, from on_train_start
        self._hours = 0.0
        """Rank 0: the run's workers x wall hours of training so far, over the steps the checkpoint kept."""
        self._window_s = 0.0
        self._graphs = 0
        """With train.compile: the graphs dynamo had compiled in this process at the latest report."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._window = (trainer.global_step, time.perf_counter())
        self._graphs = torch_private.compiled_graphs()[0] if self.train.compile else 0
        self._reported_step = self._start_step = trainer.global_step
        if trainer.is_global_zero and trainer.global_step:
            log.info("resumed from step %d", trainer.global_step)
        if trainer.is_global_zero:
            # The view (rank 0's, always there in a Ray worker) holds the config; the price is all it needs of it.
            cost = self.view.config.run.gpu_hour_cost if self.view is not None else None
            self._efficiency = Efficiency.of_run(pl_module, str(trainer.precision), cost)
            # Continues from the checkpoint's rows: the hours of steps lost to a restart are not in them.
            self._hours = hours_so_far(self.history)
        evaluated = self.evaluations.started(self.history) if self.evaluations is not None else []
        if self.view is not None:
            self.view.started(self.history)
            self.view.evaluated(evaluated)

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if math.isnan(self._time_to_first_step):
            self._time_to_first_step = time.time() - self.launched_at
        if self.cadence.report_due(step):
            self._report(trainer, pl_module, step, with_checkpoint=self.cadence.checkpoint_due(step))
        self.enter(Phase.BETWEEN_STEPS)  # the data stream marks its own waits (TrainStream)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._reported_step:
            self._report(trainer, pl_module, trainer.global_step, with_checkpoint=True)
        if self.view is not None:
            self.view.finished("success")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.view is not None:
            self.view.finished("failed")

    def _report(self, trainer: pl.Trainer, pl_module, step: int, with_checkpoint: bool) -> None:
        # Replays the epoch's order: computed once per report, for the metrics and the checkpoint.
        position = self.checkpoints.data_position(step)
        metrics = self._metrics(trainer, pl_module, step, position.epoch)
        val_loss = self.validation.take(step) if self.validation is not None else None
        if val_loss is not None:
            metrics["val_loss"] = val_loss
        shapes = pl_module.take_window_shapes()  # on every rank: each counts its own
        if self._efficiency is not None:  # rank 0
            metrics.update(self._efficiency.window(metrics["samples_per_s"], trainer.world_size, shapes))
            self._hours += trainer.world_size * self._window_s / 3600
            metrics[self._efficiency.hours_key] = self._hours
        evaluate = False
        if self.evaluations is not None:  # rank 0, with eval
            evaluated = self.evaluations.collect(self.history)
            if self.view is not None:
                self.view.evaluated(evaluated)
            evaluate = with_checkpoint and self.evaluations.due(step, final=step >= self.train.max_steps)
            if evaluate:
                metrics["evaluation_asked"] = 1.0
            metrics["evaluations_skipped"] = float(self.evaluations.skipped)
        grid = None
        if self.grids is not None and self.grids.due(step, self.train.max_steps):
            self.enter(Phase.SAMPLE_GRID)
            grid = self.grids.sample(pl_module.eval_unet, step)  # None on the ranks that only take part
        if trainer.is_global_zero:
            log.info(_progress_line(metrics, self.train.max_steps))
            self.history.append(metrics)
            if self.view is not None:
                self.enter(Phase.SAMPLE_GRID)
                self.view.reported(metrics, self.history, grid, with_checkpoint)
        self.enter(self.report_phase(with_checkpoint))
        if with_checkpoint:
            scored = scored_metrics(metrics, self._score_attribute)
            final = step >= self.train.max_steps
            self._checkpoint_stall = self.checkpoints.report(
                trainer, pl_module, scored, step, position, self.history, evaluate, final=final
            )
        else:
            began = time.perf_counter()
            ray.train.report(metrics)
            if self._upload_pending:  # the checkpoint's upload held this report: the next row's stall shows it
                self._checkpoint_stall += time.perf_counter() - began
        self.reported(with_checkpoint, final=step >= self.train.max_steps)
        self._reported_step = step

    def report_phase(self, with_checkpoint: bool) -> str:
        """The watchdog's phase of the next report: one after an asynchronously uploaded checkpoint waits for its upload
        (Ray Train takes each rank's reports in order), on rank 0 and at the barrier on the others: a slow phase."""
        if with_checkpoint:
            return Phase.CHECKPOINT
        return Phase.UPLOAD_WAIT if self._upload_pending else Phase.REPORT

    def reported(self, with_checkpoint: bool, final: bool) -> None:
        """A report was made: with a checkpoint uploaded in the background (checkpoint.upload: async; the final one is
        uploaded in the loop), the next report waits for it."""
        self._upload_pending = with_checkpoint and self.checkpoints.upload == "async" and not final

    def _metrics(self, trainer: pl.Trainer, pl_module, step: int, epoch: int) -> dict[str, float]:
        stats = pl_module.take_window_stats()
        loss = trainer.strategy.reduce(stats["loss"], reduce_op="mean")
        skipped = int(stats["skipped_steps"])
        # Rows differ per rank: sum them. Skipped steps must not: gradients (DDP) or their norm
        # (FSDP) are all-reduced, so every rank skips the same steps, or the ranks' weights differ.
        sums = trainer.strategy.reduce(torch.stack([stats["skipped_samples"], stats["skipped_steps"]]), reduce_op="sum")
        skipped_samples = int(sums[0])
        check_skipped_steps(trainer, step, skipped, int(sums[1]), int(stats["longest_bad_streak"]), self.train)
        start_step, start_time = self._window
        now = time.perf_counter()
        elapsed = max(now - start_time, 1e-9)
        steps_per_s = (step - start_step) / elapsed
        self._window = (step, now)
        self._window_s = elapsed
        # The slowest rank's (a rank that waits holds every other one at the next all-reduce) and, negated,
        # the slowest step rate, which sets the steps between preemption checks: the same on every rank; and the
        # most graphs a rank compiled in the window (a rank compiling holds every other one too).
        graphs = torch_private.compiled_graphs()[0] if self.train.compile else 0
        compiled, self._graphs = graphs - self._graphs, graphs
        slowest = torch.tensor([self.data_wait_s() / elapsed, -steps_per_s, compiled], device=pl_module.device)
        slowest = trainer.strategy.reduce(slowest, reduce_op="max")
        data_wait_fraction = float(slowest[0])
        self.slowest_steps_per_s = -float(slowest[1])
        return {
            **self._peak_memory(trainer, pl_module),
            "step": step,
            "start_step": self._start_step,  # where this worker group started: restarts show here
            "epoch": epoch,  # the data epoch the next step reads from
            "loss": float(loss),
            "skipped_steps": skipped,
            "skipped_samples": skipped_samples,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            # The global norm (all-reduced gradients: the same on every rank) before train.grad_clip_norm clips it.
            "grad_norm": float(stats["grad_norm"]),
            "grad_norm_max": float(stats["grad_norm_max"]),
            "samples_per_s": steps_per_s * self.train.global_batch_size,
            "steps_per_s": steps_per_s,
            "time": time.time(),  # wall clock: restarts show as gaps
            # Seconds the training loop waited on the latest checkpoint (save, and upload when sync).
            "checkpoint_stall_s": self._checkpoint_stall,
            # Fraction of the wall time since the previous report the training loop waited for data.
            "data_wait_fraction": data_wait_fraction,
            # From the driver's start (train()) to this worker group's first optimizer step; after a
            # restart it includes the time the failure cost.
            "time_to_first_step_s": self._time_to_first_step,
            # With train.compile: graphs compiled in the window (its first, a bucket's first draw, a recompile), whose
            # compilation its step rate holds.
            **({"graphs_compiled": float(slowest[2])} if self.train.compile else {}),
        }

    @staticmethod
    def _peak_memory(trainer: pl.Trainer, pl_module) -> dict[str, float]:
        """``peak_memory_gb``: the largest rank's peak of allocated GPU memory since it started (what the memory model
        predicts: sdtrain.model.memory); ``peak_reserved_gb``: its peak held by the caching allocator (fragmentation
        included); ``memory_capacity_gb``: the GPU's memory as torch sees it. Nothing on CPU workers, which have no
        allocator statistics."""
        if pl_module.device.type != "cuda":
            return {}
        device = pl_module.device
        figures = [
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            torch.cuda.get_device_properties(device).total_memory,
        ]
        peak = trainer.strategy.reduce(torch.tensor(figures, dtype=torch.float64, device=device), reduce_op="max")
        names = ("peak_memory_gb", "peak_reserved_gb", "memory_capacity_gb")
        return {name: float(value) / 1e9 for name, value in zip(names, peak, strict=True)}


def check_skipped_steps(
    trainer: pl.Trainer, step: int, skipped: int, skipped_on_all_ranks: int, streak: int, train: TrainConfig
) -> None:
    """Steps skipped for NaN/inf gradients: the same on every rank (else their weights diverged), and fewer than
    train.max_nonfinite_steps in a row (else training has diverged: a NonFiniteTraining, which spends no restart)."""
    if skipped_on_all_ranks != skipped * trainer.world_size:
        raise TrainingFailed(
            f"the ranks disagree on the optimizer steps skipped for NaN/inf gradients up to step {step} "
            f"({skipped_on_all_ranks} in all over {trainer.world_size} ranks, {skipped} on rank "
            f"{trainer.global_rank}): their weights have diverged. Please report this as a bug"
        )
    if streak >= train.max_nonfinite_steps:
        raise NonFiniteTraining(
            f"{streak} consecutive optimizer steps up to step {step} had NaN/inf gradients and were "
            f"skipped (train.max_nonfinite_steps={train.max_nonfinite_steps}): training has diverged. Lower train.lr "
            "or check the data; the weights were not updated by those steps"
        )


def _progress_line(metrics: dict[str, float], max_steps: int) -> str:
    step = int(metrics["step"])
    remaining = (max_steps - step) / metrics["steps_per_s"] if metrics["steps_per_s"] > 0 else math.inf
    parts = [
        f"step {step}/{max_steps} ({100 * step / max_steps:.0f}%)",
        f"loss {metrics['loss']:.4f}",
        *([f"skipped {metrics['skipped_steps']} non-finite step(s)"] if metrics["skipped_steps"] else []),
        *([f"skipped {metrics['skipped_samples']} unreadable sample(s)"] if metrics["skipped_samples"] else []),
        *([f"val_loss {metrics['val_loss']:.4f}"] if "val_loss" in metrics else []),
        f"lr {metrics['lr']:.2e}",
        f"{metrics['samples_per_s']:.1f} samples/s",
        *([f"MFU {100 * metrics['mfu']:.1f}%"] if "mfu" in metrics else []),
        *([f"{money(metrics['cost_per_million_images'])}/M images"] if "cost_per_million_images" in metrics else []),
        f"data wait {100 * metrics['data_wait_fraction']:.1f}%",
        *([f"compiled {metrics['graphs_compiled']:.0f} graph(s)"] if metrics.get("graphs_compiled") else []),
        f"ETA {format_duration(remaining)}",
    ]
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
