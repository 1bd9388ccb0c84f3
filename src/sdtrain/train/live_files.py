"""Rank 0's live view of a training run: metrics.csv and loss_curve.png in the run directory, rewritten
in a background thread after every report, so the training loop only hands over a copy of the rows."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sdtrain.artifacts.run_outputs import LossLabels, write_run_outputs
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for


class BackgroundWriter:
    """Runs the latest job handed to :meth:`submit` in one daemon thread; a job handed over while another
    waits replaces it (only the newest state of the run directory matters). A failed job is logged, never
    raised: a missing live file must not stop training."""

    def __init__(self, name: str):
        self._pending: Callable[[], None] | None = None
        self._busy = False
        self._closed = False
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
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

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
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                job()
            except Exception as error:  # a live file is a view: training goes on without it
                log.warning("could not update the run directory's live files: %s", error)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class LiveOutputs:
    """metrics.csv and loss_curve.png in ``run_dir`` (local or s3://), brought up to date at every report."""

    def __init__(self, run_dir: str, labels: LossLabels, writer: BackgroundWriter | None = None):
        """Args:
        run_dir: the run's directory (run.storage_path/run.name).
        labels: what the loss curve plots.
        writer: the background thread to write in (default: a new one).
        """
        self.filesystem, self.path = filesystem_for(run_dir)
        self.labels = labels
        self.writer = writer or BackgroundWriter("sdtrain-live-outputs")

    def update(self, history: list[dict[str, float]]) -> None:
        """Rewrite both files from ``history`` (copied: the caller goes on appending to its list)."""
        rows = [dict(row) for row in history]
        if rows:
            self.writer.submit(lambda: self._write(rows))

    def _write(self, rows: list[dict[str, float]]) -> None:
        write_run_outputs(rows, self.filesystem, self.path, self.labels)
