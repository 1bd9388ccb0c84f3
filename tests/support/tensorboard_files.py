"""What TensorBoard reads of a run's event files."""

from __future__ import annotations

from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[int]]]:
    """(tag -> [(step, value)], image tag -> [step]) as TensorBoard itself reads ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in tags["scalars"]}
    images = {tag: [e.step for e in accumulator.Images(tag)] for tag in tags["images"]}
    return scalars, images
