"""Rank 0's window on a running job, fed by :class:`sdtrain.train.reporting.StepReporter` at every
report: the live files in the run directory, the experiment trackers, and Ray metrics (gauges that
Ray's dashboard, Prometheus/Grafana and Anyscale show)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from sdtrain.artifacts.run_outputs import LossLabels
from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.train.live_files import LiveOutputs
from sdtrain.train.sample_grids import Grid
from sdtrain.train.tracker_thread import TrackerThread

# metric -> (gauge name, description): what a dashboard needs to tell a healthy run from a stalled one.
GAUGES = {
    "loss": ("sdtrain_train_loss", "Training loss (recipe-weighted) over the latest report's window"),
    "samples_per_s": ("sdtrain_samples_per_second", "Training samples per second over the latest report's window"),
    "data_wait_fraction": ("sdtrain_data_wait_fraction", "Fraction of the wall time the training loop waited for data"),
    "checkpoint_stall_s": (
        "sdtrain_checkpoint_stall_seconds",
        "Seconds training waited on the last checkpoint",
    ),
    "step": ("sdtrain_step", "Optimizer steps done"),
    "mfu": ("sdtrain_mfu", "Model FLOPs utilization over the latest report's window (GPU workers only)"),
    "peak_memory_gb": ("sdtrain_peak_memory_gb", "The largest rank's peak allocated GPU memory, GB (GPU workers only)"),
    "cost_per_million_images": (
        "sdtrain_cost_per_million_images",
        "What a million images cost at the latest report's throughput (run.gpu_hour_cost set)",
    ),
}


class RayGauges:
    """The run's metrics as ``ray.util.metrics`` gauges, tagged with the run's name."""

    def __init__(self, run_name: str):
        """Args: run_name: run.name (the tag ``run``)."""
        from ray.util.metrics import Gauge

        self.tags = {"run": run_name}
        self.gauges = {
            key: Gauge(name, description=description, tag_keys=("run",)) for key, (name, description) in GAUGES.items()
        }

    def set(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Set every gauge whose metric is in ``metrics`` and finite; returns what was set."""
        values = {key: float(metrics[key]) for key in self.gauges if key in metrics and math.isfinite(metrics[key])}
        for key, value in values.items():
            self.gauges[key].set(value, tags=self.tags)
        return values


class RunView:
    """What rank 0 shows of a run while it trains."""

    def __init__(
        self,
        config: Config,
        run_dir: str,
        ray_metrics: bool = True,
    ):
        """Args:
        config: the run's config.
        run_dir: run.storage_path/run.name, local or s3://.
        ray_metrics: export Ray gauges (only inside a Ray worker).
        """
        self.config = config
        self.run_dir = run_dir
        # model.prediction_type: concrete in a run's config (sdtrain.model.unet.resolve_prediction_type, on the driver)
        labels = LossLabels(config.model.prediction_type or "epsilon", config.train.snr_gamma)
        self.live = LiveOutputs(run_dir, labels)
        self.trackers: TrackerThread | None = None  # opened by started(), which knows where the run resumes
        self.gauges = RayGauges(config.run.name) if ray_metrics else None

    def started(self, history: list[dict[str, float]]) -> None:
        """The worker group starts from the checkpoint whose rows are ``history`` ([] for a fresh run):
        the live files drop rows of steps re-done after a restart; the trackers get the rows they lack."""
        rows = self.live.update(history)
        if self.config.tracking.trackers:
            self.trackers = TrackerThread(self.config, self.run_dir, rows)

    def reported(
        self, metrics: dict[str, float], history: list[dict[str, float]], grid: Grid | None, checkpoint: bool = False
    ) -> None:
        """A report of ``metrics``, already appended to ``history``; the sample grid drawn at this step, if any, adds
        its time (sample_grid_s) and goes to the trackers; ``checkpoint``: a checkpoint of this step follows."""
        step = int(metrics["step"])
        if grid is not None:
            metrics["sample_grid_s"] = grid.seconds
            self.image("samples", grid.image, step)
        rows = self.live.update(history)
        if self.gauges is not None:
            self.gauges.set(metrics)
        if self.trackers is not None:  # the row's copy (an evaluation merges into the row later), and the rows before
            self.trackers.log_metrics(rows[-1], step, rows)
            if checkpoint:
                self.trackers.before_checkpoint()

    def evaluated(self, results: list[tuple[int, dict[str, float]]]) -> None:
        """Finished checkpoint evaluations, already in their rows: into the live files' copies of them (written at the
        next update), and to the trackers at their checkpoints' steps.

        Args:
            results: (step, metrics) each (sdtrain.train.evaluations).
        """
        self.live.merged(results)
        for step, metrics in results:
            if self.trackers is not None:
                self.trackers.log_evaluation(metrics, step)

    def image(self, key: str, image: np.ndarray, step: int) -> None:
        """An H x W x 3 uint8 image of ``step`` for the trackers (before that step's report)."""
        if self.trackers is not None:
            self.trackers.log_image(key, image, step)

    def finished(self, status: str) -> None:
        """Training ended (success) or raised (failed): flush what is pending.

        Args:
            status: success or failed.
        """
        if self.trackers is not None:
            self.trackers.finish(status)
        if not self.live.writer.flush(timeout=120):
            log.warning("the run directory's live files were not up to date after 120 s")
