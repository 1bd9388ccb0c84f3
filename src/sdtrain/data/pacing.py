"""A pace for Ray Data's scheduling loop, which otherwise spins while the trainer is behind.

Ray Data runs each stream's scheduler on a thread of the process that iterates it: here, the
training worker. The loop blocks (in ``ray.wait``, up to 0.1 s) only while some read task is
running. When none is (the stream is ahead of the trainer and held back by its memory budget,
or a read waits for a CPU) the loop goes round with no pause at all: it burns a core and holds
the GIL against the training loop in the same process, for as long as the stream lasts: the
whole run, since one stream runs to ``train.max_steps``. On a machine with few CPUs per worker
that slows the training step itself. ``bench/scheduler_spin.py`` measures the scheduler thread's
CPU and a CPU-bound consumer's rate with and without the pace (method in bench/README.md, figures
in bench/results/).

``PacedScheduling`` is an execution callback that holds each round of the loop to at least
:data:`ROUND_S`. A round that waited for a task already took that long and is not delayed; a
round that found nothing to wait for sleeps the rest. The cost is latency: a read starts up to
:data:`ROUND_S` after the trainer makes room for it, against windows that take seconds to read
and are read ahead of the trainer. (Pacing only while the executor's output queue is full is
not enough: the iterator's prefetch empties that queue, and the loop spun as much.)
"""

from __future__ import annotations

import time

import ray.data

from sdtrain.private import ray as ray_private

ROUND_S = 0.05
"""Shortest round of the scheduling loop: at most 20 rounds a second when nothing is running."""


# Ray Data's private base class (sdtrain.private.ray): without it, streams run unpaced.
_CALLBACK = ray_private.execution_callback_base() or object


class PacedScheduling(_CALLBACK):  # type: ignore[misc, valid-type]
    """Sleeps out the rest of :data:`ROUND_S` after a scheduling round that took less."""

    def __init__(self) -> None:
        self._round_started: float | None = None

    def on_execution_step(self, executor) -> None:
        now = time.monotonic()
        if self._round_started is not None:
            rest = ROUND_S - (now - self._round_started)
            if rest > 0:
                time.sleep(rest)
        self._round_started = time.monotonic()


def paced(dataset: ray.data.Dataset) -> ray.data.Dataset:
    """``dataset``, executed with :class:`PacedScheduling` (the dataset's own context carries it to
    the training worker that iterates it)."""
    callbacks = dataset.context.custom_execution_callback_classes
    if _CALLBACK is not object and PacedScheduling not in callbacks:
        callbacks.append(PacedScheduling)
    return dataset
