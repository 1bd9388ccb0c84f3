"""This run's checkpoint staging on every node, removed when its fit ends.

A worker group's workers empty their own staging directories when they start (sdtrain.train.checkpointing), so a node
that runs the job again keeps nothing. A node no later worker group runs on keeps what a worker killed mid-upload left
there, a whole staged checkpoint (an SDXL one with its EMA and optimizer is ~40 GB), for as long as the node lives: on a
cluster of fixed nodes, for good. So when fit ends (trained, failed or interrupted), the driver removes the run's
staging directory on every node that is alive, in a task of no CPU pinned to each.
"""

from __future__ import annotations

import os
import shutil

import ray

from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.storage.run_layout import run_scratch_dir

CLEANUP_TIMEOUT_S = 60.0


def remove_run_staging(config: Config, run_dir: str, timeout_s: float = CLEANUP_TIMEOUT_S) -> dict[str, int]:
    """Remove ``run_dir``'s staging directory on every alive node; returns node id -> bytes freed there. A node that
    fails or does not answer within ``timeout_s`` is warned about, never raised: the run's outcome stands.

    Args:
        config: the run's config (checkpoint.staging_dir, run.name).
        run_dir: the run's directory (run.storage_path/run.name), which names its staging directory.
        timeout_s: seconds to wait for every node.
    """
    try:
        freed = _remove_everywhere(config, run_dir, timeout_s)
    except Exception as error:  # e.g. the driver lost the cluster: the run's outcome stands
        log.warning(f"could not remove this run's checkpoint staging from the cluster's nodes: {error}")
        return {}
    total = sum(freed.values())
    if total:
        nodes = sum(1 for size in freed.values() if size)
        log.info(f"removed {total / 2**30:.2f} GiB of checkpoint staging that killed workers left on {nodes} node(s)")
    return freed


def _remove_everywhere(config: Config, run_dir: str, timeout_s: float) -> dict[str, int]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_remove_here)
    pending = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            config.checkpoint.staging_dir, config.run.name, run_dir
        ): node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
    }
    done, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    freed: dict[str, int] = {}
    for ref in done:
        try:
            freed[pending[ref]] = ray.get(ref)
        except Exception as error:  # e.g. the node died since it was listed
            log.warning(f"could not remove this run's checkpoint staging on node {pending[ref]}: {error}")
    for ref in late:
        ray.cancel(ref, force=True)
        log.warning(f"node {pending[ref]} did not remove this run's checkpoint staging within {timeout_s:g} s")
    return freed


def _remove_here(staging_dir: str | None, run_name: str, run_dir: str) -> int:
    """Remove the run's staging directory on this node (where the task runs); returns the bytes it held. Its module
    imports no torch: a fresh worker on each node imports it (lightning and torch took ~7 s alone, past the clean-up's
    timeout with several nodes' workers on busy cores)."""
    directory = run_scratch_dir(staging_dir, run_name, run_dir)
    size = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    shutil.rmtree(directory, ignore_errors=True)
    return size
