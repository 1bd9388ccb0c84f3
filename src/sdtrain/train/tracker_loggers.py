"""Each tracker's Lightning logger (TensorBoard, MLflow, W&B), built to continue the run's tracker run, and the id
saved for it in ``trackers.json``: what :mod:`sdtrain.train.trackers` drives."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning.pytorch.loggers import Logger

from sdtrain.config.schema import Config
from sdtrain.storage.run_layout import TENSORBOARD_DIR
from sdtrain.storage.uris import is_uri


def wandb_save_dir(run_dir: str) -> str:
    # W&B writes its run files locally and syncs them itself: a local run directory holds them.
    if is_uri(run_dir):
        return tempfile.mkdtemp(prefix="sdtrain-wandb-")
    return run_dir


def mlflow_experiment(config: Config) -> str:
    """tracking.mlflow_experiment, else MLFLOW_EXPERIMENT_NAME (MLflow's own setting), else sdtrain."""
    return config.tracking.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "sdtrain"


def build_logger(name: str, config: Config, run_dir: str, run_id: str | None, purge_step: int | None) -> Logger:
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        # version="": event files straight in run_dir/tensorboard, one directory across restarts.
        # purge_step: TensorBoard drops the earlier files' events from that step on (steps re-done).
        return TensorBoardLogger(
            run_dir, name=TENSORBOARD_DIR, version="", default_hp_metric=False, purge_step=purge_step
        )
    if name == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(
            experiment_name=mlflow_experiment(config),
            run_name=config.run.name,
            tracking_uri=config.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
            run_id=run_id,
            log_model=False,
        )
        client = logger.experiment  # creates the run now, so that its id can be saved
        if run_id is not None:  # an earlier worker group's finish marked it FAILED (or FINISHED): it goes on
            client.update_run(run_id, status="RUNNING")
        return logger
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger
        from wandb.sdk.lib.runid import generate_id

        return WandbLogger(
            project=config.tracking.wandb_project,
            name=config.run.name,
            id=run_id or generate_id(),
            resume="allow",
            save_dir=wandb_save_dir(run_dir),
            log_model=False,
        )
    raise ValueError(f"unknown tracker {name!r}")


def run_id_of(name: str, logger: Any) -> str:
    if name == "tensorboard":
        return TENSORBOARD_DIR
    if name == "mlflow":
        return str(logger.run_id)
    return str(logger.experiment.id)
