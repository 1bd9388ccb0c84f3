"""A run seen while it trains: live files in the run directory, experiment trackers (TensorBoard, MLflow, W&B)
read back through their own formats, and Ray gauges."""

from __future__ import annotations

import csv
import io
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import committed_checkpoints, tiny_config, unset_env
from support.mlflow_server import mlflow_server
from support.ray_processes import our_training_workers
from support.tensorboard_files import tensorboard_scalars

from sdtrain.artifacts.run_outputs import LossLabels
from sdtrain.config.loader import load_config
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import LOSS_CURVE_FILE, METRICS_FILE, SAMPLES_DIR, TENSORBOARD_DIR, TRACKERS_FILE
from sdtrain.train.live_files import BackgroundWriter, LiveOutputs
from sdtrain.train.trackers import Trackers, read_state
from sdtrain.train.wandb_files import read_run_file, run_files

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(steps):
    return [{"step": s, "loss": 1.0 / s, "lr": 1e-4, **({"val_loss": 0.5} if s % 4 == 0 else {})} for s in steps]


def test_live_files_follow_the_history_and_are_replaced_whole(tmp_path):
    live = LiveOutputs(str(tmp_path / "run"), LossLabels("v_prediction", 5.0))
    live.update(_rows([2, 4, 6]))
    assert live.writer.flush(timeout=60)
    with open(tmp_path / "run" / METRICS_FILE) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2, 4, 6]
    assert (tmp_path / "run" / LOSS_CURVE_FILE).read_bytes()[:8] == PNG
    # A restart from the checkpoint of step 4: the rows after it go, the re-done steps follow.
    live.update(_rows([2, 4]))
    live.update(_rows([2, 4, 6, 8]))
    assert live.writer.flush(timeout=60)
    with open(tmp_path / "run" / METRICS_FILE) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2, 4, 6, 8]
    # Written through a temporary file moved over the old one: no temporary file is left behind.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOSS_CURVE_FILE, METRICS_FILE]


def test_live_files_are_created_with_the_umasks_permissions(tmp_path):
    """metrics.csv, loss_curve.png and trackers.json are written through a temporary file (0600): each ends with
    the permissions a file open() created would have, for the run's readers."""
    import stat

    from sdtrain.train.trackers import write_state

    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        previous = os.umask(umask)
        try:
            live = LiveOutputs(str(tmp_path / oct(umask)), LossLabels())
            live.update(_rows([2, 4]))
            assert live.writer.flush(timeout=60)
            write_state(str(tmp_path / oct(umask)), {"ids": {}, "logged_through": 4})
        finally:
            os.umask(previous)
        files = (METRICS_FILE, LOSS_CURVE_FILE, TRACKERS_FILE)
        assert {f: oct(stat.S_IMODE(os.stat(tmp_path / oct(umask) / f).st_mode)) for f in files} == dict.fromkeys(
            files, oct(mode)
        )


def test_loss_labels_say_what_is_plotted():
    assert LossLabels("epsilon", None).train == "train loss (unweighted, random noise and timesteps)"
    assert LossLabels("v_prediction", 5.0).train == "train loss (min-SNR-5 weighted, random noise and timesteps)"


@pytest.mark.slow
def test_live_files_on_object_storage(s3_bucket):
    live = LiveOutputs(f"{s3_bucket}/runs/r", LossLabels())
    live.update(_rows([1, 2]))
    assert live.writer.flush(timeout=60)
    fs, path = live.filesystem, live.path
    with fs.open_input_stream(f"{path}/{METRICS_FILE}") as f:
        assert [int(r["step"]) for r in csv.DictReader(io.StringIO(f.read().decode()))] == [1, 2]
    assert fs.get_file_info(f"{path}/{LOSS_CURVE_FILE}").type == pafs.FileType.File


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensorboard_on_object_storage(s3_bucket, tmp_path):
    """The default tracker with run.storage_path on s3://: TensorBoard cannot write there itself (it would
    need s3fs), so its event files are written locally and copied into the run directory as they grow."""
    import numpy as np

    run_dir = f"{s3_bucket}/runs/tb"
    config = load_config(None, ["data.train=x", "run.name=tb", f"run.storage_path={s3_bucket}/runs"])
    assert config.tracking.trackers == ["tensorboard"]
    first = Trackers(config, run_dir, [])
    first.log_image("samples", np.zeros((8, 8, 3), np.uint8), 2)
    first.log_metrics({"step": 2, "loss": 0.5}, 2)
    first.before_checkpoint()
    first.log_metrics({"step": 4, "loss": 0.25}, 4)
    first.finish("failed")
    # A restarted worker group from the checkpoint of step 2: its own event file, beside the first,
    # purges the first one's step 4, which it re-does.
    second = Trackers(config, run_dir, [{"step": 2, "loss": 0.5}])
    second.log_metrics({"step": 4, "loss": 0.3}, 4)
    second.finish("success")
    fs, remote = filesystem_for(f"{run_dir}/{TENSORBOARD_DIR}")
    (tmp_path / "tb").mkdir()
    pafs.copy_files(remote, str(tmp_path / "tb"), source_filesystem=fs)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    scalars, images = tensorboard_scalars(tmp_path / "tb")
    assert [(s, round(v, 4)) for s, v in scalars["loss"]] == [(2, 0.5), (4, 0.3)] and images == {"samples": [2]}
    assert read_state(run_dir)["logged_through"] == 4


