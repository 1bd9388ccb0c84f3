"""What Ray Train's controller does with a failed worker: stop the run at once on errors a retry cannot fix."""

from __future__ import annotations

from ray.train import UserCallback

from sdtrain.errors import find_sdtrain_error


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
