"""The digits demo's quality for its time (issue #28): the README's first command, then its final model scored.

Runs ``entrypoints/train.py`` (configs/demo.yaml, 2 CPU workers on a local Ray cluster) as the README does, in a
fresh directory, and times it; then samples the final (EMA) model once for every validation digit (197) with the
demo's guidance scale and without guidance (scale 1), through the same evaluator a run's eval.class_agreement uses,
each sample read by the demo's SVC (0.95 of the real validation digits). ``--repo`` trains from another checkout
(the demo as it was before a change, scored with its configs/demo.yaml); the scoring code is always this checkout's.

    PYTHONPATH=src .venv/bin/python bench/demo_quality.py
    PYTHONPATH=src .venv/bin/python bench/demo_quality.py --repo /tmp/before   # git worktree add /tmp/before <rev>
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"guided": 0.90, "unguided": 0.60}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose demo is trained (default: this)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of configs/demo.yaml")
    args = parser.parse_args()
    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# sdtrain {benchlib.git_commit()}", flush=True)

    from sdtrain.artifacts.loading import load_model
    from sdtrain.config.loader import load_config
    from sdtrain.demo.digits import real_digits_agreement
    from sdtrain.evaluation.checkpoint_eval import Evaluator

    with tempfile.TemporaryDirectory(prefix="sdtrain-demo-quality-") as directory:
        env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(args.repo / "src")}
        command = [sys.executable, str(args.repo / "entrypoints" / "train.py"), *args.overrides]
        started = time.perf_counter()
        subprocess.run(command, cwd=directory, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        run_dir = Path(directory) / "runs" / "demo"
        final = sorted(run_dir.glob("checkpoint_[0-9]*"))[-1]
        history = json.loads((final / "history.json").read_text())
        worker_hours = history[-1]["worker_hours"]
        print(f"command {wall:.0f} s; {worker_hours:.4f} worker-hours to step {history[-1]['step']}", flush=True)
        with open(run_dir / "metrics.csv") as f:
            curve = [(row["step"], row["class_agreement"]) for row in csv.DictReader(f) if row.get("class_agreement")]
        if curve:  # the run's own evaluations (configs/demo.yaml's eval), on data.val's first eval.num_samples digits
            print("evaluated during the run: " + ", ".join(f"step {s} {float(v):.2f}" for s, v in curve), flush=True)

        os.chdir(directory)  # configs/demo.yaml's data paths are relative to where the demo ran
        base = load_config(str(args.repo / "configs" / "demo.yaml"), args.overrides)
        guidance = base.sample_grid.guidance_scale
        model = load_model(str(final))
        scores = {}
        for name, scale in (("guided", guidance), ("unguided", 1.0)):
            config = load_config(
                str(args.repo / "configs" / "demo.yaml"),
                [
                    *args.overrides,
                    "eval.class_agreement=true",
                    "eval.num_samples=197",
                    f"sample_grid.guidance_scale={scale}",
                ],
            )
            scores[name] = Evaluator(config, None, None).evaluate(model)["class_agreement"]
            print(f"class agreement {name} (guidance {scale:g}): {scores[name]:.3f} of 197 samples", flush=True)
    print(f"real validation digits: {real_digits_agreement():.3f}; chance 0.100")
    for name, value in scores.items():
        print(
            benchlib.ratio_line(
                f"class_agreement_{name}", value, "1", 1.0, f">= {TARGETS[name]:.2f}", value >= TARGETS[name]
            )
        )
    print(f"RESULT wall_s={wall:.1f} worker_hours={worker_hours:.4f}")


if __name__ == "__main__":
    main()
