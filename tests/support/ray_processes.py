"""The processes of the Ray cluster a test started, found by descent from the test's own process: a signal sent
to "a training worker" must never reach another Ray session's on the same machine (another test run, CI)."""

from __future__ import annotations

import psutil


def our_training_workers() -> list[int]:
    """The pids of the Ray Train workers (``RayTrainWorker``) of the Ray cluster this process started: its raylet
    is this process's child, and the workers are the raylet's."""
    pids = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                pids.append(process.pid)
        except psutil.Error:  # it ended while we looked
            pass
    return pids
