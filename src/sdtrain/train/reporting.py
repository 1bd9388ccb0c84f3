"""Step-based reporting to Ray Train: metrics, progress lines, validation, and when a checkpoint
is due, the checkpoint (written by :mod:`sdtrain.train.checkpointing`).

Ray's own ``RayTrainReportCallback`` reports at epoch end only, which never comes in time for
a 550k-step single-epoch run; this one reports by optimizer step. Every rank calls
``ray.train.report`` at the same steps (it is a barrier).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import ray.train
import torch

from sdtrain.config.schema import RunConfig
from sdtrain.data.read_order import DataState
from sdtrain.errors import NonFiniteTraining, TrainingFailed
from sdtrain.train.checkpointing import report_with_checkpoint
from sdtrain.train.run_view import RunView
from sdtrain.train.strategy import is_sharded
from sdtrain.train.watchdog import Phase, StallWatchdog

log = logging.getLogger("sdtrain")

# Seconds of training between two checks for a preemption notice (a collective through Ray Train's
# synchronization actor, a few ms): Ray Train's watcher polls Ray for draining nodes every 5 s, and
# clouds give 30 s (GCP, Azure) to 120 s (AWS) of notice.
PREEMPTION_CHECK_S = 2.0

ValBatches = Callable[[], Iterable[dict[str, torch.Tensor]]]


class StepReporter(pl.Callback):
    def __init__(
        self,
        run: RunConfig,
        max_steps: int,
        samples_per_step: int,
        max_bad_steps: int,
        history: list[dict[str, float]],
        data_position: Callable[[int], DataState],
        plan_fingerprint: dict[str, Any],
        data_wait_s: Callable[[], float],
        launched_at: float,
        staging: str,
        val_batches: ValBatches | None = None,
        val_seed: int = 0,
        view: RunView | None = None,
        watchdog: StallWatchdog | None = None,
    ):
        """``history`` holds the rows of the checkpoint being resumed from ([] for a fresh run);
        ``data_position(step)`` is the data state after that step, saved with its checkpoint with
        ``plan_fingerprint``, what it refers to;
        ``data_wait_s()`` the seconds this rank waited for data since its previous call;
        ``launched_at`` the wall-clock time the driver started the run;
        ``staging`` the local directory checkpoints are written to before their upload;
        ``val_batches`` yields the whole validation set (None: no validation);
        ``view`` rank 0's live files, trackers and Ray gauges (None on other ranks);
        ``watchdog`` is told each step and what the worker does between steps (None: no watchdog)."""
        self.run = run
        self.staging = staging
        self.max_steps = max_steps
        self.samples_per_step = samples_per_step
        self.max_bad_steps = max_bad_steps
        self.data_position = data_position
        self.plan_fingerprint = plan_fingerprint
        self.data_wait_s = data_wait_s
        self.launched_at = launched_at
        self.val_batches = val_batches
        self.val_seed = val_seed
        self.view = view
        self.watchdog = watchdog
        self.val_every = run.val_every_n_steps or run.checkpoint_every_n_steps
        # One row per report, saved with each checkpoint so the curve survives restarts exactly:
        # rows after the checkpoint a restart resumes from are dropped with the steps they describe.
        self.history = list(history)
        self._seen_step = -1
        self._reported_step = -1
        self._checkpoint_stall = 0.0
        self._time_to_first_step = math.nan
        # Steps between preemption checks: every step until the first report measures the step rate.
        self._preemption_every = 1
        self._preempted_at: int | None = None  # the step of this group's just-in-time checkpoint

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window = (trainer.global_step, time.perf_counter())
        self._reported_step = self._seen_step = self._start_step = trainer.global_step
        if trainer.is_global_zero and trainer.global_step:
            log.info("resumed from step %d", trainer.global_step)
        if self.view is not None:
            self.view.started(self.history)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._enter(Phase.STEP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # a micro-batch that did not step the optimizer
            self._enter(Phase.BETWEEN_STEPS)
            return
        if self.watchdog is not None:
            self.watchdog.stepped(step)
        if self._seen_step == self._start_step:
            self._time_to_first_step = time.time() - self.launched_at
        self._seen_step = step
        checkpoint_due = step % self.run.checkpoint_every_n_steps == 0 or step >= self.max_steps
        if self._preemption_notice(trainer, step):
            checkpoint_due = True  # just in time: the restart resumes from this step
        if checkpoint_due or step % self.run.log_every_n_steps == 0:
            self._report(trainer, pl_module, step, with_checkpoint=checkpoint_due)
        self._enter(Phase.BETWEEN_STEPS)  # the data stream marks its own waits (TrainStream)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._reported_step:
            self._report(trainer, pl_module, trainer.global_step, with_checkpoint=True)
        if self.view is not None:
            self.view.finished("success")
        if self.watchdog is not None:
            self.watchdog.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.view is not None:
            self.view.finished("failed")
        if self.watchdog is not None:
            self.watchdog.stop()

    def _preemption_notice(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether Ray reported a node of this worker group as being reclaimed (a spot instance, a drain) and
        this group has not yet saved a checkpoint since. Every rank calls it at the same steps and gets rank 0's
        answer (``ray.train.get_preemption_info`` is a collective). After that checkpoint training goes on:
        Ray Train restarts the group, on the nodes that remain, at the reclaim deadline
        (failure.max_preemptions)."""
        if self._preempted_at is not None or step % self._preemption_every:
            return False
        notice = ray.train.get_preemption_info()
        if notice is None:
            return False
        self._preempted_at = step
        if trainer.is_global_zero:
            log.warning("%s: checkpoint at step %d", describe_preemption(notice), step)
        return True

    def _enter(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(phase)

    def _report(self, trainer: pl.Trainer, pl_module, step: int, with_checkpoint: bool) -> None:
        # Replays the epoch's order: computed once per report, for the metrics and the checkpoint.
        position = self.data_position(step)
        metrics = self._metrics(trainer, pl_module, step, position.epoch)
        if self.val_batches is not None and (step % self.val_every == 0 or step >= self.max_steps):
            self._enter(Phase.VALIDATION)
            metrics["val_loss"] = self._validate(trainer, pl_module)
        if trainer.is_global_zero:
            log.info(_progress_line(metrics, self.max_steps))
            self.history.append(metrics)
            if self.view is not None:
                self._enter(Phase.SAMPLE_GRID)
                self.view.reported(metrics, self.history, pl_module, with_checkpoint)
        self._enter(Phase.CHECKPOINT if with_checkpoint else Phase.REPORT)
        if with_checkpoint:
            self._checkpoint_stall = report_with_checkpoint(
                trainer,
                pl_module,
                metrics,
                step,
                position,
                self.plan_fingerprint,
                self.history,
                self.run.checkpoint_upload,
                self.staging,
            )
        else:
            ray.train.report(metrics)
        self._reported_step = step

    def _validate(self, trainer: pl.Trainer, pl_module) -> float:
        """Validation loss of the EMA weights when the run keeps an EMA (what export and generation use).

        Every rank takes part, so none waits in a collective while another validates (a long wait there
        outlasts the collective's timeout, and the restart validates again). Under DDP rank r computes the
        samples r, r + W, ...: each rank pays 1/W of the set. Under FSDP each forward pass is a collective
        over the weights' shards, so every rank runs every sample.
        """
        assert self.val_batches is not None
        if is_sharded(pl_module):
            sums = pl_module.validation_sums(self.val_batches(), self.val_seed)
        else:
            shard = pl_module.validation_sums(
                self.val_batches(), self.val_seed, rank=trainer.global_rank, world_size=trainer.world_size
            )
            sums = trainer.strategy.reduce(shard, reduce_op="sum")
        if sums[1] == 0:
            raise TrainingFailed("the validation set (data.val) yielded no samples")
        return float(sums[0] / sums[1])

    def _metrics(self, trainer: pl.Trainer, pl_module, step: int, epoch: int) -> dict[str, float]:
        stats = pl_module.take_window_stats()
        loss = trainer.strategy.reduce(stats["loss"], reduce_op="mean")
        skipped, streak = int(stats["skipped_steps"]), int(stats["longest_bad_streak"])
        # Rows differ per rank: sum them. Skipped steps must not: gradients (DDP) or their norm
        # (FSDP) are all-reduced, so every rank skips the same steps, or the ranks' weights differ.
        sums = trainer.strategy.reduce(torch.stack([stats["skipped_samples"], stats["skipped_steps"]]), reduce_op="sum")
        skipped_samples, skipped_on_all_ranks = int(sums[0]), int(sums[1])
        if skipped_on_all_ranks != skipped * trainer.world_size:
            raise TrainingFailed(
                f"the ranks disagree on the optimizer steps skipped for NaN/inf gradients up to step {step} "
                f"({skipped_on_all_ranks} in all over {trainer.world_size} ranks, {skipped} on rank "
                f"{trainer.global_rank}): their weights have diverged. Please report this as a bug"
            )
        if streak >= self.max_bad_steps:
            raise NonFiniteTraining(
                f"{streak} consecutive optimizer steps up to step {step} had NaN/inf gradients and were "
                f"skipped (train.max_bad_steps={self.max_bad_steps}): training has diverged. Lower train.lr "
                "or check the data; the weights were not updated by those steps"
            )
        start_step, start_time = self._window
        now = time.perf_counter()
        elapsed = max(now - start_time, 1e-9)
        steps_per_s = (step - start_step) / elapsed
        self._window = (step, now)
        # The slowest rank's (a rank that waits holds every other one at the next all-reduce) and, negated,
        # the slowest step rate, which sets the steps between preemption checks: the same on every rank.
        slowest = torch.tensor([self.data_wait_s() / elapsed, -steps_per_s], device=pl_module.device)
        slowest = trainer.strategy.reduce(slowest, reduce_op="max")
        data_wait_fraction = float(slowest[0])
        self._preemption_every = max(1, int(-float(slowest[1]) * PREEMPTION_CHECK_S))
        return {
            "step": step,
            "start_step": self._start_step,  # where this worker group started: restarts show here
            "epoch": epoch,  # the data epoch the next step reads from
            "loss": float(loss),
            "skipped_steps": skipped,
            "skipped_samples": skipped_samples,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "samples_per_s": steps_per_s * self.samples_per_step,
            "steps_per_s": steps_per_s,
            "time": time.time(),  # wall clock: restarts show as gaps
            # Seconds the training loop waited on the latest checkpoint (save, and upload when sync).
            "checkpoint_stall_s": self._checkpoint_stall,
            # Fraction of the wall time since the previous report the training loop waited for data.
            "data_wait_fraction": data_wait_fraction,
            # From the driver's start (train()) to this worker group's first optimizer step; after a
            # restart it includes the time the failure cost.
            "time_to_first_step_s": self._time_to_first_step,
        }


def describe_preemption(notice: ray.train.PreemptionInfo) -> str:
    """What a preemption notice says, for the log: which ranks go, and when."""
    nodes = ", ".join(node[:8] for node in notice.preempted_node_ids)
    ranks = ", ".join(str(rank) for rank in notice.preempted_ranks)
    deadline = notice.deadline_ms
    when = "at a time not given" if deadline is None else f"in {deadline / 1000 - time.time():.0f} s"
    return f"node {nodes} (rank {ranks}) is being reclaimed {when}"


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
        f"data wait {100 * metrics['data_wait_fraction']:.1f}%",
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