def test_background_writer_runs_the_newest_job_and_survives_a_failing_one(caplog):
    writer = BackgroundWriter("test-writer")
    release, done = threading.Event(), []
    writer.submit(release.wait)  # holds the thread while the next jobs queue up
    writer.submit(lambda: done.append("replaced"))
    writer.submit(lambda: 1 / 0)
    writer.submit(lambda: done.append("newest"))
    release.set()
    assert writer.flush(timeout=30)
    assert done == ["newest"]
    writer.submit(lambda: 1 / 0)
    writer.close(timeout=30)
    assert "could not update the run directory's live files: division by zero" in caplog.text


def test_background_writer_rests_after_each_job_for_its_share_of_the_time_but_not_before_a_flush():
    """The live files of a long run take ~1 s to rewrite (metrics.csv and its curve, whole, in Python): a job of d
    seconds is followed by d x (1/share - 1) of rest, so they take at most their share of the training process."""
    writer = BackgroundWriter("test-writer", share=0.01)  # 99x the job's time at rest
    first, second, third = threading.Event(), threading.Event(), threading.Event()
    began = time.monotonic()
    writer.submit(lambda: (time.sleep(0.05), first.set()))  # a job of >= 50 ms: >= 5 s of rest after it
    assert first.wait(30)
    writer.submit(second.set)
    assert not second.wait(1.0)  # resting
    assert writer.flush(timeout=30) and second.is_set()  # a flush skips the rest: the file is up to date at once
    assert time.monotonic() - began < 4.5
    writer.submit(third.set)  # rests again after the flushed job, which took almost no time
    assert third.wait(30)
    writer.close(timeout=30)


def test_live_files_copy_each_row_once_and_show_an_evaluation_merged_into_a_row_later(tmp_path):
    from sdtrain.evaluation.results import merge_results

    live = LiveOutputs(str(tmp_path / "run"), LossLabels())
    history = _rows([2, 4, 6])
    history[1]["evaluation_asked"] = 1.0
    live.update(history)
    history.append(_rows([8])[0])
    history[0]["loss"] = 123.0  # changed in place after it was handed over: not the live files' row any more
    live.update(history)
    added = merge_results(history, {4: {"eval_s": 3.0, "fd_dinov2": 12.5}})  # as an evaluation's result arrives
    assert added == [(4, {"eval_s": 3.0, "fd_dinov2": 12.5})]
    live.merged(added)
    live.update(history)
    assert live.writer.flush(timeout=60)
    with open(tmp_path / "run" / METRICS_FILE) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    assert float(rows[0]["loss"]) == 0.5 and (rows[1]["fd_dinov2"], rows[1]["eval_s"]) == ("12.5", "3.0")
    assert rows[2]["fd_dinov2"] == ""


def test_mlflow_without_a_tracking_server_is_refused_before_ray_starts(monkeypatch):
    from sdtrain.driver.trackers import check_trackers
    from sdtrain.errors import ConfigError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(None, ["data.train=unused", "tracking.trackers=[tensorboard, mlflow]"])
    with pytest.raises(
        ConfigError, match=r"tracking.trackers: mlflow needs a tracking server: set tracking.mlflow_tracking_uri"
    ):
        check_trackers(config)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")  # nothing answers there: no bad input
    check_trackers(config)
    for wrong, problem in (("mlflow:5000", "unsupported URI"), ("http://", "it names no host")):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", wrong)
        with pytest.raises(ConfigError, match=rf"tracking.mlflow_tracking_uri .*'{wrong}': MLflow cannot .*{problem}"):
            check_trackers(config)


