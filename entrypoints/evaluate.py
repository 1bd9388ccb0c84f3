"""Score trained models offline with the metrics of training's evaluation (docs/evaluation.md, Offline evaluation).

    python entrypoints/evaluate.py runs/small-256 --captions s3://bucket/coco30k/ --config configs/small.yaml \
        eval.dinov2=/models/dinov2-large eval.num_samples=30000
    python entrypoints/evaluate.py exported/a exported/b --prompts prompts.txt --reference evaluation/reference \
        eval.dinov2=/models/dinov2-large eval.clip=/models/clip-vit-large
Every option: python entrypoints/evaluate.py --help
"""

import os
import sys

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.offline_eval import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main(sys.argv[1:]))
