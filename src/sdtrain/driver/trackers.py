"""The driver's side of the experiment trackers (rank 0's side: :mod:`sdtrain.train.trackers`): the checks before
any worker starts, the tracker settings of the driver's environment handed to the workers, and the final export
attached to the run's tracker runs after it is written.

A tracker is a view of the run, never a condition of it: the checks before Ray refuse what no waiting mends (a missing
package, no MLflow URI, one MLflow cannot use) without asking the server anything, so a server that is down when the
run starts delays nothing (rank 0 logs to it once it answers); after training, a tracker that fails is warned about
and the run still succeeds."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.evaluation.results import final_results, merge_results
from sdtrain.logs import log
from sdtrain.storage.filesystems import local_copy
from sdtrain.storage.uris import is_uri
from sdtrain.train.tracker_loggers import wandb_save_dir
from sdtrain.train.trackers import (
    FORWARDED_ENV,
    NAMES,
    WANDB_EVALUATED,
    TrackerOutage,
    Trackers,
    read_state,
    write_state,
)
from sdtrain.train.wandb_files import STEP_KEY

WORKER_MLFLOW_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
"""MLflow's client retries on the workers unless this process's environment sets them. Rank 0's call that meets an
outage waits them out, and every other rank waits for rank 0 at its next collective: MLflow's own (7 retries 2 s to
128 s apart, 120 s a request) hold the whole job about 4 minutes, 20 if the server hangs; these, seconds (a server
that hangs: under a minute). The outage's later tries run in the background (sdtrain.train.trackers)."""


def tracker_env() -> dict[str, str]:
    """The tracker settings of this process's environment, for :func:`sdtrain.train.trackers.apply_tracker_env` on a
    worker, with :data:`WORKER_MLFLOW_RETRIES` where it sets none."""
    forwarded = (*FORWARDED_ENV, *WORKER_MLFLOW_RETRIES)
    env = {**WORKER_MLFLOW_RETRIES, **{key: os.environ[key] for key in forwarded if key in os.environ}}
    if env.get("MLFLOW_TRACKING_URI"):
        env["MLFLOW_TRACKING_URI"] = absolute_mlflow_uri(env["MLFLOW_TRACKING_URI"])
    return env


def absolute_mlflow_uri(uri: str) -> str:
    """``uri`` (tracking.mlflow_tracking_uri or MLFLOW_TRACKING_URI) with a relative local store made absolute against
    this process's working directory: a SQLite database (sqlite:///mlflow.db), a file: URI (file:mlruns) or a plain
    path (mlruns), which Ray Train's workers, in a directory of their own, would otherwise create there. Servers,
    other databases, absolute paths and Databricks are kept as they are."""
    parts = urlsplit(uri)
    if uri in ("databricks", "databricks-uc"):
        return uri
    if parts.scheme.split("+")[0] == "sqlite":
        prefix = f"{parts.scheme}:///"
        path = uri[len(prefix) :] if uri.startswith(prefix) else ""
        relative = path and not path.startswith("/") and not path.startswith(":memory:")
        return prefix + os.path.abspath(path) if relative else uri
    if parts.scheme == "file" and not parts.netloc and not parts.path.startswith("/"):
        return Path(os.path.abspath(os.path.expanduser(parts.path))).as_uri()
    if not parts.scheme and uri:
        return os.path.abspath(os.path.expanduser(uri))
    return uri


def check_trackers(config: Config) -> None:
    """Refuse tracking.trackers this process cannot serve, before any worker starts: a tracker's package
    missing (the ``trackers`` extra), or MLflow without a tracking URI or with one it cannot use."""
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
    if "mlflow" in config.tracking.trackers:
        _check_mlflow_uri(config.tracking.mlflow_tracking_uri or os.environ["MLFLOW_TRACKING_URI"])


def _check_mlflow_uri(uri: str) -> None:
    """Refuse a tracking URI MLflow cannot use (no request: a server that is down is no bad input)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+")[0]
    if scheme in ("http", "https"):
        problem = None if parts.hostname else "it names no host"
    elif scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        return  # a database: MLflow's client would connect to it here, and one that is down is no bad input either
    else:
        import mlflow

        try:
            mlflow.MlflowClient(uri)  # checks the scheme (and builds a local store), without a request
            problem = None
        except Exception as error:
            problem = str(error)
    if problem is not None:
        raise ConfigError(
            f"tracking.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) {uri!r}: MLflow cannot track to it: {problem}; "
            "give the tracking server's address (e.g. http://mlflow:5000)"
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
        try:
            attach_export_to_mlflow(config, mlflow_client(config), ids["mlflow"], export_uri)
        except Exception as error:  # the run and its export are done: a tracker's failure must not undo that
            log.warning(f"MLflow did not take the export (the run is done, its export in the run directory): {error}")
    if "wandb" in config.tracking.trackers and "wandb" in ids:
        try:
            _attach_export_to_wandb(config, run_dir, ids["wandb"], export_uri)
        except Exception as error:
            log.warning(f"W&B did not take the export (the run is done, its export in the run directory): {error}")


def _attach_export_to_wandb(config: Config, run_dir: str, run_id: str, export_uri: str) -> None:
    import wandb

    run = _resume_wandb(config, run_dir, run_id)
    artifact = wandb.Artifact(f"{config.run.name}-export", type="model")
    artifact.add_dir(_local(export_uri))
    run.log_artifact(artifact)
    run.finish()


def _resume_wandb(config: Config, run_dir: str, run_id: str):
    """The workers' W&B run ``run_id``, continued from this process (in a directory of its own when run_dir is on
    object storage: the workers' files may be on other nodes)."""
    import wandb

    return wandb.init(project=config.tracking.wandb_project, id=run_id, resume="allow", dir=wandb_save_dir(run_dir))


