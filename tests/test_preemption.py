"""The hold after a reclaim notice's checkpoint (sdtrain.train.preemption), without Ray: the Ray run is
test_elastic's."""

import logging
import time
from types import SimpleNamespace

import ray.train

from sdtrain.config.loader import load_config
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
