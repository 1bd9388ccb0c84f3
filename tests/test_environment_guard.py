"""The suite's guard against tests leaving environment variables behind (tests/support/environment.py): what it
restores and what it fails a test for."""

from __future__ import annotations

import os

import pytest
from support import environment


def test_a_variable_set_changed_or_removed_is_restored_and_fails_the_test_naming_it(monkeypatch):
    monkeypatch.setenv("SDTRAIN_GUARD_CHANGED", "before")
    monkeypatch.setenv("SDTRAIN_GUARD_REMOVED", "kept")
    monkeypatch.delenv("SDTRAIN_GUARD_ADDED", raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        with environment.kept():
            os.environ["SDTRAIN_GUARD_ADDED"] = "http://127.0.0.1:9"
            os.environ["SDTRAIN_GUARD_CHANGED"] = "after"
            del os.environ["SDTRAIN_GUARD_REMOVED"]
    message = str(failed.value)
    assert "SDTRAIN_GUARD_ADDED: None -> 'http://127.0.0.1:9'" in message
    assert "SDTRAIN_GUARD_CHANGED: 'before' -> 'after'" in message
    assert "SDTRAIN_GUARD_REMOVED: 'kept' -> None" in message
    assert "SDTRAIN_GUARD_ADDED" not in os.environ
    assert os.environ["SDTRAIN_GUARD_CHANGED"] == "before"
    assert os.environ["SDTRAIN_GUARD_REMOVED"] == "kept"


def test_a_librarys_side_effect_is_restored_quietly_its_process_state_kept_and_a_restored_variable_no_leak(
    monkeypatch,
):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # restored by monkeypatch after this test, not by the guard
    monkeypatch.setenv("SDTRAIN_GUARD_CHANGED", "before")
    with environment.kept():
        os.environ["MASTER_PORT"] = "29500"  # as Lightning's launcher for an in-process DDP fit sets it
        os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"  # as mlflow.set_tracking_uri does
        os.environ["RAY_AUTH_MODE"] = "token"  # as ray.init does for the Ray session it starts here
        os.environ["SDTRAIN_GUARD_CHANGED"] = "during"
        os.environ["SDTRAIN_GUARD_CHANGED"] = "before"
    assert "MASTER_PORT" not in os.environ
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_a_failing_body_is_restored_too_and_its_own_error_is_the_one_raised(monkeypatch):
    monkeypatch.delenv("SDTRAIN_GUARD_ADDED", raising=False)
    with pytest.raises(ZeroDivisionError):
        with environment.kept():
            os.environ["SDTRAIN_GUARD_ADDED"] = "1"
            1 / 0  # noqa: B018
    assert "SDTRAIN_GUARD_ADDED" not in os.environ
