"""Data at LAION scale (issue #26): what one read task, one rank and the driver pay as the dataset grows.

Builds the real planning and reading objects (``SamplePlan``, ``WindowReader`` with its ``FileTable``, the
rank's read tasks as ``RankWindows.get_read_tasks`` makes them) for 1M to 2B rows in 10k-row files named
``s3://laion/part-NNNNNN.parquet``, with 64-row chunks, 512-row windows and world size 64, without any data:
nothing here reads a file. Measured at each size:

- one read task: the bytes pickled into it (``pickle.dumps`` of the ``ReadTask``) and the time to unpickle it
  and compute its rows' order and sample indices (the task's work before its I/O), median over 200 tasks;
- one rank: unpickling what Ray Train's controller sends it (the ``WindowReader``), then planning its stretch
  after a world-size change mid-epoch and building the read tasks of ``--steps`` steps; time and peak
  Python memory (tracemalloc, which sees numpy's buffers);
- the driver: the file list, the plan, the reader and every rank's stretches (the controller's share), peak
  memory;
- a worker-group start, which plans one horizon (``sdtrain.data.horizons``), for runs of a tenth of
  ``--run-steps`` and of ``--run-steps`` steps at the largest size: the same cost, however long the run;
- a worker-group start after 10 and 40 world-size changes in one epoch (256 ranks and 255 in turn), at the largest
  size: the intervals the position replays, and the planning time, against linear growth in the changes.

Then the start-up of a restart that reads the dataset index against one that reads every footer, from a
real S3 server process (moto), at 1k and 20k files (``bench/index_startup.py``).

    python bench/data_scale.py            # 1M .. 2B rows, 1k and 20k files on S3
    python bench/data_scale.py --smoke    # seconds: 1M and 10M rows, 20 and 100 files (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pickle
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ROWS_PER_FILE = 10_000
CHUNK_ROWS, WINDOW_ROWS, WORLD_SIZE = 64, 512, 64
ROWS_PER_RANK = 32  # a global batch of 2048 over 64 ranks
SIZES = (1_000_000, 10_000_000, 100_000_000, 1_000_000_000, 2_000_000_000)
MB = 2**20


def measure(rows: int, steps: int, tasks: int = 200, buckets: int = 0, horizon_reads: int | None = None) -> dict:
    """``horizon_reads``: the rank plans one horizon of ``steps`` (sdtrain.data.horizons), as a worker-group start
    does; None: all ``steps``."""
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.bucket_order import BucketPlan
    from sdtrain.data.horizons import Horizons
    from sdtrain.data.inspection import DatasetSpec
    from sdtrain.data.read_order import DataState, SamplePlan, files_digest
    from sdtrain.data.streams import WindowReader

    files = rows // ROWS_PER_FILE
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    names = [f"s3://laion/part-{i:06d}.parquet" for i in range(files)]
    spec = DatasetSpec(tuple(names), (ROWS_PER_FILE,) * files, (4, 32, 32), (77, 1024))
    if buckets:
        shapes, runs = bucketed_files(files, buckets)
        spec = dataclasses.replace(spec, bucket_shapes=shapes, runs=runs)
        global_batch = WORLD_SIZE * ROWS_PER_RANK
        plan = BucketPlan(spec.rows_per_file, runs, shapes, 0, CHUNK_ROWS, global_batch, WINDOW_ROWS)
        # Mid-epoch: 32 ranks trained, then the group grew to 64 (a bucketed step's rows divide among the ranks).
        state = plan.advance(DataState(), 32, global_batch // 32, 300)
    else:
        plan = SamplePlan(spec.rows_per_file, 0, CHUNK_ROWS, WINDOW_ROWS, files_digest(spec.files))
        # Mid-epoch: 48 ranks trained, then the group grew to 64 (the replay of a segment is part of planning).
        state = plan.advance(DataState(), 48, 2048 // 48, 300)
    reader = WindowReader(spec, DataConfig(train=["s3://laion/"]), plan)
    if horizon_reads is None:
        stretches = plan.rank_stretches(state, WORLD_SIZE, ROWS_PER_RANK, steps)  # the controller, for every rank
    else:
        stretches = Horizons.of(plan, horizon_reads, state, WORLD_SIZE, ROWS_PER_RANK, steps).stretches(plan, 0)
    driver_s = time.perf_counter() - started
    driver_mb = tracemalloc.get_traced_memory()[1] / MB
    tracemalloc.stop()
    sent = pickle.dumps(reader)  # what each rank receives once
    del names, spec, plan, reader
    gc.collect()

    # One rank: receive the reader, plan its stretch, build its read tasks (RankWindows.get_read_tasks). Timed
    # without tracemalloc (it slows allocations several times over), then again for the memory.
    rank_s, read_tasks = rank_start(sent, stretches[WORLD_SIZE // 2])
    del read_tasks
    gc.collect()
    tracemalloc.start()
    _, read_tasks = rank_start(sent, stretches[WORLD_SIZE // 2])
    rank_mb = tracemalloc.get_traced_memory()[1] / MB
    tracemalloc.stop()

    # One read task: its payload, and its work before I/O.
    chosen = [read_tasks[i] for i in np.linspace(0, len(read_tasks) - 1, min(tasks, len(read_tasks))).astype(int)]
    payloads, seconds = [], []
    for task in chosen:
        payload = pickle.dumps(task)
        payloads.append(len(payload))
        began = time.perf_counter()
        read = pickle.loads(payload).read_fn
        read.window.order()
        read.first_index[read.window.spans[:, 0]]
        seconds.append(time.perf_counter() - began)
    return {
        "rows": rows,
        "files": files,
        "task_bytes": statistics.median(payloads),
        "task_s": statistics.median(seconds),
        "rank_s": rank_s,
        "rank_mb": rank_mb,
        "rank_windows": len(read_tasks),
        "rank_receives_mb": len(sent) / MB,
        "driver_s": driver_s,
        "driver_mb": driver_mb,
    }


def bucketed_files(files: int, buckets: int, per_file: int = 20) -> tuple[tuple, np.ndarray]:
    """``buckets`` aspect-ratio buckets of about 32 x 32 latents, and each file's runs as preprocessing writes them: a
    file's rows in ``per_file`` of the buckets (the common ones: their popularity falls off geometrically), one run a
    bucket, in bucket order."""
    shapes = tuple((4, 32 - 2 * (i % 8), 32 + 2 * (i // 8)) for i in range(buckets))
    popularity = np.exp(-np.arange(buckets) / 6.0)
    rng = np.random.default_rng(0)
    chosen = np.sort(np.argsort(rng.random((files, buckets)) / popularity, axis=1)[:, :per_file], axis=1)
    counts = rng.multinomial(ROWS_PER_FILE, np.ones(per_file) / per_file, size=files)
    runs = np.stack([np.repeat(np.arange(files), per_file), chosen.ravel(), counts.ravel()], axis=1)
    return shapes, runs[runs[:, 2] > 0]


def rank_start(sent: bytes, stretches) -> tuple[float, list]:
    from sdtrain.data.streams import RankWindows

    started = time.perf_counter()
    source = RankWindows(pickle.loads(sent), stretches)
    read_tasks = source.get_read_tasks(source.count, data_context=object())
    return time.perf_counter() - started, read_tasks


def table(sizes, steps: int, buckets: int) -> list[dict]:
    """The table of :func:`measure` at each size, printed as it goes."""
    print(
        f"{'rows':>14} {'files':>7} {'task bytes':>10} {'task ms':>8} {'rank s':>7} {'rank MB':>8} "
        f"{'windows':>8} {'rank gets MB':>12} {'driver s':>8} {'driver MB':>9}"
    )
    results = []
    for rows in sizes:
        r = measure(rows, steps, buckets=buckets)
        results.append(r)
        print(
            f"{r['rows']:>14,} {r['files']:>7} {r['task_bytes']:>10.0f} {r['task_s'] * 1e3:>8.3f} "
            f"{r['rank_s']:>7.2f} {r['rank_mb']:>8.1f} {r['rank_windows']:>8} {r['rank_receives_mb']:>12.2f} "
            f"{r['driver_s']:>8.2f} {r['driver_mb']:>9.1f}",
            flush=True,
        )
    return results


def ratio_lines(results: list[dict], prefix: str) -> list[str]:
    """The targets, the largest size against the smallest: a task's time and bytes, a rank's time and memory."""
    small, large = results[0], results[-1]
    size = f"{large['rows'] / 1e9:g}B" if large["rows"] >= 1e9 else f"{large['rows'] / 1e6:g}M"

    def line(figure: str, baseline_name: str, baseline: float, target: float) -> str:
        value = large[figure]
        met = value <= target * baseline
        return benchlib.ratio_line(f"{prefix}{figure}_{size}", value, baseline_name, baseline, f"<= {target:g}", met)

    return [
        line("task_s", f"{prefix}task_s_1M", small["task_s"], 1.5),
        line("task_bytes", f"{prefix}task_bytes_1M", small["task_bytes"], 1.5),
        line("task_bytes", "1MB", MB, 1),
        line("rank_s", "2s", 2.0, 1),
        line("rank_mb", "512MB", 512, 1),
    ]


def horizon_lines(rows: int, runs: tuple[int, int], reads: int) -> list[str]:
    """A worker-group start plans one horizon of ``reads`` read tasks (sdtrain.data.horizons): its cost at a short and
    a long run."""
    short, long = (measure(rows, steps, tasks=20, horizon_reads=reads) for steps in runs)
    lines = [
        f"# a rank's start, one horizon ({reads} read tasks) of a {steps}-step run at {rows:,} rows: "
        f"{r['rank_s']:.2f} s, {r['rank_mb']:.0f} MB, {r['rank_windows']} read tasks"
        for steps, r in zip(runs, (short, long), strict=True)
    ]
    for figure in ("rank_s", "rank_mb"):
        met = long[figure] <= 1.5 * short[figure]
        name = f"horizon_{figure}_{runs[1]}_steps"
        lines.append(benchlib.ratio_line(name, long[figure], f"{runs[0]}_steps", short[figure], "<= 1.5", met))
    return lines


def resize_lines(rows: int, world_size: int, resizes: tuple[int, ...], steps_between: int) -> list[str]:
    """A worker-group start mid-epoch after each of ``resizes`` world-size changes (``world_size`` ranks and one fewer
    in turn, a spot node lost and back, ``steps_between`` steps apart): what the controller pays to plan every rank's
    next 50 steps, and what one rank pays to plan its windows for them (its part of what the epoch has left, mapped
    back through the earlier segments), beside the whole epoch's replay at the fewest changes."""
    from sdtrain.data.read_order import DataState, SamplePlan, files_digest

    files = rows // ROWS_PER_FILE
    names = [f"s3://laion/part-{i:06d}.parquet" for i in range(files)]
    digest = files_digest(names)
    global_batch, state, measured, states = world_size * ROWS_PER_RANK, DataState(), {}, {}
    plan_args = ((ROWS_PER_FILE,) * files, 0, CHUNK_ROWS, WINDOW_ROWS, digest)
    plan = SamplePlan(*plan_args)
    for done in range(max(resizes) + 1):
        size = world_size - done % 2
        if done in resizes:
            states[done] = state
            controller_plan = SamplePlan(*plan_args)  # each process plans once per segment: nothing cached yet
            gc.collect()
            started = time.perf_counter()
            stretches = controller_plan.rank_stretches(state, size, global_batch // size, 50)
            controller_s = time.perf_counter() - started
            ranks_s, intervals = [], 0
            for rank in (0, size // 2, size - 1):
                rank_plan = SamplePlan(*plan_args)
                gc.collect()
                started = time.perf_counter()
                rank_plan.windows(stretches[rank][0])
                ranks_s.append(time.perf_counter() - started)
                intervals = max(intervals, len(rank_plan.part(state, size, rank)))
            measured[done] = (controller_s, statistics.median(ranks_s), intervals)
        # Most segments end inside a window: its leftover rows, in shuffled order, are most of the intervals added.
        state = plan.advance(state, size, global_batch // size, steps_between)
    lines = [
        f"# a worker group's start after {done} resizes ({world_size} and {world_size - 1} ranks in turn, "
        f"{steps_between} steps apart) at {rows:,} rows: the controller plans every rank's next 50 steps in "
        f"{controller * 1e3:.1f} ms, a rank its windows for them in {rank_s * 1e3:.1f} ms (median of 3; its part "
        f"holds up to {intervals:,} intervals)"
        for done, (controller, rank_s, intervals) in measured.items()
    ]
    few, many = min(measured), max(measured)
    started = time.perf_counter()
    whole = SamplePlan(*plan_args).remaining(states[few])
    lines.append(
        f"# the whole epoch's replay after {few} resizes, as every rank paid before it mapped back its own part: "
        f"{time.perf_counter() - started:.3f} s, {len(whole):,} intervals"
    )
    growth = many / few  # linear in the resizes would be this
    for figure, index in (("controller", 0), ("rank", 1)):
        value, baseline = measured[many][index], measured[few][index]
        name = f"resize_{figure}_s"
        lines.append(
            benchlib.ratio_line(
                f"{name}_{many}", value, f"{name}_{few}", baseline, f"<= {growth:g}", value <= growth * baseline
            )
        )
    return lines


def main() -> None:
    from sdtrain.logs import configure_logging

    configure_logging()  # the index's own lines (files from the index, footers read), as a command line prints them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="1M and 10M rows, 20 and 100 files: checks that it runs")
    parser.add_argument("--steps", type=int, default=20_000, help="steps a rank plans its read tasks for")
    parser.add_argument(
        "--run-steps", type=int, default=550_000, help="at the largest size, also plan a whole run of this many steps"
    )
    parser.add_argument("--no-s3", action="store_true", help="skip the restart start-up against the S3 server")
    parser.add_argument(
        "--buckets", type=int, default=40, help="also the same sizes in this many aspect-ratio buckets (0: not)"
    )
    args = parser.parse_args()
    sizes = SIZES[:2] if args.smoke else SIZES
    steps = 500 if args.smoke else args.steps

    import os

    from sdtrain.storage import s3

    saved = {var: os.environ.get(var) for var in s3.ENDPOINT_VARS}
    s3.configure_s3("http://127.0.0.1:9", 3)  # the files are named on S3; nothing is read, so no server is needed

    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# commit {benchlib.git_commit()}", flush=True)
    print(
        f"# {ROWS_PER_FILE}-row files, {CHUNK_ROWS}-row chunks, {WINDOW_ROWS}-row windows, world size {WORLD_SIZE}, "
        f"{ROWS_PER_RANK} rows per rank per step, {steps} steps planned by the rank"
    )
    results = table(sizes, steps, 0)
    print("\n".join(ratio_lines(results, "")), flush=True)
    from sdtrain.data.horizons import HORIZON_READS

    runs = (steps, 10 * steps) if args.smoke else (args.run_steps // 10, args.run_steps)
    print("\n".join(horizon_lines(sizes[-1], runs, 16 if args.smoke else HORIZON_READS)), flush=True)
    if not args.smoke:
        whole = measure(sizes[-1], args.run_steps, tasks=20)
        print(
            f"# a rank's start, were it to plan a whole run of {args.run_steps} steps at {sizes[-1]:,} rows (one "
            f"dataset, not horizons): {whole['rank_s']:.2f} s, {whole['rank_mb']:.0f} MB, {whole['rank_windows']} "
            "read tasks",
            flush=True,
        )
    resizes = (2, 4) if args.smoke else (10, 40, 100)
    print("\n".join(resize_lines(sizes[-1], 16 if args.smoke else 256, resizes, 100 if args.smoke else 1000)))
    if args.buckets:
        print(
            f"# aspect-ratio buckets: {args.buckets} of them, each file's rows in 20 (the common ones), one run a "
            "bucket; the bucket order (every step one bucket's)"
        )
        print("\n".join(ratio_lines(table(sizes, steps, args.buckets), "bucketed_")), flush=True)

    # Back to this process's own S3 settings: the restart start-up runs against a real server of its own.
    s3.configure_s3(None, s3.S3Settings().max_attempts)
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value

    if not args.no_s3:
        import index_startup

        startup = index_startup.restart_startup((20, 100) if args.smoke else (1000, 20000))
        print("\n".join(index_startup.ratio_lines(startup)), flush=True)


if __name__ == "__main__":
    main()
