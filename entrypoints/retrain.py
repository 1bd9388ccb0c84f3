"""Scheduled production retraining: train on the date partitions that arrived since the production
model, warm-started from it, and promote the result only if it is at least as good.

    python entrypoints/retrain.py --config configs/retrain.yaml retrain.date=2026-11-22
    anyscale schedule apply -f schedule.yaml      # runs this daily on Anyscale
Running twice for the same date does not train twice. Without retrain.date, the retries of an Anyscale
job keep its first attempt's date. One run at a time: a run that finds <models_root>/retrain.lock held
exits 2 at once (docs/retraining.md). Every config key: --help
"""

import os
import sys
from pathlib import Path

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.cli import retrain_main

RETRAIN_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retrain.yaml"

if __name__ == "__main__":
    sys.exit(retrain_main(sys.argv[1:], default_config=RETRAIN_CONFIG))
