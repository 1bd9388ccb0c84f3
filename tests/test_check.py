"""The check job users run first (entrypoints/check.py), end to end on CPU workers of a real Ray cluster: a phase on
one worker and one on two, and the table they print."""

import re

import pytest
from conftest import committed_checkpoints, write_latents

from sdtrain.config.loader import load_config
from sdtrain.driver.check import CheckReport, phase_config
from sdtrain.driver.cli import check_main


def _args(tmp_path, *extra):
    return [
        "--steps",
        "8",
        # Compiling takes two phases 2-4 minutes on 2 cores; the compiled step is test_options' (the same
        # build_training), and --eager leaves the rest of the check's path as it is.
        "--eager",
        f"data.train={tmp_path}/train",
        "model.preset=tiny",
        "train.global_batch_size=8",
        "train.micro_batch_size=auto",  # on CPU workers: null's size, the per-worker batch
        "scaling.num_workers=[1,2]",
        "scaling.use_gpu=false",
        "scaling.cpus_per_worker=1",
        f"run.storage_path={tmp_path}/runs",
        "run.name=mine",
        "run.gpu_hour_cost=2.5",
        "train.max_steps=100000",
        *extra,
    ]


def test_the_checks_phases_run_without_evaluation_and_its_table_says_so(tmp_path):
    """Ray Train waits for the final checkpoint's evaluation before a run ends: a phase of an eval-enabled config took
    up to twice eval.timeout_s (an hour each by default) beside its few minutes of training."""
    evaluated = [
        f"data.train={tmp_path}/train",
        f"data.val={tmp_path}/val",
        "eval.dinov2=/models/dinov2",
        "eval.clip=/models/clip",
        "checkpoint.score_attribute=fd_dinov2",
        "retrain.metric=clip_score",
        "scaling.num_workers=[1,2]",
    ]
    for workers in (1, 2):
        phase = phase_config(None, evaluated, workers, steps=8)
        assert not phase.eval.enabled and phase.eval.metrics == [], phase.eval
        assert phase.checkpoint.score_attribute is None and phase.retrain.metric == "val_loss"
    table = CheckReport(load_config(None, [*evaluated, "eval.inception=/i.pt"]), [], None, None, None).table()
    assert any(
        line.startswith("evaluation: off in the check's phases (the run evaluates fd_dinov2, fd_inception, clip_score)")
        for line in table
    ), table
    plain = CheckReport(load_config(None, evaluated[:1]), [], None, None, None).table()
    assert not any(line.startswith("evaluation") for line in plain)


@pytest.mark.slow  # two short Ray Train runs
@pytest.mark.timeout(400)
def test_the_check_trains_on_one_worker_then_all_and_reports_what_it_measured(ray_cluster, tmp_path, capsys):
    write_latents(tmp_path / "train/a.parquet", rows=64, seed=1)
    assert check_main(_args(tmp_path), default_config=None) == 0
    out = capsys.readouterr().out
    lines = [line.removeprefix("[sdtrain check] ") for line in out.splitlines() if line.startswith("[sdtrain check]")]
    header, one, two, communication, projected = lines
    assert header.split()[:3] == ["phase", "options", "result"]
    # Each phase: trained, with its micro-batch (auto: null's on CPU workers); images/s per GPU, no MFU on CPU, data
    # wait, checkpoint stall, no measured peak memory on CPU beside the memory model's prediction.
    for row, name in ((one, "1 GPU"), (two, "2 GPUs")):
        assert row.startswith(name) and "compile" not in row and "micro-batch 4" in row and " trained " in row, row
        figures = re.fullmatch(r".* trained +(\d+\.\d) +- +(\d+\.\d)% +(\d+\.\d) s +- \((\d+\.\d\d)\)", row)
        assert figures and float(figures[1]) > 0 and float(figures[4]) > 0, row
    assert re.fullmatch(r"communication: \d+\.\d% of the full run's step", communication), communication
    hours = re.fullmatch(
        r"projected: 100000 steps in (\d+)h(\d\d)m on 2 workers, ([\d,]+) at run.gpu_hour_cost", projected
    )
    assert hours, projected
    # Each phase is its own run beside the configured one's, checkpointed halfway and at the end, not exported.
    runs = sorted(p.name for p in (tmp_path / "runs/checks").iterdir())
    assert [re.sub(r"check-\d{8}T\d{6}", "check-T", name) for name in runs] == ["mine-check-T-1w", "mine-check-T-2w"]
    for name in runs:
        assert committed_checkpoints(tmp_path / "runs/checks" / name) == [
            "checkpoint_000000004",
            "checkpoint_000000008",
        ]
        assert not (tmp_path / "runs/checks" / name / "export").exists()
    assert not (tmp_path / "runs/mine").exists()


@pytest.mark.slow  # two short Ray Train runs
def test_a_phase_that_fails_is_reported_and_the_check_exits_1(ray_cluster, tmp_path, capsys):
    write_latents(tmp_path / "train/a.parquet", rows=64, caption_shape=(77, 16), seed=1)  # the tiny UNet wants 32
    assert check_main(_args(tmp_path), default_config=None) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[sdtrain check\] 1 GPU +.* failed ", out, re.M), out
    assert re.search(r"^\[sdtrain check\] 1 GPU failed: DataError: .*a\.parquet", out, re.M), out
    assert "projected" not in out
