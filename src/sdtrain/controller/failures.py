"""What a failed run does: stop at once on errors a retry cannot fix, and say where it stands."""

from __future__ import annotations

from typing import Any

import ray.train
from ray.train import UserCallback

from sdtrain.errors import find_sdtrain_error
from sdtrain.storage.filesystems import ray_storage, uri_for


class StopOnDeterministicErrors(UserCallback):
    """Runs on the Ray Train controller: a worker failing with one of our own errors (bad data,
    a diverged run, a bad config) would fail the same way after every restart, so the run stops
    now instead of spending ``failure.max_failures`` restarts on it.

    Raising here makes a controller error, which Ray Train's failure policy never retries;
    worker losses (SIGKILL, node preemption, OOM) stay retryable.
    """

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for error in worker_exceptions.values():
            ours = find_sdtrain_error(error)
            if ours is not None:
                raise ours


def failure_message(error: Exception, run_dir: str) -> str:
    filesystem, path = ray_storage(run_dir)
    try:
        latest = ray.train.Result.from_path(path, storage_filesystem=filesystem).checkpoint
    except Exception:  # no checkpoint manager state yet: the run failed before its first checkpoint
        latest = None
    where = (
        f"the latest checkpoint is {uri_for(latest.filesystem, latest.path)}" if latest else "no checkpoint was written"
    )
    rerun = "re-running the same command resumes from it" if latest else "re-running starts from scratch"
    ours = find_sdtrain_error(error)
    cause: Any = ours if ours is not None else error
    return f"training failed: {cause}\n{where}; after fixing the cause, {rerun} (run directory: {run_dir})"
