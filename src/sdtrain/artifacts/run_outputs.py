"""metrics.csv and loss_curve.png in the run directory: rewritten by rank 0 at every report while the run
trains (sdtrain.train.live_files), and by the driver at the end."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import posixpath
import tempfile
from dataclasses import dataclass

import pyarrow.fs as pafs

from sdtrain.storage.run_layout import HISTORY_FILE, LOSS_CURVE_FILE, METRICS_FILE


def read_history(checkpoint) -> list[dict[str, float]]:
    """The metric rows stored with a reported ``ray.train.Checkpoint`` (local or remote)."""
    with checkpoint.filesystem.open_input_stream(posixpath.join(checkpoint.path, HISTORY_FILE)) as f:
        return json.loads(f.read())


@dataclass(frozen=True)
class LossLabels:
    """What the loss curve plots, for its title."""

    prediction_type: str = "epsilon"
    snr_gamma: float | None = None

    @property
    def train(self) -> str:
        weighting = f"min-SNR-{self.snr_gamma:g} weighted" if self.snr_gamma is not None else "unweighted"
        return f"train loss ({weighting}, random noise and timesteps)"


def write_run_outputs(
    history: list[dict[str, float]], filesystem: pafs.FileSystem, run_dir: str, labels: LossLabels = LossLabels()
) -> list[str]:
    """Write metrics.csv (a row per report) and loss_curve.png into ``run_dir``, each whole (a reader
    never sees half a file); return their paths.

    Args:
        labels: what the curve plots (its title).
    """
    columns = list(dict.fromkeys(key for row in history for key in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    paths = [posixpath.join(run_dir, METRICS_FILE), posixpath.join(run_dir, LOSS_CURVE_FILE)]
    for path, payload in zip(paths, (text.getvalue().encode(), loss_curve_png(history, labels)), strict=True):
        write_whole(filesystem, path, payload)
    return paths


def write_whole(filesystem: pafs.FileSystem, path: str, payload: bytes) -> None:
    """Replace the file at ``path`` by ``payload`` at once: locally a temporary file moved over it, on
    object storage one upload (an object appears only once it is complete)."""
    if not isinstance(filesystem, pafs.LocalFileSystem):
        with filesystem.open_output_stream(path) as f:
            f.write(payload)
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            # mkstemp's file is 0600: readable by others as a file open() creates would be (the run's readers)
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _umask() -> int:
    # os.umask reads it only by setting it, which would race other threads' file creation: Linux shows it in /proc.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration):
        return 0o022  # the usual umask, where the process's is not to be read safely


def loss_curve_png(history: list[dict[str, float]], labels: LossLabels = LossLabels()) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label=labels.train)
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss (plain MSE, fixed noise and timesteps)")
    target = {"epsilon": "noise", "v_prediction": "v"}.get(labels.prediction_type, labels.prediction_type)
    ax.set_title(f"{labels.prediction_type} prediction: MSE of the predicted {target}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{target}-prediction MSE")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
