"""Ray's private names that sdtrain relies on, each behind one function here and imported only when it is called.

Ray is pinned exactly (pyproject.toml). An upgrade that moves one of them fails ``tests/test_private_apis.py``
naming it, and at run time only the feature it serves: the ones that are optimizations (the scheduler's pace, Ray
Data's start-up on the driver) go on without it, with a warning.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sdtrain.logs import log
from sdtrain.private._lookup import PrivateApiMissing, private

NAMES = {
    ("ray.train.v2._internal.constants", "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME"): (
        "the name of Ray Train's record of a run's checkpoints, in the error when it cannot be read"
    ),
    ("ray.train.v2._internal.constants", "DEFAULT_PREEMPTION_DEADLINE_S"): (
        "how long Ray Train waits out a reclaim notice that names no deadline, which the workers hold for"
    ),
    ("ray.train.v2._internal.exceptions", "CheckpointManagerInitializationError"): (
        "what Ray Train raises for a record of a run's checkpoints it cannot read"
    ),
    ("ray.train.v2._internal.execution.context", "__file__"): (
        "the logger Ray Train reports every step at INFO under: its module's path"
    ),
    ("ray.data._internal.datasource.range_datasource", "RangeDatasource"): (
        "ids 0..n-1 as a datasource whose read tasks take no CPU (ray.data.range's take one)"
    ),
    ("ray.data._internal.stats", "STATS_ACTOR_NAME"): "Ray Data's stats actor, whose start the driver pays early",
    ("ray.data._internal.stats", "STATS_ACTOR_NAMESPACE"): "the stats actor's namespace",
    ("ray.data._internal.execution.execution_callback", "ExecutionCallback"): (
        "a hook on every round of Ray Data's scheduling loop, which paces it"
    ),
    ("ray.data._internal.progress", "__name__"): "a logger whose 'progress bars disabled' line workers drop",
    ("ray.data._internal.logging", "__name__"): "a logger whose per-execution lines workers quiet",
    ("ray.train.v2._internal.callbacks.placement_group_callback", "PlacementGroupCleanerCallback"): (
        "the callback that launches Ray Train's placement-group cleaner, which sdtrain's trainer replaces"
    ),
    ("ray.train.v2._internal.execution.controller.placement_group_cleaner", "PlacementGroupCleaner"): (
        "Ray Train's placement-group cleaner, which sdtrain's guarded one extends"
    ),
    ("ray._common.constants", "HEAD_NODE_RESOURCE_NAME"): "the head node's resource, where the cleaner runs",
    ("ray._private.state", "actors"): "the GCS's actor table, which says whether Ray Train's controller is dead",
}
"""(module, name) -> what it serves: every private name this module reads (the test imports each)."""

COORDINATOR_NAME = COORDINATOR_NAMESPACE = "AutoscalingCoordinator"
"""Ray Data's names for its cluster-wide autoscaling coordinator, literals in
ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator (so no import can check them: the start-up
test sees the actor by this name)."""


def _get(module: str, name: str) -> Any:
    return private(module, name, "ray", NAMES[module, name])


def checkpoint_record_file() -> str:
    """The file name of Ray Train's record of a run's committed checkpoints."""
    return _get("ray.train.v2._internal.constants", "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME")


def unstated_preemption_deadline_s() -> float:
    """Seconds from its detection that Ray Train waits out a reclaim notice naming no deadline, then restarts."""
    return float(_get("ray.train.v2._internal.constants", "DEFAULT_PREEMPTION_DEADLINE_S"))


def checkpoint_record_error() -> type[Exception]:
    """The exception Ray Train raises for a record of a run's checkpoints that it cannot read."""
    return _get("ray.train.v2._internal.exceptions", "CheckpointManagerInitializationError")


def report_logger_name() -> str:
    """The logger Ray Train writes a line per report to: named by its module's file path, outside ``ray.train``."""
    return _get("ray.train.v2._internal.execution.context", "__file__")


def data_logger_names() -> tuple[str, str]:
    """Ray Data's progress logger and its execution logger (in that order)."""
    return _get("ray.data._internal.progress", "__name__"), _get("ray.data._internal.logging", "__name__")


def range_datasource(n: int) -> Any:
    """A datasource of ids 0..n-1 in a column ``id``, one row per id, as arrow blocks."""
    source = _get("ray.data._internal.datasource.range_datasource", "RangeDatasource")
    return source(n=n, block_format="arrow", column_name="id")


def data_stats_actor() -> tuple[str, str]:
    """(name, namespace) of Ray Data's stats actor."""
    return (
        _get("ray.data._internal.stats", "STATS_ACTOR_NAME"),
        _get("ray.data._internal.stats", "STATS_ACTOR_NAMESPACE"),
    )


@cache
def execution_callback_base() -> type | None:
    """Ray Data's execution callback class, or None (logged once) where this Ray has none: pacing is an
    optimization, and a run goes on unpaced."""
    try:
        return _get("ray.data._internal.execution.execution_callback", "ExecutionCallback")
    except PrivateApiMissing as error:
        log.warning("Ray Data's scheduling loop runs unpaced: %s", error)
        return None


def placement_group_cleaner() -> tuple[type, type, str]:
    """(the callback class that launches Ray Train's placement-group cleaner, the cleaner's class, the head node's
    resource name, which Ray launches it on)."""
    return (
        _get("ray.train.v2._internal.callbacks.placement_group_callback", "PlacementGroupCleanerCallback"),
        _get("ray.train.v2._internal.execution.controller.placement_group_cleaner", "PlacementGroupCleaner"),
        _get("ray._common.constants", "HEAD_NODE_RESOURCE_NAME"),
    )


def gcs_actor(actor_id: str) -> dict[str, Any]:
    """The GCS actor table's record of one actor ({} where it has none), read from the GCS, not the dashboard."""
    return dict(_get("ray._private.state", "actors")(actor_id=actor_id))