def test_a_workers_mlflow_client_gives_up_on_a_server_that_is_down_in_seconds_not_minutes(monkeypatch):
    """Rank 0's tracker call that meets an outage holds every rank until MLflow's client gives up (the later tries are
    the background's): the workers get fewer retries than MLflow's default unless the driver's environment sets them,
    and a call to a closed port then fails well inside what the default's backoff alone sleeps (2 + 4 + ... + 128 s)."""
    import mlflow
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    from sdtrain.driver.trackers import WORKER_MLFLOW_RETRIES, tracker_env
    from sdtrain.train.trackers import apply_tracker_env

    unset_env(monkeypatch, WORKER_MLFLOW_RETRIES)
    env = tracker_env()
    assert env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2" and env["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "15"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the cluster's own setting wins
    assert tracker_env()["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    apply_tracker_env(env)  # as a worker does
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2 and MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 15
    start = time.monotonic()
    with pytest.raises(mlflow.exceptions.MlflowException, match="Max retries exceeded"):
        mlflow.MlflowClient("http://127.0.0.1:9").get_experiment_by_name("nothing-answers")
    assert time.monotonic() - start < 60  # MLflow's default: over 254 s of backoff


def test_mlflow_down_at_the_end_of_a_run_is_warned_about_and_fails_nothing(tmp_path, monkeypatch, caplog):
    """The driver's last calls to MLflow (the catch-up with the last rows, the export) after training succeeded."""
    from sdtrain.driver.trackers import log_export, log_final

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after MLflow's minutes of retries
    config = tiny_config(
        "data.train=unused", "tracking.trackers=[mlflow]", "tracking.mlflow_tracking_uri=http://127.0.0.1:9"
    )
    (tmp_path / "export").mkdir()
    (tmp_path / TRACKERS_FILE).write_text('{"ids": {"mlflow": "0123"}, "logged_through": 4}')
    log_final(config, str(tmp_path), [{"step": 4, "loss": 0.5}])
    log_export(config, str(tmp_path), str(tmp_path / "export"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w.split(":")[0] for w in warned] == [
        "MLflow did not take the run's last steps or its final evaluation (the run succeeded; they are in metrics.csv)",
        "MLflow did not take the export (the run is done, its export in the run directory)",
    ], warned


def test_the_driver_catches_mlflow_up_with_the_runs_last_steps_each_once(tmp_path, monkeypatch, caplog):
    """MLflow was down when the workers ended: it holds the run up to step 4, the final checkpoint's history goes to 8.
    The driver's end of the run (also that of a re-run of the finished run) sends MLflow steps 6 and 8 and the final
    checkpoint's evaluation, and TensorBoard that evaluation alone, once each however often it runs; with MLflow down,
    it warns that re-running catches it up, and raises nothing."""
    import dataclasses

    import mlflow

    import sdtrain.driver.trackers
    from sdtrain.driver.trackers import log_final

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a server's backend store, in this process (its file store is retired)
    config = tiny_config(
        "data.train=unused",
        "data.val=unused",
        "eval.dinov2=unused",
        "tracking.trackers=[tensorboard, mlflow]",
        f"tracking.mlflow_tracking_uri={uri}",
        tmp_path=tmp_path,
        name="ended",
    )
    # The final checkpoint's evaluation, which finished after the workers stopped (sdtrain.evaluation.results).
    monkeypatch.setattr(sdtrain.driver.trackers, "final_results", lambda run_dir, rows: {8: {"fd_dinov2": 3.0}})
    run_dir = tmp_path / "runs" / "ended"
    earlier = set(threading.enumerate())  # an earlier test's may outlive it

    def final_history() -> list[dict[str, float]]:  # as finish reads it from the final checkpoint, each time
        return [{"step": step, "loss": 1.0 / step} for step in (2, 4, 6, 8)]

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "sdtrain"]

    workers = Trackers(config, str(run_dir), [])
    for row in final_history()[:2]:
        assert workers.log_metrics(row, int(row["step"]))
    workers.finish("success")
    run_id = read_state(str(run_dir))["ids"]["mlflow"]
    event_files = list((run_dir / TENSORBOARD_DIR).glob("events.*"))

    client = mlflow.MlflowClient(uri)
    for _ in range(2):  # the end of the run, then a re-run of the finished run: each step once
        history = final_history()
        log_final(config, str(run_dir), history)
        assert history[-1] == {"step": 8, "loss": 0.125, "fd_dinov2": 3.0}  # for metrics.csv
        loss = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
        assert sorted(loss) == [(2, 0.5), (4, 0.25), (6, 1 / 6), (8, 0.125)]
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "fd_dinov2")] == [(8, 3.0)]
        assert read_state(str(run_dir)) == {
            "ids": {"tensorboard": TENSORBOARD_DIR, "mlflow": run_id},
            "logged_through": 8,
            "evaluated": [8],
        }
        assert len(list((run_dir / TENSORBOARD_DIR).glob("events.*"))) == len(event_files) + 1  # the driver's, once
    assert client.get_run(run_id).info.status == "FINISHED"
    scalars, _ = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert scalars["fd_dinov2"] == [(8, 3.0)] and [s for s, _ in scalars["loss"]] == [2, 4]
    assert not warned(), caplog.text

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after MLflow's minutes of retries
    down = tmp_path / "runs" / "down"
    down.mkdir()
    (down / TRACKERS_FILE).write_text('{"ids": {"mlflow": "0123"}, "logged_through": 4}')
    config = dataclasses.replace(
        config, tracking=dataclasses.replace(config.tracking, mlflow_tracking_uri="http://127.0.0.1:9")
    )
    start = time.monotonic()
    log_final(config, str(down), final_history())
    assert time.monotonic() - start < 60
    assert len(warned()) == 1 and "Re-running the same command catches MLflow up" in warned()[0], warned()
    assert not [thread.name for thread in set(threading.enumerate()) - earlier if thread.name.startswith("sdtrain-")]
    assert "evaluated" not in read_state(str(down))  # sent when it answers: the re-run's log_final sends it


def test_the_driver_gives_tensorboard_the_final_evaluation_once(tmp_path, monkeypatch):
    """The final checkpoint's evaluation finishes after the workers' last report: the driver's end of the run writes it
    to TensorBoard at its step, once however often it runs, without MLflow among the trackers."""
    import sdtrain.driver.trackers
    from sdtrain.driver.trackers import log_final

    config = tiny_config(
        "data.train=unused", "data.val=unused", "eval.dinov2=unused", tmp_path=tmp_path, name="tb-eval"
    )
    monkeypatch.setattr(sdtrain.driver.trackers, "final_results", lambda run_dir, rows: {4: {"fd_dinov2": 3.0}})
    run_dir = tmp_path / "runs" / "tb-eval"
    history = [{"step": 2, "loss": 0.5}, {"step": 4, "loss": 0.25}]
    workers = Trackers(config, str(run_dir), [])
    for row in history:
        assert workers.log_metrics(row, int(row["step"]))
    workers.finish("success")
    for _ in range(2):  # the end of the run, then a re-run of the finished run
        log_final(config, str(run_dir), [dict(row) for row in history])
    scalars, _ = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert scalars["fd_dinov2"] == [(4, 3.0)] and scalars["loss"] == [(2, 0.5), (4, 0.25)]
    assert read_state(str(run_dir))["evaluated"] == [4]


