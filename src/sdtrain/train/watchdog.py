"""A training worker that makes no optimizer step for ``run.stall_timeout_s`` fails its attempt.

Two bounds, so that a legitimately long phase between steps neither fails every restart at the same step nor
hides a hang: the step's own work (waiting for data, the step and its collectives, reporting metrics) has
``run.stall_timeout_s``, counted from the last step or the end of the last slow phase; each slow phase
(start-up with the checkpoint restore, validation, a checkpoint's save and upload, a sample grid, the hold before a
reclaim deadline) has ``run.slow_phase_timeout_s`` of its own, counted from its start.

A hung read, a rank stuck in a collective whose peer hangs, or an upload that never returns
would otherwise hold the whole job, silently, for as long as the cluster runs. The watchdog
runs on a thread of its own in each worker, so it fires whatever the training thread is blocked
in (a C call in a collective, a wait on Ray Data). It says what the worker was doing and for how
long, then ends the worker process: a collective wait cannot be interrupted by an exception. Ray
Train then sees a lost worker and restarts the group from the latest checkpoint
(``failure.max_failures``), or, with none left, the job fails with the reason in its log.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import lightning.pytorch as pl

from sdtrain.logs import log

EXIT_CODE = 75
"""The exit status of a worker the watchdog ended (EX_TEMPFAIL: a retry may succeed)."""


class Phase:
    """What a worker does between optimizer steps, as the watchdog's message says it."""

    STARTING = "starting: building the model and the trainer, restoring the checkpoint, joining the other ranks"
    FIRST_BATCH = "waiting for the first batch from the data stream (Ray Data)"
    NEXT_BATCH = "waiting for the next batch from the data stream (Ray Data)"
    BETWEEN_STEPS = "between steps: in Lightning's loop and its end-of-step checks across ranks"
    STEP = "in a training step: forward, backward and the optimizer step, with the gradient all-reduce across ranks"
    VALIDATION = "validating (data.val)"
    CHECKPOINT = "reporting a checkpoint: saving it, uploading it, and the barrier with every other rank"
    REPORT = "reporting metrics: the barrier with every other rank"
    UPLOAD_WAIT = (
        "reporting metrics after an asynchronously uploaded checkpoint: Ray Train takes reports in order, so this "
        "waits for rank 0's upload of it (checkpoint.upload: async), then the barrier with every other rank"
    )
    SAMPLE_GRID = "rendering a sample grid (sample_grid.every_n_steps) and writing the live files"
    RECLAIM = "holding after the last checkpoint before a reclaim deadline, until Ray Train restarts the group there"
    FINISHING = "finishing: the final report and checkpoint, and the trackers' and live files' last writes"


SLOW_PHASES = frozenset(
    {
        Phase.STARTING,
        Phase.VALIDATION,
        Phase.CHECKPOINT,
        Phase.UPLOAD_WAIT,
        Phase.SAMPLE_GRID,
        Phase.RECLAIM,
        Phase.FINISHING,
    }
)
"""Phases whose length grows with the model, the held-out set, the network or a reclaim notice, not with a step:
bounded on their own (run.slow_phase_timeout_s), and excluded from the step's bound."""

RECLAIM_BOUND_S = 420.0
"""The least a reclaim hold is allowed, whatever run.slow_phase_timeout_s: sdtrain.train.preemption holds up to
HOLD_BEFORE_DEADLINE_S + RESTART_MARGIN_S (360 s) for Ray Train to restart the group at the deadline. A worker
ended during the hold counts as a failure (failure.max_failures), not a preemption."""


def _end_worker(message: str) -> None:
    log.error("%s", message)
    for handler in logging.getLogger("sdtrain").handlers + logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)  # the training thread may be blocked in C: no exception reaches it


