"""The driver's side of the experiment trackers (rank 0's side: :mod:`sdtrain.train.trackers`): the checks before
any worker starts, the tracker settings of the driver's environment handed to the workers, and the final export
attached to the run's tracker runs after it is written."""

from __future__ import annotations

import importlib
import os

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.storage.filesystems import local_copy
from sdtrain.storage.uris import is_uri
from sdtrain.train.trackers import FORWARDED_ENV, read_state, wandb_save_dir


def tracker_env() -> dict[str, str]:
    """The tracker settings of this process's environment, for :func:`sdtrain.train.trackers.apply_tracker_env` on a
    worker."""
    return {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}


def check_trackers(config: Config) -> None:
    """Refuse tracking.trackers this process cannot serve, before any worker starts: a tracker's package
    missing (the ``trackers`` extra), or MLflow without a tracking URI."""
    modules = {"tensorboard": "lightning.pytorch.loggers.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
    for name in config.tracking.trackers:
        try:
            importlib.import_module(modules[name])
        except ImportError as error:
            raise ConfigError(
                f"tracking.trackers: {name} needs its package ({error}); install sdtrain's trackers extra "
                "(pip install 'sdtrain[trackers]') or leave it out of tracking.trackers"
            ) from None
    if "mlflow" in config.tracking.trackers and not (
        config.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    ):
        raise ConfigError(
            "tracking.trackers: mlflow needs a tracking server: set tracking.mlflow_tracking_uri (or "
            "MLFLOW_TRACKING_URI)"
        )


def log_export(config: Config, run_dir: str, export_uri: str) -> None:
    """Attach the final export to the run's MLflow and W&B runs (MLflow: registered as a version of the
    model tracking.mlflow_register_as when set); from the driver, after the export is written.

    Args:
        config: the run's config.
        run_dir: the run's directory.
        export_uri: the export directory (local or s3://).
    """
    ids = read_state(run_dir)["ids"]
    if "mlflow" in config.tracking.trackers and "mlflow" in ids:
        attach_export_to_mlflow(config, mlflow_client(config), ids["mlflow"], export_uri)
    if "wandb" in config.tracking.trackers and "wandb" in ids:
        import wandb

        run = wandb.init(
            project=config.tracking.wandb_project,
            id=ids["wandb"],
            resume="allow",
            dir=wandb_save_dir(run_dir),
        )
        artifact = wandb.Artifact(f"{config.run.name}-export", type="model")
        artifact.add_dir(_local(export_uri))
        run.log_artifact(artifact)
        run.finish()


def mlflow_client(config: Config):
    """An MlflowClient of tracking.mlflow_tracking_uri, else MLFLOW_TRACKING_URI."""
    import mlflow

    return mlflow.MlflowClient(config.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))


def attach_export_to_mlflow(config: Config, client, run_id: str, export_uri: str) -> str | None:
    """Log the export directory ``export_uri`` as the MLflow run ``run_id``'s export/ artifacts and, with
    tracking.mlflow_register_as, register them as a new version of that model; returns the version (None: not
    registered)."""
    client.log_artifacts(run_id, _local(export_uri), artifact_path="export")
    name = config.tracking.mlflow_register_as
    if not name:
        return None
    # A version of the run's export/ (diffusers files, not an MLflow "logged model" flavour).
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    source = f"{client.get_run(run_id).info.artifact_uri}/export"
    version = client.create_model_version(name, source, run_id=run_id).version
    log.info(f"registered the export as MLflow model {name} version {version}")
    return version


def _local(export_uri: str) -> str:
    return local_copy(export_uri) if is_uri(export_uri) else export_uri


def log_evaluations(config: Config, run_dir: str, results: list[tuple[int, dict[str, float]]]) -> None:
    """Evaluations that finished after the workers stopped (the final checkpoint's), from the driver: to the run's
    MLflow run at their steps. TensorBoard and W&B get the evaluations that finish while training runs.

    Args:
        results: (step, metrics) each.
    """
    ids = read_state(run_dir)["ids"]
    if not results or "mlflow" not in config.tracking.trackers or "mlflow" not in ids:
        return
    client = mlflow_client(config)
    for step, metrics in results:
        for key, value in metrics.items():
            client.log_metric(ids["mlflow"], key, value, step=step)
