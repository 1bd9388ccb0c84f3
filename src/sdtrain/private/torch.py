"""torch's private names that sdtrain relies on, each behind one function here and imported only when called.

torch is pinned exactly (pyproject.toml). An upgrade that moves one fails ``tests/test_private_apis.py`` naming it,
and at run time only the feature it serves: the memory model's prediction (``train.micro_batch_size: auto`` and the
check before workers start), or compilation's recompile limit.

The foreach kernels (``torch._foreach_*``) are not here: torch's own optimizers call them on every step, and they are
named by the test beside the others.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sdtrain.private._lookup import private

NAMES = {
    ("torch._subclasses.fake_tensor", "FakeTensorMode"): "tensors without memory, for the memory model's trace",
    ("torch.distributed._tools.mem_tracker", "MemTracker"): "the memory model's count of a step's tensors",
    ("torch.distributed._tools.mem_tracker", "_MemRefType"): "the kinds of memory MemTracker counts",
    ("torch.utils._pytree", "tree_map_only"): "casting a call's tensor arguments in the memory model's autocast rules",
    ("torch._dynamo", "config"): "raising dynamo's recompile limit for FSDP's compiled units and for buckets",
    ("torch._dynamo.utils", "counters"): "the graphs a compiled run compiled and broke, for its log",
    ("torch.utils._python_dispatch", "TorchDispatchMode"): "the per-op model's record of a step's ops and tensors",
    ("torch", "_foreach_norm"): "gradient norms in one kernel per dtype (clipping, the non-finite check)",
    ("torch", "_foreach_mul_"): "scaling every gradient by the clipping factor in one kernel",
    ("torch", "_foreach_lerp_"): "the EMA update in one kernel",
}
"""(module, name) -> what it serves: every private name sdtrain uses (the test imports each)."""


def _get(module: str, name: str) -> Any:
    return private(module, name, "torch", NAMES[module, name])


def fake_tensor_mode() -> Any:
    """A new FakeTensorMode: tensors with shapes, dtypes and strides but no storage."""
    return _get("torch._subclasses.fake_tensor", "FakeTensorMode")()


@cache
def transient_memory_tracker() -> type:
    """A MemTracker that keeps only the peak of a step's transient bytes (activations, temporaries and what it could
    not attribute), in ``transient_peak``. Its own peak bookkeeping (per module, at every op) is skipped: it would
    take most of the trace's time. It reads MemTracker's private snapshot."""
    tracker = _get("torch.distributed._tools.mem_tracker", "MemTracker")
    kinds = _get("torch.distributed._tools.mem_tracker", "_MemRefType")
    transient = (kinds.ACT, kinds.TEMP, kinds.OTH)

    class TransientTracker(tracker):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.transient_peak = 0

        def _update_peak_stats(self, peak_state) -> None:
            for snapshot in self._curr_mem_snap.values():
                self.transient_peak = max(self.transient_peak, sum(snapshot[kind] for kind in transient))

    return TransientTracker


def dispatch_mode() -> type:
    """torch's TorchDispatchMode: a context that sees every aten op with its tensors (sdtrain.model.op_costs)."""
    return _get("torch.utils._python_dispatch", "TorchDispatchMode")


def tree_map_only(kind: type, fn: Any, tree: Any) -> Any:
    """torch's pytree map over the leaves of ``tree`` that are ``kind``."""
    return _get("torch.utils._pytree", "tree_map_only")(kind, fn, tree)


def raise_recompile_limit(at_least: int) -> None:
    """Let dynamo cache at least ``at_least`` graphs per code object before it falls back to eager."""
    config = _get("torch._dynamo", "config")
    config.recompile_limit = max(config.recompile_limit, at_least)


def compiled_graphs() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) in this process so far, from its counters."""
    counters = _get("torch._dynamo.utils", "counters")
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))
