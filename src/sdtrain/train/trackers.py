"""Experiment trackers chosen by run.trackers (TensorBoard, MLflow, W&B), through Lightning's own
loggers, driven by rank 0 at each report rather than by ``self.log`` (which knows nothing of restarts).

One tracker run per training run, however often it restarts: the ids live in ``trackers.json`` in
the run directory, with the last step logged. A worker group that resumes from an earlier
checkpoint re-does steps already logged; those are not logged again, so every tracker holds each
step once (the first time it was trained; metrics.csv holds the re-done values).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import posixpath
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow.fs as pafs
from lightning.pytorch.loggers import Logger

from sdtrain.artifacts.run_outputs import write_whole
from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.storage.filesystems import filesystem_for, local_copy
from sdtrain.storage.uris import is_uri
from sdtrain.train.live import BackgroundWriter

log = logging.getLogger("sdtrain")

STATE_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
# Settings the driver's environment gives the trackers, handed to the workers (a cluster started
# separately does not share it). Credentials are not among them: they belong in the cluster's environment.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_ENTITY", "WANDB_BASE_URL")


def tracker_env() -> dict[str, str]:
    """The tracker settings of this process's environment, for :func:`apply_tracker_env` on a worker."""
    return {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}


def apply_tracker_env(env: Mapping[str, str]) -> None:
    """Args: env: what :func:`tracker_env` returned on the driver."""
    os.environ.update(env)
    # W&B keeps the address of its service process in the environment, which Ray's workers inherit from
    # the process that started the cluster: a worker sharing that service leaves its run open there when
    # it is killed, and the restarted worker could not continue the run ("run ID is in use").
    os.environ.pop("WANDB_SERVICE", None)