class StallWatchdog:
    """Ends this worker process if no optimizer step completes for ``timeout_s`` seconds outside slow phases, or a
    slow phase lasts ``slow_phase_timeout_s``.

    Args:
        timeout_s: Seconds without a step outside slow phases (from the end of start-up for the first one).
        rank: This worker's rank, for the message.
        slow_phase_timeout_s: Seconds one slow phase (:data:`SLOW_PHASES`) may last; None = unbounded.
        on_stall: Called with the message instead of ending the process (tests).
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        slow_phase_timeout_s: float | None = None,
        on_stall: Callable[[str], None] = _end_worker,
    ):
        self.timeout_s = timeout_s
        self.slow_phase_timeout_s = slow_phase_timeout_s
        self.rank = rank
        self._on_stall = on_stall
        self._lock = threading.Lock()
        self._phase, self._phase_since = Phase.STARTING, time.monotonic()
        self._last_step: int | None = None
        self._progress_at = self._phase_since  # the last step, or the end of the last slow phase
        self._stopped = threading.Event()
        poll = min(timeout_s, slow_phase_timeout_s or timeout_s) / 4
        threading.Thread(target=self._watch, args=(min(5.0, poll),), name="sdtrain-stall-watchdog", daemon=True).start()

    def enter(self, phase: str) -> None:
        """The worker now does ``phase`` (a :class:`Phase`)."""
        with self._lock:
            if phase != self._phase:
                now = time.monotonic()
                if self._phase in SLOW_PHASES:
                    self._progress_at = max(self._progress_at, now)
                self._phase, self._phase_since = phase, now

    def stepped(self, step: int) -> None:
        """Optimizer step ``step`` completed."""
        with self._lock:
            self._last_step, self._progress_at = step, time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def stalled(self, now: float) -> str | None:
        """What the watchdog would say at ``now``, if this worker is stalled."""
        with self._lock:
            phase, in_phase = self._phase, now - self._phase_since
            step, progress_at = self._last_step, self._progress_at
        since = "its start" if step is None else f"step {step}"
        if phase in SLOW_PHASES:
            bound = self.slow_phase_timeout_s
            if bound is not None and phase == Phase.RECLAIM:
                bound = max(bound, RECLAIM_BOUND_S)
            if bound is None or in_phase < bound:
                return None
            return (
                f"rank {self.rank} stalled: it has been {phase} for {in_phase:.0f} s (run.slow_phase_timeout_s="
                f"{self.slow_phase_timeout_s:g}; last optimizer step: {since}). Ending this worker so that Ray Train "
                "restarts the group from the latest checkpoint (failure.max_failures); raise "
                "run.slow_phase_timeout_s if this phase is legitimately this long"
            )
        idle = now - progress_at
        if idle < self.timeout_s:
            return None
        return (
            f"rank {self.rank} stalled: no optimizer step for {idle:.0f} s since {since}, outside start-up, "
            f"validation, checkpoints and sample grids (run.stall_timeout_s={self.timeout_s:g}); it has been {phase} "
            f"for {in_phase:.0f} s. Ending this worker so that Ray Train restarts the group from the latest "
            "checkpoint (failure.max_failures); raise run.stall_timeout_s if this phase is legitimately this long"
        )

    def _watch(self, poll_s: float) -> None:
        while not self._stopped.wait(poll_s):
            message = self.stalled(time.monotonic())
            if message is not None and not self._stopped.is_set():
                self._on_stall(message)
                return


class StallWatch(pl.Callback):
    """Tells the worker's :class:`StallWatchdog` each optimizer step, when a step starts, and when training ends (a
    slow phase); stops it on an exception.

    Listed first, so that the other callbacks' phases (validation, reporting, checkpointing) follow the step's.
    """

    def __init__(self, watchdog: StallWatchdog):
        self.watchdog = watchdog
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.watchdog.enter(Phase.STEP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.watchdog.stepped(trainer.global_step)
        self.watchdog.enter(Phase.BETWEEN_STEPS)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Watched on, not stopped: the callbacks after this one end the run here (StepReporter's final report and
        # checkpoint, the trackers' finish), and a hang there hung the job with no message. The worker stops the
        # watchdog once fit returns.
        self.watchdog.enter(Phase.FINISHING)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.watchdog.stop()
