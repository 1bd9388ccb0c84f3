"""The stall watchdog's two bounds (sdtrain.train.watchdog), on its real thread, without Ray."""

import threading
import time

import pytest

from sdtrain.config.loader import load_config
from sdtrain.data.read_order import DataState
from sdtrain.train.cadence import ReportCadence
from sdtrain.train.checkpointing import CheckpointWriter
from sdtrain.train.preemption import HOLD_BEFORE_DEADLINE_S, RESTART_MARGIN_S
from sdtrain.train.reporting import StepReporter
from sdtrain.train.watchdog import RECLAIM_BOUND_S, SLOW_PHASES, Phase, StallWatchdog


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


def test_the_end_of_training_is_watched_as_a_slow_phase():
    """The callbacks after StallWatch end the run in on_train_end (StepReporter's final report and checkpoint, the
    trackers' finish): the watchdog was stopped before them, and a hang there hung the job with no message."""
    import lightning.pytorch as pl
    import torch

    from sdtrain.train.watchdog import StallWatch

    watchdog, fired, done = _watchdog(timeout_s=100, slow_phase_timeout_s=0.5)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class HangsAtTheEnd(pl.Callback):  # as a tracker's finish or an upload that never ends
        def on_train_end(self, trainer, pl_module):
            done.wait(10)

    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[StallWatch(watchdog), HangsAtTheEnd()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
    watchdog.stop()
    assert len(fired) == 1 and Phase.FINISHING in fired[0] and "run.slow_phase_timeout_s=0.5" in fired[0], fired


def test_a_reclaim_hold_outlasts_a_short_slow_phase_bound():
    """A hold after the last checkpoint before a reclaim deadline lasts up to 360 s: ended at a shorter
    run.slow_phase_timeout_s, the worker's exit was a failure that spent failure.max_failures, not a preemption."""
    assert RECLAIM_BOUND_S > HOLD_BEFORE_DEADLINE_S + RESTART_MARGIN_S
    watchdog, fired, _ = _watchdog(timeout_s=100, slow_phase_timeout_s=120)
    watchdog.enter(Phase.RECLAIM)
    assert watchdog.stalled(time.monotonic() + HOLD_BEFORE_DEADLINE_S + RESTART_MARGIN_S) is None
    message = watchdog.stalled(time.monotonic() + RECLAIM_BOUND_S + 1)
    assert message is not None and Phase.RECLAIM in message
    watchdog.enter(Phase.CHECKPOINT)  # the other slow phases keep the configured bound
    assert watchdog.stalled(time.monotonic() + 121) is not None
    watchdog.stop()
    assert not fired


@pytest.mark.parametrize("upload", ["async", "sync"])
def test_the_report_after_an_async_checkpoint_waits_for_its_upload_as_a_slow_phase(tmp_path, upload):
    """Ray Train takes a rank's reports in order: the metrics report after a checkpoint uploaded in the background
    waits for the upload, on every rank (rank 0's upload, the barrier on the others). As REPORT it was bounded by
    run.stall_timeout_s: a long upload ended the workers, uncommitted, at every restart."""
    config = load_config(None, ["data.train=x", "train.max_steps=100", f"checkpoint.upload={upload}"])
    writer = CheckpointWriter(lambda step: DataState(), {}, config.checkpoint.upload, str(tmp_path))
    reporter = StepReporter(ReportCadence(config), config.train, writer, [], lambda: 0.0, 0.0)
    assert reporter.report_phase(False) == Phase.REPORT and reporter.report_phase(True) == Phase.CHECKPOINT
    reporter.reported(True, final=False)
    waits = Phase.UPLOAD_WAIT if upload == "async" else Phase.REPORT
    assert reporter.report_phase(False) == waits and reporter.report_phase(True) == Phase.CHECKPOINT
    reporter.reported(False, final=False)  # it waited: the next report does not
    assert reporter.report_phase(False) == Phase.REPORT
    reporter.reported(True, final=True)  # the final checkpoint is uploaded in the loop whatever the setting
    assert reporter.report_phase(False) == Phase.REPORT
    assert Phase.UPLOAD_WAIT in SLOW_PHASES
