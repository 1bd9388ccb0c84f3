"""The session's forkserver for tests that run code in processes of their own (gloo ranks, registry writers killed
mid-write): its server imports torch, Lightning, diffusers and sdtrain once, and each process it forks starts with them
imported, where a spawned one spent 6-10 s importing them on 2 cores. Each is still a real process of its own."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from multiprocessing.context import ForkServerContext

PRELOAD = [
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "diffusers",
    "sdtrain.train.build",
    "sdtrain.driver.retrain",
    "sdtrain.artifacts.registry",
    "sdtrain.artifacts.loading",
]


def preloaded() -> ForkServerContext:
    """The forkserver context, its server (started at its first process) importing PRELOAD."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def stop() -> None:
    """Stops the server, if this session started one (its processes have ended)."""
    multiprocessing.forkserver._forkserver._stop()
