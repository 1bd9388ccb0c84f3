"""The hold after a reclaim notice's checkpoint (sdtrain.train.preemption), without Ray: the Ray run is
test_elastic's."""

import logging
import time
from types import SimpleNamespace

import ray.train

from sdtrain.config.loader import load_config
from sdtrain.train.cadence import ReportCadence
from sdtrain.train.preemption import RESTART_MARGIN_S, PreemptionCheck
from sdtrain.train.watchdog import Phase


def _check(phases: list[str]) -> PreemptionCheck:
    cadence = ReportCadence(load_config(None, ["data.train=x", "train.max_steps=100"]))
    return PreemptionCheck(cadence, lambda: 0.0, enter=phases.append)


def _notice(deadline_in_s: float) -> ray.train.PreemptionInfo:
    deadline_ms = int((time.time() + deadline_in_s) * 1000)
    return ray.train.PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={"3f9a1c2e0000": [1]})


def test_the_ranks_hold_out_of_any_collective_until_past_the_deadline_then_train_on(caplog):
    # A deadline 1.5 s before the hold gives up: Ray Train would have ended the group by then.
    phases: list[str] = []
    check = _check(phases)
    check._notice = _notice(1.5 - RESTART_MARGIN_S)
    trainer = SimpleNamespace(is_global_zero=True)
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        started = time.monotonic()
        check.on_train_batch_start(trainer, None, None, 0)
        held = time.monotonic() - started
    assert 1.0 < held < 10, held
    # The watchdog counts the hold as a slow phase, then the step that follows it as a step.
    assert phases == [Phase.RECLAIM, Phase.STEP]
    messages = [record.getMessage() for record in caplog.records]
    assert "holding until Ray Train restarts the group at the reclaim deadline" in messages[0], messages
    assert messages[1] == (
        f"the group was not restarted {RESTART_MARGIN_S:.0f} s after the reclaim deadline: training on"
    )
    # Once: the next step trains without holding.
    started = time.monotonic()
    check.on_train_batch_start(trainer, None, None, 1)
    assert time.monotonic() - started < 0.5 and len(phases) == 2


def test_no_notice_no_hold_and_only_rank_zero_logs(caplog):
    phases: list[str] = []
    check = _check(phases)
    check.on_train_batch_start(SimpleNamespace(is_global_zero=True), None, None, 0)
    assert phases == []
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        held = check.hold(_notice(-RESTART_MARGIN_S - 5), log_it=False)
    assert held < 0.5 and phases == [Phase.RECLAIM] and not caplog.records
