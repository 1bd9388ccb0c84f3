"""Experiment trackers chosen by tracking.trackers (TensorBoard, MLflow, W&B), through Lightning's own
loggers, driven by rank 0 at each report rather than by ``self.log`` (which knows nothing of restarts), in a thread
of their own (:mod:`sdtrain.train.tracker_thread`).

One tracker run per training run, however often it restarts: the ids live in ``trackers.json`` in
the run directory. Each tracker holds each step once across restarts. A worker group starting from
the checkpoint of step S asks each tracker what it already holds, logs what it lacks up to S from the
checkpoint's history (a killed worker's W&B service may have died before writing its last steps), and
then logs each step the tracker does not hold yet:
- TensorBoard holds every step up to S (flushed before the checkpoint was taken); its new event file
  purges the steps after S, which are logged again as they are re-done (the values metrics.csv shows).
- MLflow holds what its server has; a re-done step it already holds keeps the first value.
- W&B holds what its run files hold (offline) or its server's summary says (online); likewise.

What the driver does with them (the checks before Ray, the settings it hands the workers, the export it attaches
at the end) is in :mod:`sdtrain.driver.trackers`.
"""

from __future__ import annotations

import bisect
import functools
import io
import json
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from sdtrain.artifacts.run_outputs import write_whole
from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import SAMPLES_DIR, TENSORBOARD_DIR, TRACKERS_FILE, sample_grid_file
from sdtrain.storage.uris import is_uri
from sdtrain.train.live_files import LIVE_FILES_SHARE, BackgroundWriter, Outage
from sdtrain.train.tracker_loggers import build_logger, run_id_of
from sdtrain.train.wandb_files import STEP_KEY, run_files

HELD_KEY = "loss"  # in every report: the steps a tracker holds are those it has this metric at
BATCH_METRICS = 1000  # MLflow takes at most this many metrics in one log_batch request

# Settings the driver's environment gives the trackers, handed to the workers (a cluster started
# separately does not share it). Credentials are not among them: they belong in the cluster's environment.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_ENTITY", "WANDB_BASE_URL")


def apply_tracker_env(env: Mapping[str, str]) -> None:
    """Args: env: what :func:`sdtrain.driver.trackers.tracker_env` returned on the driver (FORWARDED_ENV)."""
    os.environ.update(env)
    # W&B keeps the address of its service process in the environment, which Ray's workers inherit from
    # the process that started the cluster: a worker sharing that service leaves its run open there when
    # it is killed, and the restarted worker could not continue the run ("run ID is in use").
    os.environ.pop("WANDB_SERVICE", None)


def read_state(run_dir: str) -> dict[str, Any]:
    """The run's tracker state: ``ids`` (tracker -> run id) and ``logged_through`` (the last step logged)."""
    fs, path = filesystem_for(posixpath.join(run_dir, TRACKERS_FILE))
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return {"ids": {}, "logged_through": -1}


def write_state(run_dir: str, state: dict[str, Any]) -> None:
    """Replace the run's tracker state (:func:`read_state`) with ``state``, whole."""
    fs, path = filesystem_for(posixpath.join(run_dir, TRACKERS_FILE))
    write_whole(fs, path, json.dumps(state).encode())


# Seconds from a tracker's failure to the next try of it, in the background (its client's retries come on top:
# MLflow's give up on a server that is down after about 4 minutes).
RETRY_S = 30.0

NAMES = {"tensorboard": "TensorBoard", "mlflow": "MLflow", "wandb": "W&B"}

WANDB_EVALUATED = "wandb_evaluated"
"""trackers.json's list of the evaluation steps W&B holds, kept by every worker group and the driver's end of a run
(sdtrain.driver.trackers.log_final, which sends W&B those it lacks). Absent (a run from before it), "evaluated" stands
for it."""


class TrackerOutage(Outage):
    """A tracker's outage, and what tries got of it: its logger, its hyperparameters logged, the last step it holds."""

    def __init__(self, name: str, retry_s: float, logger: Any = None):
        super().__init__(NAMES[name], retry_s)
        self.logger, self.params_logged = logger, logger is not None
        self.held: int | None = None  # then it is sent the rows after it, from the run's history
        # Evaluations it missed: those of steps it holds are sent when it answers (a later step's row holds its own).
        self.evaluations: list[tuple[int, dict[str, float]]] = []

    def untold(self, status: str) -> None:
        log.warning(f"{self.view} was not told that the worker group ended ({status}): it does not answer")


