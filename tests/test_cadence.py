"""The one schedule of reports, validations and checkpoints every rank follows (sdtrain.train.cadence)."""

import pytest

from sdtrain.config.loader import load_config
from sdtrain.errors import ConfigError
from sdtrain.train.cadence import ReportCadence


def _cadence(max_steps, *overrides):
    return ReportCadence(load_config(None, ["data.train=x", f"train.max_steps={max_steps}", *overrides]))


def test_reports_validations_and_checkpoints_fall_on_the_same_steps_for_every_rank():
    cadence = _cadence(47, "checkpoint.every_n_steps=20", "run.log_every_n_steps=5", "run.val_every_n_steps=10")
    steps = range(1, 48)
    assert [s for s in steps if cadence.report_due(s)] == [5, 10, 15, 20, 25, 30, 35, 40, 45, 47]
    assert [s for s in steps if cadence.validation_due(s)] == [10, 20, 30, 40, 47]
    assert [s for s in steps if cadence.checkpoint_due(s)] == [20, 40, 47]
    # A preemption notice at step 23 makes it a checkpoint step (and so a report), once.
    cadence.checkpoint_now(23)
    assert cadence.checkpoint_due(23) and cadence.report_due(23) and not cadence.validation_due(23)
    assert not cadence.checkpoint_due(24)
    # Validation defaults to the checkpoint interval, and happens only at a report.
    default = _cadence(12, "checkpoint.every_n_steps=6", "run.log_every_n_steps=4")
    assert [s for s in range(1, 13) if default.validation_due(s)] == [6, 12]
    # An interval off the reports would run less often than it says (3, 6, ... are not reports): refused.
    off_schedule = ("checkpoint.every_n_steps=8", "run.log_every_n_steps=8", "run.val_every_n_steps=3")
    with pytest.raises(ConfigError, match=r"^run\.val_every_n_steps: 3 is a multiple of neither .* every 24 steps"):
        _cadence(16, *off_schedule)
    # A multiple of the checkpoint interval is always a report, whatever the log interval.
    at_checkpoints = _cadence(16, "checkpoint.every_n_steps=4", "run.log_every_n_steps=3", "run.val_every_n_steps=8")
    assert [s for s in range(1, 17) if at_checkpoints.validation_due(s)] == [8, 16]


@pytest.mark.parametrize("key", ["run.val_every_n_steps", "sample_grid.every_n_steps"])
def test_an_interval_that_falls_between_reports_is_refused_naming_what_it_would_become(key):
    """Validation and sample grids run only at report steps: every 30 with reports every 50 ran every 150."""
    with pytest.raises(
        ConfigError, match=rf"^{key}: 30 is a multiple of neither run\.log_every_n_steps=50 .* every 150"
    ):
        _cadence(1000, "run.log_every_n_steps=50", f"{key}=30")
    _cadence(1000, "run.log_every_n_steps=50", f"{key}=100")  # a multiple of the reports
    _cadence(1000, "run.log_every_n_steps=50", f"{key}=1000")  # at the last step only, as it says
