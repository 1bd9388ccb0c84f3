"""What the driver writes into the run directory at the end: metrics.csv and loss_curve.png."""

from __future__ import annotations

import csv
import io
import json
import posixpath

import pyarrow.fs as pafs

from sdtrain.artifacts.checkpoint_format import HISTORY_FILE

METRICS_FILE = "metrics.csv"
LOSS_CURVE_FILE = "loss_curve.png"


def read_history(checkpoint) -> list[dict[str, float]]:
    """The metric rows stored with a reported ``ray.train.Checkpoint`` (local or remote)."""
    with checkpoint.filesystem.open_input_stream(posixpath.join(checkpoint.path, HISTORY_FILE)) as f:
        return json.loads(f.read())


def write_run_outputs(history: list[dict[str, float]], filesystem: pafs.FileSystem, run_dir: str) -> list[str]:
    """Write metrics.csv (a row per report) and loss_curve.png into ``run_dir``; return their paths."""
    columns = list(dict.fromkeys(key for row in history for key in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    paths = [posixpath.join(run_dir, METRICS_FILE), posixpath.join(run_dir, LOSS_CURVE_FILE)]
    for path, payload in zip(paths, (text.getvalue().encode(), loss_curve_png(history)), strict=True):
        with filesystem.open_output_stream(path) as f:
            f.write(payload)
    return paths


def loss_curve_png(history: list[dict[str, float]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss (fixed noise)")
    ax.set_xlabel("step")
    ax.set_ylabel("noise-prediction MSE")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