def check_trackers(config: Config) -> None:
    """Refuse run.trackers this process cannot serve, before any worker starts: a tracker's package
    missing (the ``trackers`` extra), or MLflow without a tracking URI."""
    modules = {"tensorboard": "lightning.pytorch.loggers.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
    for name in config.run.trackers:
        try:
            importlib.import_module(modules[name])
        except ImportError as error:
            raise ConfigError(
                f"run.trackers: {name} needs its package ({error}); install sdtrain's trackers extra "
                "(pip install 'sdtrain[trackers]') or leave it out of run.trackers"
            ) from None
    if "mlflow" in config.run.trackers and not (
        config.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    ):
        raise ConfigError(
            "run.trackers: mlflow needs a tracking server: set run.mlflow_tracking_uri (or MLFLOW_TRACKING_URI)"
        )


def read_state(run_dir: str) -> dict[str, Any]:
    """The run's tracker state: ``ids`` (tracker -> run id) and ``logged_through`` (the last step logged)."""
    fs, path = filesystem_for(posixpath.join(run_dir, STATE_FILE))
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return {"ids": {}, "logged_through": -1}


def _write_state(run_dir: str, state: dict[str, Any]) -> None:
    fs, path = filesystem_for(posixpath.join(run_dir, STATE_FILE))
    write_whole(fs, path, json.dumps(state).encode())


def _wandb_save_dir(run_dir: str) -> str:
    # W&B writes its run files locally and syncs them itself: a local run directory holds them.
    if is_uri(run_dir):
        return tempfile.mkdtemp(prefix="sdtrain-wandb-")
    return run_dir


class Trackers:
    """Rank 0's tracker runs for one worker group: hyperparameters once per tracker run, metrics and
    images at their steps, each step at most once across restarts."""

    def __init__(self, config: Config, run_dir: str):
        """Args:
        config: the run's config (logged in full as hyperparameters).
        run_dir: the run's directory (run.storage_path/run.name), local or s3://.
        """
        self.run_dir = run_dir
        self.state = read_state(run_dir)
        self.logged_through: int = self.state["logged_through"]
        ids: dict[str, str] = self.state["ids"]
        self._state_writer = BackgroundWriter("sdtrain-tracker-state")
        # TensorBoard writes through fsspec, which needs s3fs for s3://: on object storage it writes
        # on this node's disk, and the event files are copied to run_dir/tensorboard after each flush.
        self._tensorboard_local = tempfile.mkdtemp(prefix="sdtrain-tensorboard-") if is_uri(run_dir) else None
        self._mirror_writer = BackgroundWriter("sdtrain-tensorboard-mirror")
        # Any: each tracker's extras (experiment, run_id, log_image) are its own logger class's.
        self.loggers: dict[str, Any] = {}
        for name in config.run.trackers:
            where = self._tensorboard_local if name == "tensorboard" and self._tensorboard_local else run_dir
            logger = _build_logger(name, config, where, ids.get(name))
            # MLflow refuses a param changed on resume (W&B keeps the first); TensorBoard's hparams.yaml
            # is rewritten from what this worker group logged, so it gets them at every start.
            if name not in ids or name == "tensorboard":
                logger.log_hyperparams(config.to_dict())
            ids[name] = _run_id(name, logger)
            self.loggers[name] = logger
        self._save_state()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> bool:
        """Log ``metrics`` at ``step`` to every tracker unless a previous worker group already did; returns
        whether they were logged."""
        if step <= self.logged_through:
            return False
        values = {key: float(value) for key, value in metrics.items() if key != "step"}
        for name, logger in self.loggers.items():
            logger.log_metrics(values, step)
            if name == "tensorboard":  # its writer flushes every 2 minutes: a killed worker would lose them
                logger.experiment.flush()
                self._mirror_tensorboard()
        self.logged_through = step
        self._save_state()
        return True

    def log_image(self, key: str, image: np.ndarray, step: int) -> None:
        """Send an H x W x 3 uint8 image to every tracker at ``step`` (call before :meth:`log_metrics` of
        that step: a step already logged is skipped)."""
        if step <= self.logged_through:
            return
        for name, logger in self.loggers.items():
            if name == "tensorboard":
                logger.experiment.add_image(key, image, step, dataformats="HWC")
            elif name == "mlflow":
                logger.experiment.log_image(logger.run_id, image, key=key, step=step)
            elif name == "wandb":
                logger.log_image(key, [image], step=step)

    def finish(self, status: str = "success") -> None:
        """Flush and close every tracker run (it continues when the run resumes).

        Args:
            status: success or failed.
        """
        for name, logger in self.loggers.items():
            logger.finalize(status)
            if name == "wandb":  # Lightning's finalize leaves the W&B run open: its files would not be complete
                logger.experiment.finish(exit_code=0 if status == "success" else 1)
        self._mirror_tensorboard()
        self._mirror_writer.close(timeout=60)
        self._state_writer.close(timeout=60)

    def _mirror_tensorboard(self) -> None:
        local = self._tensorboard_local
        if local is None or "tensorboard" not in self.loggers:
            return
        fs, remote = filesystem_for(posixpath.join(self.run_dir, TENSORBOARD_DIR))
        # Each file is one object put whole; event files only grow, so the newest copy holds all of it.
        self._mirror_writer.submit(
            lambda: pafs.copy_files(os.path.join(local, TENSORBOARD_DIR), remote, destination_filesystem=fs)
        )

    def _save_state(self) -> None:
        ids = {**self.state["ids"], **{name: _run_id(name, lg) for name, lg in self.loggers.items()}}
        state = {"ids": ids, "logged_through": self.logged_through}
        self._state_writer.submit(lambda: _write_state(self.run_dir, state))


def _build_logger(name: str, config: Config, run_dir: str, run_id: str | None) -> Logger:
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        # version="": event files straight in run_dir/tensorboard, one directory across restarts.
        return TensorBoardLogger(run_dir, name=TENSORBOARD_DIR, version="", default_hp_metric=False)
    if name == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(
            experiment_name=config.run.mlflow_experiment,
            run_name=config.run.name,
            tracking_uri=config.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
            run_id=run_id,
            log_model=False,
        )
        logger.experiment  # noqa: B018 -- creates the run now, so that its id can be saved
        return logger
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger
        from wandb.sdk.lib.runid import generate_id

        return WandbLogger(
            project=config.run.wandb_project,
            name=config.run.name,
            id=run_id or generate_id(),
            resume="allow",
            save_dir=_wandb_save_dir(run_dir),
            log_model=False,
        )
    raise ValueError(f"unknown tracker {name!r}")


def _run_id(name: str, logger: Any) -> str:
    if name == "tensorboard":
        return TENSORBOARD_DIR
    if name == "mlflow":
        return str(logger.run_id)
    return str(logger.experiment.id)


def log_export(config: Config, run_dir: str, export_uri: str) -> None:
    """Attach the final export to the run's MLflow and W&B runs (MLflow: registered as a version of the
    model run.mlflow_register_as when set); from the driver, after the export is written.

    Args:
        config: the run's config.
        run_dir: the run's directory.
        export_uri: the export directory (local or s3://).
    """
    ids = read_state(run_dir)["ids"]
    local = local_copy(export_uri) if is_uri(export_uri) else export_uri
    if "mlflow" in config.run.trackers and "mlflow" in ids:
        import mlflow

        client = mlflow.MlflowClient(config.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        client.log_artifacts(ids["mlflow"], local, artifact_path="export")
        if config.run.mlflow_register_as:
            name = config.run.mlflow_register_as
            # A version of the run's export/ (diffusers files, not an MLflow "logged model" flavour).
            if not client.search_registered_models(f"name='{name}'"):
                client.create_registered_model(name)
            source = f"{client.get_run(ids['mlflow']).info.artifact_uri}/export"
            version = client.create_model_version(name, source, run_id=ids["mlflow"])
            print(f"[sdtrain] registered the export as MLflow model {name} version {version.version}", flush=True)
    if "wandb" in config.run.trackers and "wandb" in ids:
        import wandb

        run = wandb.init(
            project=config.run.wandb_project,
            id=ids["wandb"],
            resume="allow",
            dir=_wandb_save_dir(run_dir),
        )
        artifact = wandb.Artifact(f"{config.run.name}-export", type="model")
        artifact.add_dir(local)
        run.log_artifact(artifact)
        run.finish()
