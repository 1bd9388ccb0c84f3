"""Write the dataset index beside directories of parquet latents that did not come from preprocess.py, so that
training on them reads no footer and every restart lists nothing (one HEAD a directory; docs/data.md, Dataset index).

    python entrypoints/index.py s3://bucket/latents
    python entrypoints/index.py --config configs/small.yaml      # the directories data.train and data.val name
    ray job submit --working-dir . -- python entrypoints/index.py s3://bucket/latents data.caption_column=caption_ids
Re-run it after adding, removing or rewriting files: it reads only the footers of what changed.
"""

import os
import sys

try:
    import sdtrain  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed (e.g. a job's working_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from sdtrain.driver.cli import index_main

if __name__ == "__main__":
    sys.exit(index_main(sys.argv[1:]))
