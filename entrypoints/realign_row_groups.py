"""Copy bucketed parquet latents written by an sdtrain before 2026-12-01 (read ~2x: their row groups are counted from
each file's start) with a row group starting at each bucket run, as preprocessing writes them now. CPU only: nothing
is encoded again (docs/data.md, Aspect-ratio buckets).

Locally (starts a Ray cluster in this process):
    python entrypoints/realign_row_groups.py /data/latents /data/latents-2
On a cluster (the runtime env ships sdtrain to the nodes' tasks):
    ray job submit --working-dir . --runtime-env runtime_env/gpu.yaml -- \
        python entrypoints/realign_row_groups.py s3://bucket/latents s3://bucket/latents-2
Then train on the copy. A re-run after a kill does what is not done.
"""

import os
import sys

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.realign_cli import realign_main

if __name__ == "__main__":
    sys.exit(realign_main(sys.argv[1:]))
