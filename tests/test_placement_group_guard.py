"""The placement-group cleaner of sdtrain's runs (sdtrain.driver.placement_group_guard) on the session's Ray cluster:
a live controller's group stays whatever the state API reported; a dead one's is removed. That every run launches it
is asserted in test_train_ray's exactly-once test."""

import inspect
import time

import pytest
import ray
import ray.train
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from sdtrain.driver.placement_group_guard import gcs_actor_state, guarded_cleaner, torch_trainer_class
from sdtrain.private import ray as ray_private


@ray.remote(num_cpus=0)
class _Controller:
    """Stands where Ray Train's controller does: the actor the cleaner watches."""

    def ready(self) -> bool:
        return True


def test_the_trainer_launches_the_guarded_cleaner_through_the_names_ray_calls():
    """Without Ray: the trainer's callbacks hold the guarded cleaner's in place of Ray's, and Ray's monitor loop and
    trainer call the names the guard overrides (an upgrade that renames one fails here, not as a torn-down run)."""
    ray_callback, ray_cleaner, _ = ray_private.placement_group_cleaner()
    trainer = torch_trainer_class()(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
    callbacks = trainer._create_default_callbacks()
    cleaners = [type(c) for c in callbacks if isinstance(c, ray_callback)]
    assert len(cleaners) == 1 and cleaners[0] is not ray_callback, callbacks
    assert "self._cleanup_placement_group(" in inspect.getsource(ray_cleaner._monitor_loop)
    assert "PlacementGroupCleanerCallback()" in inspect.getsource(type(trainer).__mro__[1]._create_default_callbacks)
    assert {"_check_interval_s", "_get_actor_timeout_s", "_stop_timeout", "_cleaner"} <= set(vars(ray_callback()))


@pytest.mark.slow  # the session's Ray cluster
@pytest.mark.timeout(120)
def test_the_cleaner_removes_a_group_only_once_the_gcs_has_its_controller_dead(ray_cluster):
    controller = _Controller.remote()
    ray.get(controller.ready.remote())
    controller_id = controller._actor_id.hex()
    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=60)
    cleaner = guarded_cleaner()(
        controller_actor_id=controller_id, check_interval_s=1.0, get_actor_timeout_s=10, stop_timeout=2.0
    )
    try:
        assert gcs_actor_state(controller_id) == "ALIVE"
        # Ray's monitor loop calls this when the state API reports the controller gone: here a false report, as
        # the one that tore down a live run in CI.
        cleaner._cleanup_placement_group(group)
        assert placement_group_table(group)["state"] == "CREATED"

        ray.kill(controller, no_restart=True)  # returns before the GCS has it dead: wait until it does
        deadline = time.monotonic() + 60
        while gcs_actor_state(controller_id) != "DEAD":
            assert time.monotonic() < deadline, gcs_actor_state(controller_id)
            time.sleep(0.1)  # polling the GCS until it records the death
        cleaner._cleanup_placement_group(group)
        assert placement_group_table(group)["state"] == "REMOVED"
    finally:
        if placement_group_table(group)["state"] != "REMOVED":
            remove_placement_group(group)

    # An actor the GCS never had, and an id it cannot parse: unknown, never "DEAD".
    assert gcs_actor_state(ray.ActorID.from_random().hex()) is None
    assert gcs_actor_state("not-an-actor-id") is None
