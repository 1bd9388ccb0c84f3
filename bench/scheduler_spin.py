"""Scheduler spin benchmark (issue #7, part 3's cause): what Ray Data's scheduling loop takes from
a training loop in the same process while the stream is held back.

A training worker iterates its rank's stream, so Ray Data's scheduling loop runs on a thread of
the training process. With no read task running (the stream is ahead of the trainer, held back
by its memory budget) the loop does not wait: it spins. ``sdtrain.data.pacing`` paces it. This runs
the package's stream (``benchlib.sdtrain_batches``: the plan's windows, one Ray Data task each)
to a consumer that does a fixed amount of CPU work per batch (a stand-in for a training step,
1 torch thread), with the budget capped so the stream is held back, once paced (the package)
and once without the pace, each in a fresh process with its own 2-CPU Ray cluster.

Reported: the consumer's steps/s, and the CPU seconds per wall second of the scheduling thread
and of the consumer's thread; the ratio is steps/s paced over unpaced.

    python bench/scheduler_spin.py            # 8192 rows (16 windows), 30 ms steps
    python bench/scheduler_spin.py --smoke    # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small stream: checks that it runs")
    parser.add_argument(
        "--rows", type=int, help="rows of 4x16x16 latents and 77x32 captions (default 8192; smoke 2048)"
    )
    parser.add_argument("--work", type=int, help="matmuls of 256x256 per step (default 30; smoke 5)")
    parser.add_argument("--budget-mib", type=float, help="Ray Data's object-store budget (default 10; smoke 1)")
    parser.add_argument("--child", choices=["paced", "unpaced"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rows = args.rows or (2048 if args.smoke else 8192)
    args.budget_mib = args.budget_mib or (1 if args.smoke else 10)
    args.work = args.work or (5 if args.smoke else 30)
    if args.child:
        return child(args)

    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    print(
        f"# {args.rows} rows in 512-row windows, batch {BATCH}, {args.work} matmuls a step, "
        f"object-store budget {args.budget_mib:g} MiB; one fresh process per run"
    )
    with tempfile.TemporaryDirectory(prefix="sdtrain-bench-") as workdir:
        benchlib.write_dataset(
            Path(workdir), args.rows, 64, "float16", latent_shape=(4, 16, 16), caption_shape=(77, 32)
        )
        results = {mode: run_child(mode, workdir, args) for mode in ("unpaced", "paced")}
    print(f"{'stream':8} {'steps/s':>8} {'scheduler CPU s/s':>18} {'consumer CPU s/s':>17} {'steps':>6}")
    for mode, r in results.items():
        print(f"{mode:8} {r['steps_per_s']:8.2f} {r['scheduler_cpu']:18.2f} {r['consumer_cpu']:17.2f} {r['steps']:6}")
    print(
        benchlib.ratio_line(
            "consumer steps/s paced", results["paced"]["steps_per_s"], "unpaced", results["unpaced"]["steps_per_s"]
        )
    )
    print(
        benchlib.ratio_line(
            "scheduler CPU paced", results["paced"]["scheduler_cpu"], "unpaced", results["unpaced"]["scheduler_cpu"]
        )
    )


def run_child(mode: str, workdir: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--data",
        workdir,
        "--rows",
        str(args.rows),
        "--work",
        str(args.work),
        "--budget-mib",
        str(args.budget_mib),
    ]
    process = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if process.returncode:
        raise SystemExit(f"the {mode} run failed with exit code {process.returncode}:\n{process.stdout[-4000:]}")
    return benchlib.parsed_result(process.stdout)


def child(args) -> None:
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    files = sorted(str(p) for p in Path(args.data).glob("*.parquet"))
    batches, _ = benchlib.sdtrain_batches(
        files, BATCH, caption_dim=32, paced=args.child == "paced", object_store_limit=int(args.budget_mib * 2**20)
    )
    batches = iter(batches)
    try:
        next(batches)  # start-up is not what this measures
        schedulers = [t for t in threading.enumerate() if t.name.startswith("StreamingExecutor")]
        if not schedulers:
            raise SystemExit(
                "the stream was read to its end before the first step: use more --rows or a smaller --budget-mib"
            )
        scheduler = schedulers[0]
        started, scheduler_cpu, consumer_cpu = time.perf_counter(), _thread_cpu(scheduler.native_id), time.thread_time()
        x, steps = torch.randn(256, 256), 0
        last = (started, scheduler_cpu, consumer_cpu, 0)
        for _ in batches:
            for _ in range(args.work):
                x = torch.tanh(x @ x)
            steps += 1
            try:
                last = (time.perf_counter(), _thread_cpu(scheduler.native_id), time.thread_time(), steps)
            # The stream has read its last window: its scheduler thread is gone (before the open, or between the
            # open and the read).
            except (FileNotFoundError, ProcessLookupError):
                break
    finally:
        # Before Ray's own exit hook: an iterator finalized after ray.shutdown() restarts Ray and hangs.
        batches.close()
    wall_end, scheduler_end, consumer_end, steps_end = last
    wall = wall_end - started
    benchlib.print_result(
        steps_per_s=steps_end / wall,
        steps=steps_end,
        scheduler_cpu=(scheduler_end - scheduler_cpu) / wall,
        consumer_cpu=(consumer_end - consumer_cpu) / wall,
    )


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) of a thread of this process."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
