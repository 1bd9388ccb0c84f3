"""What checkpoint evaluation (eval) costs the training ranks (issue #28): the same run with eval off and on.

Runs ``sdtrain.driver.run.train(config)`` on one local Ray cluster of 2 CPUs, twice per repeat, interleaved: a tiny UNet
on 1 worker of 1 CPU, a checkpoint every ``--every`` steps; with eval on, each checkpoint is evaluated (tiny DINOv2
and VAE built from configs, ``eval.num_samples`` images sampled) in Ray Train's validation task on the other CPU
(``eval.num_cpus=1``: its own resources, as a GPU of its own on a cluster). The figure is the training loop's own
time: the sum over the run's metric rows of each report window (steps / steps_per_s), which excludes the start,
the final evaluation the run waits for, and the export; and the job's wall time beside it.

    python bench/eval_overhead.py            # 3 repeats of 120 steps, a checkpoint every 20
    python bench/eval_overhead.py --smoke    # 1 repeat of 16 steps: checks that it runs
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.tiny_models
import benchlib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="1 repeat of 16 steps: checks that it runs")
    parser.add_argument("--steps", type=int, help="steps per run (default 120; smoke 16)")
    parser.add_argument("--every", type=int, help="checkpoint.every_n_steps (default 20; smoke 8)")
    parser.add_argument("--repeats", type=int, help="runs of each kind, interleaved (default 3; smoke 1)")
    parser.add_argument("--samples", type=int, default=32, help="eval.num_samples (default %(default)s)")
    args = parser.parse_args()
    steps = args.steps or (16 if args.smoke else 120)
    every = args.every or (8 if args.smoke else 20)
    repeats = args.repeats or (1 if args.smoke else 3)

    import ray
    from support.tiny_models import write_tiny_dinov2, write_tiny_sd_model

    from sdtrain.config.loader import load_config
    from sdtrain.driver.run import train

    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    with tempfile.TemporaryDirectory(prefix="sdtrain-bench-") as workdir:
        root = Path(workdir)
        benchlib.write_dataset(root / "train", 512, 128, "float16", latent_shape=(4, 16, 16), caption_shape=(77, 32))
        benchlib.write_dataset(root / "val", args.samples, args.samples, "float16", (4, 16, 16), (77, 32))
        sd = write_tiny_sd_model(str(root / "sd"))
        dinov2 = write_tiny_dinov2(str(root / "dinov2"))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

        def run(evaluate: bool, repeat: int) -> dict:
            keys = [
                "model.preset=tiny",
                f"data.train=[{root / 'train'}]",
                f"data.val=[{root / 'val'}]",
                f"train.max_steps={steps}",
                "train.global_batch_size=8",
                "scaling.num_workers=1",
                "scaling.use_gpu=false",
                "scaling.cpus_per_worker=1",
                f"run.storage_path={root / 'runs'}",
                f"run.name={'on' if evaluate else 'off'}-{repeat}",
                f"checkpoint.every_n_steps={every}",
                f"run.log_every_n_steps={every // 2}",
                f"run.val_every_n_steps={every}",
                "sample_grid.every_n_steps=1000000",  # the grid at the end only, in both runs
                "sample_grid.steps=4",
                "export.enabled=false",
            ]
            if evaluate:
                keys += [
                    f"eval.dinov2={dinov2}",
                    f"eval.vae={sd}",
                    f"eval.num_samples={args.samples}",
                    "eval.num_cpus=1",
                    "eval.batch_size=16",
                ]
            started = time.perf_counter()
            summary = train(load_config(None, keys))
            wall = time.perf_counter() - started
            with open(Path(summary.run_dir) / "metrics.csv") as f:
                rows = list(csv.DictReader(f))
            training_s, previous = 0.0, 0
            for row in rows:
                step = int(row["step"])
                training_s += (step - previous) / float(row["steps_per_s"])
                previous = step
            evaluations = [float(r["eval_s"]) for r in rows if r.get("eval_s")]
            return {"training_s": training_s, "wall": wall, "evaluations": evaluations}

        results: dict[bool, list[dict]] = {False: [], True: []}
        for repeat in range(repeats):
            for evaluate in (False, True):
                result = run(evaluate, repeat)
                results[evaluate].append(result)
                evaluated = result["evaluations"]
                line = f"eval {'on ' if evaluate else 'off'} #{repeat}: training loop {result['training_s']:.2f} s"
                line += f" for {steps} steps, the job {result['wall']:.1f} s"
                if evaluated:
                    median = statistics.median(evaluated)
                    line += f"; {len(evaluated)} evaluations of {args.samples} samples, median {median:.1f} s"
                print(line, flush=True)
        ray.shutdown()

    off = statistics.median(r["training_s"] for r in results[False])
    on = statistics.median(r["training_s"] for r in results[True])
    print(benchlib.ratio_line("training_loop_s eval on", on, "eval off", off, "<= 1.02", on <= 1.02 * off))
    wall_off = statistics.median(r["wall"] for r in results[False])
    wall_on = statistics.median(r["wall"] for r in results[True])
    print(benchlib.ratio_line("job_wall_s eval on", wall_on, "eval off", wall_off))


if __name__ == "__main__":
    main()
