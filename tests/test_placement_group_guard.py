"""The placement-group cleaner of sdtrain's runs (sdtrain.driver.placement_group_guard) on the session's Ray cluster:
a live controller's group stays whatever the state API reported; a dead one's is removed. That every run launches it
is asserted in test_train_ray's exactly-once test."""

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from sdtrain.driver.placement_group_guard import gcs_actor_state, guarded_cleaner

pytestmark = pytest.mark.slow  # the session's Ray cluster


@ray.remote(num_cpus=0)
class _Controller:
    """Stands where Ray Train's controller does: the actor the cleaner watches."""

    def ready(self) -> bool:
        return True


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

        ray.kill(controller, no_restart=True)
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(controller.ready.remote())
        assert gcs_actor_state(controller_id) == "DEAD"
        cleaner._cleanup_placement_group(group)
        assert placement_group_table(group)["state"] == "REMOVED"
    finally:
        if placement_group_table(group)["state"] != "REMOVED":
            remove_placement_group(group)

    # An actor the GCS never had, and an id it cannot parse: unknown, never "DEAD".
    assert gcs_actor_state(ray.ActorID.from_random().hex()) is None
    assert gcs_actor_state("not-an-actor-id") is None