def _tensorboard_and_offline_wandb(tmp_path, monkeypatch, name: str):
    """A run's config that tracks to TensorBoard and to W&B offline (its run files on disk), with evaluation on."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = ("data.train=unused", "data.val=unused", "eval.dinov2=unused")
    return tiny_config(*data, "tracking.trackers=[tensorboard, wandb]", tmp_path=tmp_path, name=name)


def _wandb_down(*args):
    raise ConnectionError("W&B does not answer")


def test_the_driver_gives_wandb_the_final_evaluation_once(tmp_path, monkeypatch, caplog):
    """The final checkpoint's evaluation finishes after the workers' last W&B row: the driver's end of the run appends
    it to the workers' W&B run in a row of its own at the checkpoint's step, once however often it runs, and sends no
    training row again. W&B down then, while TensorBoard takes it, is warned about, and a re-run sends it."""
    import sdtrain.driver.trackers
    from sdtrain.driver.trackers import log_final

    config = _tensorboard_and_offline_wandb(tmp_path, monkeypatch, "wandb-eval")
    final = {"fd_dinov2": 3.0, "eval_s": 1.5}
    monkeypatch.setattr(sdtrain.driver.trackers, "final_results", lambda run_dir, rows: {6: final})
    run_dir = tmp_path / "runs" / "wandb-eval"

    def final_history() -> list[dict[str, float]]:  # step 2's evaluation finished while training ran
        return [
            {"step": 2, "loss": 0.5, "fd_dinov2": 4.0, "eval_s": 1.0},
            {"step": 4, "loss": 0.25},
            {"step": 6, "loss": 0.125},
        ]

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "sdtrain"]

    workers = Trackers(config, str(run_dir), [])
    assert workers.log_metrics({"step": 2, "loss": 0.5}, 2)
    workers.log_evaluation({"fd_dinov2": 4.0, "eval_s": 1.0}, 2)  # W&B: in the next row
    for row in final_history()[1:]:
        assert workers.log_metrics(row, int(row["step"]))
    workers.finish("success")
    ids = read_state(str(run_dir))["ids"]

    with monkeypatch.context() as patched:  # TensorBoard takes the evaluation, W&B does not
        patched.setattr(sdtrain.driver.trackers, "_resume_wandb", _wandb_down)
        log_final(config, str(run_dir), final_history())
    assert len(warned()) == 1 and warned()[0].startswith("W&B did not take the final evaluation"), warned()
    assert "W&B does not answer" in warned()[0] and "Re-running the same command sends it" in warned()[0]
    state = {"ids": ids, "logged_through": 6, "evaluated": [2, 6], "wandb_evaluated": [2]}
    assert read_state(str(run_dir)) == state
    for _ in range(2):  # a re-run of the finished run sends it, the next one nothing
        log_final(config, str(run_dir), final_history())
        assert read_state(str(run_dir)) == {**state, "wandb_evaluated": [2, 6]}
    assert len(warned()) == 1, warned()

    runs = run_files(str(run_dir))
    assert [run.run_id for run in runs] == [ids["wandb"], ids["wandb"]]  # the workers', then the driver's once
    rows = [(int(row["trainer/global_step"]), row) for run in runs for row in run.history]
    assert [(step, float(row["loss"])) for step, row in rows if "loss" in row] == [(2, 0.5), (4, 0.25), (6, 0.125)]
    assert [
        (step, int(row["evaluated_step"]), float(row["fd_dinov2"])) for step, row in rows if "fd_dinov2" in row
    ] == [
        (4, 2, 4.0),  # joined to the workers' next row
        (6, 6, 3.0),  # the driver's row, at the final step
    ]
    assert {key for key in runs[1].history[0] if not key.startswith("_")} == {
        *final,
        "evaluated_step",
        "trainer/global_step",
    }
    scalars, _ = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert scalars["fd_dinov2"] == [(2, 4.0), (6, 3.0)] and scalars["loss"] == [(2, 0.5), (4, 0.25), (6, 0.125)]


def test_a_final_evaluation_wandb_missed_is_sent_once_the_run_resumed_for_more_steps_ends(tmp_path, monkeypatch):
    """W&B down at the end of a run misses step 6's late evaluation, which TensorBoard takes. The run is then resumed
    for more steps: its new worker group keeps the record of what W&B holds (wandb_evaluated), so the end of the
    longer run sends W&B step 6's evaluation, once, and none W&B took during training again."""
    import sdtrain.driver.trackers
    from sdtrain.driver.trackers import log_final

    config = _tensorboard_and_offline_wandb(tmp_path, monkeypatch, "wandb-resumed")
    monkeypatch.setattr(sdtrain.driver.trackers, "final_results", lambda run_dir, rows: {6: {"fd_dinov2": 3.0}})
    run_dir = tmp_path / "runs" / "wandb-resumed"
    first = [{"step": step, "loss": 1.0 / step} for step in (2, 4, 6)]
    workers = Trackers(config, str(run_dir), [])
    for row in first:
        assert workers.log_metrics(row, int(row["step"]))
    workers.finish("success")

    with monkeypatch.context() as patched:
        patched.setattr(sdtrain.driver.trackers, "_resume_wandb", _wandb_down)
        log_final(config, str(run_dir), first)
    assert (read_state(str(run_dir))["evaluated"], read_state(str(run_dir))["wandb_evaluated"]) == ([6], [])

    # Resumed from step 6's checkpoint to step 10; step 8's evaluation finishes while it trains.
    workers = Trackers(config, str(run_dir), first)
    assert workers.log_metrics({"step": 8, "loss": 0.1}, 8, first)
    workers.log_evaluation({"fd_dinov2": 2.0}, 8)
    assert workers.log_metrics({"step": 10, "loss": 0.05}, 10, first)
    workers.finish("success")
    assert read_state(str(run_dir))["wandb_evaluated"] == [8]  # the worker group kept the record, and added to it
    history = [*first, {"step": 8, "loss": 0.1, "fd_dinov2": 2.0}, {"step": 10, "loss": 0.05}]
    for _ in range(2):  # the end of the longer run, then a re-run of it: step 6 sent once
        log_final(config, str(run_dir), history)
        assert read_state(str(run_dir))["wandb_evaluated"] == [6, 8]

    rows = [row for run in run_files(str(run_dir)) for row in run.history if "fd_dinov2" in row]
    assert sorted((int(row["evaluated_step"]), float(row["fd_dinov2"])) for row in rows) == [(6, 3.0), (8, 2.0)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tensorboard_holds_each_step_once_when_a_restart_resumes_from_no_checkpoint(tmp_path):
    """A worker group killed before the run's first checkpoint: the next starts over from step 0 and re-does the
    steps the first logged; TensorBoard keeps the second group's values, each step once."""
    run_dir = tmp_path / "runs" / "early"
    config = tiny_config("data.train=unused", "tracking.trackers=[tensorboard]", tmp_path=tmp_path, name="early")
    first = Trackers(config, str(run_dir), [])
    for step in (2, 4):
        assert first.log_metrics({"step": step, "loss": 1.0 / step}, step)
    first.finish("failed")
    second = Trackers(config, str(run_dir), [])  # no checkpoint: history is empty
    assert second.held == {"tensorboard": 0}
    for step in (2, 4, 6):
        assert second.log_metrics({"step": step, "loss": 10.0 / step}, step)
    second.finish("success")
    scalars, _ = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert [(s, round(v, 4)) for s, v in scalars["loss"]] == [(2, 5.0), (4, 2.5), (6, 1.6667)]


def test_trackers_hold_each_step_once_across_a_restart(tmp_path, monkeypatch, mlflow_uri, mlflow_experiment_name):
    """Two worker groups of one run: the first logs up to step 6 and is killed; its W&B service had
    written only step 2. The second resumes from the checkpoint of step 4, gives W&B step 4 from the
    checkpoint's history (with its saved grid), re-does steps 5 and 6 and goes on to 8."""
    import mlflow
    import numpy as np
    from PIL import Image

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "runs" / "tracked"
    grid = np.zeros((16, 24, 3), np.uint8)
    saved_grid = np.full((16, 24, 3), 200, np.uint8)
    (run_dir / SAMPLES_DIR).mkdir(parents=True)
    Image.fromarray(saved_grid).save(run_dir / SAMPLES_DIR / "step_4.png")
    history = [{"step": 2, "loss": 0.5}, {"step": 4, "loss": 0.25, "sample_grid_s": 0.1}]
    uri = mlflow_uri
    config = tiny_config(
        "data.train=unused",
        "tracking.trackers=[tensorboard, mlflow, wandb]",
        f"tracking.mlflow_tracking_uri={uri}",
        f"tracking.mlflow_experiment={mlflow_experiment_name}",  # its runs alone: the server is the session's
        tmp_path=tmp_path,
        name="tracked",
    )
    first = Trackers(config, str(run_dir), [])
    for row in [*history, {"step": 6, "loss": 1 / 6}]:
        if row["step"] in (4, 6):
            first.log_image("samples", grid, row["step"])
        assert first.log_metrics(row, row["step"])
    first.finish("failed")
    ids = read_state(str(run_dir))["ids"]
    assert read_state(str(run_dir))["logged_through"] == 6 and set(ids) == {"tensorboard", "mlflow", "wandb"}
    cut_wandb_file_after(run_dir, ids["wandb"], 2)  # what a service killed after writing step 2 leaves

    second = Trackers(config, str(run_dir), history)
    assert second.held == {"tensorboard": 4, "mlflow": 6, "wandb": 4}
    for step in (6, 8):  # 6 is re-done: MLflow holds it, TensorBoard purged it
        second.log_image("samples", grid, step)
        assert second.log_metrics({"step": step, "loss": 10.0 / step}, step)
        if step == 6:  # the checkpoint of step 4's evaluation comes in (sdtrain.train.evaluations), once
            second.log_evaluation({"fd_dinov2": 3.0, "eval_s": 1.5}, 4)
            second.log_evaluation({"fd_dinov2": 3.0, "eval_s": 1.5}, 4)
    second.finish("success")
    # W&B took step 4's evaluation too (wandb_evaluated: what the driver's end of the run need not send it).
    assert read_state(str(run_dir)) == {"ids": ids, "logged_through": 8, "evaluated": [4], "wandb_evaluated": [4]}

    scalars, images = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert [(s, round(v, 4)) for s, v in scalars["loss"]] == [(2, 0.5), (4, 0.25), (6, 1.6667), (8, 1.25)]
    assert images == {"samples": [4, 6, 8]}
    assert scalars["fd_dinov2"] == [(4, 3.0)]  # at the evaluated checkpoint's step
    assert (run_dir / TENSORBOARD_DIR / "hparams.yaml").read_text().count("tracked") >= 1

    client = mlflow.MlflowClient(uri)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["run/name"] == "tracked" and run.data.params["model/preset"] == "tiny"
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "loss")] == [
        (2, 0.5),
        (4, 0.25),
        (6, 1 / 6),
        (8, 1.25),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "fd_dinov2")] == [(4, 3.0)]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the restart continued the same run
    assert run.info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(ids["mlflow"], "images")]
    assert len(artifacts) >= 3, artifacts

    runs = run_files(str(run_dir))
    assert [run.run_id for run in runs] == [ids["wandb"], ids["wandb"]]
    rows = [(int(row["trainer/global_step"]), row) for run in runs for row in run.history]
    assert [(step, round(float(row["loss"]), 4)) for step, row in rows if "loss" in row] == [
        (2, 0.5),
        (4, 0.25),  # from the checkpoint's history
        (6, 1.6667),
        (8, 1.25),
    ]
    assert [step for step, row in rows if "samples/_type" in row] == [4, 6, 8]
    # W&B's steps only grow: the evaluation of step 4 joins the next row, saying which step it is for.
    assert [
        (step, int(row["evaluated_step"]), float(row["fd_dinov2"])) for step, row in rows if "fd_dinov2" in row
    ] == [(8, 4, 3.0)]
    assert (run_dir / TRACKERS_FILE).exists()


