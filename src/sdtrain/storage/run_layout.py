"""The names inside a run directory (run.storage_path/run.name), its checkpoints and its export: their one owner.

<run dir>/
    checkpoint_<step>/      Ray Train's, committed and pruned by it: CHECKPOINT_FILE, HISTORY_FILE,
                            DATA_STATE_FILE, MODEL_FILE and, with checkpoint.record_rows, SAMPLES_FILE
    dataset_index/          the run's dataset index: train.parquet, val.parquet
    metrics.csv, loss_curve.png
    samples/step_<N>.png    the sample grids
    evaluation/             checkpoint evaluations: step_<N>.json each (metrics or error), reference-<key>.npz (the
                            feature statistics of data.val's images, computed once per run)
    trackers.json, tensorboard/, wandb/
    export/                 the diffusers pipeline: unet/, scheduler/, EXPORT_INFO_FILE, the grid, the empty prompt
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile

# --- the run directory
METRICS_FILE = "metrics.csv"
LOSS_CURVE_FILE = "loss_curve.png"
EXPORT_DIR = "export"
SAMPLES_DIR = "samples"
TRACKERS_FILE = "trackers.json"
"""The run's tracker run ids and the last step logged (sdtrain.train.trackers)."""
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
DATASET_INDEX_DIR = "dataset_index"
SAMPLE_GRID_STEP = re.compile(r"step_(\d+)\.png")
"""A sample grid's file name in SAMPLES_DIR, its step the group."""


def sample_grid_file(step: int) -> str:
    return f"step_{step}.png"


EVALUATION_DIR = "evaluation"


def evaluation_file(step: int) -> str:
    return f"step_{step}.json"


# --- a checkpoint
def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


CHECKPOINT_FILE = "checkpoint.ckpt"
HISTORY_FILE = "history.json"
"""The metric rows reported up to the checkpoint's step: the run's curve, readable without the weights."""
DATA_STATE_FILE = "data_state.json"
"""The step and the data position after it (sdtrain.data.read_order.DataState): where the data stream resumes."""
MODEL_FILE = "model.json"
"""The checkpoint's metadata (sdtrain.artifacts.checkpoint_format.CheckpointMeta), readable without the weights: the
driver holds a resume to the model it trained before Ray starts."""
SAMPLES_FILE = "samples.npy"
"""With checkpoint.record_rows: (world size, rows) sample indices trained on since the previous checkpoint."""

# --- an export (and a preprocessing output: the empty prompt's embedding)
EXPORT_INFO_FILE = "sdtrain.json"
EXPORT_SAMPLE_GRID_FILE = "sample_grid.png"
UNCONDITIONAL_FILE = "unconditional_caption.npy"
"""The empty prompt's caption embedding, beside an export and a preprocessing output."""
UNCONDITIONAL_IDS_FILE = "unconditional_caption_ids.npy"
"""The empty prompt's token ids, beside a preprocessing output of token ids (output.captions)."""


def run_scratch_dir(staging_dir: str | None, run_name: str, run_dir: str) -> str:
    """A run's local directory on the node that calls it (its workers' staged checkpoints and its restore copy):
    under ``staging_dir`` (checkpoint.staging_dir), else the node's temporary directory, named by the run's name and
    a digest of its directory. Light, for the clean-up task every node runs (sdtrain.driver.staging_cleanup)."""
    run_key = hashlib.sha256(run_dir.encode()).hexdigest()[:12]
    return os.path.join(staging_dir or tempfile.gettempdir(), "sdtrain-staging", f"{run_name}-{run_key}")
