"""Preemption-check benchmark: what asking Ray Train for a reclaim notice costs a training loop.

sdtrain's workers call ``ray.train.get_preemption_info()`` (a collective through Ray Train's
synchronization actor: every rank gets rank 0's answer) at the same steps on every rank, about every
``sdtrain.train.preemption.PREEMPTION_CHECK_S`` seconds of training. This times the call in a real
TorchTrainer worker group of 1, then 2, CPU workers on a local Ray cluster of its own, after a few
untimed calls.

Reported: milliseconds per call (rank 0's mean: in a collective every rank waits for the slowest)
and, as the ratio, the share of training time the checks take at that cadence.

    python bench/preemption_check.py           # 500 calls per worker group
    python bench/preemption_check.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import tempfile
import time


def _time_checks(config: dict) -> float:
    import ray.train

    for _ in range(10):
        ray.train.get_preemption_info()
    started = time.perf_counter()
    for _ in range(config["calls"]):
        assert ray.train.get_preemption_info() is None  # no node of this cluster is being reclaimed
    return 1000 * (time.perf_counter() - started) / config["calls"]  # rank 0's: Ray Train returns its value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few calls on one worker: checks that it runs")
    parser.add_argument("--calls", type=int, help="timed calls per worker (default 500; smoke 20)")
    args = parser.parse_args()
    calls = args.calls or (20 if args.smoke else 500)
    worker_counts = (1,) if args.smoke else (1, 2)

    import ray  # after the arguments: --help answers without loading Ray
    import ray.train

    from sdtrain.driver.placement_group_guard import torch_trainer_class
    from sdtrain.train.preemption import PREEMPTION_CHECK_S

    ray.init(address="local", num_cpus=max(worker_counts), include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            for workers in worker_counts:
                result = torch_trainer_class()(  # as sdtrain's runs: a cleaner that keeps live workers
                    _time_checks,
                    train_loop_config={"calls": calls},
                    scaling_config=ray.train.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                    run_config=ray.train.RunConfig(storage_path=storage, name=f"checks-{workers}"),
                ).fit()
                ms = result.return_value  # what rank 0's function returned
                print(f"{workers} worker(s): {ms:.2f} ms per ray.train.get_preemption_info() ({calls} calls)")
                print(
                    f"RATIO preemption checks / training time at {workers} worker(s) = "
                    f"{ms / 1000 / PREEMPTION_CHECK_S:.5f}  (one check per {PREEMPTION_CHECK_S:g} s of training)"
                )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
