"""What rank 0's MLflow tracker run shows on a real MLflow server: its status across a retried worker group, a
catch-up after an outage in few requests, the experiment it lands in, and reports that go on while the server hangs."""

from __future__ import annotations

import math
import os
import signal
import threading

import mlflow
import psutil
import pytest
from conftest import tiny_config, unset_env
from support.mlflow_server import mlflow_server
from support.tensorboard_files import tensorboard_scalars

from sdtrain.storage.run_layout import TENSORBOARD_DIR
from sdtrain.train.run_view import RunView
from sdtrain.train.trackers import Trackers, read_state

# mlflow_uri: the session's MLflow server (conftest), shared with other tests' runs in experiments of their own.


def _config(tmp_path, uri, name, *overrides):
    return tiny_config(
        "data.train=unused",
        "tracking.trackers=[mlflow]",
        f"tracking.mlflow_tracking_uri={uri}",
        *overrides,
        tmp_path=tmp_path,
        name=name,
    )


def test_a_retried_worker_group_sets_its_mlflow_run_running_again(tmp_path, mlflow_uri, mlflow_experiment_name):
    """A worker group that raised ends the run FAILED; the group Ray Train restarts logs into the same run, which
    shows RUNNING again while it trains, and FINISHED at its end."""
    experiment = f"tracking.mlflow_experiment={mlflow_experiment_name}"
    config, run_dir = _config(tmp_path, mlflow_uri, "retried", experiment), str(tmp_path / "runs" / "retried")
    first = Trackers(config, run_dir, [])
    for step in (2, 4):
        assert first.log_metrics({"step": step, "loss": 1.0 / step}, step)
    first.finish("failed")
    client = mlflow.MlflowClient(mlflow_uri)
    run_id = read_state(run_dir)["ids"]["mlflow"]
    assert client.get_run(run_id).info.status == "FAILED"

    second = Trackers(config, run_dir, [{"step": 2, "loss": 0.5}, {"step": 4, "loss": 0.25}])
    assert second.log_metrics({"step": 6, "loss": 1 / 6}, 6)
    assert client.get_run(run_id).info.status == "RUNNING"
    second.finish("success")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [2, 4, 6]


def test_an_mlflow_catch_up_sends_the_missed_rows_in_few_requests_each_once(
    tmp_path, mlflow_uri, mlflow_experiment_name, monkeypatch
):
    """The rows an outage left MLflow without (300, 4 metrics each) reach it in batches of up to 1000 metrics, not a
    request a row (synchronous, on the training thread), and each row lands once at its step."""
    experiment = f"tracking.mlflow_experiment={mlflow_experiment_name}"
    config, run_dir = _config(tmp_path, mlflow_uri, "caught-up", experiment), str(tmp_path / "runs" / "caught-up")
    trackers = Trackers(config, run_dir, [])
    assert trackers.log_metrics({"step": 1, "loss": 1.0}, 1)
    requests: list[int] = []
    log_batch = mlflow.MlflowClient.log_batch

    def counted(self, run_id, metrics=(), *args, **kwargs):  # the real call, counted
        requests.append(len(metrics))
        return log_batch(self, run_id, metrics, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", counted)
    count = 300
    history = [{"step": s, "loss": 1.0 / s, "lr": 1e-4, "samples_per_s": float(s)} for s in range(1, count + 1)]
    history.append({"step": count + 1, "loss": 0.1})  # the report's own row ends the history it is given with
    assert trackers.log_metrics(history[-1], count + 1, history)
    sent = sum(requests)
    assert sent == 3 * (count - 1) + 1 and len(requests) <= math.ceil(sent / 1000) + 1, requests
    trackers.finish()

    client = mlflow.MlflowClient(mlflow_uri)
    run_id = read_state(run_dir)["ids"]["mlflow"]
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert loss == [(1, 1.0), *((s, 1.0 / s) for s in range(2, count + 1)), (count + 1, 0.1)]
    speeds = [(m.step, m.value) for m in client.get_metric_history(run_id, "samples_per_s")]
    assert sorted(speeds) == [(s, float(s)) for s in range(2, count + 1)]
    ordered = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: (m.timestamp, m.step))
    assert [m.step for m in ordered] == list(range(1, count + 2))  # in time order, in step order


