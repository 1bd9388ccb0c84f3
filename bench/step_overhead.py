"""Stack-overhead benchmark (issue #7, part 3).

Full path: sdtrain's real ``sdtrain.driver.run.train(config)`` (Ray start, data checks, Ray Data,
Ray Train's TorchTrainer with one CPU worker, Lightning, the package's module and callbacks)
on parquet latents. Baseline: a bare PyTorch loop with the same UNet (``sdtrain.model.unet.build_unet``),
batch size, noise schedule, loss, AdamW and gradient clipping on in-memory tensors, in a process
with as many torch threads as the Ray Train worker had.

The two alternate, --repeat times each (full, bare, full, bare, ...), each in a fresh process,
and the speed ratio is the median over every adjacent (full, bare) pair: on a shared machine a
rate drifts 10-25% over minutes, and a pair run back to back shares most of that drift.

Reported: steady-state steps/s of both (the first --warmup steps excluded) and their ratio;
the time from calling ``train()`` to the end of the first optimizer step; the fraction of
steady-state wall time the training loop spent waiting for its next batch. The full path's
figures are the job's own metrics (``metrics.csv``: ``steps_per_s``, ``time_to_first_step_s``,
``data_wait_fraction``), as a user of the package sees them: nothing in the worker is patched.

    python bench/step_overhead.py           # tiny UNet, 160 steps of 16, full and bare twice each
    python bench/step_overhead.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SPEED_TARGET = 0.95  # full path steps/s over the bare loop's
WAIT_TARGET = 0.02  # fraction of step time waiting for data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few steps: checks that it runs")
    parser.add_argument(
        "--preset", default="tiny", help="model.preset (default tiny: the worst case, the shortest step)"
    )
    parser.add_argument("--steps", type=int, help="training steps (default 160; smoke 8)")
    parser.add_argument("--warmup", type=int, help="steps excluded from the steady state (default 40; smoke 3)")
    parser.add_argument("--batch-size", type=int, help="per step (default 16: the demo's per-worker batch; smoke 8)")
    parser.add_argument("--log-every", type=int, help="run.log_every_n_steps (default 20; smoke 4)")
    parser.add_argument("--repeat", type=int, help="runs of each path, alternating (default 2; smoke 1)")
    parser.add_argument("--dtype", default="float16", help="stored dtype of the parquet latents")
    parser.add_argument("--workdir", help="where to write data and the run (default: a temporary directory)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.smoke else 160)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.smoke else 40)
    args.log_every = args.log_every or (4 if args.smoke else 20)
    args.batch_size = args.batch_size or (8 if args.smoke else 16)
    args.repeat = args.repeat or (1 if args.smoke else 2)
    if args.child == "full":
        return full_path(args)
    if args.child == "bare":
        return bare_loop(args)

    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    print(
        f"# preset {args.preset}, batch {args.batch_size}, {args.steps} steps ({args.warmup} excluded as warm-up), "
        f"fp32 on CPU, 1 Ray Train worker; {args.dtype} parquet latents"
    )
    fulls, bares = [], []
    with tempfile.TemporaryDirectory(prefix="sdtrain-bench-", dir=args.workdir) as workdir:
        args.data = workdir
        for round_ in range(args.repeat):
            fulls.append(run_child("full", args))
            # As many torch threads as Ray Train gave its worker.
            bares.append(run_child("bare", args, "--threads", str(fulls[0]["worker_threads"])))
            print(
                f"  round {round_ + 1}: full path {fulls[-1]['steady_steps_per_s']:.2f} steps/s, "
                f"bare loop {bares[-1]['steady_steps_per_s']:.2f} steps/s",
                flush=True,
            )
    # Adjacent pairs in run order: (full 1, bare 1), (bare 1, full 2), (full 2, bare 2), ...
    rates = [
        run["steady_steps_per_s"] for pair in zip(fulls, bares, strict=True) for run in pair
    ]  # full at even positions
    ratios = sorted((a / b if i % 2 == 0 else b / a) for i, (a, b) in enumerate(itertools.pairwise(rates)))
    ratio = ratios[len(ratios) // 2]
    full, bare = benchlib.medians(fulls), benchlib.medians(bares)

    print(
        f"full path (train(config)): {full['steady_steps_per_s']:.2f} steps/s after step {args.warmup} "
        f"(the job's metrics.csv; median of {len(fulls)}); torch threads in the worker: {full['worker_threads']}"
    )
    print(
        f"bare PyTorch loop:         {bare['steady_steps_per_s']:.2f} steps/s steady (median of {len(bares)}; "
        f"{bare['threads']} torch threads)"
    )
    print(f"ratio of each adjacent (full, bare) pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        f"time to first step: {full['first_step_s']:.1f} s from calling train() (time_to_first_step_s); "
        f"whole run {full['total_s']:.1f} s"
    )
    print(
        f"data wait: {100 * full['wait_fraction']:.2f}% of {full['steady_s']:.2f} s steady-state training "
        f"(data_wait_fraction)"
    )
    print(
        f"RATIO steps/s full path / bare loop = {ratio:.3f}  (median of {len(ratios)} adjacent pairs; "
        f"target >= {SPEED_TARGET}: {'met' if ratio >= SPEED_TARGET else 'MISSED'})"
    )
    fraction = full["wait_fraction"]
    print(
        f"RATIO data wait / step time = {fraction:.4f}  (target < {WAIT_TARGET}: "
        f"{'met' if fraction < WAIT_TARGET else 'MISSED'})"
    )
    print(
        f"RATIO time to first step / steady step time = {full['first_step_s'] * full['steady_steps_per_s']:.1f}  "
        f"({full['first_step_s']:.1f} s)"
    )


def run_child(kind: str, args, *extra: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--data",
        args.data,
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--log-every",
        str(args.log_every),
        "--dtype",
        args.dtype,
        *extra,
    ]
    process = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = process.stdout.splitlines()
    if process.returncode:
        raise SystemExit(f"the {kind} run failed with exit code {process.returncode}:\n" + "\n".join(lines[-60:]))
    for line in lines:
        if line.startswith("[sdtrain]") or "step " in line and "loss" in line:
            print(f"  [{kind}] {line.strip()}")
    result = benchlib.parsed_result(process.stdout)
    if kind == "full":  # the worker logs its torch threads at start: the bare loop gets as many
        result["worker_threads"] = int(re.search(r"(\d+) torch thread\(s\) per worker", process.stdout).group(1))
    return result


# ----------------------------------------------------------------------------- the full path


def full_path(args) -> None:
    import sdtrain.driver.run
    from sdtrain.config.schema import Config
    from sdtrain.model.presets import PRESETS
    from sdtrain.model.unet import unet_config

    preset = PRESETS[args.preset]
    size, caption_dim = preset["sample_size"], preset["cross_attention_dim"]
    rows = (args.steps + 2) * args.batch_size  # one epoch covers the run
    data_dir = Path(args.data) / "train"
    benchlib.write_dataset(
        data_dir,
        rows,
        max(args.batch_size * 8, rows // 16),
        args.dtype,
        latent_shape=(4, size, size),
        caption_shape=(77, caption_dim),
    )
    config = Config.from_dict(
        {
            "data": {"train": [str(data_dir)]},
            "model": {"preset": args.preset},
            "train": {"max_steps": args.steps, "global_batch_size": args.batch_size, "lr": 1e-4, "warmup_steps": 10},
            "scaling": {"num_workers": 1, "use_gpu": False},
            # A fresh storage directory per run: the same one would resume the previous run's checkpoint.
            "run": {
                "name": "step-overhead",
                "storage_path": tempfile.mkdtemp(prefix="runs-", dir=args.data),
                "log_every_n_steps": args.log_every,
            },
            "checkpoint": {"every_n_steps": args.steps, "num_to_keep": 1},
            "failure": {"max_failures": 0},
            "export": {"enabled": False},  # latents that name no VAE: no pipeline to export
        }
    )
    assert unet_config(config.model)["cross_attention_dim"] == caption_dim
    launched = time.time()
    summary = sdtrain.driver.run.train(config)
    total = time.time() - launched

    with open(os.path.join(summary.run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    # Report windows after warm-up, combined by their durations (each row covers the steps since the previous).
    steps_done, seconds, waited, previous = 0, 0.0, 0.0, 0
    for r in rows:
        step = int(r["step"])
        if previous >= args.warmup:
            window = (step - previous) / float(r["steps_per_s"])
            steps_done, seconds = steps_done + step - previous, seconds + window
            waited += float(r["data_wait_fraction"]) * window
        previous = step
    benchlib.print_result(
        steady_steps_per_s=steps_done / seconds,
        first_step_s=float(rows[0]["time_to_first_step_s"]),
        total_s=total,
        wait_fraction=waited / seconds,
        steady_s=seconds,
        final_step=summary.final_step,
    )


# ----------------------------------------------------------------------------- the bare loop


def bare_loop(args) -> None:
    import torch
    import torch.nn.functional as F

    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.presets import PRESETS
    from sdtrain.model.unet import build_noise_scheduler, build_unet, noise_scheduler_config

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_config = ModelConfig(preset=args.preset)
    unet = build_unet(model_config)
    scheduler = build_noise_scheduler(noise_scheduler_config(model_config))
    preset = PRESETS[args.preset]
    size, caption_dim = preset["sample_size"], preset["cross_attention_dim"]
    batches = [
        (torch.randn(args.batch_size, 4, size, size), torch.randn(args.batch_size, 77, caption_dim)) for _ in range(8)
    ]
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    unet.train()
    times = []
    for step in range(args.steps):
        latents, captions = batches[step % len(batches)]
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (len(latents),))
        noisy = scheduler.add_noise(latents, noise, timesteps)
        loss = F.mse_loss(unet(noisy, timesteps, encoder_hidden_states=captions).sample, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)  # the loop a user writes looks at its loss; also a sync point
        times.append(time.perf_counter())
    benchlib.print_result(
        steady_steps_per_s=(args.steps - args.warmup) / (times[-1] - times[args.warmup - 1]),
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
