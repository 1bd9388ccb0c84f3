"""A chaos run: a tiny job whose training workers are SIGKILLed at random moments, then audited.

    python bench/chaos.py                 # 10 kills
    python bench/chaos.py --kills 3 --seed 1

One training worker on a local Ray cluster (the demo's digits, the tiny UNet, checkpoint.record_rows
on). A killer thread waits for a checkpoint committed since its previous kill (so the run makes
progress between kills), waits a random 0-2 s more (a kill may land in a step, a report, a
checkpoint write or an upload), and SIGKILLs the RayTrainWorker process. Then it checks what a
user relies on:

- the run ends at exactly train.max_steps;
- every row is trained on once per epoch (the sample indices of checkpoint.record_rows);
- the loss curve is continuous: one row per logged step, in order, all finite;
- no checkpoint lost or half-read: each restart started at a committed checkpoint's step.

It prints the kills survived of the kills made and the time each kill cost (SIGKILL to the first
report after the restart). Not a CI test: it takes minutes. Results: bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from sdtrain.config.loader import load_config
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.driver.run import train
from sdtrain.storage.run_layout import HISTORY_FILE, SAMPLES_FILE

CHECKPOINT_EVERY = 4
BATCH = 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs to make (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: %(default)s)")
    parser.add_argument("--dir", help="working directory (default: a new temporary one)")
    args = parser.parse_args()

    import psutil
    import ray

    root = Path(args.dir or tempfile.mkdtemp(prefix="sdtrain-chaos-"))
    max_steps = CHECKPOINT_EVERY * (2 * args.kills + 3)  # room for every kill, with progress between them
    config = load_config(
        None,
        [
            f"data.train={root}/data/train",
            "model.preset=tiny",
            f"train.max_steps={max_steps}",
            f"train.global_batch_size={BATCH}",
            "scaling.num_workers=1",
            "scaling.use_gpu=false",
            f"run.storage_path={root}/runs",
            "run.name=chaos",
            f"checkpoint.every_n_steps={CHECKPOINT_EVERY}",
            "run.log_every_n_steps=2",
            "checkpoint.num_to_keep=null",
            "checkpoint.record_rows=true",
            "export.enabled=false",
            f"failure.max_failures={args.kills + 1}",
        ],
    )
    run_dir = root / "runs" / "chaos"
    rng = random.Random(args.seed)
    kills: list[tuple[float, int]] = []  # (time, committed checkpoints at the kill)
    done = threading.Event()

    def committed() -> list[str]:
        try:
            snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        except (OSError, ValueError):
            return []
        return [c["checkpoint_dir_name"] for c in snapshot["checkpoint_results"]]

    def killer() -> None:
        seen = 0
        while len(kills) < args.kills and not done.is_set():
            if len(committed()) <= seen:
                done.wait(0.2)
                continue
            seen = len(committed())
            done.wait(rng.uniform(0, 2))
            workers = [
                p.info["pid"]
                for p in psutil.process_iter(["pid", "cmdline"])
                if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])
            ]
            if workers and not done.is_set():
                os.kill(rng.choice(workers), signal.SIGKILL)
                kills.append((time.time(), seen))
                print(f"[chaos] kill {len(kills)}: after {seen} committed checkpoint(s)", flush=True)

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    started = time.time()
    try:
        summary = train(config)
    finally:
        done.set()
        thread.join()
        ray.shutdown()
    wall = time.time() - started

    problems = []
    if summary.final_step != max_steps:
        problems.append(f"the run ended at step {summary.final_step}, not {max_steps}")
    history = json.loads((run_dir / f"checkpoint_{max_steps:09d}" / HISTORY_FILE).read_text())
    steps = [row["step"] for row in history]
    logged = sorted(set(range(2, max_steps + 1, 2)) | set(range(CHECKPOINT_EVERY, max_steps + 1, CHECKPOINT_EVERY)))
    if steps != logged:
        problems.append(f"the curve's steps are {steps}, not each logged step once: {logged}")
    if not all(np.isfinite(row["loss"]) for row in history):
        problems.append("a non-finite loss in the curve")
    checkpoint_steps = {int(name.rsplit("_", 1)[1]) for name in committed()}
    starts = sorted({row["start_step"] for row in history} - {0})
    if not set(starts) <= checkpoint_steps:
        problems.append(f"restarts began at steps {starts}, not all committed checkpoints {sorted(checkpoint_steps)}")
    trained = np.concatenate([np.load(run_dir / name / SAMPLES_FILE).ravel() for name in sorted(committed())])
    files = resolve_parquet_files([str(root / "data" / "train")], "data.train")
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    per_epoch = (rows // BATCH) * BATCH  # an epoch's last rows that cannot fill a batch are left out
    if len(trained) != max_steps * BATCH or not ((trained >= 0) & (trained < rows)).all():
        problems.append(f"{len(trained)} sample indices recorded for {max_steps} steps of {BATCH} rows of {rows}")
    for epoch, start in enumerate(range(0, len(trained), per_epoch)):
        ids = trained[start : start + per_epoch]
        if len(np.unique(ids)) != len(ids):
            problems.append(f"epoch {epoch}: {len(ids) - len(np.unique(ids))} rows trained on twice")

    costs = []
    for killed_at, _ in kills:
        after = [row["time"] for row in history if row["time"] > killed_at and row["start_step"] > 0]
        if after:
            costs.append(min(after) - killed_at)
    survived = len(kills) if not problems else 0
    print(f"[chaos] {len(kills)} kills in {wall:.0f} s, {max_steps} steps, {len(trained)} samples trained on")
    print(f"RATIO kills survived / kills made = {survived}/{len(kills)}")
    if costs:
        print(
            "RATIO time lost per kill (SIGKILL to the first report after the restart): "
            f"median {np.median(costs):.1f} s, max {max(costs):.1f} s"
        )
    for problem in problems:
        print(f"[chaos] PROBLEM: {problem}")
    return 1 if problems or len(kills) < args.kills else 0


if __name__ == "__main__":
    sys.exit(main())