def _give_wandb_evaluations(config: Config, run_dir: str, evaluated: list[tuple[int, dict[str, float]]]) -> None:
    """Send W&B the late ``evaluated`` (step, metrics) it does not hold (:data:`WANDB_EVALUATED`), one row each in the
    workers' W&B run, appended after its last (W&B's steps only grow) with the workers' ``evaluated_step`` and the
    trainer step of Lightning's rows, ``trainer/global_step``, both the checkpoint's; no training row is sent again.
    Recorded apart from the other trackers' "evaluated": W&B failing here is warned about and tried again at a
    re-run of the finished run, or at the end of the run resumed for more steps, however they fared."""
    state = read_state(run_dir)
    if "wandb" not in config.tracking.trackers or "wandb" not in state["ids"]:
        return
    held = set(state.get(WANDB_EVALUATED, state.get("evaluated", [])))
    due = [(step, values) for step, values in evaluated if step not in held]
    if not due:
        return
    try:
        import wandb

        run = _resume_wandb(config, run_dir, state["ids"]["wandb"])
        try:
            for step, values in due:
                run.log({**values, "evaluated_step": step, STEP_KEY: step})
        finally:
            run.finish()
            wandb.teardown()  # closes the run's files, whole for whoever reads them next (as the workers' finish)
        held |= {step for step, _ in due}
    except Exception as error:  # training succeeded: a tracker's failure must not fail the run
        log.warning(
            f"W&B did not take the final evaluation (the run succeeded; it is in metrics.csv): {error}. Re-running "
            "the same command sends it once W&B answers"
        )
    # Before the other trackers' catch-up, which writes trackers.json back with it (Trackers.kept).
    write_state(run_dir, {**state, WANDB_EVALUATED: sorted(held)})


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


class _EndOutage(TrackerOutage):
    """MLflow not answering the driver's catch-up at the end of a run: nothing in this process tries again, and a
    re-run of the command does (a finished run goes straight to :func:`sdtrain.driver.run.finish`, which calls
    :func:`log_final` again)."""

    def warn(self, error: Exception) -> None:
        log.warning(
            f"{self.view} did not take the run's last steps or its final evaluation (the run succeeded; they are in "
            f"metrics.csv): {error}. Re-running the same command catches {self.view} up once it answers"
        )

    def untold(self, status: str) -> None:
        pass  # warn said what it lacks


class _EndTrackers(Trackers):
    outage = _EndOutage


def log_final(config: Config, run_dir: str, history: list[dict[str, float]]) -> None:
    """The end of a run, from the driver (at each re-run of a finished run too): merge into ``history`` the evaluations
    that finished after their rows were saved (the final checkpoint's: Ray Train waits for it), catch MLflow up
    through :class:`sdtrain.train.trackers.Trackers` with the rows after the last step it holds (the workers' last
    ones when it was down at their end), and send MLflow, TensorBoard and W&B those evaluations at their steps, each
    once (trackers.json; W&B's apart, :func:`_give_wandb_evaluations`). A tracker failing is warned about.

    TensorBoard holds every step up to the final checkpoint (flushed and mirrored before it was taken): it gets only
    the evaluations, in an event file of the driver's, written when there is one it lacks. W&B's rows are left to the
    workers: its client queues what it was given and sends it itself, and online the step it holds is its server's
    summary, which can lag that queue: rows sent again from here would be dropped by W&B (its steps only grow), or
    held twice. It gets only the evaluations, each in a row of its own after the workers' last one.

    Args:
        config: the run's config.
        run_dir: the run's directory.
        history: the final checkpoint's rows, in step order.
    """
    evaluated = merge_results(history, final_results(run_dir, history)) if config.eval.enabled else []
    _give_wandb_evaluations(config, run_dir, evaluated)
    sent = set(read_state(run_dir).get("evaluated", []))
    # TensorBoard only for an evaluation it lacks: each open of it writes an event file.
    lacking = {*dict(evaluated)} - sent
    names = [n for n in config.tracking.trackers if n == "mlflow" or (n == "tensorboard" and lacking)]
    if not names or not history:
        return
    late = dict(evaluated)
    # The late evaluations go through log_evaluation, which sends each once across re-runs: not in their rows as well.
    rows = [{k: v for k, v in row.items() if k not in late.get(int(row["step"]), {})} for row in history]
    tracking = dataclasses.replace(config.tracking, trackers=list(names))
    try:
        # From the rows: TensorBoard holds them all, MLflow is sent those after the step it holds.
        trackers = _EndTrackers(dataclasses.replace(config, tracking=tracking), run_dir, rows)
        try:
            for step, values in evaluated:
                if "mlflow" in names and "mlflow" not in trackers.loggers:
                    break  # down (_EndOutage warned): a re-run sends it, and TensorBoard with it (each once)
                trackers.log_evaluation(values, step)
        finally:
            trackers.finish("success")
    except Exception as error:  # training succeeded: a tracker's failure must not fail the run
        log.warning(
            f"{' and '.join(NAMES[n] for n in names)} did not take the run's last steps or its final evaluation (the "
            f"run's rows are in metrics.csv): {error}; re-running the same command catches them up"
        )
