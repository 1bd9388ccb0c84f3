"""A checkpoint just in time when Ray reports a node of the worker group as being reclaimed, then a hold.

After that checkpoint every rank holds, out of any collective, until Ray Train ends the group at the reclaim
deadline and restarts it on the nodes that remain, from this checkpoint (failure.max_preemptions). Training on
would gain nothing: the restart resumes from the latest committed checkpoint, so steps after it are lost. And it
would risk the run: a rank in a gradient all-reduce when the node goes fails at once ("Connection closed by
peer"), and Ray Train, seeing a surviving worker fail before it sees the deadline pass, counts that as a failure
(failure.max_failures), not a preemption (a CI run failed so with failure.max_failures=0).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl
import ray.train

from sdtrain.logs import log
from sdtrain.private.ray import unstated_preemption_deadline_s
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence
from sdtrain.train.watchdog import Phase

# Seconds of training between two checks for a preemption notice (a collective through Ray Train's
# synchronization actor, a few ms): Ray Train's watcher polls Ray for draining nodes every 5 s, and
# clouds give 30 s (GCP, Azure) to 120 s (AWS) of notice.
PREEMPTION_CHECK_S = 2.0

# How long past the deadline the ranks hold before training on: Ray Train's controller notices the deadline at
# its next poll (every 2 s) and gives the workers 5 s to shut down. A group still alive after this was not ended
# by Ray Train (the notice was withdrawn, or Ray Train's preemption handling changed): training goes on.
RESTART_MARGIN_S = 60.0


class PreemptionCheck(OptimizerStepCallback):
    """Asks Ray about every PREEMPTION_CHECK_S seconds of training whether a node of this group is being
    reclaimed; the first notice makes this step a checkpoint step, and the ranks hold before the next one.

    Args:
        cadence: the run's schedule, told to checkpoint now.
        steps_per_s: the slowest rank's step rate at the latest report (the same on every rank: the check is a
            collective, so every rank must make it at the same steps); 0 before the first report.
        enter: told the phase (the stall watchdog's), or a no-op.
    """

    def __init__(
        self,
        cadence: ReportCadence,
        steps_per_s: Callable[[], float],
        enter: Callable[[str], None] = lambda phase: None,
    ):
        self.cadence = cadence
        self.steps_per_s = steps_per_s
        self.enter = enter
        self._notice: ray.train.PreemptionInfo | None = None
        self._held = False

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        every = max(1, int(self.steps_per_s() * PREEMPTION_CHECK_S))  # every step until the first report
        if self._notice is not None or step % every:
            return
        notice = ray.train.get_preemption_info()  # rank 0's answer on every rank
        if notice is None:
            return
        self._notice = notice
        self.cadence.checkpoint_now(step)
        if trainer.is_global_zero:
            log.warning("%s: checkpoint at step %d", describe_preemption(notice), step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The notice's step has reported its checkpoint (StepReporter, after this callback, at that step's end).
        if self._notice is None or self._held:
            return
        self._held = True
        self.hold(self._notice, log_it=trainer.is_global_zero)
        self.enter(Phase.STEP)

    def hold(self, notice: ray.train.PreemptionInfo, log_it: bool) -> float:
        """Wait out the reclaim: Ray Train ends this process when it restarts the group, so returning means it
        did not, RESTART_MARGIN_S after the deadline. Returns the seconds held."""
        started = time.time()
        if notice.deadline_ms is None:  # Ray Train's own wait for such a notice, from its detection
            deadline_s = started + unstated_preemption_deadline_s()
        else:
            deadline_s = notice.deadline_ms / 1000
        self.enter(Phase.RECLAIM)
        if log_it:
            log.warning(
                "holding until Ray Train restarts the group at the reclaim deadline (in %.0f s); steps trained "
                "after the notice's checkpoint would be lost at the restart",
                deadline_s - started,
            )
        time.sleep(max(0.0, deadline_s + RESTART_MARGIN_S - started))  # nothing to wait on: Ray Train kills us
        if log_it:
            log.warning("the group was not restarted %.0f s after the reclaim deadline: training on", RESTART_MARGIN_S)
        return time.time() - started


def describe_preemption(notice: ray.train.PreemptionInfo) -> str:
    """What a preemption notice says, for the log: which ranks go, and when."""
    nodes = ", ".join(node[:8] for node in notice.preempted_node_ids)
    ranks = ", ".join(str(rank) for rank in notice.preempted_ranks)
    deadline = notice.deadline_ms
    when = "at a time not given" if deadline is None else f"in {deadline / 1000 - time.time():.0f} s"
    return f"node {nodes} (rank {ranks}) is being reclaimed {when}"
