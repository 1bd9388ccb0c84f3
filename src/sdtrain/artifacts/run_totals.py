"""A run's totals from its checkpoints' metric rows (history.json): images trained, GPU-hours (worker-hours on CPU),
MFU over them and cost. Rank 0 continues the hours from a restored checkpoint's rows; the driver sums up the final
one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def hours_so_far(history: Sequence[Mapping[str, float]]) -> float:
    """The cumulative hours the rows of a checkpoint end with (0 for a fresh run, or rows that predate them)."""
    if not history:
        return 0.0
    last = history[-1]
    return float(last.get("gpu_hours", last.get("worker_hours", 0.0)))


@dataclass(frozen=True)
class RunTotals:
    """What a run's final summary says of its cost.

    Args:
        images: images trained (optimizer steps x train.global_batch_size).
        hours: GPU-hours (worker-hours on CPU) of the steps the final checkpoint kept; None if its rows have none.
        on_gpu: hours are GPU-hours.
        mfu: model FLOPs utilization over those hours (None: no MFU: CPU, an unknown GPU).
        cost: run.gpu_hour_cost x hours (None: no price set).
    """

    images: int
    hours: float | None
    on_gpu: bool
    mfu: float | None
    cost: float | None

    def line(self) -> str:
        """The summary as one line of text."""
        unit = "GPU-hours" if self.on_gpu else "worker-hours"
        parts = [f"{self.images:,} images trained"]
        if self.hours is not None:
            parts[0] += f" in {self.hours:.4g} {unit}"
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        elif not self.on_gpu:
            parts.append("no MFU on CPU workers")
        if self.cost is not None:
            parts.append(f"cost {money(self.cost)} (run.gpu_hour_cost x {unit})")
        return ", ".join(parts)


def run_totals(
    history: Sequence[Mapping[str, float]], global_batch_size: int, gpu_hour_cost: float | None
) -> RunTotals:
    """The totals of a run whose final checkpoint holds the metric rows ``history``.

    The run's MFU is each row's MFU weighted by the hours its window took: the model FLOPs of every image over
    the peak FLOPs of every GPU-hour.

    Args:
        history: the final checkpoint's metric rows.
        global_batch_size: train.global_batch_size.
        gpu_hour_cost: run.gpu_hour_cost.
    """
    images = int(history[-1]["step"]) * global_batch_size if history else 0
    on_gpu = any("gpu_hours" in row for row in history)
    has_hours = any("gpu_hours" in row or "worker_hours" in row for row in history)
    hours = hours_so_far(history) if has_hours else None
    weighted, weight, previous = 0.0, 0.0, 0.0
    for row in history:
        current = row.get("gpu_hours", row.get("worker_hours"))
        if current is None:
            continue
        if "mfu" in row and math.isfinite(row["mfu"]) and current > previous:
            weighted += row["mfu"] * (current - previous)
            weight += current - previous
        previous = current
    cost = gpu_hour_cost * hours if gpu_hour_cost is not None and hours is not None else None
    return RunTotals(images, hours, on_gpu, weighted / weight if weight > 0 else None, cost)


def money(amount: float) -> str:
    """An amount in the user's currency: cents above 1, three significant digits below (a CPU test run's cost)."""
    return f"{amount:,.2f}" if amount >= 1 else f"{amount:.3g}"