class Trackers:
    """Rank 0's tracker runs for one worker group: hyperparameters once per tracker run, metrics and
    images at their steps, each step once across restarts. A tracker that raises is a view that failed, as a live file
    is: warned about once, left out until it answers again, then sent what it missed in order (TrackerOutage)."""

    outage = TrackerOutage  # the driver's catch-up at the end of a run says what an outage means there
    kept: tuple[str, ...] = ("evaluated", WANDB_EVALUATED)  # kept in trackers.json across worker groups

    def __init__(self, config: Config, run_dir: str, history: list[dict[str, float]], retry_s: float = RETRY_S):
        """Args:
        config: the run's config (logged in full as hyperparameters).
        run_dir: the run's directory (run.storage_path/run.name), local or s3://.
        history: the rows of the checkpoint this worker group starts from ([] for a fresh run).
        retry_s: seconds from a tracker's failure to the next try of it.
        """
        self.config, self.run_dir, self.retry_s = config, run_dir, retry_s
        self.state = read_state(run_dir)
        if "wandb" in config.tracking.trackers:
            self.state.setdefault(WANDB_EVALUATED, list(self.state.get("evaluated", [])))
        self.logged_through: int = self.state["logged_through"]
        self.ids: dict[str, str] = dict(self.state["ids"])
        self._known = set(self.ids)  # the tracker runs earlier worker groups started
        self.resumed_step = int(history[-1]["step"]) if history else 0
        self._state_writer = BackgroundWriter("sdtrain-tracker-state")
        # TensorBoard writes through fsspec, which needs s3fs for s3://: on object storage it writes
        # on this node's disk, and the event files are copied to run_dir/tensorboard after each flush.
        mirrored = is_uri(run_dir) and "tensorboard" in config.tracking.trackers
        self._tensorboard_local = tempfile.mkdtemp(prefix="sdtrain-tensorboard-") if mirrored else None
        # Each copy uploads the whole event files, which grow with the run: at most LIVE_FILES_SHARE of the time.
        self._mirror_writer = BackgroundWriter("sdtrain-tensorboard-mirror", share=LIVE_FILES_SHARE)
        self.loggers: dict[str, Any] = {}  # the trackers that answer (Any: each logger class has its own extras)
        self.held: dict[str, int] = {}  # tracker -> the last step it holds: it is sent only later ones
        self.down: dict[str, TrackerOutage] = {}  # the trackers that raised and have not caught up since
        self._imaged: dict[str, int] = {}  # tracker -> the step of the last image log_image sent it
        self._mlflow_ms = 0  # the timestamp of the last row sent to MLflow
        for name in config.tracking.trackers:
            opening = self.outage(name, retry_s)
            try:
                self._open(name, opening)
            except Exception as error:  # e.g. MLflow's server down: the history lookup is tried again later
                self._failed(name, error, opening)
                continue
            self._adopt(name, opening)
        for tracker in list(self.loggers):  # the checkpoint's rows it lacks, with their grids (samples/step_<N>.png)
            held = self.held[tracker]
            if self._send(tracker, _rows_after(history, held)):
                log.info(f"{NAMES[tracker]} held the run up to step {held}: logged the checkpoint's later rows again")
        self._save_state()

    def log_metrics(self, metrics: Mapping[str, float], step: int, history: Sequence[Mapping[str, float]] = ()) -> bool:
        """Log ``metrics`` at ``step`` to every tracker that answers and does not hold that step yet, after the rows of
        ``history`` (the run's rows so far, in step order) it missed while it did not; returns whether any took it."""
        self._answering()
        row = {**metrics, "step": step}
        took = [name for name in list(self.loggers) if self._send(name, [*_rows_after(history, self.held[name]), row])]
        if took:
            self._save_state()
        return bool(took)

    def log_evaluation(self, metrics: Mapping[str, float], step: int) -> None:
        """An evaluation's ``metrics`` at its checkpoint's ``step``, which the trackers already hold (it finished
        later): TensorBoard and MLflow at that step; W&B, whose steps only grow, in its next row with
        ``evaluated_step``. Each step's once across restarts (trackers.json)."""
        evaluated = set(self.state.setdefault("evaluated", []))
        if step in evaluated:
            return
        values = {key: float(value) for key, value in metrics.items()}
        for name in list(self.loggers):
            self._call(name, self._evaluate, name, values, step)
        for name in self.down.keys() - self.loggers.keys():  # sent when it answers again
            self.down[name].evaluations.append((step, values))
        self.state["evaluated"] = sorted(evaluated | {step})
        self._save_state()

    def log_image(self, key: str, image: np.ndarray, step: int) -> None:
        """Send an H x W x 3 uint8 image to every tracker at ``step`` (call before :meth:`log_metrics` of
        that step: a step a tracker holds is skipped)."""
        for name in list(self.loggers):
            if step > self.held[name]:
                self._call(name, self._image, name, key, image, step)

    def before_checkpoint(self, timeout: float = 300) -> None:
        """Wait until TensorBoard's event files are in the run directory: a restart from the checkpoint
        about to be taken takes every step up to it as held there.

        Args:
            timeout: seconds to wait at most.
        """
        if self._tensorboard_local is not None and not self._mirror_writer.flush(timeout):
            log.warning("TensorBoard's event files were not copied to the run directory within %d s", timeout)

    def finish(self, status: str = "success") -> None:
        """Flush and close every tracker run (it continues when the run resumes).

        Args:
            status: success or failed.
        """
        for name in self.down.keys() - self.loggers.keys():
            self.down[name].untold(status)
        for name in list(self.loggers):
            self._call(name, self._finalize, name, status)
        self._mirror_tensorboard()
        self._mirror_writer.close(timeout=60)
        self._state_writer.close(timeout=60)

    def _finalize(self, name: str, status: str) -> None:
        logger = self.loggers[name]
        logger.finalize(status)
        if name == "wandb":  # Lightning's finalize leaves the W&B run open: its files would not be complete
            logger.experiment.finish(exit_code=0 if status == "success" else 1)
            # finish returns once W&B's service has the run's last records, and only tells it to close the run's
            # transaction log: shut the service down, which closes it, so the file is whole on disk when this
            # returns, for the next worker group to read (sdtrain.train.wandb_files). A CI run read the header only.
            import wandb

            wandb.teardown()

    def _open(self, name: str, outage: TrackerOutage) -> None:
        """Bring a tracker as far as it goes (at the start, or in a try's thread): its logger built, its
        hyperparameters logged, and ``outage.held`` the last step it holds."""
        known = name in self._known
        if outage.logger is None:
            tensorboard = name == "tensorboard"
            where = self._tensorboard_local if tensorboard and self._tensorboard_local else self.run_dir
            # From step 1 too: a group that started fresh and was killed before its first checkpoint logged steps
            # the next one re-does.
            purge_step = self.resumed_step + 1 if tensorboard and known else None
            outage.logger = build_logger(name, self.config, where, self.ids.get(name), purge_step)
        if not outage.params_logged:
            # MLflow refuses a param changed on resume (W&B keeps the first); TensorBoard's hparams.yaml
            # is rewritten from what this worker group logged, so it gets them at every start.
            if not known or name == "tensorboard":
                outage.logger.log_hyperparams(self.config.to_dict())
            outage.params_logged = True
        # Failed after holding that (MLflow's server may have taken a request whose answer was lost):
        if name in self.held:
            outage.held = max(self.held[name], self._held_step(name, outage.logger) if name == "mlflow" else -1)
        else:
            outage.held = self._held_step(name, outage.logger) if known else -1

    def _adopt(self, name: str, outage: TrackerOutage) -> None:
        assert outage.held is not None
        self.loggers[name], self.held[name] = outage.logger, outage.held
        self.ids[name] = run_id_of(name, outage.logger)

    def _answering(self) -> None:
        """Take back the trackers a try found answering; the evaluations they missed at steps they hold go first."""
        for name, outage in self.down.items():
            if name in self.loggers or not outage.answered(functools.partial(self._open, name, outage)):
                continue
            self._adopt(name, outage)
            while outage.evaluations and name in self.loggers:
                step, values = outage.evaluations[0]
                if step > self.held[name] or self._call(name, self._evaluate, name, values, step):
                    outage.evaluations.pop(0)

    def _failed(self, name: str, error: Exception, opening: TrackerOutage | None = None) -> None:
        """``name`` raised ``error``: left out until a try finds it answering; warned about once an outage."""
        logger = self.loggers.pop(name, None)
        if name in self.down:
            self.down[name].again()
            return
        self.down[name] = opening or self.outage(name, self.retry_s, logger)
        self.down[name].warn(error)

    def _call(self, name: str, action: Callable[..., None], *args: Any) -> bool:
        """``action(*args)``, a call to tracker ``name``; False when it raised (a view: training goes on)."""
        try:
            action(*args)
        except Exception as error:
            self._failed(name, error)
            return False
        return True

    def _send(self, name: str, rows: Sequence[Mapping[str, float]]) -> bool:
        """Log the ``rows`` (in step order) after the step the tracker holds, each with its saved sample grid unless
        log_image sent that; returns whether it took any (False when it raised: it holds the rows before)."""
        before, pending = self.held[name], list[Mapping[str, float]]()
        # MLflow takes many rows in one request; the others each row on its own, held as it goes.
        limit = BATCH_METRICS if name == "mlflow" else 0
        for row in rows:
            step = int(row["step"])
            if step <= (int(pending[-1]["step"]) if pending else self.held[name]):  # a step once, the first row's
                continue
            wants_grid = "sample_grid_s" in row and step > self._imaged.get(name, -1)
            grid = _saved_grid(self.run_dir, step) if wants_grid else None
            # A grid goes before its row's metrics (W&B's row takes it), so the rows before it go first.
            if grid is not None and not self._flush(name, pending):
                return False
            if grid is not None and not self._call(name, self._image, name, "samples", grid, step):
                return False
            if sum(len(r) for r in pending) + len(row) > limit and not self._flush(name, pending):
                return False
            pending.append(row)
        if not self._flush(name, pending):
            return False
        outage = self.down.pop(name, None)
        if outage is not None:
            outage.over(f"every step up to {self.held[name]}")
        return self.held[name] > before

    def _flush(self, name: str, rows: list[Mapping[str, float]]) -> bool:
        """Log ``rows`` (MLflow: one request) and empty the list; False when the tracker raised."""
        if rows and not self._call(name, self._metrics, name, rows):
            return False
        if rows:
            step = int(rows[-1]["step"])
            self.held[name], self.logged_through = step, max(self.logged_through, step)
        rows.clear()
        return True

    def _metrics(self, name: str, rows: Sequence[Mapping[str, float]]) -> None:
        logger = self.loggers[name]
        if name == "mlflow":  # a catch-up's rows in one request, not one each
            logger.experiment.log_batch(logger.run_id, metrics=self._mlflow_metrics(rows))
            return
        for row in rows:
            logger.log_metrics({key: float(value) for key, value in row.items() if key != "step"}, int(row["step"]))
        if name == "tensorboard":  # its writer flushes every 2 minutes: a killed worker would lose them
            logger.experiment.flush()
            self._mirror_tensorboard()

    def _mlflow_metrics(self, rows: Sequence[Mapping[str, float]]) -> list[Any]:
        from mlflow.entities import Metric

        metrics = []
        for row in rows:  # timestamps rise row by row: a metric's history in time order is in step order
            self._mlflow_ms = max(int(time.time() * 1000), self._mlflow_ms + 1)
            step = int(row["step"])
            metrics += [Metric(k, float(v), self._mlflow_ms, step) for k, v in row.items() if k != "step"]
        return metrics

    def _evaluate(self, name: str, values: dict[str, float], step: int) -> None:
        if name == "wandb":
            self.loggers[name].experiment.log({**values, "evaluated_step": step}, commit=False)
            self.state[WANDB_EVALUATED] = sorted({*self.state[WANDB_EVALUATED], step})
        else:
            self._metrics(name, [{**values, "step": step}])

    def _image(self, name: str, key: str, image: np.ndarray, step: int) -> None:
        logger = self.loggers[name]
        if name == "tensorboard":
            logger.experiment.add_image(key, image, step, dataformats="HWC")
        elif name == "mlflow":
            logger.experiment.log_image(logger.run_id, image, key=key, step=step)
        elif name == "wandb":  # in the row of the step's metrics: a row is written whole or not at all
            import wandb

            logger.experiment.log({key: wandb.Image(image)}, commit=False)
        self._imaged[name] = step

    def _held_step(self, name: str, logger: Any) -> int:
        """The last step a tracker run continued from an earlier worker group holds."""
        if name == "tensorboard":
            return self.resumed_step  # what came after is purged by the new event file
        if name == "mlflow":
            points = logger.experiment.get_metric_history(logger.run_id, HELD_KEY)
            return max((point.step for point in points), default=-1)
        run = logger.experiment
        if not run.offline:  # the server's summary of the resumed run: its last step logged
            return int(run.summary.get(STEP_KEY, -1))
        if is_uri(self.run_dir):  # offline files on another attempt's scratch disk, out of reach
            return self.logged_through
        steps = [step for file in run_files(self.run_dir, run.id) for step in file.steps(HELD_KEY)]
        return max(steps, default=-1)

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
        state = {"ids": dict(self.ids), "logged_through": self.logged_through}
        state |= {key: self.state[key] for key in self.kept if key in self.state}  # evaluated: a run with eval's
        self._state_writer.submit(lambda: write_state(self.run_dir, state))


def _rows_after(history: Sequence[Mapping[str, float]], held: int) -> list[Mapping[str, float]]:
    """The rows of ``history`` (in step order) after step ``held``."""
    return list(history[bisect.bisect_right(history, held, key=lambda row: int(row["step"])) :])


def _saved_grid(run_dir: str, step: int) -> np.ndarray | None:
    from PIL import Image

    fs, path = filesystem_for(posixpath.join(run_dir, SAMPLES_DIR, sample_grid_file(step)))
    try:
        with fs.open_input_stream(path) as f:
            return np.asarray(Image.open(io.BytesIO(f.read())).convert("RGB"))
    except FileNotFoundError:
        return None
