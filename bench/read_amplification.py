"""The rows a rank reads against the rows it trains on, by world size: the real read plans, no data.

A read task reads whole parquet row groups (``WindowReader._row_group``: pyarrow reads a column chunk whole) and holds
each for the rest of its window, so a rank reads every row group its windows touch once a window. This builds the
real plans (``SamplePlan`` for data of one shape, ``BucketPlan`` for aspect-ratio buckets) over 1e6 rows in 100
files, plans one rank's windows for ``--steps`` steps at a global batch of 2048 and world sizes 8 to 256, and counts,
over those windows, the rows of the row groups touched (rows read) against the rows in the spans (rows trained on),
for row groups of 64 rows (preprocessing's ``output.row_group_rows`` default), 16 and 8. ``turns`` is the bucketed plan
with ``data.bucket_steps: auto`` at each world size (chunk rows / a rank's share of a step, 1 where the share is a
chunk or more); ``buckets``, with turns of one step. Bucketed files are laid out two ways: ``start``, row groups counted
from the file's start (files written before preprocessing started a row group at each run), and ``runs``, a row
group starting at each bucket run, as preprocessing writes them now.

    python bench/read_amplification.py            # 1e6 rows, 400 steps a rank
    python bench/read_amplification.py --smoke    # seconds (CI)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import CHUNK_ROWS, ROWS_PER_FILE, WINDOW_ROWS, bucketed_files  # noqa: E402

GLOBAL_BATCH = 2048
WORLD_SIZES = (8, 32, 64, 128, 256)
ROW_GROUPS = (64, 16, 8)


def turn_steps(world_size: int) -> int:
    """data.bucket_steps: auto's turns at ``world_size`` workers."""
    from sdtrain.data.bucket_turns import auto_bucket_steps

    return auto_bucket_steps(CHUNK_ROWS, GLOBAL_BATCH, world_size)


def plans(files: int):
    """{order: {world size: plan}}."""
    from sdtrain.data.bucket_order import BucketPlan
    from sdtrain.data.read_order import SamplePlan

    rows = [ROWS_PER_FILE] * files
    shapes, runs = bucketed_files(files, 40)
    square = SamplePlan(rows, 0, CHUNK_ROWS, WINDOW_ROWS, "bench")
    buckets = BucketPlan(rows, runs, shapes, 0, CHUNK_ROWS, GLOBAL_BATCH, WINDOW_ROWS)
    turns = {
        steps: BucketPlan(rows, runs, shapes, 0, CHUNK_ROWS, GLOBAL_BATCH, WINDOW_ROWS, bucket_steps=steps)
        for steps in {turn_steps(w) for w in WORLD_SIZES}
    }
    return {
        "one shape": dict.fromkeys(WORLD_SIZES, square),
        "buckets": dict.fromkeys(WORLD_SIZES, buckets),
        "turns": {w: turns[turn_steps(w)] for w in WORLD_SIZES},
    }


def group_starts(plan, layout: str) -> np.ndarray:
    """The sample index each stretch of row groups starts at: each file's first row (``start``), or each bucket run's
    (``runs``); row groups of ``group_rows`` rows follow from there to the next such start."""
    if layout == "start" or not hasattr(plan, "run_start"):  # one shape: a file is one run
        return np.asarray(plan.file_offsets, np.int64)
    starts = plan.file_offsets[plan.run_file] + plan.run_start
    return np.append(starts, plan.file_offsets[-1]).astype(np.int64)


def read_and_used(
    plan, world_size: int, steps: int, group_rows: int, layout: str = "runs", rank: int | None = None
) -> tuple[int, int, int]:
    """(rows of the row groups touched, rows in the spans, files opened) over ``rank``'s windows of ``steps`` steps
    from the start: a task opens each file of its window once, a footer read each."""
    from sdtrain.data.intervals import FILE, START, STOP
    from sdtrain.data.read_order import DataState

    rank = world_size // 2 if rank is None else rank
    starts = group_starts(plan, layout)
    stretches = plan.rank_stretches(DataState(), world_size, GLOBAL_BATCH // world_size, steps)[rank]
    read = used = opened = 0
    for stretch in stretches:
        for window in plan.windows(stretch):
            spans = window.spans
            opened += len(np.unique(spans[:, FILE]))
            used += int((spans[:, STOP] - spans[:, START]).sum())
            lo = plan.file_offsets[spans[:, FILE]] + spans[:, START]
            hi = plan.file_offsets[spans[:, FILE]] + spans[:, STOP]
            stretch_of = np.searchsorted(starts, lo, side="right") - 1
            assert (hi <= starts[stretch_of + 1]).all(), "a span crosses a run"
            first = (lo - starts[stretch_of]) // group_rows
            last = (hi - 1 - starts[stretch_of]) // group_rows
            groups = {(int(s), g) for s, a, b in zip(stretch_of, first, last, strict=True) for g in range(a, b + 1)}
            # A stretch's last row group holds what is left of it.
            read += sum(min(group_rows, int(starts[s + 1] - starts[s]) - g * group_rows) for s, g in groups)
    return read, used, opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100, help="10,000-row files")
    parser.add_argument("--steps", type=int, default=400, help="steps a rank plans")
    parser.add_argument("--smoke", action="store_true", help="10 files, 40 steps")
    args = parser.parse_args()
    files, steps = (10, 40) if args.smoke else (args.files, args.steps)
    built = plans(files)
    print(f"# {files * ROWS_PER_FILE} rows in {files} files, global batch {GLOBAL_BATCH}, chunks of {CHUNK_ROWS} rows,")
    print(f"# windows of ~{WINDOW_ROWS} rows, {steps} steps of rank W/2; rows read / rows trained on")
    ratios, footers = {}, {}
    rows = [("one shape", "start")] + [(name, layout) for name in ("buckets", "turns") for layout in ("start", "runs")]
    print(f"{'order':>10} {'groups at':>9} {'row group':>9} " + " ".join(f"{f'W={w}':>8}" for w in WORLD_SIZES))
    print(f"{'turns of':>10} {'':>9} {'':>9} " + " ".join(f"{turn_steps(w):8d}" for w in WORLD_SIZES))
    for name, layout in rows:
        label = name if name == "one shape" else f"{name}/{layout}"
        for group_rows in ROW_GROUPS:
            cells = []
            for world_size in WORLD_SIZES:
                read, used, opened = read_and_used(built[name][world_size], world_size, steps, group_rows, layout)
                ratios[label, group_rows, world_size] = read / used
                footers[name, world_size] = opened / used * 1000
                cells.append(f"{read / used:8.2f}")
            print(f"{name:>10} {layout:>9} {group_rows:>9} " + " ".join(cells))
    print("# files opened (a footer read each) per 1000 rows trained on")
    for name in built:
        print(f"{name:>10} {'':>9} {'':>9} " + " ".join(f"{footers[name, w]:8.1f}" for w in WORLD_SIZES))
    for label, group_rows, world_size in ratios:
        if world_size in (WORLD_SIZES[0], WORLD_SIZES[-1]):
            ratio = ratios[label, group_rows, world_size]
            print(f"RATIO rows read / trained on, {label}, {group_rows}-row groups, W={world_size} = {ratio:.3f}")
    for world_size in (WORLD_SIZES[0], WORLD_SIZES[-1]):
        for name in ("buckets", "turns"):
            ratio = footers[name, world_size] / footers["one shape", world_size]
            print(f"RATIO files opened per row, {name} / one shape, W={world_size} = {ratio:.3f}")


if __name__ == "__main__":
    main()
