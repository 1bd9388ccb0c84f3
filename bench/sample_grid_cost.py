"""What watching a run costs its training loop (issue #19): sample grids and the live files.

Sample grids: the training loop stops for a grid (rank 0 samples while the other ranks wait at the
next all-reduce), so its cost is the grid's time over the training time between two grids. Measured
in this process with the code a worker runs: ``sdtrain.train.build.fit_without_ray`` times
--steps optimizer steps (after --warmup) and ``sdtrain.train.sample_grids.SampleGrids.sample``
draws the grid of the default settings (4 captions x 4 samples, 20 DDIM steps, guidance 3) from the
trained module's weights, --repeat times.

Live files: at each report the training loop only hands the metric rows to a background thread
(``LiveOutputs.update``, which copies the rows not copied before), which rewrites metrics.csv and
loss_curve.png whole, resting after each write for 19x its time (``LIVE_FILES_SHARE``). Measured: the
first hand-over and a report's, and the background write, with a history of --rows rows (a 550k-step run
reporting every 50 steps has 11k); then training steps with the files updated at every step of a
--long-rows history (run.log_every_n_steps=1 on a long run), against none, and against the writer without
rest (as before 2026-11-30, which rewrote them back to back).

    python bench/sample_grid_cost.py           # tiny UNet, grid every 1000 steps (checkpoint.every_n_steps)
    python bench/sample_grid_cost.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from step_timer import StepTimer  # noqa: E402

from sdtrain.artifacts.run_outputs import LossLabels  # noqa: E402
from sdtrain.config.loader import load_config  # noqa: E402
from sdtrain.sampling.captions import Captions  # noqa: E402
from sdtrain.train.build import checkpoint_meta, fit_without_ray  # noqa: E402
from sdtrain.train.device_settings import training_autocast  # noqa: E402
from sdtrain.train.live_files import LIVE_FILES_SHARE, BackgroundWriter, LiveOutputs  # noqa: E402
from sdtrain.train.sample_grids import SampleGrids  # noqa: E402

TARGET = 0.03  # "at most a few percent" of the training loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few steps: checks that it runs")
    parser.add_argument("--preset", default="tiny", help="model.preset (default tiny)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per training step (default 16)")
    parser.add_argument("--steps", type=int, help="timed training steps (default 30; smoke 4)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 10; smoke 2)")
    parser.add_argument("--every", type=int, default=1000, help="steps between grids (default 1000)")
    parser.add_argument("--repeat", type=int, help="grids timed (default 3; smoke 1)")
    parser.add_argument("--rows", type=int, help="metric rows of the live files (default 11000; smoke 100)")
    parser.add_argument(
        "--long-rows", type=int, help="rows of the history updated at every step (default 50000; smoke 2000)"
    )
    args = parser.parse_args()
    steps = args.steps or (4 if args.smoke else 30)
    warmup = args.warmup or (2 if args.smoke else 10)
    repeat = args.repeat or (1 if args.smoke else 3)
    rows = args.rows or (100 if args.smoke else 11000)

    overrides = [
        "data.train=unused",
        f"model.preset={args.preset}",
        f"train.global_batch_size={args.batch_size}",
        "train.ema_decay=0.999",
    ]
    config = load_config(None, [*overrides, f"train.max_steps={warmup + steps}"])
    from sdtrain.model.unet import unet_config

    unet = unet_config(config.model)
    size = unet["sample_size"]
    latent_shape, caption_shape = (unet["in_channels"], size, size), (77, unet["cross_attention_dim"])
    meta = checkpoint_meta(config, latent_shape, caption_shape)
    generator = torch.Generator().manual_seed(0)
    batches = [
        {
            "latents": torch.randn((args.batch_size, *latent_shape), generator=generator),
            "captions": torch.randn((args.batch_size, *caption_shape), generator=generator),
        }
        for _ in range(8)
    ]
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as workdir:
        module, trainer = fit_without_ray(
            config, batches, meta, use_gpu=False, callbacks=[timer], default_root_dir=workdir
        )
        step_s = timer.seconds / timer.timed_steps

        captions = Captions(torch.randn((4, *caption_shape), generator=generator), [f"row {i}" for i in range(4)])
        # Under the training step's autocast, as the worker draws them (sdtrain.train.device_settings).
        grids = SampleGrids(
            config, meta, captions, workdir, torch.zeros(caption_shape), autocast=lambda: training_autocast(trainer)
        )
        grid_times = [grids.sample(module.eval_unet, step).seconds for step in range(repeat)]
        grid_s = statistics.median(grid_times)

        history = report_rows(rows)
        live = LiveOutputs(workdir + "/live", LossLabels())
        started = time.perf_counter()
        live.update(history)
        handover_s = time.perf_counter() - started
        live.writer.flush()
        write_s = time.perf_counter() - started
        history.append({**history[-1], "step": history[-1]["step"] + 50})
        started = time.perf_counter()
        live.update(history)  # a report's: the one new row
        report_s = time.perf_counter() - started
        live.writer.close()

        long_rows = args.long_rows or (2000 if args.smoke else 50000)
        timed = steps if args.smoke else 2 * steps  # the smoke checks that it runs: a CI lane pays each step
        config = load_config(None, [*overrides, f"train.max_steps={warmup + timed}"])
        contended = {
            name: steps_with_live_files(config, batches, meta, warmup, timed, workdir, long_rows, share)
            for name, share in (("none", 0.0), ("live", LIVE_FILES_SHARE), ("no_rest", None))
        }

    cost = grid_s / (args.every * step_s)
    print(f"machine: {benchlib.machine()}")
    print(f"preset {args.preset}, batch {args.batch_size}: {step_s * 1000:.1f} ms per training step ({steps} timed)")
    print(f"sample grid (4 x 4, 20 DDIM steps, guidance 3): {grid_s:.2f} s (median of {repeat})")
    print(
        f"live files with {rows} rows: first hand-over {handover_s * 1000:.2f} ms, a report's {report_s * 1000:.3f} ms,"
        f" background write {write_s:.2f} s"
    )
    print(
        f"training steps with the live files of {long_rows} rows updated every step: {contended['live'] * 1000:.1f} ms;"
        f" without live files {contended['none'] * 1000:.1f} ms; with the writer never resting "
        f"{contended['no_rest'] * 1000:.1f} ms"
    )
    print(
        benchlib.ratio_line(
            "sample grid time",
            grid_s,
            f"training time between grids (every {args.every} steps)",
            args.every * step_s,
            target=f"<= {TARGET}",
            met=cost <= TARGET,
        )
    )
    print(benchlib.ratio_line("live-file hand-over", handover_s, "one training step", step_s))
    print(
        benchlib.ratio_line(
            "a report's live-file hand-over",
            report_s,
            "one training step",
            step_s,
            "<= 0.01",
            report_s <= 0.01 * step_s,
        )
    )
    slowdown = contended["live"] / contended["none"]
    print(
        benchlib.ratio_line(
            f"step with live files of {long_rows} rows",
            contended["live"],
            "step without",
            contended["none"],
            "<= 1.05",
            slowdown <= 1.05,
        )
    )
    print(
        benchlib.ratio_line("step with a writer never resting", contended["no_rest"], "step without", contended["none"])
    )


def report_rows(count: int) -> list[dict[str, float]]:
    """``count`` rows as a worker reports them every 50 steps (sdtrain.train.reporting: about 20 columns)."""
    keys = ["samples_per_s", "data_wait_fraction", "checkpoint_stall_s", "lr", "grad_norm", "step_time_s", "epoch"]
    keys += ["start_step", "time_to_first_step_s", "skipped_steps", "skipped_samples", "worker_hours", "val_loss"]
    return [
        {"step": 50 * i, "loss": float(np.exp(-i / 1000)), **{key: 0.1 * (i % 7) for key in keys}}
        for i in range(1, count + 1)
    ]


class ReportEveryStep(pl.Callback):
    """Appends a row to ``history`` and hands it to ``live`` at every optimizer step, as rank 0's report does."""

    def __init__(self, live: LiveOutputs | None, history: list[dict[str, float]]):
        self.live, self.history = live, history

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.history.append({**self.history[-1], "step": self.history[-1]["step"] + 1})
        if self.live is not None:
            self.live.update(self.history)


def steps_with_live_files(config, batches, meta, warmup, steps, workdir, rows, share) -> float:
    """Seconds a training step takes with the live files of a ``rows``-row history updated at every step, their writer
    resting for ``share`` (None: never resting; 0: no live files)."""
    live = None
    if share != 0.0:
        live = LiveOutputs(f"{workdir}/contended-{share}", LossLabels(), BackgroundWriter("bench-live", share=share))
    timer = StepTimer(warmup)
    fit_without_ray(
        config,
        batches,
        meta,
        use_gpu=False,
        callbacks=[timer, ReportEveryStep(live, report_rows(rows))],
        default_root_dir=workdir,
    )
    if live is not None:
        live.writer.close()
    return timer.seconds / timer.timed_steps


if __name__ == "__main__":
    main()
