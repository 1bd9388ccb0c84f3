"""Ray Data's once-per-cluster start-up, paid on the driver while the trainer starts.

A stream's executor sizes itself by what Ray Data's autoscaling coordinator (a cluster-wide actor)
says the cluster has. The first execution on a cluster creates that actor, and the stats actor,
each in a new worker process that must import Ray Data first. Until the coordinator answers, the
executor sees no CPUs at all and runs one read task at a time (its rule that some task may always
run), so a stream's first windows are read one after another instead of in parallel; with the
coordinator already up, the executor waits only for its next refresh of its view of the cluster.
``bench/ingest.py`` measures a stream's first batch and throughput with this start-up done (method
in bench/README.md, figures in bench/results/).

:func:`warm_up_ray_data` runs one tiny dataset on the driver, in the background, while Ray Train
starts its controller and workers, which usually takes longer, so the first stream finds it done.
It creates both actors, and leaves an idle worker process that has imported Ray Data and the
package's reader, which a stream read from the driver can take (``bench/ingest.py``'s); a train
worker's read tasks run in Ray Train's worker runtime environment and so start processes of their
own. The actors live as long as the cluster: on a cluster that has them (every run after the first
on a long-lived cluster, a retry), there is nothing to start and no dataset is run.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import ray.data

from sdtrain.logs import log
from sdtrain.private import ray as ray_private
from sdtrain.private._lookup import PrivateApiMissing

_THREAD_NAME = "sdtrain-ray-data-warmup"


class _NotFromWarmUp(logging.Filter):
    """Keeps Ray Data's lines about the warm-up's own dataset off the console (its log file keeps
    them): a user would read "Dataset ... execution finished" before training as their data."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _THREAD_NAME


_QUIET = _NotFromWarmUp()


def warm_up_ray_data() -> threading.Thread | None:
    """Start Ray Data's cluster-wide actors and a read worker in the background; returns the thread,
    or None where the cluster has the actors already.

    An optimization only: a failure is logged, never raised (the streams then pay the start-up).
    """
    try:
        if _cluster_actors_exist():
            return None
    except PrivateApiMissing as error:
        log.warning("Ray Data's start-up is left to the streams: %s", error)
        return None
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and _QUIET not in handler.filters:
            handler.addFilter(_QUIET)
    thread = threading.Thread(target=_run, name=_THREAD_NAME, daemon=True)
    thread.start()
    return thread


def _cluster_actors_exist() -> bool:
    """Whether Ray Data's autoscaling coordinator and stats actor run on this cluster already."""
    named = {(actor["namespace"], actor["name"]) for actor in ray.util.list_named_actors(all_namespaces=True)}
    stats_name, stats_namespace = ray_private.data_stats_actor()
    coordinator = (ray_private.COORDINATOR_NAMESPACE, ray_private.COORDINATOR_NAME)
    return {coordinator, (stats_namespace, stats_name)} <= named


def _run() -> None:
    started = time.perf_counter()
    try:
        # One block, read and mapped in one task, as a stream's windows are (sdtrain.data.streams).
        # No CPU, as the streams' reads take none: it must not wait behind workers that hold every CPU.
        ids = ray_private.range_datasource(1)
        dataset = ray.data.read_datasource(ids, override_num_blocks=1, num_cpus=0).map_batches(
            _import_reader, batch_size=None, num_cpus=0
        )
        dataset.materialize()
    except Exception as error:  # e.g. Ray shut down before it finished
        log.warning("Ray Data's start-up on the driver did not finish (%s); the streams will pay it", error)
        return
    log.debug("Ray Data started on the driver in %.1f s", time.perf_counter() - started)


def _import_reader(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import sdtrain.data.streams  # noqa: F401  (what every read task imports before its first window)

    return batch
