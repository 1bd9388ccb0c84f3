"""Sample from a trained model, or export it in diffusers format.

    python entrypoints/generate.py runs/demo --captions .sdtrain-data/digits/val --out samples/demo
    python entrypoints/generate.py runs/small-256/checkpoint_000550000 --captions prompts.npy --vae /models/sd2/vae
    python entrypoints/generate.py runs/demo/checkpoint_000000700 --export-to exported/demo
Every option: python entrypoints/generate.py --help
"""

import os
import sys

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main(sys.argv[1:]))
