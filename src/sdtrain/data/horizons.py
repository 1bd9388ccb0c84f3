"""A rank's training stream as a chain of datasets, a *horizon* of steps each, so a start costs what one horizon does.

Ray Data makes every read task of a dataset when it starts executing it, and puts each in the object store. One
dataset for a rank's whole remaining run costs, at each worker-group start, time and memory in proportion to the
run: ~45 us and ~4 KB a read task, ~275k tasks a rank for a 550k-step run at world size 8 (~12 s and ~1.1 GB a
rank). Ray Train's data hook (:class:`sdtrain.controller.data_hook.PlannedStreams`) gives each rank the first
horizon's dataset; the rank makes each next one itself (:func:`sdtrain.train.train_stream.horizon_dataset`) from
the plan it already holds, shortly before the previous one ends (:class:`sdtrain.train.train_stream.TrainStream`).

A horizon ends on a step boundary, and a rank's reads from a data position are the same cut anywhere at a step
(what makes a resumed run read what an uninterrupted one would), so the chain yields exactly the rows one dataset
of the whole run would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sdtrain.data.read_order import DataState, ReadPlan

HORIZON_READS = 2048
"""Read tasks of a rank's horizon, about: a start plans ~0.1 s and ~8 MB of them (unbucketed), and the chain moves
on to a new dataset every ~2k windows."""

HORIZON_READS_VAR = "SDTRAIN_STREAM_HORIZON_READS"
"""Overrides :data:`HORIZON_READS`, read where the driver makes the run's reader (the tests use a few)."""


def horizon_reads() -> int:
    """Read tasks a horizon is sized for: :data:`HORIZON_READS_VAR`, else :data:`HORIZON_READS`."""
    raw = os.environ.get(HORIZON_READS_VAR, "")
    try:
        reads = int(raw) if raw else HORIZON_READS
    except ValueError:
        raise ValueError(f"{HORIZON_READS_VAR}={raw!r}: expected a whole number of read tasks") from None
    if reads < 1:
        raise ValueError(f"{HORIZON_READS_VAR}={raw!r}: expected at least 1 read task")
    return reads


@dataclass(frozen=True)
class Horizons:
    """A worker group's remaining run from a data position, cut into horizons of ``horizon`` steps (the last: what
    is left)."""

    state: DataState
    """The data position the worker group starts from."""
    world_size: int
    rows_per_step: int
    """Rows each rank reads a step."""
    steps: int
    """Steps left to ``train.max_steps``."""
    horizon: int

    @classmethod
    def of(cls, plan: ReadPlan, reads: int, state: DataState, world_size: int, rows_per_step: int, steps: int):
        """About ``reads`` read tasks a horizon: a read task holds ~``plan.window_rows`` rows (bucketed: whole steps'
        shares of about that many)."""
        horizon = max(1, reads * plan.window_rows // rows_per_step)
        return cls(state, world_size, rows_per_step, steps, horizon)

    def __len__(self) -> int:
        return -(-self.steps // self.horizon)

    def steps_of(self, index: int) -> int:
        """Steps of horizon ``index``."""
        return min(self.horizon, self.steps - index * self.horizon)

    def stretches(self, plan: ReadPlan, index: int) -> list[list[Any]]:
        """Each rank's stretches of horizon ``index``: the plan's, from the position after the horizons before it."""
        state = plan.advance(self.state, self.world_size, self.rows_per_step, index * self.horizon)
        return plan.rank_stretches(state, self.world_size, self.rows_per_step, self.steps_of(index))
