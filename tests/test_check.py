"""The check job users run first (entrypoints/check.py), end to end on CPU workers of a real Ray cluster: a phase on
one worker and one on two, and the table they print."""

import dataclasses
import json
import re

import pytest
from conftest import REPO, committed_checkpoints, write_latents

from sdtrain.config.loader import load_config
from sdtrain.driver.check import phase_config
from sdtrain.driver.check_report import CheckReport, Phase, communication_share
from sdtrain.driver.cli import check_main


def _args(tmp_path, *extra):
    return [
        "--steps",
        "8",
        # Trained as configured: eager here (compiling takes each phase 2-4 minutes on 2 cores; the compiled step of
        # the shipped options is test_options', through the same build_training).
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


def test_a_phase_takes_any_run_config_the_validator_accepts():
    """A phase checkpoints halfway through its few steps and keeps every checkpoint: a run that ranks them by
    val_loss, validating every 500 steps and checkpointing every 1000, must not have the phase refused for a
    validation interval that no longer divides its checkpoint interval."""
    scored = [
        "data.train=/d/train",
        "data.val=/d/val",
        "checkpoint.score_attribute=val_loss",
        "run.val_every_n_steps=500",
        "checkpoint.every_n_steps=1000",
        "scaling.num_workers=4",
        "train.global_batch_size=32",
    ]
    assert load_config(None, scored).checkpoint.score_attribute == "val_loss"
    for workers in (1, 4):
        phase = phase_config(None, scored, workers, steps=40)
        assert phase.checkpoint.every_n_steps == 20 and phase.checkpoint.num_to_keep is None
        assert phase.checkpoint.score_attribute is None and phase.run.val_every_n_steps == 40  # at its end only


def test_a_phase_trains_the_runs_micro_batch_and_is_measured_by_a_window_of_training_alone():
    """micro_batch_size null (or auto) over an elastic range is the largest size every allowed world size divides: a
    phase, on one world size, took the whole per-GPU batch at once (the memory fit then refused a config that
    trains). The window a phase was measured by held the last step's validation, or a checkpoint's save."""
    from sdtrain.driver.check import measured_step, run_micro_batch
    from sdtrain.train.cadence import ReportCadence

    elastic = ["data.train=/d", "train.micro_batch_size=null", "scaling.num_workers=[2,4]"]
    elastic.append("train.global_batch_size=96")
    assert run_micro_batch(load_config(None, elastic)) == 8  # 48, 32 or 24 a worker: 8 divides each
    cpu_auto = [*elastic, "train.micro_batch_size=auto", "scaling.use_gpu=false"]
    assert run_micro_batch(load_config(None, cpu_auto)) == 8  # auto without GPUs: null's
    assert phase_config(None, elastic, 1).batch_layout(1).micro_batch == 24  # unpinned: all of one GPU's share
    for workers, accumulation in ((1, 3), (4, 3)):
        layout = phase_config(None, elastic, workers, micro_batch=8).batch_layout(workers)
        assert (layout.micro_batch, layout.accumulation) == (8, accumulation)  # the run's, at its 4 workers
    # Under FSDP with auto, a phase on fewer GPUs than the run fits its own: the run's size assumes sharded state.
    from sdtrain.driver.check import _pinned

    sharded = load_config(None, [*cpu_auto, "train.strategy=fsdp", "scaling.use_gpu=auto"])
    assert (_pinned(sharded, 1, 8), _pinned(sharded, 4, 8), _pinned(load_config(None, elastic), 1, 8)) == ("auto", 8, 8)
    for steps in (8, 40, 41, 42, 101):
        cadence = ReportCadence(phase_config(None, ["data.val=/v", *elastic], 1, steps=steps))
        end = measured_step(steps)
        start = max(step for step in range(end) if step == 0 or cadence.report_due(step))
        assert start > 0 and end < steps, steps  # not the first window (compilation), not the last
        window = range(start + 1, end + 1)
        assert not any(cadence.validation_due(step) for step in window), steps
        assert not any(cadence.checkpoint_due(step) for step in range(start, end)), steps  # none saved in it


def test_the_check_of_the_shipped_sdxl_config_trains_a_gpus_share_that_fits_one_h100():
    """check.py on configs/sdxl-base.yaml (64 GPUs, 2048 a step): its one-GPU phase trains one GPU's 32 images a step
    as the run does (compiled, FSDP, checkpointed); FSDP over one rank holds the whole 2.57B model's state, so
    micro-batch auto halves the micro-batch there (16 x 2, ~67 GiB predicted) where 8 ranks take 32 at once."""
    from sdtrain.driver.memory_fit import fit_micro_batch

    latents, captions = (4, 128, 128), (77, 2048)  # 1024 px, SDXL's two encoders
    one = phase_config(str(REPO / "configs" / "sdxl-base.yaml"), [], 1)
    assert (one.model.preset, one.train.strategy, one.train.compile) == ("sdxl-base", "fsdp", True)
    assert one.train.global_batch_size == 32 and one.train.gradient_checkpointing and not one.export.enabled
    fitted, said = fit_micro_batch(one, "H100", latents, captions, "bf16-mixed")
    assert fitted.batch_layout(1).micro_batch == 16 and fitted.batch_layout(1).accumulation == 2, said
    assert said is not None and re.search(r"predicted 6\d\.\d GiB a rank on H100", said), said


def test_the_phases_train_as_configured_and_the_table_nets_out_data_wait_and_prices_the_run():
    """Compiled if the config compiles (both phases: today's run), the compile comparison's phase the other way;
    the communication share from images/s net of data wait; the cost from run.gpu_hour_cost, or how to get one;
    the peak allocated and reserved memory beside the prediction and the GPU's capacity."""
    compiled = ["data.train=/d", "train.compile=true", "scaling.num_workers=[2,4]", "train.global_batch_size=24"]
    for workers in (1, 4):
        assert phase_config(None, compiled, workers).train.compile is True
    flipped = phase_config(None, compiled, 1, compile_unet=False, stamp="T")
    assert flipped.train.compile is False and flipped.run.name.endswith("-check-T-1w-eager")
    assert phase_config(None, ["data.train=/d"], 1).train.compile is False
    # One GPU at 100 images/s waiting 20% of the time for data, four at 90 waiting 28%: 125 against 125 while
    # training, no communication lost (1 - 90 / 100 = 10% counted their data wait as communication).
    one = Phase("1 GPU", 1, "ddp", True, images_per_s_per_gpu=100.0, data_wait=0.2, steps_per_s=1.0)
    four = Phase("4 GPUs", 4, "ddp", True, images_per_s_per_gpu=90.0, data_wait=0.28, steps_per_s=0.5)
    assert communication_share(one, four) == pytest.approx(0.0, abs=1e-12)
    slower = dataclasses.replace(four, images_per_s_per_gpu=100.0, data_wait=0.0)
    assert communication_share(one, slower) == pytest.approx(0.2)
    eager = Phase(
        "1 GPU, compile flipped", 1, "ddp", False, images_per_s_per_gpu=80.0, data_wait=0.0,
        peak_memory_gb=17.9, peak_reserved_gb=19.4, memory_capacity_gb=23.8, predicted_memory_gb=19.8,
    )  # fmt: skip
    config = load_config(None, compiled)
    table = CheckReport(config, [one, four, eager], 0.0, 2.5, None).table()
    assert "compile: 100.0 images/s per GPU compiled, 80.0 eager (+25%) on one GPU" in table, table
    assert not any("graph(s)" in line for line in table), table  # graphs_compiled None (eager) or 0: nothing to say
    # A rare bucket first drawn in the one-GPU phase's measured window: its figures hold the compilation.
    drawn_late = [dataclasses.replace(one, graphs_compiled=3), dataclasses.replace(four, graphs_compiled=0)]
    (late,) = [line for line in CheckReport(config, drawn_late, 0.0, 2.5, None).table() if "graph(s)" in line]
    assert late.startswith("1 GPU: compiled 3 graph(s) in its measured window"), late
    assert any(
        line.endswith("(no cost: set run.gpu_hour_cost, a worker's price an hour, as check_job.yaml does)")
        for line in table
    ), table
    assert any(
        line.startswith("1 GPU, compile flipped") and line.endswith("17.90/19.40 (19.80) of 23.8") for line in table
    ), table
    priced = load_config(None, [*compiled, "run.gpu_hour_cost=2.54"])
    (projection,) = [line for line in CheckReport(priced, [one, four], 0.0, 2.5, 25.4).table() if "projected" in line]
    assert projection == "projected: 550000 steps in 2h30m on 4 workers, 25 at run.gpu_hour_cost=2.54", projection


@pytest.mark.slow  # two short Ray Train runs
@pytest.mark.timeout(400)
def test_the_check_trains_on_one_worker_then_all_and_reports_what_it_measured(ray_cluster, tmp_path, capsys):
    write_latents(tmp_path / "train/a.parquet", rows=64, seed=1)
    assert check_main(_args(tmp_path), default_config=None) == 0
    out = capsys.readouterr().out
    lines = [line.split("[sdtrain] check: ", 1)[1] for line in out.splitlines() if "[sdtrain] check: " in line]
    header, one, two, communication, projected, recorded = lines
    assert header.split()[:3] == ["phase", "options", "result"]
    # Each phase: trained as configured (eager), with its micro-batch (auto: null's on CPU workers); images/s per GPU,
    # no MFU on CPU, data wait, checkpoint stall, no measured peak memory on CPU beside the memory model's prediction.
    for row, name in ((one, "1 GPU"), (two, "2 GPUs")):
        assert row.startswith(name) and ", eager, micro-batch 4" in row and " trained " in row, row
        figures = re.fullmatch(r".* trained +(\d+\.\d) +- +(\d+\.\d)% +(\d+\.\d) s +-/- \((\d+\.\d\d)\) of -", row)
        assert figures and float(figures[1]) > 0 and float(figures[4]) > 1, row  # 1 GiB for the CUDA runtime
    assert re.fullmatch(r"communication: \d+\.\d% of the full run's step \(.*net of data wait\)", communication)
    hours = re.fullmatch(
        r"projected: 100000 steps in (\d+)h(\d\d)m on 2 workers, ([\d,]+) at run.gpu_hour_cost=2.5", projected
    )
    assert hours, projected
    # The table, recorded beside the phases as JSON: what was printed, and the figures as data.
    (record,) = (tmp_path / "runs/checks").glob("mine-check-*.json")
    assert recorded == f"recorded: {record}"
    saved = json.loads(record.read_text())
    assert saved["table"] == lines[:-1] and [phase["workers"] for phase in saved["phases"]] == [1, 2]
    assert saved["phases"][0]["images_per_s_per_gpu"] > 0 and saved["phases"][0]["compiled"] is False
    assert saved["phases"][0]["graphs_compiled"] is None  # eager: no count
    assert saved["gpu_hour_cost"] == 2.5 and saved["projected_cost"] > 0
    # Each phase is its own run beside the configured one's, checkpointed halfway and at the end, not exported.
    runs = sorted(p.name for p in (tmp_path / "runs/checks").iterdir() if p.is_dir())
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
    assert re.search(r"\[sdtrain\] check: 1 GPU +.* failed ", out), out
    assert re.search(r"\[sdtrain\] check: 1 GPU failed: DataError: .*a\.parquet", out), out
    assert "projected" not in out
