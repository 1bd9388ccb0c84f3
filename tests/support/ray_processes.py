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


def committed_checkpoints(run_dir) -> list[str]:
    """The checkpoints Ray Train has committed for the run in ``run_dir`` (a Path), from its own record, the checkpoint
    manager's snapshot: files on disk alone may be a checkpoint still being reported, which a restart rightly
    ignores. None while the snapshot is missing or half written."""
    import json

    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        return [c["checkpoint_dir_name"] for c in snapshot["checkpoint_results"]]
    except (OSError, ValueError, KeyError):
        return []


def kill_at_first_checkpoint(driver, run_dir, timeout: float) -> tuple[list[str], str, list[int]]:
    """Once the run of ``driver`` (a train.py Popen, text mode, that started a Ray of its own) has committed a
    checkpoint in ``run_dir``, SIGKILL it and every process under it, by their ids (as when a job's head node dies);
    returns the committed checkpoints, what the driver printed to its piped stdout and the pids killed. Fails, with
    its piped stderr, if the driver ends first or ``timeout`` seconds pass."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and driver.poll() is None and not committed_checkpoints(run_dir):
        time.sleep(0.2)  # polling a file another process writes: nothing to wait on in this one
    if driver.poll() is not None:
        raise AssertionError(f"the run ended before a checkpoint could be waited for: {driver.communicate()[1]}")
    assert committed_checkpoints(run_dir), f"no checkpoint committed in {timeout} s"
    started = [driver.pid] + [child.pid for child in psutil.Process(driver.pid).children(recursive=True)]
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output, _ = driver.communicate(timeout=30)
    return committed_checkpoints(run_dir), output or "", started
