"""Rank 0's live view of a training run: metrics.csv and loss_curve.png in the run directory, rewritten
in a background thread after every report, so the training loop only hands over a copy of the rows; and the
background tries of a view that failed (:class:`Outage`, the experiment trackers')."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from sdtrain.artifacts.run_outputs import LossLabels, write_run_outputs
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for


class BackgroundWriter:
    """Runs the latest job handed to :meth:`submit` in one daemon thread; a job handed over while another
    waits replaces it (only the newest state of the run directory matters). A failed job is logged, never
    raised: a missing live file must not stop training.

    With ``share``, a job of d seconds is followed by d x (1 / share - 1) seconds of rest before the next (none
    before a :meth:`flush` or :meth:`close`): jobs that grow with the run (the live files are rewritten whole, and
    format in Python under the GIL) never take more than that share of the thread's time, however long the run."""

    def __init__(self, name: str, share: float | None = None):
        """Args:
        name: the thread's.
        share: the most of its time the thread spends in jobs (None: no rest between them).
        """
        self._pending: Callable[[], None] | None = None
        self._busy = False
        self._closed = False
        self._urgent = 0  # flushes waiting: they skip the rest
        self._rest = 0.0 if share is None else 1 / share - 1
        self._resume_at = 0.0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._pending = job
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job handed over has run; False if ``timeout`` seconds passed first.

        Args:
            timeout: seconds to wait at most (None: no limit).
        """
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)
            finally:
                self._urgent -= 1

    def close(self, timeout: float | None = None) -> None:
        """Run what is pending, then stop the thread.

        Args:
            timeout: seconds to wait at most (None: no limit).
        """
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                while self._pending is not None and not (self._closed or self._urgent):  # rest after the last job
                    left = self._resume_at - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        break
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            began = time.monotonic()
            try:
                job()
            except Exception as error:  # a live file is a view: training goes on without it
                log.warning("could not update the run directory's live files: %s", error)
            finally:
                with self._cond:
                    ended = time.monotonic()
                    self._busy, self._resume_at = False, ended + (ended - began) * self._rest
                    self._cond.notify_all()


class Outage:
    """A view (an experiment tracker) that raised and has not caught up since: warned about once, when it starts and
    when it ends. Whether it answers again is tried in a daemon thread, one try at a time and ``retry_s`` apart: the
    training thread never waits on one."""

    def __init__(self, view: str, retry_s: float):
        """Args:
        view: its name, for the log.
        retry_s: seconds from a failure to the next try.
        """
        self.view = view
        self.since = time.monotonic()
        self.retry_s = retry_s
        self._answered = False
        self._next_try = self.since + retry_s
        self._thread: threading.Thread | None = None

    def warn(self, error: Exception) -> None:
        log.warning(
            f"{self.view} failed: {error}. Training goes on without it: what it misses stays in the run's history and "
            f"is sent to it in order once it answers again (tried every {self.retry_s:g} s, in the background)"
        )

    def over(self, held: str) -> None:
        log.warning(f"{self.view} answers again after {time.monotonic() - self.since:.0f} s: it holds {held} now")

    def again(self) -> None:
        """It failed again after a try found it answering: the same outage, tried again later."""
        self._answered, self._next_try = False, time.monotonic() + self.retry_s

    def answered(self, attempt: Callable[[], None]) -> bool:
        """Whether a try (``attempt``, which raises while the view does not answer) went through; else starts one when
        it is due."""
        if self._answered:
            return True
        if self._thread is not None and not self._thread.is_alive():
            self._thread, self._next_try = None, time.monotonic() + self.retry_s
        if self._thread is None and time.monotonic() >= self._next_try:
            self._thread = threading.Thread(target=self._try, args=(attempt,), name="sdtrain-view-try", daemon=True)
            self._thread.start()
        return False

    def _try(self, attempt: Callable[[], None]) -> None:
        try:
            attempt()
            self._answered = True
        except Exception as error:
            log.debug(f"{self.view} still does not answer: {error}")


# The most of a core's time (and of the training process's GIL) rewriting the live files takes: a long run's files
# are rewritten whole (a 50k-row metrics.csv and its curve take ~1 s), so they are brought up to date less often.
LIVE_FILES_SHARE = 0.05


class LiveOutputs:
    """metrics.csv and loss_curve.png in ``run_dir`` (local or s3://), brought up to date after the reports, in the
    background and at most :data:`LIVE_FILES_SHARE` of the time."""

    def __init__(self, run_dir: str, labels: LossLabels, writer: BackgroundWriter | None = None):
        """Args:
        run_dir: the run's directory (run.storage_path/run.name).
        labels: what the loss curve plots.
        writer: the background thread to write in (default: a new one).
        """
        self.filesystem, self.path = filesystem_for(run_dir)
        self.labels = labels
        self.writer = writer or BackgroundWriter("sdtrain-live-outputs", share=LIVE_FILES_SHARE)
        # Copies of the history's rows, made once each: the caller goes on appending to its list, and a row it changes
        # later (an evaluation's result) is replaced here (merged), never changed, so the writer's list stays whole.
        self._rows: list[dict[str, float]] = []

    def update(self, history: list[dict[str, float]]) -> list[dict[str, float]]:
        """Rewrite both files from ``history``: the rows after those copied before are copied (all of them when the
        history was cut back, a restart's). Returns the copies, a list no one changes (the trackers' rows too)."""
        rows = self._rows
        if len(history) < len(rows) or (rows and history[len(rows) - 1]["step"] != rows[-1]["step"]):
            rows.clear()
        rows.extend(dict(row) for row in history[len(rows) :])
        snapshot = list(rows)
        if snapshot:
            self.writer.submit(lambda: self._write(snapshot))
        return snapshot

    def merged(self, results: list[tuple[int, dict[str, float]]]) -> None:
        """``(step, metrics)`` merged into rows of the history since they were copied (sdtrain.train.evaluations): in
        the files at the next update."""
        steps = [int(row["step"]) for row in self._rows] if results else []
        for step, metrics in results:
            index = bisect.bisect_left(steps, step)
            if index < len(steps) and steps[index] == step:
                self._rows[index] = {**self._rows[index], **metrics}

    def _write(self, rows: list[dict[str, float]]) -> None:
        write_run_outputs(rows, self.filesystem, self.path, self.labels)
