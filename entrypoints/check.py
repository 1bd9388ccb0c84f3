"""Check a training config on the cluster it will run on, in a few minutes, before the real run: it trains on one
GPU, then on all the config's workers, as configured (compiled if train.compile is on), and prints images/s per GPU,
MFU, the share lost to communication (net of data wait), data wait, checkpoint stall, peak allocated and reserved
memory beside the memory model's prediction and the GPU's capacity, and the projected time and cost of the
configured run (run.gpu_hour_cost); the table is also recorded as JSON under <run.storage_path>/checks/.
--compare-compile adds a one-GPU phase with train.compile the other way. Exit code 1 if a phase failed.

    ray job submit --working-dir . --runtime-env runtime_env/gpu.yaml -- \\
        python entrypoints/check.py --config configs/small.yaml
    anyscale job submit -f check_job.yaml
"""

import os
import sys
from pathlib import Path

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import check_main

if __name__ == "__main__":
    sys.exit(check_main(sys.argv[1:], default_config=Path(__file__).resolve().parent.parent / "configs" / "small.yaml"))
