"""A training worker that makes no optimizer step for ``run.stall_timeout_s`` fails its attempt.

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

log = logging.getLogger("sdtrain")

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
    SAMPLE_GRID = "rendering a sample grid (run.sample_every_n_steps) and writing the live files"


class StallWatchdog:
    """Ends this worker process if no optimizer step completes for ``timeout_s`` seconds.

    Args:
        timeout_s: Seconds without a step (from the worker's start for the first one).
        rank: This worker's rank, for the message.
    """

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._lock = threading.Lock()
        self._phase, self._phase_since = Phase.STARTING, time.monotonic()
        self._last_step: int | None = None
        self._last_step_at = self._phase_since
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="sdtrain-stall-watchdog", daemon=True).start()

    def enter(self, phase: str) -> None:
        """The worker now does ``phase`` (a :class:`Phase`)."""
        with self._lock:
            if phase != self._phase:
                self._phase, self._phase_since = phase, time.monotonic()

    def stepped(self, step: int) -> None:
        """Optimizer step ``step`` completed."""
        with self._lock:
            self._last_step, self._last_step_at = step, time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(5.0, self.timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                idle, phase, in_phase, step = (
                    now - self._last_step_at,
                    self._phase,
                    now - self._phase_since,
                    self._last_step,
                )
            if idle >= self.timeout_s and not self._stopped.is_set():
                since = "its start" if step is None else f"step {step}"
                log.error(
                    "rank %d stalled: no optimizer step for %.0f s since %s (run.stall_timeout_s=%g); it has been "
                    "%s for %.0f s. Ending this worker so that Ray Train restarts the group from the latest "
                    "checkpoint (failure.max_failures); raise run.stall_timeout_s if this phase is legitimately "
                    "this long",
                    self.rank,
                    idle,
                    since,
                    self.timeout_s,
                    phase,
                    in_phase,
                )
                for handler in logging.getLogger("sdtrain").handlers + logging.getLogger().handlers:
                    handler.flush()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_CODE)  # the training thread may be blocked in C: no exception reaches it
