"""Ray Train's TorchTrainer with a placement-group cleaner that asks the GCS, not the state API, whether the run's
controller is dead.

Every Ray Train run starts a detached PlacementGroupCleaner that removes the run's placement group when the controller
dies. Ray 2.60's cleaner decides "dead" from `ray.util.state.get_actor`, a query to the dashboard's state API, and takes
an empty answer for a dead controller (`is_actor_alive`: `actor_state and ...`). Under load that API fails and now and
then answers empty for a live actor: a CI run of the suite (2026-11-30) lost a live two-worker run that way, "Destroying
worker since its placement group was removed", as a controller error that no FailureConfig retry covers. Here the
cleaner removes the group only when the GCS's own actor table says DEAD.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import ray
from ray.train.torch import TorchTrainer

from sdtrain.logs import log
from sdtrain.private import ray as ray_private
from sdtrain.private._lookup import PrivateApiMissing


def gcs_actor_state(actor_id: str) -> str | None:
    """The actor's state in the GCS actor table ("ALIVE", "DEAD", ...); None where the GCS did not answer or has no
    record of it."""
    try:
        state = ray_private.gcs_actor(actor_id).get("State")
    except Exception as e:  # noqa: BLE001  # an unanswered query is "unknown", never "dead"
        log.warning(f"could not read actor {actor_id} from the GCS: {e}")
        return None
    return None if state is None else str(state)


@cache
def guarded_cleaner() -> type:
    """Ray's PlacementGroupCleaner, removing the placement group only when the GCS says the controller is DEAD."""
    _, cleaner, _ = ray_private.placement_group_cleaner()

    class GuardedPlacementGroupCleaner(cleaner):  # type: ignore[valid-type,misc]
        """Ray's monitor loop calls _cleanup_placement_group once, when the state API reports the controller gone,
        then exits. After a false report the group is left alone and this cleaner exits with it: the job's driver
        owns the controller, and Ray removes a job's placement groups when the job ends."""

        def _cleanup_placement_group(self, placement_group: Any) -> None:
            state = gcs_actor_state(self._controller_actor_id)
            if state != "DEAD":
                log.warning(
                    f"the state API reported Ray Train's controller {self._controller_actor_id} gone, but the GCS has "
                    f"it {state or 'unknown'}: its placement group and workers are left running"
                )
                return
            super()._cleanup_placement_group(placement_group)

    return GuardedPlacementGroupCleaner


@cache
def _guarded_callback() -> type:
    """Ray's PlacementGroupCleanerCallback, launching guarded_cleaner() with the options Ray 2.60 launches its own with:
    detached, on the head node, no CPU."""
    callback, _, head_node = ray_private.placement_group_cleaner()
    cleaner_class = guarded_cleaner()

    class GuardedCleanerCallback(callback):  # type: ignore[valid-type,misc]
        def after_controller_start(self, train_run_context: Any) -> None:
            self._controller_actor_id = ray.get_runtime_context().get_actor_id()
            try:
                cleaner: Any = (
                    ray.remote(num_cpus=0)(cleaner_class)
                    .options(
                        lifetime="detached",
                        get_if_exists=False,
                        resources={head_node: 0.001},
                        scheduling_strategy="DEFAULT",
                    )
                    .remote(
                        controller_actor_id=self._controller_actor_id,
                        check_interval_s=self._check_interval_s,
                        get_actor_timeout_s=self._get_actor_timeout_s,
                        stop_timeout=self._stop_timeout,
                    )
                )
            except Exception as e:  # noqa: BLE001  # as Ray's: a run without a cleaner still trains
                log.warning(
                    f"could not launch the placement-group cleaner ({e}): were the controller to die, its placement "
                    "group would stay until the job ends"
                )
                self._cleaner = None
                return
            cleaner.start_monitoring.remote()
            self._cleaner = cleaner

    return GuardedCleanerCallback


@cache
def torch_trainer_class() -> type[TorchTrainer]:
    """TorchTrainer with guarded_cleaner() for Ray's cleaner; Ray's own, with a warning, where this Ray lacks a name
    the guard reads (an unpinned upgrade: tests/test_private_apis.py names it)."""
    try:
        ray_callback, _, _ = ray_private.placement_group_cleaner()
        guarded = _guarded_callback()
    except PrivateApiMissing as e:
        log.warning(f"Ray Train's own placement-group cleaner runs, which can remove a live run's workers: {e}")
        return TorchTrainer

    class GuardedTorchTrainer(TorchTrainer):
        # ray.train.torch's stubs are Train V1's; Ray 2.60 runs V2 (DataParallelTrainer._create_default_callbacks).
        def _create_default_callbacks(self) -> list[Any]:
            return [
                guarded() if type(callback) is ray_callback else callback
                for callback in super()._create_default_callbacks()  # type: ignore[misc]
            ]

    return GuardedTorchTrainer
