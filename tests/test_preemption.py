"""The hold after a reclaim notice's checkpoint (sdtrain.train.preemption), without Ray: the Ray run is
test_elastic's."""

import logging
import time
from types import SimpleNamespace

import ray.train

from sdtrain.config.loader import load_config
from sdtrain.train import preemption
from sdtrain.train.cadence import ReportCadence
from sdtrain.train.preemption import (
    HOLD_BEFORE_DEADLINE_S,
    RESTART_MARGIN_S,
    PreemptionCheck,
    seconds_to_deadline,
)
from sdtrain.train.watchdog import Phase


def _check(phases: list[str], deadline_in_s=None, rank_zero_says=None) -> PreemptionCheck:
    """A check whose Ray answers are given: a notice of a deadline ``deadline_in_s`` from when it is asked for (none
    where None), and rank 0's answers to "hold now?" (this rank's own, where None: a world of one)."""
    cadence = ReportCadence(load_config(None, ["data.train=x", "train.max_steps=100", "checkpoint.every_n_steps=50"]))
    answers = iter(rank_zero_says or [])
    return PreemptionCheck(
        cadence,
        lambda: 0.0,
        enter=phases.append,
        ask=lambda: None if deadline_in_s is None else _notice(deadline_in_s),
        agree=(lambda mine: mine) if rank_zero_says is None else (lambda mine: next(answers)),
    )


def _notice(deadline_in_s: float) -> ray.train.PreemptionInfo:
    deadline_ms = int((time.time() + deadline_in_s) * 1000)
    return ray.train.PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={"3f9a1c2e0000": [1]})


TRAINER = SimpleNamespace(is_global_zero=True)


def test_the_ranks_hold_out_of_any_collective_until_past_the_deadline_then_train_on(caplog):
    # A cloud's notice: the notice's checkpoint is the last. A deadline 1.5 s before the hold gives up: Ray Train
    # would have ended the group by then.
    phases: list[str] = []
    check = _check(phases, 1.5 - RESTART_MARGIN_S)
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        check.on_step(TRAINER, None, 7)
        assert check.cadence.checkpoint_due(7)
        started = time.monotonic()
        check.on_train_batch_start(TRAINER, None, None, 0)
        held = time.monotonic() - started
    assert 1.0 < held < 10, held
    # The watchdog counts the hold as a slow phase, then the step that follows it as a step.
    assert phases == [Phase.RECLAIM, Phase.STEP]
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("node 3f9a1c2e (rank 1) is being reclaimed in -"), messages
    assert messages[0].endswith(": checkpoint at step 7"), messages
    assert "holding until Ray Train restarts the group at the reclaim deadline" in messages[1], messages
    assert messages[2] == (
        f"the group was not restarted {RESTART_MARGIN_S:.0f} s after the reclaim deadline: training on"
    )
    # Once: the next step trains without holding.
    started = time.monotonic()
    check.on_step(TRAINER, None, 8)
    check.on_train_batch_start(TRAINER, None, None, 1)
    assert time.monotonic() - started < 0.5 and len(phases) == 2 and not check.cadence.checkpoint_due(8)


def test_a_long_notice_trains_on_to_a_last_checkpoint_at_the_step_rank_zero_names_then_holds(caplog):
    """A drain an hour ahead: training goes on; rank 0's clock, not this rank's, names the step of the last
    checkpoint (here this rank's clock says "past the deadline" at every check, rank 0's "not yet" twice)."""
    phases: list[str] = []
    check = _check(phases, 1.5 - RESTART_MARGIN_S, rank_zero_says=[False, False, True])
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        due = []
        for step in (10, 11, 12):
            check.on_train_batch_start(TRAINER, None, None, step)  # the ranks train on: no hold
            check.on_step(TRAINER, None, step)
            due.append(check.cadence.checkpoint_due(step))  # what StepReporter asks next, at this step's end
        assert phases == [] and due == [True, False, True]
        started = time.monotonic()
        check.on_train_batch_start(TRAINER, None, None, 13)
        assert 1.0 < time.monotonic() - started < 10
    assert phases == [Phase.RECLAIM, Phase.STEP]
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].endswith(": checkpoint at step 10"), messages
    assert messages[1].startswith("the reclaim deadline is -"), messages
    assert messages[1].endswith(" s away: last checkpoint at step 12"), messages
    assert "holding until Ray Train restarts the group" in messages[2], messages


def test_the_hold_starts_hold_before_deadline_s_ahead_of_the_deadline():
    asked: list[bool] = []

    def rank_zero(mine: bool) -> bool:
        asked.append(mine)
        return mine

    cadence = ReportCadence(load_config(None, ["data.train=x"]))
    for deadline_in_s in (3600, HOLD_BEFORE_DEADLINE_S + 30, HOLD_BEFORE_DEADLINE_S - 30, 30):
        notice = _notice(deadline_in_s)
        PreemptionCheck(cadence, lambda: 0.0, ask=lambda notice=notice: notice, agree=rank_zero).on_step(
            TRAINER, None, 1
        )
    assert asked == [False, False, True, True]
    # A notice without a deadline: Ray Train's own wait for one, under the reserve, so the notice's is the last.
    assert seconds_to_deadline(ray.train.PreemptionInfo(None, {"3f9a1c2e0000": [1]})) <= HOLD_BEFORE_DEADLINE_S


