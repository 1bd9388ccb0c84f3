"""entrypoints/train.py as users run it: a subprocess."""

import csv
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, write_latents
from support.deprecations import pythonwarnings
from support.ray_processes import kill_at_first_checkpoint

TRAIN = [sys.executable, str(REPO / "entrypoints" / "train.py")]
# This checkout's package in the subprocess, whatever the cwd (a relative PYTHONPATH would not
# resolve from tmp_path, and an installed sdtrain from another checkout would be imported instead).
# A deprecated call made by sdtrain's code is an error there and in every process of the Ray it starts.
CHECKOUT = {"PYTHONPATH": str(REPO / "src"), "PYTHONWARNINGS": pythonwarnings()}


def _run(args, tmp_path, timeout):
    # RAY_ADDRESS=local: start a cluster of its own, never join another test's.
    env = {**os.environ, "RAY_ADDRESS": "local", **CHECKOUT}
    return subprocess.run(TRAIN + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_help_lists_every_key(tmp_path):
    result = _run(["--help"], tmp_path, timeout=50)
    assert result.returncode == 0
    for key in (
        "data.train",
        "model.preset",
        "model.unet",
        "train.precision",
        "scaling.num_workers",
        "checkpoint.num_to_keep",
        "failure.max_failures",
    ):
        assert key in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (["train.lr=fast"], "error: train.lr: expected float, got 'fast'"),
        (
            ["data.train=bad.parquet"],
            "error: data.train: {tmp}/bad.parquet, column 'caption_latents' (data.caption_column) has 2464 "
            "values a row, which is not L*D for D = the UNet's cross_attention_dim = 1024",
        ),
    ],
)
def test_bad_input_exits_2_with_one_paragraph(tmp_path, args, message):
    write_latents(tmp_path / "bad.parquet", caption_shape=(77, 32))  # the small preset wants 1024-wide captions
    result = _run(["--config", str(REPO / "configs" / "small.yaml"), *args], tmp_path, timeout=110)
    assert result.returncode == 2
    assert message.format(tmp=tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_every_command_tells_bad_input_a_failed_run_and_a_busy_registry_apart_by_its_exit_status():
    """2: bad input; 1: a run that failed after it started (train.py, retrain.py and check.py alike: check.py said 2);
    75 (EX_TEMPFAIL, as the watchdog's): the registry's lock is held, try later. A scheduler that retries on 75 alone
    no longer spends its retries on a config that cannot work, nor marks a held lock a failure of the input."""
    from sdtrain.artifacts.registry_lock import RegistryBusy
    from sdtrain.driver.cli import exit_code
    from sdtrain.errors import ConfigError, DataError, TrainingFailed

    assert exit_code(ConfigError("x")) == exit_code(DataError("x")) == 2
    assert exit_code(TrainingFailed("x")) == 1
    assert exit_code(RegistryBusy("x")) == 75


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_retrain_entrypoint_checks_its_input_before_anything_runs(tmp_path):
    retrain = [sys.executable, str(REPO / "entrypoints" / "retrain.py")]
    env = {**os.environ, "RAY_ADDRESS": "local", **CHECKOUT}
    result = subprocess.run(
        retrain + ["retrain.date=2026-13-01"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert (
        result.returncode == 2 and "error: retrain.date: must be a date YYYY-MM-DD, got '2026-13-01'" in result.stderr
    )
    result = subprocess.run(
        retrain
        + [f"retrain.data_root={tmp_path}/none", f"retrain.models_root={tmp_path}/models", f"data.val={tmp_path}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"error: retrain.data_root: {tmp_path}/none holds no complete date=YYYY-MM-DD partitions up to" in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.slow
def test_the_demo_survives_a_killed_driver_and_the_loss_falls(tmp_path, monkeypatch):
    """The README's demo command, shortened to 40 steps (everything else is configs/demo.yaml).
    Once a checkpoint is committed, SIGKILL the driver and the local Ray it started (as when a
    job's head node dies); the same command again resumes from it, ends at max_steps, and the
    loss has fallen."""
    import json

    import psutil

    args = [
        "train.max_steps=40",
        "run.log_every_n_steps=10",
        "checkpoint.every_n_steps=10",
        "checkpoint.num_to_keep=null",
        "run.gpu_hour_cost=1.5",  # a CPU worker's hour, priced: the cost is shown, MFU is not
    ]
    args += ["sample_grid.columns=2", "sample_grid.steps=4"]  # a grid at each checkpoint: 16 s each at the demo's size
    args += ["eval.num_samples=20"]  # each checkpoint's class agreement, evaluated beside training, on 20 val digits
    env = {**os.environ, "RAY_ADDRESS": "local", **CHECKOUT}
    driver = subprocess.Popen(
        TRAIN + args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    run_dir = tmp_path / "runs" / "demo"
    committed, first_output, started = kill_at_first_checkpoint(driver, run_dir, 400)
    assert "wrote the digits demo dataset" in first_output
    assert committed and "checkpoint_000000040" not in committed

    result = _run(args, tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    # The workers' lines reach this console (Ray forwards them); none is a warning about sdtrain's own code, nor
    # DDP's about a deprecated setting.
    console = result.stdout + result.stderr
    assert not re.findall(r"^.*/sdtrain/\S+\.py:\d+: \w*Warning: .*$", console, re.MULTILINE)
    assert "broadcast_buffers" not in console
    resumed_from = int(committed[-1].split("_")[1])
    assert f"resumed from step {resumed_from}" in result.stdout + result.stderr
    assert f"final checkpoint: {run_dir}/checkpoint_000000040" in result.stdout
    # The run's totals, from the final checkpoint's rows: configs/demo.yaml's 16 images a step, the hours of the
    # kept steps (worker-hours: CPU workers) and their price; no MFU on a CPU, never a made-up one.
    totals = re.search(
        r"\[sdtrain\] 640 images trained in ([0-9.e-]+) worker-hours, no MFU on CPU workers, "
        r"cost ([0-9.e-]+) \(run\.gpu_hour_cost x worker-hours\)\n",
        result.stdout,
    )
    assert totals, result.stdout
    history = json.loads((run_dir / "checkpoint_000000040" / "history.json").read_text())
    assert [row["step"] for row in history] == [10, 20, 30, 40]
    hours = [row["worker_hours"] for row in history]
    assert 0 < hours[0] < hours[1] < hours[2] < hours[3] and not any("mfu" in row for row in history)
    assert float(totals[1]) == pytest.approx(hours[-1], rel=1e-3)
    assert float(totals[2]) == pytest.approx(1.5 * hours[-1], rel=1e-2)
    assert all(row["cost_per_million_images"] > 0 for row in history)
    assert [row["start_step"] for row in history if row["step"] > resumed_from] == [resumed_from] * (
        (40 - resumed_from) // 10
    )
    assert all((run_dir / "samples" / f"step_{step}.png").is_file() for step in (10, 20, 30, 40))
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(row["loss"]) for row in rows]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    # The demo's class agreement, evaluated off the training ranks at least for the final checkpoint, lands at its
    # step; an evaluation of that checkpoint in this process, from the same rows and noise, reads the same samples.
    agreement = {int(row["step"]): float(row["class_agreement"]) for row in rows if row.get("class_agreement")}
    assert 40 in agreement and all(0 <= value <= 1 for value in agreement.values()), agreement
    from sdtrain.config.loader import load_config
    from sdtrain.evaluation.checkpoint_eval import Evaluator

    monkeypatch.chdir(tmp_path)  # configs/demo.yaml's data paths are relative to where the run started
    config = load_config(str(REPO / "configs" / "demo.yaml"), args)
    again = Evaluator(config, None, None).evaluate(str(run_dir / "checkpoint_000000040"))
    assert again["class_agreement"] == agreement[40] and again["eval_samples"] == 20
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in started)

    # The README's next command, as written (a relative run directory), at a token size: a row per
    # digit, and the class agreement of the samples.
    generate = [
        sys.executable,
        str(REPO / "entrypoints" / "generate.py"),
        "runs/demo",
        "--captions",
        ".sdtrain-data/digits/val",
        "--out",
        "samples/demo",
        "--samples-per-caption",
        "1",
        "--steps",
        "2",
    ]
    result = subprocess.run(generate, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "of 10 samples look like the digit they were conditioned on" in result.stdout
    assert json.loads((tmp_path / "samples" / "demo" / "class_agreement.json").read_text())["samples"] == 10
