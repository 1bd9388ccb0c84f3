"""Checkpoint stall benchmark (issue #5): how long training waits per checkpoint written to a bucket.

Runs the package's ``sdtrain.driver.run.train(config)`` twice on one local Ray cluster, with
``run.storage_path`` in a bucket of a real S3-protocol server (moto's server mode, in its own
process on loopback): once with ``checkpoint.upload: async`` (the default: Ray Train uploads
in the background) and once with ``sync``. The figure is the job's own metric
``checkpoint_stall_s`` (the seconds the training loop spent in a checkpoint report), per
checkpoint, against the step time. With async the stall should be the local save only; the sync
run shows what the upload alone would cost.

The UNet is the tiny preset widened (``--width``) so that a checkpoint (weights, AdamW state, EMA)
is large enough for its upload to matter.

    python bench/checkpoint_stall.py            # 28M parameters, a 450 MB checkpoint, 4 checkpoints a run
    python bench/checkpoint_stall.py --smoke    # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import benchlib  # noqa: E402
from s3_server import moto_server  # noqa: E402

BUCKET = "sdtrain-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps: checks that it runs")
    parser.add_argument(
        "--width", type=int, help="block_out_channels of the widened tiny UNet: (w, 2w) (default 192; smoke 32)"
    )
    parser.add_argument("--checkpoints", type=int, help="checkpoints per run (default 4; smoke 2)")
    parser.add_argument("--every", type=int, help="checkpoint.every_n_steps (default 4; smoke 2)")
    args = parser.parse_args()
    width = args.width or (32 if args.smoke else 192)
    checkpoints = args.checkpoints or (2 if args.smoke else 4)
    args.every = args.every or (2 if args.smoke else 4)

    import boto3
    import ray

    from sdtrain.config.schema import Config
    from sdtrain.driver.run import train
    from sdtrain.model.unet import build_unet

    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    with (
        tempfile.TemporaryDirectory(prefix="sdtrain-bench-") as workdir,
        moto_server(Path(workdir) / "moto.log") as endpoint,
    ):
        for key, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            os.environ[key] = value  # before Ray starts: its processes inherit them
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)  # it would win over the server's for S3 (a shell's, a caller's)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        data = Path(workdir) / "train"
        benchlib.write_dataset(data, 256, 128, "float16", latent_shape=(4, 16, 16), caption_shape=(77, 32))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)

        def config(mode: str) -> Config:
            return Config.from_dict(
                {
                    "data": {"train": [str(data)]},
                    "model": {
                        "preset": "tiny",
                        "unet": {"block_out_channels": [width, 2 * width], "norm_num_groups": 32},
                    },
                    "train": {"max_steps": checkpoints * args.every, "global_batch_size": 4, "ema_decay": 0.999},
                    "scaling": {"num_workers": 1, "use_gpu": False},
                    "run": {
                        "name": f"stall-{mode}",
                        "storage_path": f"s3://{BUCKET}/runs",
                        "log_every_n_steps": args.every,
                    },
                    "checkpoint": {"upload": mode, "every_n_steps": args.every, "num_to_keep": 2},
                    "export": {"enabled": False},
                    "failure": {"max_failures": 0},
                }
            )

        parameters = sum(p.numel() for p in build_unet(config("async").model).parameters())
        results = {}
        for mode in ("async", "sync"):
            started = time.perf_counter()
            summary = train(config(mode))
            wall = time.perf_counter() - started
            rows = _metrics(summary.run_dir)
            size = _checkpoint_bytes(summary.checkpoint_path)
            # A row's checkpoint_stall_s is the latest checkpoint's, so the rows after each checkpoint
            # hold its stall; the last checkpoint's stall is never reported (the run ends with it).
            stalls = [float(r["checkpoint_stall_s"]) for r in rows[1:]]
            step_s = statistics.median(1 / float(r["steps_per_s"]) for r in rows)
            results[mode] = dict(stall=statistics.median(stalls), step=step_s, wall=wall, size=size)
            print(
                f"{mode:5s}: checkpoint {size / 1e6:.0f} MB ({parameters / 1e6:.1f}M parameters); stall per checkpoint "
                f"{', '.join(f'{s:.2f}' for s in stalls)} s (median {results[mode]['stall']:.2f} s); "
                f"median step {step_s:.2f} s (windows include the stall); whole run {wall:.1f} s"
            )
        ray.shutdown()

    a, s = results["async"], results["sync"]
    print(benchlib.ratio_line("checkpoint stall async", a["stall"], "sync", s["stall"], "< 1", a["stall"] < s["stall"]))
    print(benchlib.ratio_line("checkpoint stall async", a["stall"], "step time", a["step"]))
    print(benchlib.ratio_line("whole run async", a["wall"], "sync", s["wall"]))


def _metrics(run_dir: str) -> list[dict]:
    from sdtrain.storage.filesystems import filesystem_for

    fs, path = filesystem_for(f"{run_dir}/metrics.csv")
    with fs.open_input_stream(path) as f:
        return list(csv.DictReader(f.read().decode().splitlines()))


def _checkpoint_bytes(checkpoint: str) -> int:
    import pyarrow.fs as pafs

    from sdtrain.storage.filesystems import filesystem_for

    fs, path = filesystem_for(checkpoint)
    return sum(
        i.size for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.type == pafs.FileType.File
    )


if __name__ == "__main__":
    main()
