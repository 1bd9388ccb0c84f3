"""The Ray task Ray Train runs a checkpoint's evaluation in (driver: ``ValidationConfig``).

It gives up its CPU priority before anything else, so that on a node it shares with training workers it only runs on
CPU time they leave idle: importing torch, diffusers and transformers (seconds of CPU in every new process) and the
evaluation's own CPU work then never take a core from a training step or its data reads. On CPUs nobody else wants it
runs at full speed. Light on purpose: Ray imports this module to call the task, before the priority is lowered.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("sdtrain")

EVALUATION_TASK_ENV = "SDTRAIN_EVALUATION_TASK"
"""Set (to "1") in the task's runtime environment by the driver: Ray keeps worker processes of a runtime environment
apart from the others', so a process whose priority an evaluation lowered only ever runs evaluations."""


def evaluate_in_task(checkpoint: Any, config: dict[str, Any], run_dir: str, vae: str | None) -> dict[str, float]:
    """Ray Train's validation function: :func:`sdtrain.evaluation.checkpoint_eval.evaluate_checkpoint` at the lowest
    CPU priority.

    Args:
        checkpoint: the ray.train.Checkpoint Ray Train committed.
        config: the run's config as a dict (the task's arguments must be JSON).
        run_dir: run.storage_path/run.name.
        vae: the VAE that decodes latents (None when no metric needs images).
    """
    lowest_cpu_priority()
    from sdtrain.evaluation.checkpoint_eval import evaluate_checkpoint  # torch and the models: after the line above

    return evaluate_checkpoint(checkpoint, config, run_dir, vae)


def lowest_cpu_priority() -> bool:
    """Every thread of this process to Linux's SCHED_IDLE, which the threads it starts later inherit (torch's pools);
    nice 19 where there is no SCHED_IDLE (macOS: the whole process). Returns whether it was lowered.

    It cannot be undone without privileges, so only a process that runs nothing but evaluations is lowered: one whose
    environment has EVALUATION_TASK_ENV. A system that refuses is logged and the evaluation runs as it is.
    """
    if os.environ.get(EVALUATION_TASK_ENV) != "1":
        log.warning("evaluation: no %s in its environment; its CPU priority stays", EVALUATION_TASK_ENV)
        return False
    try:
        if hasattr(os, "SCHED_IDLE"):
            for thread in os.listdir("/proc/self/task"):
                try:
                    os.sched_setscheduler(int(thread), os.SCHED_IDLE, os.sched_param(0))
                except ProcessLookupError:  # the thread ended meanwhile
                    pass
        else:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError as error:
        log.warning("evaluation: could not lower its CPU priority (%s); it competes with training for CPU", error)
        return False
    return True


def cpu_policy() -> str:
    """This thread's CPU scheduling: "idle" (SCHED_IDLE), "nice <n>", or "normal"."""
    if hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) == os.SCHED_IDLE:
        return "idle"
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    return f"nice {nice}" if nice else "normal"
