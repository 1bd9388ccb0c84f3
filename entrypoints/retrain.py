"""Scheduled production retraining: train on the date partitions that arrived since the production
model, warm-started from it, and promote the result only if it is at least as good.

    python entrypoints/retrain.py --config configs/retrain.yaml retrain.date=2026-11-22
    anyscale schedule apply -f schedule.yaml      # runs this daily on Anyscale
    python entrypoints/retrain.py --rollback [vNNNN] [--reason TEXT] retrain.models_root=...
Running twice for the same date does not train twice. Without retrain.date, the retries of an Anyscale
job keep its first attempt's date. One run at a time: a run that finds <models_root>/retrain.lock held
exits 75 at once (busy: try later; docs/retraining.md). --rollback moves production back (default: to the latest other
version it named that no rollback abandoned) without waiting for that lock (a run going on reports `superseded`),
recorded in the pointer log, so no later run promotes the version rolled back from again. With
tracking.mlflow_register_as (and mlflow in tracking.trackers), both move the MLflow model's production alias too
(docs/retraining.md#in-mlflow).
Every config key: --help
"""

import argparse
import os
import sys
from pathlib import Path

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import retrain_main

RETRAIN_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retrain.yaml"


def rollback_main(argv: list[str]) -> int:
    from sdtrain.config.loader import load_config
    from sdtrain.driver.cli import REPORTED, exit_code
    from sdtrain.driver.retrain import rollback

    parser = argparse.ArgumentParser(prog="retrain.py --rollback", description="Move production back, logged.")
    parser.add_argument("--rollback", nargs="?", const="", metavar="vNNNN", help="the version to go back to")
    parser.add_argument("--reason", default="", help="why (recorded in the pointer log)")
    parser.add_argument("--config", default=str(RETRAIN_CONFIG), help="YAML config file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override a config key")
    args = parser.parse_args(argv)
    if args.rollback and "=" in args.rollback:  # `--rollback key=value`: no version named, an override
        args.overrides.insert(0, args.rollback)
        args.rollback = None
    try:
        source, target = rollback(load_config(args.config, args.overrides), args.rollback or None, args.reason)
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)  # 2: nothing to roll back to, or production moved meanwhile; 75: storage failing for now
    print(f"[sdtrain] rolled back: production now names {target}, not {source} (recorded in the pointer log)")
    return 0


if __name__ == "__main__":
    if any(a == "--rollback" or a.startswith("--rollback=") for a in sys.argv[1:]):
        sys.exit(rollback_main(sys.argv[1:]))
    sys.exit(retrain_main(sys.argv[1:], default_config=RETRAIN_CONFIG))
