"""Train a Stable Diffusion UNet from parquet latents on Ray Train + Lightning.

Locally (starts a Ray cluster in this process; no arguments runs configs/demo.yaml):
    python entrypoints/train.py
    python entrypoints/train.py --config configs/small.yaml data.train=/data/latents run.name=exp1
On a cluster:
    ray job submit --working-dir . --runtime-env runtime_env/gpu.yaml -- \
        python entrypoints/train.py --config configs/small.yaml
Every config key: python entrypoints/train.py --help
"""

import os
import sys
from pathlib import Path

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import train_main

# The embedded default: what this script runs with no arguments.
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:], default_config=DEMO_CONFIG))
