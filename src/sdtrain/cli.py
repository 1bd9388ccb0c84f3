"""Command lines of entrypoints/train.py and entrypoints/retrain.py: parse, load the config, run, report."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sdtrain.config.schema import Config, help_text, load_config
from sdtrain.errors import SdtrainError, TrainingFailed


def train_main(argv: Sequence[str] | None, default_config: Path) -> int:
    """Run the training job; the exit code is 0 on success, 2 for bad input, 1 for a failed run."""
    return _main(
        argv,
        default_config,
        "train.py",
        "Train a Stable Diffusion UNet on parquet latents with Ray Train + Lightning.",
        _train,
    )


def retrain_main(argv: Sequence[str] | None, default_config: Path) -> int:
    """Run one scheduled retraining; exit codes as for training (a rejected model is not a failure)."""
    return _main(
        argv,
        default_config,
        "retrain.py",
        "Retrain on new date partitions and promote the result if it is better.",
        _retrain,
    )


def _main(argv, default_config: Path, prog: str, description: str, job: Callable[[Config], list[str]]) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override a config key")
    args = parser.parse_args(argv)
    try:
        lines = job(load_config(args.config, args.overrides))
    except SdtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TrainingFailed) else 2
    for line in lines:
        print(f"[sdtrain] {line}")
    return 0


def _train(config: Config) -> list[str]:
    from sdtrain.launch import train  # imports Ray and torch: only once the config is known good

    summary = train(config)
    return [
        f"done: step {summary.final_step}, loss {summary.final_loss:.4f}",
        f"final checkpoint: {summary.checkpoint_path}",
        *(f"wrote {path}" for path in summary.outputs),
    ]


def _retrain(config: Config) -> list[str]:
    from sdtrain.errors import ConfigError
    from sdtrain.retrain import retrain

    if config.retrain.data_root is None:
        raise ConfigError("retrain.data_root and retrain.models_root are required for retraining")
    day = (
        datetime.date.fromisoformat(config.retrain.date)
        if config.retrain.date
        else datetime.datetime.now(datetime.timezone.utc).date()
    )
    outcome = retrain(config, day)
    return [f"{outcome.status}: {outcome.message}", f"production: {outcome.production or 'none'}"]
