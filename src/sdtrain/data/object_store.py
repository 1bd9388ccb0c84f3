"""What the driver puts in Ray's object store for every rank, fetched once a process.

``ray.get`` deserializes anew at every call: a bucketed read plan at 2e5 files is rebuilt into ~100 MB each time
(its pickle holds only the runs). A training worker needs it twice, for its own planning and for its stream's read
tasks (asked for on a Ray Data thread of the same process), and the controller once a worker group.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import ray

_KEPT = 2
"""Objects kept a process: a process serves one run, so one, and one more for a test's second run."""

_fetched: OrderedDict[ray.ObjectRef, Any] = OrderedDict()
_lock = threading.Lock()


def fetched(ref: ray.ObjectRef) -> Any:
    """``ray.get(ref)``, the same object at every call in this process (under a lock: the worker's main thread and
    its stream's thread may ask at once)."""
    with _lock:
        if ref not in _fetched:
            _fetched[ref] = ray.get(ref)
            while len(_fetched) > _KEPT:
                _fetched.popitem(last=False)
        _fetched.move_to_end(ref)
        return _fetched[ref]