def test_no_notice_no_hold_and_only_rank_zero_logs(caplog):
    phases: list[str] = []
    check = _check(phases)
    check.on_step(TRAINER, None, 1)
    check.on_train_batch_start(TRAINER, None, None, 0)
    assert phases == []
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        held = check.hold(_notice(-RESTART_MARGIN_S - 5), log_it=False)
    assert held < 0.5 and phases == [Phase.RECLAIM] and not caplog.records


class _Clock:
    """The preemption module's clock (``time.time`` and ``time.sleep``): it stands still, and a sleep moves it on
    at once."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def notice(self, deadline_in_s: float, nodes: tuple[str, ...] = ("3f9a1c2e0000",)) -> ray.train.PreemptionInfo:
        """Ray's notice now of a reclaim of ``nodes`` (hosting ranks 1, 2, ... in turn) ``deadline_in_s`` away."""
        deadline_ms = int((self.now + deadline_in_s) * 1000)
        ranks = {node: [rank] for rank, node in enumerate(nodes, start=1)}
        return ray.train.PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks=ranks)


def _asking(monkeypatch, ray_says: list, phases: list[str]) -> tuple[PreemptionCheck, _Clock]:
    """A check in a world of one, asking at every step (no report yet), whose Ray answers the last of
    ``ray_says``, on a clock of its own."""
    clock = _Clock()
    monkeypatch.setattr(preemption, "time", clock)
    cadence = ReportCadence(load_config(None, ["data.train=x", "train.max_steps=100", "checkpoint.every_n_steps=50"]))
    check = PreemptionCheck(cadence, lambda: 0.0, phases.append, ask=lambda: ray_says[-1], agree=lambda mine: mine)
    return check, clock


def _train(check: PreemptionCheck, steps: range) -> list[int]:
    """Calls the check as the trainer does at ``steps``; returns those that checkpoint."""
    checkpoints = []
    for step in steps:
        check.on_train_batch_start(TRAINER, None, None, step)
        check.on_step(TRAINER, None, step)
        if check.cadence.checkpoint_due(step):
            checkpoints.append(step)
    return checkpoints


def test_a_later_notice_with_an_earlier_deadline_checkpoints_at_once_and_the_hold_goes_by_it(monkeypatch, caplog):
    """Node A drained for maintenance an hour ahead, then node B reclaimed by its cloud with 90 s of notice: Ray
    Train restarts the group at B's deadline, so the ranks checkpoint at the step that notice reaches them and
    hold until B's deadline, not A's."""
    phases: list[str] = []
    ray_says: list = [None]
    check, clock = _asking(monkeypatch, ray_says, phases)
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        ray_says.append(clock.notice(3600))
        checkpoints = _train(check, range(10, 13))
        clock.now += 30
        ray_says.append(clock.notice(90, nodes=("3f9a1c2e0000", "5b7d0e410000")))  # Ray's names both nodes
        checkpoints += _train(check, range(13, 16))
    assert checkpoints == [10, 13]
    assert clock.slept == [90 + RESTART_MARGIN_S] and phases == [Phase.RECLAIM, Phase.STEP]
    messages = [record.getMessage() for record in caplog.records]
    assert messages[:2] == [
        "node 3f9a1c2e (rank 1) is being reclaimed in 3600 s: checkpoint at step 10",
        "node 3f9a1c2e, 5b7d0e41 (rank 1, 2) is being reclaimed in 90 s: checkpoint at step 13",
    ], messages
    assert "holding until Ray Train restarts the group at the reclaim deadline (in 90 s)" in messages[2], messages


def test_the_earliest_deadline_is_kept_through_a_later_notice_or_none(monkeypatch):
    """Ray Train's controller restarts the group at the earliest deadline of every notice it got: one naming a
    later deadline, or none, neither checkpoints nor moves the hold."""
    phases: list[str] = []
    ray_says: list = [None]
    check, clock = _asking(monkeypatch, ray_says, phases)
    ray_says.append(clock.notice(HOLD_BEFORE_DEADLINE_S + 100))
    checkpoints = _train(check, range(1, 3))
    ray_says.append(clock.notice(3600, nodes=("5b7d0e410000",)))
    checkpoints += _train(check, range(3, 5))
    ray_says.append(None)
    checkpoints += _train(check, range(5, 7))
    assert checkpoints == [1] and phases == []
    clock.now += 100  # the first deadline is HOLD_BEFORE_DEADLINE_S away: the last checkpoint, then the hold
    checkpoints += _train(check, range(7, 9))
    assert checkpoints == [1, 7]
    assert clock.slept == [HOLD_BEFORE_DEADLINE_S + RESTART_MARGIN_S] and phases == [Phase.RECLAIM, Phase.STEP]
