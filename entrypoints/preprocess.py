"""Encode images and captions into the parquet latents that entrypoints/train.py reads (Ray Data:
decode and crop on CPUs, the SD VAE and text encoder in an actor pool, on GPUs where there are).

    python entrypoints/preprocess.py input.paths=s3://bucket/laion output.path=s3://bucket/latents
    ray job submit --working-dir . -- python entrypoints/preprocess.py --config configs/preprocess.yaml ...
Every config key: python entrypoints/preprocess.py --help; a re-run resumes (docs/preprocessing.md).
"""

import os
import sys
from pathlib import Path

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import preprocess_main

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "preprocess.yaml"

if __name__ == "__main__":
    sys.exit(preprocess_main(sys.argv[1:], default_config=DEFAULT_CONFIG))
