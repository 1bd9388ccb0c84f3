"""Lightning's private names that sdtrain relies on, each behind one function here and imported only when called.

Lightning is pinned exactly (pyproject.toml). An upgrade that moves one fails ``tests/test_private_apis.py`` naming
it; at run time the one it serves is an optimization, which goes without it, with a warning.
"""

from __future__ import annotations

import threading
from typing import Any

from sdtrain.logs import log
from sdtrain.private._lookup import PrivateApiMissing, private

_LOOP = ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop")
BROADCAST = "_broadcast_sigterm_tensor"
NAMES = {
    _LOOP: (
        f"the training loop whose {BROADCAST} (rank 0's SIGTERM flag to every rank before each micro-batch, read "
        "on the host) a Ray Train worker skips"
    ),
}
"""(module, name) -> what it serves."""


def skip_sigterm_broadcast(trainer: Any) -> bool:
    """Stop ``trainer``'s training loop from broadcasting rank 0's SIGTERM flag before every micro-batch, where no
    SIGTERM can set it; True if it was stopped. Call it from the thread that runs ``trainer.fit``, once the loop is
    built (a strategy's ``setup``).

    In a distributed run, Lightning broadcasts the flag and reads it with ``.item()`` before each micro-batch: a
    collective through every rank and a host sync, which empties the GPU's queue (the host waits for all the
    micro-batch's kernels) and holds every rank to the slowest, micro-batch by micro-batch. The flag is set only by
    the SIGTERM handler Lightning installs, and Python installs signal handlers only from the main thread. Ray Train
    runs a worker's training function in a thread of its own, so there the flag stays False and the broadcast
    carries nothing. Preemption reaches sdtrain's workers as Ray's notice instead (``sdtrain.train.preemption``).
    On the main thread (Lightning's handler installed) the loop is left as it is.
    """
    if threading.current_thread() is threading.main_thread():
        return False
    try:
        loop_class = private(*_LOOP, "lightning", NAMES[_LOOP])
        if not callable(getattr(loop_class, BROADCAST, None)):
            raise PrivateApiMissing(f"lightning's {_LOOP[0]}.{_LOOP[1]} has no {BROADCAST}")
    except PrivateApiMissing as error:
        log.warning("Lightning's per-micro-batch SIGTERM broadcast is left on: %s", error)
        return False
    loop = trainer.fit_loop.epoch_loop
    if not isinstance(loop, loop_class):
        return False
    setattr(loop, BROADCAST, _nothing)  # on this Trainer's loop only
    return True


def _nothing() -> None:
    """The broadcast skipped: no SIGTERM can reach the training loop's thread."""