def test_the_mlflow_experiment_is_the_configs_else_mlflow_experiment_name(tmp_path, mlflow_uri, monkeypatch):
    """MLFLOW_EXPERIMENT_NAME (MLflow's own setting, forwarded to the workers) names the experiment when
    tracking.mlflow_experiment is unset; a config value wins over it."""
    from sdtrain.driver.trackers import WORKER_MLFLOW_RETRIES, tracker_env
    from sdtrain.train.trackers import FORWARDED_ENV, apply_tracker_env

    unset_env(monkeypatch, (*FORWARDED_ENV, *WORKER_MLFLOW_RETRIES))  # apply_tracker_env sets them in this process
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-diffusion")
    client = mlflow.MlflowClient(mlflow_uri)
    for name, overrides, expected in (
        ("from-env", (), "team-diffusion"),
        ("from-config", ("tracking.mlflow_experiment=from-config",), "from-config"),
    ):
        apply_tracker_env(tracker_env())  # as a worker does
        run_dir = str(tmp_path / "runs" / name)
        trackers = Trackers(_config(tmp_path, mlflow_uri, name, *overrides), run_dir, [])
        assert trackers.log_metrics({"step": 1, "loss": 1.0}, 1)
        trackers.finish()
        run = client.get_run(read_state(run_dir)["ids"]["mlflow"])
        assert client.get_experiment(run.info.experiment_id).name == expected


def _server_listening_on(uri: str) -> int:
    """The process group of the server listening on ``uri``'s port (support.mlflow_server starts it in its own)."""
    port = int(uri.rsplit(":", 1)[1])
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return os.getpgid(pid)


@pytest.mark.slow  # an MLflow server of its own, stopped and continued
def test_reports_go_on_while_mlflow_hangs_and_it_gets_every_step_once_after(tmp_path, monkeypatch):
    """Rank 0's view hands each report to the tracker thread (sdtrain.train.tracker_thread). A checkpoint's report
    returns once the trackers hold its step. With the MLflow server stopped (SIGSTOP: it takes connections and never
    answers, as a hung server does), reports go on while MLflow holds none of them; once it answers again, the end of
    the worker group waits for the calls made, and MLflow and TensorBoard hold every step once, in order."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")  # a request waits out the stop, as it would in a run
    history: list[dict[str, float]] = []

    def report(view: RunView, step: int, checkpoint: bool = False) -> None:
        history.append({"step": step, "loss": 1.0 / step, "lr": 1e-4})
        view.reported(history[-1], history, None, checkpoint)

    with mlflow_server(tmp_path) as uri:
        config = tiny_config(
            "data.train=unused",
            "tracking.trackers=[tensorboard, mlflow]",
            f"tracking.mlflow_tracking_uri={uri}",
            tmp_path=tmp_path,
            name="hung",
        )
        view = RunView(config, config.run.directory, ray_metrics=False)
        view.started([])
        report(view, 1)
        report(view, 2, checkpoint=True)
        assert view.trackers is not None and view.trackers.trackers is not None
        trackers = view.trackers.trackers
        client = mlflow.MlflowClient(uri)
        run_id = trackers.ids["mlflow"]
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]  # the checkpoint waited for it

        server = _server_listening_on(uri)
        os.killpg(server, signal.SIGSTOP)
        try:
            reports = threading.Thread(target=lambda: [report(view, step) for step in (3, 4, 5)], daemon=True)
            reports.start()
            reports.join(timeout=60)
            assert not reports.is_alive(), "a report waited for the stopped MLflow server"
            assert trackers.held["mlflow"] == 2  # its request for step 3 is still waiting
        finally:
            os.killpg(server, signal.SIGCONT)
        view.finished("success")

        points = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: (m.timestamp, m.step))
        assert [(m.step, m.value) for m in points] == [(s, 1.0 / s) for s in range(1, 6)]  # once each, in order
        assert client.get_run(run_id).info.status == "FINISHED"
    scalars, _ = tensorboard_scalars(tmp_path / "runs" / "hung" / TENSORBOARD_DIR)
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3, 4, 5]