@pytest.mark.slow  # a real MLflow server in its own process, stopped and started again
@pytest.mark.timeout(300)
def test_an_mlflow_outage_fails_no_training_call_and_mlflow_catches_up_each_step_once(tmp_path, monkeypatch, caplog):
    """MLflow's server stops while a worker group reports, and a restarted group opens while it is still down: no call
    of training's raises, each group warns once, and once the server is back (same backend store, same address) MLflow
    holds every step once, in order, the re-done step with the second group's value, and each evaluation once."""
    import mlflow
    import numpy as np
    import support.mlflow_server
    from PIL import Image
    from support.ray_head import free_ports

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow down: fail at once, not after minutes
    port = free_ports(1)[0]
    monkeypatch.setattr(support.mlflow_server, "free_ports", lambda count: [port])  # back at the same address
    run_dir = tmp_path / "runs" / "outage"
    config = tiny_config(
        "data.train=unused",
        "tracking.trackers=[tensorboard, mlflow]",
        f"tracking.mlflow_tracking_uri=http://127.0.0.1:{port}",
        tmp_path=tmp_path,
        name="outage",
    )
    history: list[dict[str, float]] = []

    def report(trackers: Trackers, step: int, value: float, **extra: float) -> bool:
        history.append({"step": step, "loss": value, **extra})
        return trackers.log_metrics(history[-1], step, history)

    def warned(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and text in r.getMessage()]

    with mlflow_server(tmp_path):
        first = Trackers(config, str(run_dir), [], retry_s=0)
        for step in (1, 2):
            assert report(first, step, 1.0 / step)
    caplog.clear()
    for step in (3, 4, 5):  # the server is down: TensorBoard takes each step, MLflow none, and nothing raises
        assert report(first, step, 1.0 / step)
    assert first.held == {"tensorboard": 5, "mlflow": 2} and "mlflow" in first.down
    first.finish("failed")
    assert len(warned("MLflow failed")) == 1 and len(warned("MLflow was not told")) == 1, caplog.text

    # The next worker group resumes from the checkpoint of step 4 while MLflow is still down: it cannot ask MLflow
    # which steps it holds, and opens anyway.
    del history[4:]
    caplog.clear()
    second = Trackers(config, str(run_dir), history, retry_s=0)
    assert "mlflow" in second.down and second.held == {"tensorboard": 4}
    second.log_evaluation({"fd_dinov2": 3.0}, 2)  # MLflow holds step 2: sent when it answers
    history[3]["fd_dinov2"] = 2.0  # merged into its row first (sdtrain.train.evaluations); MLflow lacks step 4
    second.log_evaluation({"fd_dinov2": 2.0}, 4)
    grid = np.full((16, 24, 3), 200, np.uint8)
    (run_dir / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(run_dir / SAMPLES_DIR / "step_6.png")
    second.log_image("samples", grid, 6)
    for step in (5, 6):
        assert report(second, step, 10.0 / step, **({"sample_grid_s": 0.1} if step == 6 else {}))
    assert len(warned("MLflow failed")) == 1, caplog.text

    with mlflow_server(tmp_path) as uri:
        step, deadline = 6, time.monotonic() + 120
        while "mlflow" in second.down:  # tried in the background: it catches up at the report after its answer
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.2)
            step += 1
            assert report(second, step, 10.0 / step)
        assert second.held == {"tensorboard": step, "mlflow": step}
        assert report(second, step + 1, 10.0 / (step + 1))
        second.finish("success")
        assert len(warned("MLflow failed")) == 1 and len(warned("MLflow answers again")) == 1, caplog.text

        client = mlflow.MlflowClient(uri)
        run_id = read_state(str(run_dir))["ids"]["mlflow"]
        points = client.get_metric_history(run_id, "loss")
        logged = [(m.step, round(m.value, 4)) for m in sorted(points, key=lambda m: m.timestamp)]
        expected = [(s, round((1.0 if s <= 4 else 10.0) / s, 4)) for s in range(1, step + 2)]
        assert logged == expected  # each step once, in order; 5 with the second group's value
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "fd_dinov2")) == [(2, 3.0), (4, 2.0)]
        images = [a.path for a in client.list_artifacts(run_id, "images")]
        assert any("+step+6+" in path for path in images), images  # its saved grid
        assert client.get_run(run_id).info.status == "FINISHED"
        assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1


