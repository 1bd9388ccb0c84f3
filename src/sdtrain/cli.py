"""Command line of entrypoints/train.py: parse, load the config, train, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from sdtrain.config import help_text, load_config
from sdtrain.errors import SdtrainError, TrainingFailed


def parse_args(argv: Optional[Sequence[str]], default_config: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train a Stable Diffusion UNet on parquet latents with Ray Train + Lightning.",
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=str(default_config),
        help="YAML config file (default: %(default)s, the demo)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override a config key")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]], default_config: Path) -> int:
    """Run the training job; the exit code is 0 on success, 2 for bad input, 1 for a failed run."""
    args = parse_args(argv, default_config)
    try:
        config = load_config(args.config, args.overrides)
        from sdtrain.launch import train  # imports Ray and torch: only once the config is known good

        summary = train(config)
    except SdtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TrainingFailed) else 2
    print(f"[sdtrain] done: step {summary.final_step}, loss {summary.final_loss:.4f}")
    print(f"[sdtrain] final checkpoint: {summary.checkpoint_path}")
    for path in summary.outputs:
        print(f"[sdtrain] wrote {path}")
    return 0
