"""The CPU priority of the process evaluations run in: lowered to the least before anything else loads, so that on a
node it shares with training workers an evaluation only runs on CPU time they leave idle (sdtrain.evaluation.eval_task).
Light on purpose: it imports nothing but the standard library."""

from __future__ import annotations

import os

from sdtrain.logs import log

EVALUATION_TASK_ENV = "SDTRAIN_EVALUATION_TASK"
"""Set (to "1") in the task's runtime environment by the driver: Ray keeps worker processes of a runtime environment
apart from the others', so a process whose priority an evaluation lowered only ever runs evaluations."""


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