def cut_wandb_file_after(run_dir: Path, run_id: str, step: int) -> None:
    """Cut the oldest W&B run file of ``run_id`` to its longest prefix with no row past ``step``."""
    path = Path(run_files(str(run_dir), run_id)[0].path)
    data, probe = path.read_bytes(), path.with_suffix(".probe")

    def past(length: int) -> bool:
        probe.write_bytes(data[:length])
        return any(s > step for s in read_run_file(str(probe)).steps())

    low, high = 0, len(data)  # past(high) holds; find the shortest such prefix
    assert past(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if past(middle) else (middle, high)
    probe.unlink()
    path.write_bytes(data[:low])
    assert max(read_run_file(str(path)).steps()) == step


@pytest.mark.slow
@pytest.mark.timeout(300)  # the actor's start, then the wait below: both slow on a busy 2-core machine
def test_ray_gauges_reach_rays_metrics_export(ray_cluster):
    """The gauges rank 0 sets, read back from the node's Prometheus endpoint that Ray's dashboard,
    Prometheus/Grafana and Anyscale scrape."""
    import ray

    @ray.remote
    class Rank0:
        def report(self, metrics):
            from sdtrain.train.run_view import RayGauges

            self.gauges = RayGauges("gauge-test")  # kept: the process exports what it holds
            return self.gauges.set(metrics)

    rank0 = Rank0.remote()
    metrics = {"step": 7, "loss": 0.25, "samples_per_s": 12.5, "data_wait_fraction": float("nan"), "lr": 1e-4}
    metrics |= {"mfu": 0.3125, "cost_per_million_images": 2.5}  # on GPU workers, with run.gpu_hour_cost
    assert ray.get(rank0.report.remote(metrics)) == {
        "step": 7.0,
        "loss": 0.25,
        "samples_per_s": 12.5,
        "mfu": 0.3125,
        "cost_per_million_images": 2.5,
    }
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    wanted = {"ray_sdtrain_train_loss": 0.25, "ray_sdtrain_samples_per_second": 12.5, "ray_sdtrain_step": 7.0}
    wanted |= {"ray_sdtrain_mfu": 0.3125, "ray_sdtrain_cost_per_million_images": 2.5}
    found: dict[str, float] = {}
    unanswered: list[str] = []  # scrapes the endpoint did not answer in time: on a busy machine, asked again
    deadline = time.monotonic() + 180  # seconds, usually; the test's whole former 120 s ran out on a busy machine
    while found != wanted and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                for line in response.read().decode().splitlines():
                    name = line.split("{", 1)[0]
                    if name in wanted and 'run="gauge-test"' in line:
                        found[name] = float(line.rsplit(" ", 1)[1])
        except OSError as error:
            unanswered.append(repr(error))
        time.sleep(1)  # Ray exports metrics every few seconds: polling the endpoint until they appear
    assert found == wanted, unanswered[-3:]
    ray.kill(rank0)


# Readers of what the trackers wrote, each through the tracker's own format (an MLflow server: support.mlflow_server).


@pytest.fixture(autouse=True)
def _event_files_sort_as_written(tmp_path_factory: pytest.TempPathFactory) -> None:
    """TensorBoard reads a directory's event files in name order; a name holds the second the file was made in, the
    process id and a count of the process's files (``...42.10`` sorts before ``...42.9``). Two worker groups played
    in one process within one second (real ones are processes seconds apart), or the workers' and then the driver's
    file, are read in the order written only while that count keeps its number of digits: before each test here it
    is moved past a power of ten that is near, by making files of its own."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("tensorboard-count")
    for i in range(100):
        SummaryWriter(str(root / str(i))).close()
        (name,) = os.listdir(root / str(i))
        count = int(name.rsplit(".", 1)[1])
        if len(str(count + 1)) == len(str(count + 20)):  # a test here makes a few files
            return
    raise AssertionError(f"TensorBoard's file count did not move: {name}")


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_hung_worker_is_ended_by_the_stall_watchdog_and_the_resumed_run_shows_each_step_once_everywhere(
    ray_cluster, tmp_path, monkeypatch, run_attempts, capfd, mlflow_uri, mlflow_experiment_name
):
    """Two workers, one SIGSTOPped (hung: no exception, no exit) once the first checkpoint is committed: the other
    waits for it in a collective, which would hold the job until the collective's 30-minute timeout. Its stall
    watchdog (run.stall_timeout_s, or run.slow_phase_timeout_s in a slow phase) ends it instead, saying where it
    stalled, with os._exit: a worker gone mid-run without clean-up, as a SIGKILLed one. Whichever rank was stopped,
    rank 0 ends without clean-up: ended by its watchdog, or stopped where it was and ended by Ray Train with the
    group. Ray Train restarts the group, which resumes from that checkpoint and ends exactly at max_steps. The
    live files were there while it trained, and after the restart every tracker and metrics.csv hold each step
    once; the sample grids, the export artifact and the registered model version are there."""

    import re

    import mlflow
    import psutil
    from conftest import write_latents
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.driver.run import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    write_latents(tmp_path / "train/a.parquet", rows=64, encoding="list", seed=4)
    write_latents(tmp_path / "val/v.parquet", rows=8, encoding="list", dtype="float32", seed=5)
    sd = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    run_dir = tmp_path / "runs" / "watched"
    max_steps, every = 20, 4
    stopped: list[int] = []
    seen_live: list[list[int]] = []  # each version of the live metrics.csv seen while the run trained
    finished = threading.Event()

    def live_steps() -> list[int]:
        """The steps metrics.csv holds now: rank 0 rewrites it (replaced whole) in a thread of its own after
        each report, while it trains; the driver writes it only at the end."""
        try:
            with open(run_dir / METRICS_FILE) as f:
                return [int(r["step"]) for r in csv.DictReader(f)]
        except FileNotFoundError:
            return []

    def stop_a_worker_after_the_first_checkpoint():
        # As soon as a checkpoint is committed: 16 steps remain, however fast the reports (rank 0's trackers do not
        # hold them). The live metrics.csv is watched meanwhile, and after the stop, until the run returns.
        deadline = time.monotonic() + 300
        while not committed_checkpoints(run_dir) and not finished.is_set():
            if time.monotonic() > deadline:
                return
            watch_live()
            time.sleep(0.2)  # polling the run directory of a run in another process
        for pid in our_training_workers():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # it ended since the listing: the next one
                continue
            stopped.append(pid)
            break
        while not finished.wait(0.5):
            watch_live()

    def watch_live() -> None:
        steps = live_steps()
        if steps and (not seen_live or seen_live[-1] != steps):
            seen_live.append(steps)

    uri = mlflow_uri
    config = load_config(
        None,
        [
            f"data.train={tmp_path}/train",
            f"data.val={tmp_path}/val",
            "model.preset=tiny",
            f"train.max_steps={max_steps}",
            "train.global_batch_size=8",
            "train.ema_decay=0.9",
            "scaling.num_workers=2",
            f"run.storage_path={tmp_path}/runs",
            "run.name=watched",
            f"checkpoint.every_n_steps={every}",
            "run.log_every_n_steps=2",
            "tracking.trackers=[tensorboard, mlflow, wandb]",
            f"tracking.mlflow_tracking_uri={uri}",
            f"tracking.mlflow_experiment={mlflow_experiment_name}",  # its runs alone: the server is the session's
            "tracking.mlflow_register_as=watched-unet",  # a model name no other test registers
            "sample_grid.steps=4",
            # Above the longest a rank goes without a step outside slow phases, the first batch and step of a
            # group included (11 s measured on 2 cores at a load of 13, with MLflow and W&B): a bound that fires
            # on a slow machine spends a restart, and the run shows 3 attempts.
            "run.stall_timeout_s=30",
            # The survivor may wait in a slow phase (a checkpoint's barrier, a validation's or a sample grid's
            # collective): bounded above a busy machine's start-up (a restarted group's restore too; 10 s measured).
            "run.slow_phase_timeout_s=60",
            "failure.max_failures=2",  # a false stall before or after the stop shows as a third attempt
            f"export.base_model={sd}",  # the registered version is a pipeline with its VAE and text encoder
        ],
    )
    stopper = threading.Thread(target=stop_a_worker_after_the_first_checkpoint)
    stopper.start()
    try:
        summary = train(config)
    finally:
        finished.set()
        stopper.join()
        for pid in stopped:  # Ray Train ends the old group's workers; a stopped one left behind is let go
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    assert stopped, f"no RayTrainWorker process was stopped (live metrics.csv: {seen_live or live_steps()})"
    assert not psutil.pid_exists(stopped[0])  # the hung worker went with its group
    assert run_attempts("watched") == 2 and summary.final_step == max_steps
    # The live file was there while it trained, each step once in order, and it grew.
    assert seen_live and all(steps == sorted(set(steps)) for steps in seen_live), seen_live
    assert max(steps[-1] for steps in seen_live) > seen_live[0][-1], seen_live

    expected = list(range(2, max_steps + 1, 2))
    grids = list(range(every, max_steps + 1, every))
    with open(run_dir / METRICS_FILE) as f:
        rows = list(csv.DictReader(f))
    # Steps after the checkpoint the restart resumed from were dropped with the state they described.
    assert [int(r["step"]) for r in rows] == expected
    restarted = [(int(r["step"]), int(float(r["start_step"]))) for r in rows if float(r["start_step"]) > 0]
    assert restarted and restarted[0][1] % every == 0 and restarted[0][0] == restarted[0][1] + 2
    assert [int(r["step"]) for r in rows if r["sample_grid_s"]] == grids
    assert {p.name for p in (run_dir / SAMPLES_DIR).iterdir()} == {f"step_{s}.png" for s in grids}
    assert all(p.read_bytes()[:8] == PNG for p in (run_dir / SAMPLES_DIR).iterdir())

    state = read_state(str(run_dir))
    assert state["logged_through"] == max_steps
    scalars, images = tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert [s for s, _ in scalars["loss"]] == expected
    assert [s for s, _ in scalars["val_loss"]] == grids
    assert images == {"samples": grids}

    client = mlflow.MlflowClient(uri)
    run = client.get_run(state["ids"]["mlflow"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == expected
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sample_grid_s")] == grids
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert run.data.params["train/max_steps"] == str(max_steps)
    exported = {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    assert {"export/sdtrain.json", "export/model_index.json", "export/vae"} <= exported, exported
    versions = client.search_model_versions("name='watched-unet'")
    assert [(v.version, v.run_id) for v in versions] == [("1", run.info.run_id)]

    # The false alarms Ray Data raised in every worker are gone from the console (forwarded to the driver).
    out, err = capfd.readouterr()
    assert "resumed from step" in out + err  # the workers' own lines do come through
    for alarm in ("Progress bars disabled", "registers for logging while another dataset"):
        assert alarm not in out + err

    # The survivor's watchdog said where it stalled: outside slow phases after run.stall_timeout_s, in one after
    # run.slow_phase_timeout_s.
    stall = re.search(
        r"rank \d stalled: no optimizer step for \d+ s since step (\d+), .*?; it has been (.*?) for \d+ s\.",
        out + err,
    ) or re.search(
        r"rank \d stalled: it has been (.*?) for \d+ s \(run\.slow_phase_timeout_s=60; "
        r"last optimizer step: step (\d+)\)",
        out + err,
    )
    assert stall, "the watchdog's message is not in the run's output"
    step, phase = (stall.group(1), stall.group(2)) if "no optimizer step" in stall.group(0) else stall.group(2, 1)
    assert int(step) >= every
    # The surviving rank waits for the stopped one in a collective (a step's all-reduce, Lightning's checks
    # between steps, a report's or a checkpoint's barrier, a validation's or a sample grid's), not for its own data.
    assert phase.startswith(
        ("in a training step", "between steps", "reporting", "validating", "rendering a sample grid")
    ), phase

    runs = run_files(str(run_dir))
    # A worker ended before its W&B service wrote the run's header leaves a file without it.
    assert {run.run_id for run in runs} <= {state["ids"]["wandb"], ""}
    assert len([run for run in runs if run.run_id]) >= 2  # the restarted worker's, the driver's export
    assert [name for run in runs for name in run.artifacts] == ["watched-export"]
    steps = [step for run in runs for step in run.steps("loss")]
    # Each step once: what the ended rank 0's W&B service had not written came from the checkpoint.
    assert steps == expected
    assert [step for run in runs for step in run.steps("samples/_type")] == grids
