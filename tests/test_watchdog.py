"""The stall watchdog's two bounds (sdtrain.train.watchdog), on its real thread, without Ray."""

import threading
import time

from sdtrain.train.watchdog import Phase, StallWatchdog


def _watchdog(timeout_s, slow_phase_timeout_s=None):
    fired: list[str] = []
    done = threading.Event()

    def on_stall(message):
        fired.append(message)
        done.set()

    return StallWatchdog(timeout_s, 1, slow_phase_timeout_s, on_stall=on_stall), fired, done


def test_a_slow_phase_does_not_spend_the_steps_bound_and_has_its_own():
    watchdog, fired, _ = _watchdog(timeout_s=100, slow_phase_timeout_s=1000)
    start = time.monotonic()
    watchdog.enter(Phase.NEXT_BATCH)
    watchdog.stepped(10)
    watchdog.enter(Phase.VALIDATION)
    # A validation of 500 s: beyond the step's bound, within the slow phases'.
    assert watchdog.stalled(start + 500) is None
    watchdog.enter(Phase.NEXT_BATCH)  # (now, on the real clock): the step's bound starts again here
    assert watchdog.stalled(time.monotonic() + 99) is None
    message = watchdog.stalled(time.monotonic() + 101)
    assert message is not None and message.startswith("rank 1 stalled: no optimizer step for 10")
    assert "since step 10" in message and "run.stall_timeout_s=100" in message and Phase.NEXT_BATCH in message
    # A slow phase past its own bound.
    watchdog.enter(Phase.CHECKPOINT)
    message = watchdog.stalled(time.monotonic() + 1001)
    assert message is not None and f"it has been {Phase.CHECKPOINT} for 100" in message
    assert "run.slow_phase_timeout_s=1000; last optimizer step: step 10" in message
    # Unbounded slow phases (null) never fire; a step's phase still does.
    unbounded, _, _ = _watchdog(timeout_s=100)
    assert unbounded.stalled(time.monotonic() + 10**6) is None  # start-up is a slow phase
    unbounded.enter(Phase.STEP)
    assert unbounded.stalled(time.monotonic() + 101) is not None
    watchdog.stop()
    unbounded.stop()
    assert not fired


def test_the_thread_fires_once_in_the_phase_it_stalled_in():
    # Start-up unbounded: however long this thread takes to get to the next line, only the data wait can fire.
    watchdog, fired, done = _watchdog(timeout_s=0.4)
    watchdog.enter(Phase.FIRST_BATCH)
    assert done.wait(10), "the watchdog did not fire"
    assert len(fired) == 1 and "since its start" in fired[0] and Phase.FIRST_BATCH in fired[0]
    slow, fired, done = _watchdog(timeout_s=0.4, slow_phase_timeout_s=0.8)
    started = time.monotonic()
    slow.enter(Phase.SAMPLE_GRID)
    assert done.wait(10), "the watchdog did not fire in a slow phase"
    assert time.monotonic() - started >= 0.8 and "run.slow_phase_timeout_s=0.8" in fired[0]
    # A stopped watchdog says nothing, even in a phase past its bound (stopped first: no race with its thread).
    quiet, fired, done = _watchdog(timeout_s=0.4)
    quiet.stop()
    quiet.enter(Phase.STEP)
    assert not done.wait(1.5) and not fired
