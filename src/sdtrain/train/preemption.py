"""A checkpoint just in time when Ray reports a node of the worker group as being reclaimed, then a hold.

After the last checkpoint before the reclaim deadline every rank holds, out of any collective, until Ray Train
ends the group at the deadline and restarts it on the nodes that remain, from that checkpoint
(failure.max_preemptions). Training on to the deadline would gain nothing: the restart resumes from the latest
committed checkpoint, so steps after it are lost. And it would risk the run: a rank in a gradient all-reduce when
the node goes fails at once ("Connection closed by peer"), and Ray Train, seeing a surviving worker fail before it
sees the deadline pass, counts that as a failure (failure.max_failures), not a preemption (a CI run failed so with
failure.max_failures=0).

A cloud's notice (30 s to 120 s) is shorter than HOLD_BEFORE_DEADLINE_S: the notice's checkpoint is the last, and
the ranks hold right after it. A longer one (a drain for maintenance, ``ray drain-node --deadline-remaining-seconds
3600``) would idle the whole group for most of it: training goes on, checkpointing on its schedule, until
HOLD_BEFORE_DEADLINE_S before the deadline, when it checkpoints once more and holds.

A later notice with an earlier deadline (a spot reclaim of another node during a maintenance drain) checkpoints
again at once, and the hold goes by it: Ray Train restarts the group at the earliest deadline of its notices.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl
import ray.train
from ray.train.collective import broadcast_from_rank_zero

from sdtrain.logs import log
from sdtrain.private.ray import unstated_preemption_deadline_s
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence
from sdtrain.train.watchdog import Phase

# Seconds of training between two checks for a preemption notice (a collective through Ray Train's
# synchronization actor, a few ms): Ray Train's watcher polls Ray for draining nodes every 5 s, and
# clouds give 30 s (GCP, Azure) to 120 s (AWS) of notice.
PREEMPTION_CHECK_S = 2.0

# How long before the reclaim deadline the ranks take their last checkpoint and hold: a step, then the checkpoint's
# save and upload must fit in it, since Ray Train resumes only from a checkpoint committed before the node goes.
HOLD_BEFORE_DEADLINE_S = 300.0

# How long past the deadline the ranks hold before training on: Ray Train's controller notices the deadline at
# its next poll (every 2 s) and gives the workers 5 s to shut down. A group still alive after this was not ended
# by Ray Train (the notice was withdrawn, or Ray Train's preemption handling changed): training goes on.
RESTART_MARGIN_S = 60.0


class PreemptionCheck(OptimizerStepCallback):
    """Asks Ray about every PREEMPTION_CHECK_S seconds of training whether a node of this group is being
    reclaimed; the first notice, and any later one whose deadline is earlier than every one before it, makes this
    step a checkpoint step. From then on, at the same steps, rank 0's clock decides for every rank whether the
    earliest deadline is HOLD_BEFORE_DEADLINE_S away: that step checkpoints too (unless it is a notice's), and the
    ranks hold before the next one.

    Args:
        cadence: the run's schedule, told to checkpoint now.
        steps_per_s: the slowest rank's step rate at the latest report (the same on every rank: the check is a
            collective, so every rank must make it at the same steps); 0 before the first report.
        enter: told the phase (the stall watchdog's), or a no-op.
        ask: the notice, rank 0's on every rank (Ray Train's ``get_preemption_info``).
        agree: rank 0's value on every rank (Ray Train's ``broadcast_from_rank_zero``).
    """

    def __init__(
        self,
        cadence: ReportCadence,
        steps_per_s: Callable[[], float],
        enter: Callable[[str], None] = lambda phase: None,
        ask: Callable[[], ray.train.PreemptionInfo | None] = ray.train.get_preemption_info,
        agree: Callable[[bool], bool] = broadcast_from_rank_zero,
    ):
        self.cadence = cadence
        self.steps_per_s = steps_per_s
        self.enter = enter
        self.ask = ask
        self.agree = agree
        self._notice: ray.train.PreemptionInfo | None = None
        self._hold_after: int | None = None
        self._held = False

    def on_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        every = max(1, int(self.steps_per_s() * PREEMPTION_CHECK_S))  # every step until the first report
        if self._hold_after is not None or step % every:
            return
        # Asked at every check, not only until the first notice: Ray Train sends a new one at each drain change
        # and restarts the group at the earliest deadline of all it got. Merged as its controller merges them, not
        # replaced: Ray never clears a worker's notice in a group's life (no drain left sends none), and a later
        # deadline (once the node drained first is gone, say) does not move the restart. Were a notice withdrawn,
        # keeping it would cost at most the hold, which ends RESTART_MARGIN_S after the deadline kept.
        acted = self._notice
        notice = self._notice = merge_notices(acted, self.ask())
        if notice is None:
            return
        if acted is None or is_earlier(notice, acted):
            self.cadence.checkpoint_now(step)
            if trainer.is_global_zero:
                log.warning("%s: checkpoint at step %d", describe_preemption(notice), step)
        # Every rank must stop at the same step (a rank left in an all-reduce would wait for the others until the
        # node goes), so one clock decides.
        if not self.agree(seconds_to_deadline(notice) <= HOLD_BEFORE_DEADLINE_S):
            return
        self._hold_after = step
        if not self.cadence.checkpoint_due(step):
            self.cadence.checkpoint_now(step)
            if trainer.is_global_zero:
                away = seconds_to_deadline(notice)
                log.warning("the reclaim deadline is %.0f s away: last checkpoint at step %d", away, step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The last step has reported its checkpoint (StepReporter, after this callback, at that step's end).
        if self._hold_after is None or self._held:
            return
        self._held = True
        assert self._notice is not None  # set with _hold_after
        self.hold(self._notice, log_it=trainer.is_global_zero)
        self.enter(Phase.STEP)

    def hold(self, notice: ray.train.PreemptionInfo, log_it: bool) -> float:
        """Wait out the reclaim: Ray Train ends this process when it restarts the group, so returning means it
        did not, RESTART_MARGIN_S after the deadline. Returns the seconds held."""
        started = time.time()
        deadline_s = started + seconds_to_deadline(notice)
        self.enter(Phase.RECLAIM)
        if log_it:
            log.warning(
                "holding until Ray Train restarts the group at the reclaim deadline (in %.0f s); steps trained "
                "after this checkpoint would be lost at the restart",
                deadline_s - started,
            )
        time.sleep(max(0.0, deadline_s + RESTART_MARGIN_S - started))  # nothing to wait on: Ray Train kills us
        if log_it:
            log.warning("the group was not restarted %.0f s after the reclaim deadline: training on", RESTART_MARGIN_S)
        return time.time() - started


def merge_notices(
    old: ray.train.PreemptionInfo | None, new: ray.train.PreemptionInfo | None
) -> ray.train.PreemptionInfo | None:
    """The notice Ray Train's controller acts on after ``old`` and then ``new`` (its merge_preemption_info): the
    nodes of both, at the earlier deadline (a notice without one leaves the other's).

    Args:
        old: the notice acted on so far, or None.
        new: the notice Ray gives now, or None.
    """
    if old is None or new is None:
        return old or new
    nodes = {node: sorted(set(ranks)) for node, ranks in old.preempted_node_to_ranks.items()}
    for node, ranks in new.preempted_node_to_ranks.items():
        nodes[node] = sorted({*nodes.get(node, []), *ranks})
    deadlines = [deadline for deadline in (old.deadline_ms, new.deadline_ms) if deadline is not None]
    return ray.train.PreemptionInfo(deadline_ms=min(deadlines, default=None), preempted_node_to_ranks=nodes)


def is_earlier(notice: ray.train.PreemptionInfo, acted: ray.train.PreemptionInfo) -> bool:
    """Whether ``notice``'s deadline is earlier than ``acted``'s, by the deadlines alone (the same on every rank,
    unlike the clocks). A deadline after a notice naming none is not: that notice held at once (Ray Train's wait
    for it is under HOLD_BEFORE_DEADLINE_S), and were the wait longer, the hold's own checkpoint would still come
    HOLD_BEFORE_DEADLINE_S before the deadline named now.

    Args:
        notice: the merged notice.
        acted: the notice acted on before it.
    """
    if notice.deadline_ms is None or acted.deadline_ms is None:
        return False
    return notice.deadline_ms < acted.deadline_ms


def seconds_to_deadline(notice: ray.train.PreemptionInfo) -> float:
    """Seconds from now to the notice's deadline (negative once past); a notice without one gets Ray Train's own
    wait for such a notice, counted from now (Ray Train's from its detection, a few seconds earlier)."""
    if notice.deadline_ms is None:
        return unstated_preemption_deadline_s()
    return notice.deadline_ms / 1000 - time.time()


def describe_preemption(notice: ray.train.PreemptionInfo) -> str:
    """What a preemption notice says, for the log: which ranks go, and when."""
    nodes = ", ".join(node[:8] for node in notice.preempted_node_ids)
    ranks = ", ".join(str(rank) for rank in notice.preempted_ranks)
    deadline = notice.deadline_ms
    when = "at a time not given" if deadline is None else f"in {deadline / 1000 - time.time():.0f} s"
    return f"node {nodes} (rank {ranks}) is being reclaimed {when}"
