"""Each test leaves this process's environment as it found it (tests/conftest.py's autouse fixture).

A variable a test (or the code under test) set and left behind reaches every later test in its process, in an order
pytest-randomly and the lanes choose, and every Ray cluster, server and subprocess those start: an endpoint of a moto
server stopped long before sent a benchmark's S3 requests nowhere, and MLflow's worker retries set by one test timed
out another's requests. The fixture restores every variable after each test but those of ``PROCESS_STATE``, and fails
the test for one that sdtrain's code or the test itself changed, so that the test says so (a fixture restoring it,
``conftest.unset_env``) instead of leaning on the restore. What a library sets as a side effect of a call a test makes
in this process (``SIDE_EFFECTS``) is restored without a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest

# A library's state for this whole process, which outlives the test that made it: left as it is, not reported.
PROCESS_STATE = frozenset(
    {
        # pytest's own, rewritten at each phase of each test.
        "PYTEST_CURRENT_TEST",
        # ray.init, for the Ray session it starts in this process (which later tests use): token authentication, no
        # usage reports, breakpoint() to Ray's debugger.
        "RAY_AUTH_MODE",
        "RAY_USAGE_STATS_ENABLED",
        "PYTHONBREAKPOINT",
        # MLflow's telemetry, per process.
        "_MLFLOW_TELEMETRY_SESSION_ID",
        # Inductor, before it loads each compiled module: an address in this process, set again at each load.
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    }
)

# Set in this process by a library as a side effect of a call a test makes here: restored, not reported.
SIDE_EFFECTS = frozenset(
    {
        # Lightning's launcher for an in-process DDP or FSDP fit (cores / processes, where unset), and its seeding.
        "OMP_NUM_THREADS",
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
        # torch.distributed's and Lightning's cluster environment for an in-process process group.
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        # mlflow.set_tracking_uri, which Lightning's MLFlowLogger and sdtrain's MLflow client calls make.
        "MLFLOW_TRACKING_URI",
        # wandb.init: the address of the W&B service it started here, which a Ray cluster started later in this
        # process would hand to its workers (sdtrain.train.trackers.apply_tracker_env drops it there).
        "WANDB_SERVICE",
    }
)


def changes(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Each variable set, changed or removed between ``before`` and ``after``: its value then and now (None: unset)."""
    names = (before.keys() | after.keys()) - PROCESS_STATE
    return {name: (before.get(name), after.get(name)) for name in sorted(names) if before.get(name) != after.get(name)}


def set_values(values: Mapping[str, str | None]) -> None:
    """Sets each variable of ``values`` to its value, or unsets it where None."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def restore(before: Mapping[str, str]) -> None:
    """Sets os.environ back to ``before``: variables set since removed, changed or removed ones as they were."""
    set_values({name: was for name, (was, _) in changes(before, os.environ).items()})


def reported(leaked: Mapping[str, tuple[str | None, str | None]]) -> str | None:
    """One message naming the variables a test left changed that are not a library's side effect, or None."""
    ours = {name: values for name, values in leaked.items() if name not in SIDE_EFFECTS}
    if not ours:
        return None
    described = "; ".join(f"{name}: {was!r} -> {now!r}" for name, (was, now) in ours.items())
    return (
        f"the test left the environment changed ({described}), which would reach every later test in this process "
        "and what they start; it is restored now. Restore it where the test or its fixture changes it "
        "(monkeypatch.setenv, conftest.unset_env)"
    )


@contextmanager
def kept() -> Iterator[None]:
    """The environment as found (but ``PROCESS_STATE``), restored on leaving; then fails the test where it left a
    variable changed that is not a library's side effect (``reported``)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        leaked = changes(before, os.environ)
        restore(before)
    message = reported(leaked)
    if message is not None:
        pytest.fail(message, pytrace=False)
