"""Rank 0's experiment trackers on a thread of their own: a report hands its row over and training goes on.

A tracker's request was made on the training thread at every report: MLflow's ``log_batch`` took 40 ms median and up
to 360 ms against a server on the same machine, a server across a network its round trips more, and one that hangs
held training for its client's timeout (bench/tracker_wait.py). :class:`TrackerThread` makes the same calls of
:class:`sdtrain.train.trackers.Trackers`, in the order they were made, one at a time, in one daemon thread, so that
class's bookkeeping (each step once per tracker across restarts and outages) holds as it did on one thread. A report
waiting behind a newer one is dropped: the newer one's rows hold it (a tracker is sent every row after the step it
holds). A checkpoint waits for the calls before it: TensorBoard must hold every step up to a checkpoint that a restart
resumes from.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.train.live_files import BackgroundWriter
from sdtrain.train.trackers import Trackers

WAIT_S = 300  # the most a checkpoint or the end of a worker group waits for the trackers' calls before it


class TrackerThread:
    """The calls of a worker group's :class:`Trackers`, made in a thread in the order they were made."""

    def __init__(self, config: Config, run_dir: str, history: list[dict[str, float]]):
        """Args:
        config: the run's config.
        run_dir: run.storage_path/run.name, local or s3://.
        history: the rows of the checkpoint this worker group starts from, never changed (a copy).
        """
        self.trackers: Trackers | None = None  # opened in the thread: opening asks each tracker what it holds
        self._calls: collections.deque[tuple[str, Callable[[], object]]] = collections.deque()
        self._thread = BackgroundWriter("sdtrain-trackers")
        self._failed: set[str] = set()

        def open_trackers() -> None:
            self.trackers = Trackers(config, run_dir, history)

        self._call("open", open_trackers)

    def log_metrics(self, row: Mapping[str, float], step: int, history: Sequence[Mapping[str, float]]) -> None:
        """Args:
        row: the report's metrics, never changed once handed over.
        step: its step.
        history: the run's rows up to it, in step order, a list no one changes (the live files' copy).
        """
        self._call("report", lambda: self._opened().log_metrics(row, step, history))

    def log_evaluation(self, metrics: Mapping[str, float], step: int) -> None:
        """Args: metrics: an evaluation's, at its checkpoint's ``step``."""
        self._call("evaluation", lambda: self._opened().log_evaluation(metrics, step))

    def log_image(self, key: str, image: np.ndarray, step: int) -> None:
        """Args: key: its name; image: H x W x 3 uint8, never changed once handed over; step: its step."""
        self._call("image", lambda: self._opened().log_image(key, image, step))

    def before_checkpoint(self) -> None:
        """Wait for the calls made so far, then for TensorBoard's copy to the run directory (Trackers')."""
        self._call("checkpoint", lambda: self._opened().before_checkpoint(WAIT_S))
        if not self._thread.flush(WAIT_S):
            log.warning("the experiment trackers had not taken the rows before this checkpoint after %d s", WAIT_S)

    def finish(self, status: str) -> None:
        """Make the calls pending, close every tracker run, and stop the thread.

        Args:
            status: success or failed.
        """
        self._call("finish", lambda: self._opened().finish(status))
        if not self._thread.flush(WAIT_S):
            log.warning("the experiment trackers had not taken the run's last rows after %d s", WAIT_S)
        self._thread.close(timeout=0)

    def _call(self, kind: str, call: Callable[[], object]) -> None:
        self._calls.append((kind, call))
        self._thread.submit(self._drain)

    def _drain(self) -> None:
        while self._calls:
            kind, call = self._calls.popleft()
            if kind == "report" and self._calls and self._calls[0][0] == "report":
                continue  # the next report sends this one's rows too
            try:
                call()
            except Exception as error:  # a tracker is a view: training goes on (Trackers warns of its trackers' own)
                if kind not in self._failed:
                    self._failed.add(kind)
                    log.warning("the experiment trackers' %s call failed: %r", kind, error, exc_info=True)

    def _opened(self) -> Trackers:
        if self.trackers is None:
            raise RuntimeError("the trackers did not open")
        return self.trackers
