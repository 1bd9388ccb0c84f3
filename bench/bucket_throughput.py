"""Aspect-ratio buckets against one square shape, on the same rows (issue #40, part 6).

Two datasets of the same rows, count and file layout: every row's latents 4 x 16 x 16 (square), or the rows
spread over three buckets of about that area, 4 x 16 x 16, 4 x 14 x 18 and 4 x 18 x 14, sorted by bucket within each
file with the bucket metadata preprocessing writes (bucketed). Each trains with sdtrain's real
``sdtrain.driver.run.train(config)`` (Ray Data, Ray Train, Lightning, one CPU worker), alternating square and bucketed
runs, each in a fresh process; steady steps/s are the job's own metrics (``metrics.csv``). The ratio is the median
over adjacent (square, bucketed) pairs, as bench/step_overhead.py pairs its runs.

Also, from the read plans themselves (pure logic, no Ray): over several epochs, the share of rows each order drops
or pads. The bucket order carries a bucket's remainder into its next epoch; the one-shape order leaves out the rows
of an epoch that cannot fill a global batch, as drop_last does.

    python bench/bucket_throughput.py           # tiny UNet, 160 steps of 16, each kind twice
    python bench/bucket_throughput.py --smoke   # seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SPEED_TARGET = 0.95  # bucketed steps/s over square's
SHAPES = [(4, 16, 16), (4, 14, 18), (4, 18, 14)]
CAPTION_SHAPE = (77, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few steps: checks that it runs")
    parser.add_argument("--steps", type=int, help="training steps (default 160; smoke 8)")
    parser.add_argument("--warmup", type=int, help="steps excluded from the steady state (default 40; smoke 3)")
    parser.add_argument("--batch-size", type=int, help="per step (default 16; smoke 8)")
    parser.add_argument("--repeat", type=int, help="runs of each kind, alternating (default 2; smoke 1)")
    parser.add_argument("--workdir", help="where to write data and runs (default: a temporary directory)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.smoke else 160)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.smoke else 40)
    args.batch_size = args.batch_size or (8 if args.smoke else 16)
    args.repeat = args.repeat or (1 if args.smoke else 2)
    if args.child:
        return train_once(args)

    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    rows = (args.steps + 2) * args.batch_size  # one epoch covers the run
    print(
        f"# tiny UNet, {rows} rows in 16 files, batch {args.batch_size}, {args.steps} steps ({args.warmup} excluded "
        f"as warm-up), fp32 on CPU, 1 Ray Train worker; buckets {', '.join('x'.join(map(str, s)) for s in SHAPES)}"
    )
    plan_shares(rows + 5, args.batch_size)  # rows no global batch divides: an epoch leaves some over
    runs: dict[str, list[dict]] = {"square": [], "bucketed": []}
    with tempfile.TemporaryDirectory(prefix="sdtrain-bench-", dir=args.workdir) as workdir:
        args.data = workdir
        write_square(Path(workdir) / "square", rows)
        write_bucketed(Path(workdir) / "bucketed", rows)
        for round_ in range(args.repeat):
            for kind in runs:
                runs[kind].append(run_child(kind, args))
            print(
                f"  round {round_ + 1}: square {runs['square'][-1]['steady_steps_per_s']:.2f} steps/s, "
                f"bucketed {runs['bucketed'][-1]['steady_steps_per_s']:.2f} steps/s",
                flush=True,
            )
    rates = [run["steady_steps_per_s"] for pair in zip(runs["square"], runs["bucketed"], strict=True) for run in pair]
    # Adjacent pairs in run order: (square 1, bucketed 1), (bucketed 1, square 2), ...: bucketed over square.
    ratios = sorted((b / a if i % 2 == 0 else a / b) for i, (a, b) in enumerate(itertools.pairwise(rates)))
    ratio = ratios[len(ratios) // 2]
    square, bucketed = benchlib.medians(runs["square"]), benchlib.medians(runs["bucketed"])
    print(f"square:   {square['steady_steps_per_s']:.2f} steps/s (median of {len(runs['square'])})")
    print(f"bucketed: {bucketed['steady_steps_per_s']:.2f} steps/s (median of {len(runs['bucketed'])})")
    print(f"ratio of each adjacent (square, bucketed) pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    flops = model_flops()
    print(
        f"model FLOPs per image: square {flops[0] / 1e6:.1f} M, the buckets' mean {np.mean(flops) / 1e6:.1f} M "
        "(their steps are drawn in proportion to their rows, here a third each)"
    )
    print(
        f"RATIO steps/s bucketed / square = {ratio:.3f}  (median of {len(ratios)} adjacent pairs; "
        f"target >= {SPEED_TARGET}: {'met' if ratio >= SPEED_TARGET else 'MISSED'})"
    )
    print(f"RATIO model FLOP/s bucketed / square = {ratio * np.mean(flops) / flops[0]:.3f}")
    print(
        f"RATIO data wait bucketed / square = {bucketed['wait_fraction']:.4f} / {square['wait_fraction']:.4f} "
        f"(fractions of step time)"
    )


def plan_shares(rows: int, global_batch: int, epochs: int = 5) -> None:
    """The rows each read order drops or pads over ``epochs`` epochs, from the plans alone: a row is due once an
    epoch; padding would read one more often, dropping less often. The bucket order's last remainders (rows one epoch
    behind) count as carried, not dropped, when the next epoch reads them."""
    from sdtrain.data.bucket_order import BucketPlan
    from sdtrain.data.read_order import SamplePlan

    per_file = np.diff(np.linspace(0, rows, 17).astype(np.int64))
    thirds = [np.diff(np.linspace(0, r, 4).astype(np.int64)) for r in per_file]
    runs = np.array([(f, b, n) for f, parts in enumerate(thirds) for b, n in enumerate(parts)])
    plans = {
        "bucketed": BucketPlan(per_file, runs, SHAPES, 0, 16, global_batch, 256),
        "square": SamplePlan(per_file, 0, 16, 256),
    }
    for name, plan in plans.items():
        steps = [plan.steps_in_epoch(e) if name == "bucketed" else rows // global_batch for e in range(epochs + 1)]
        reads = _reads(plan, global_batch, sum(steps))
        within = reads[: sum(steps[:epochs]) * global_batch]
        per_row = np.bincount(within, minlength=rows)
        padded = int(np.clip(per_row - epochs, 0, None).sum())
        short = np.clip(epochs - per_row, 0, None)
        next_epoch = set(reads[len(within) :].tolist())
        carried = [r for r in np.flatnonzero(short == 1) if r in next_epoch] if name == "bucketed" else []
        dropped = int(short.sum()) - len(carried)
        print(
            f"{name:8s} plan: {sum(steps[:epochs])} steps of {global_batch} over {epochs} epochs of {rows} rows: "
            f"{len(within)} rows read, {padded} twice in an epoch, {dropped} due and never read, {len(carried)} "
            "carried into the next epoch and read there"
        )
        print(f"RATIO rows dropped or padded / rows due, {name} = {(dropped + padded) / (epochs * rows):.4f}")


def _reads(plan, global_batch: int, steps: int) -> np.ndarray:
    """Every row one rank of one reads in ``steps`` steps from the start, in order."""
    from sdtrain.data.read_order import DataState

    stretches = plan.rank_stretches(DataState(), 1, global_batch, steps)[0]
    return np.concatenate([plan.sample_indices(w) for s in stretches for w in plan.windows(s)])


def model_flops() -> list[float]:
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.flops import unet_train_step_flops
    from sdtrain.model.unet import unet_config

    config = unet_config(ModelConfig(preset="tiny"))
    return [float(unet_train_step_flops(config, shape, CAPTION_SHAPE)) for shape in SHAPES]


# ----------------------------------------------------------------------------- the data


def write_square(directory: Path, rows: int) -> None:
    benchlib.write_dataset(
        directory, rows, -(-rows // 16), "float16", latent_shape=SHAPES[0], caption_shape=CAPTION_SHAPE
    )


def write_bucketed(directory: Path, rows: int) -> None:
    """As preprocessing writes bucketed output (sdtrain.preprocess.outputs.shard_table): a third of each file's rows
    in each bucket, sorted by bucket, the buckets and runs in the schema metadata."""
    from sdtrain.data.metadata import BUCKET_SHAPES
    from sdtrain.preprocess.outputs import parquet_bytes, shard_table

    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    metadata = {BUCKET_SHAPES: json.dumps([list(s) for s in SHAPES])}
    columns = {"latents": benchlib.IMAGE_COLUMN, "embeddings": benchlib.CAPTION_COLUMN}
    bounds = np.linspace(0, rows, 17).astype(int)
    for index, (start, stop) in enumerate(itertools.pairwise(bounds)):
        table_rows = []
        for i in range(start, stop):
            bucket = (i - start) * 3 // (stop - start)
            table_rows.append(
                {
                    "latents": rng.standard_normal(SHAPES[bucket], dtype=np.float32),
                    "embeddings": rng.standard_normal(CAPTION_SHAPE, dtype=np.float32),
                    "bucket": bucket,
                    "caption": f"row {i}",
                    "key": str(i),
                }
            )
        (directory / f"part-{index:05d}.parquet").write_bytes(
            parquet_bytes(shard_table(table_rows, columns, metadata), 16)
        )


# ----------------------------------------------------------------------------- one run


def run_child(kind: str, args) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--data", args.data, "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    process = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if process.returncode:
        lines = process.stdout.splitlines()
        raise SystemExit(f"the {kind} run failed with exit code {process.returncode}:\n" + "\n".join(lines[-60:]))
    return benchlib.parsed_result(process.stdout)


def train_once(args) -> None:
    import sdtrain.driver.run
    from sdtrain.config.schema import Config

    log_every = max(1, args.steps // 8)
    config = Config.from_dict(
        {
            "data": {"train": [str(Path(args.data) / args.child)], "shuffle_chunk_rows": 16},
            "model": {"preset": "tiny"},
            "train": {"max_steps": args.steps, "global_batch_size": args.batch_size, "lr": 1e-4, "warmup_steps": 10},
            "scaling": {"num_workers": 1, "use_gpu": False},
            # A fresh storage directory per run: the same one would resume the previous run's checkpoint.
            "run": {
                "name": f"buckets-{args.child}",
                "storage_path": tempfile.mkdtemp(prefix="runs-", dir=args.data),
                "log_every_n_steps": log_every,
            },
            "checkpoint": {"every_n_steps": args.steps, "num_to_keep": 1},
            "failure": {"max_failures": 0},
            "export": {"enabled": False},  # synthetic latents name no VAE to make a pipeline of
        }
    )
    launched = time.time()
    summary = sdtrain.driver.run.train(config)
    with open(os.path.join(summary.run_dir, "metrics.csv")) as f:
        metrics = list(csv.DictReader(f))
    steps_done, seconds, waited, previous = 0, 0.0, 0.0, 0
    for row in metrics:  # report windows after warm-up, combined by their durations
        step = int(row["step"])
        if previous >= args.warmup:
            window = (step - previous) / float(row["steps_per_s"])
            steps_done, seconds = steps_done + step - previous, seconds + window
            waited += float(row["data_wait_fraction"]) * window
        previous = step
    benchlib.print_result(
        steady_steps_per_s=steps_done / seconds,
        wait_fraction=waited / seconds,
        total_s=time.time() - launched,
        final_step=summary.final_step,
    )


if __name__ == "__main__":
    main()
