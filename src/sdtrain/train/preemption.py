"""A checkpoint just in time when Ray reports a node of the worker group as being reclaimed.

After that checkpoint training goes on: Ray Train restarts the group, on the nodes that remain, at the reclaim
deadline (failure.max_preemptions), from this checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl
import ray.train

from sdtrain.logs import log
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence

# Seconds of training between two checks for a preemption notice (a collective through Ray Train's
# synchronization actor, a few ms): Ray Train's watcher polls Ray for draining nodes every 5 s, and
# clouds give 30 s (GCP, Azure) to 120 s (AWS) of notice.
PREEMPTION_CHECK_S = 2.0


class PreemptionCheck(OptimizerStepCallback):
    """Asks Ray about every PREEMPTION_CHECK_S seconds of training whether a node of this group is being
    reclaimed; the first notice makes this step a checkpoint step.

    Args:
        cadence: the run's schedule, told to checkpoint now.
        steps_per_s: the slowest rank's step rate at the latest report (the same on every rank: the check is a
            collective, so every rank must make it at the same steps); 0 before the first report.
    """

    def __init__(self, cadence: ReportCadence, steps_per_s: Callable[[], float]):
        self.cadence = cadence
        self.steps_per_s = steps_per_s
        self._noticed = False

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        every = max(1, int(self.steps_per_s() * PREEMPTION_CHECK_S))  # every step until the first report
        if self._noticed or step % every:
            return
        notice = ray.train.get_preemption_info()  # rank 0's answer on every rank
        if notice is None:
            return
        self._noticed = True
        self.cadence.checkpoint_now(step)
        if trainer.is_global_zero:
            log.warning("%s: checkpoint at step %d", describe_preemption(notice), step)


def describe_preemption(notice: ray.train.PreemptionInfo) -> str:
    """What a preemption notice says, for the log: which ranks go, and when."""
    nodes = ", ".join(node[:8] for node in notice.preempted_node_ids)
    ranks = ", ".join(str(rank) for rank in notice.preempted_ranks)
    deadline = notice.deadline_ms
    when = "at a time not given" if deadline is None else f"in {deadline / 1000 - time.time():.0f} s"
    return f"node {nodes} (rank {ranks}) is being reclaimed {when}"
