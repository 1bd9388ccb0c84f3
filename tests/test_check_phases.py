"""The check job's planning of its phases (sdtrain.driver.check): where it lists data.train before any phase, the
micro-batch and memory prediction of a phase under FSDP, the dataset index a phase starts from, the compile line of
a one-worker run, and a retraining config refused before any phase."""

import os
import re

import boto3
import pytest
from conftest import REPO, write_latents

from sdtrain.config.loader import load_config
from sdtrain.driver.check import (
    _pinned,
    fitted_micro_batch,
    phase_config,
    phase_options,
    plan_check,
    predicted_memory,
    run_micro_batch,
    seed_phase_index,
)
from sdtrain.driver.check_report import CheckReport, Phase
from sdtrain.driver.cli import check_main
from sdtrain.errors import ConfigError, DataError

SDXL = str(REPO / "configs" / "sdxl-base.yaml")
SDXL_SHAPES = ((4, 128, 128), (77, 2048), ())  # 1024 px latents, SDXL's two encoders' embeddings


def test_the_checks_planning_lists_s3_data_on_the_configured_endpoint(s3_bucket, ray_cluster, tmp_path, monkeypatch):
    """micro_batch_size auto lists data.train before any phase (its shapes fit the micro-batch): storage.endpoint_url
    must be applied first. It was applied only in each phase's preflight, so that listing went to AWS."""
    from sdtrain.storage.s3 import ENDPOINT_VARS, s3_endpoint

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    s3 = boto3.client("s3")
    for i in range(3):
        write_latents(tmp_path / f"part-{i}.parquet", rows=8, seed=i)
        s3.upload_file(str(tmp_path / f"part-{i}.parquet"), "sdtrain-test", f"train/part-{i}.parquet")
    for var in ENDPOINT_VARS:  # the endpoint from the config alone, as a job's is
        monkeypatch.delenv(var, raising=False)
    overrides = [
        f"data.train={s3_bucket}/train/",
        f"storage.endpoint_url={endpoint}",
        "model.preset=tiny",
        "train.micro_batch_size=auto",
        "scaling.use_gpu=auto",  # the session's cluster has no GPU: auto is null's size, from data.train's shapes
        "scaling.num_workers=2",
        "train.global_batch_size=8",
        f"run.storage_path={tmp_path}/runs",
    ]
    config, micro = plan_check(None, overrides)
    assert micro == 4 and config.data.train == [f"{s3_bucket}/train/"]
    assert s3_endpoint() == (endpoint, "storage.endpoint_url")


def test_under_fsdp_a_phase_on_fewer_gpus_than_the_run_fits_its_own_micro_batch_and_says_so():
    """sdxl-base at a fixed micro-batch of 32 fits a rank of 64 (FSDP shards the model's state over them); the
    one-GPU phase pinned the run's 32, which one GPU holding the whole model cannot (80.7 GiB: refused on an A100,
    out of memory on an 80 GB H100)."""
    from sdtrain.model.hardware import memory_range

    overrides = ["train.micro_batch_size=32"]
    run = load_config(SDXL, overrides)
    micro = run_micro_batch(run)
    assert micro == 32 and run.train.strategy == "fsdp" and run.scaling.min_workers > 1
    most = run.scaling.max_workers
    full = phase_config(SDXL, overrides, most, micro_batch=_pinned(run, most, micro))
    assert full.train.micro_batch_size == 32  # the run's own world size: the run's size
    one = phase_config(SDXL, overrides, 1, micro_batch=_pinned(run, 1, micro))
    assert one.train.micro_batch_size == "auto"
    h100 = memory_range("H100")[0]
    assert predicted_memory(one, 1, True, 32, SDXL_SHAPES) > h100  # the run's size on one GPU
    fitted = fitted_micro_batch(one, "H100", True, SDXL_SHAPES)  # the memory check fits it, and accepts it
    assert fitted == 16 and predicted_memory(one, 1, True, fitted, SDXL_SHAPES) < h100
    assert phase_options(one, 1, fitted, 32).endswith("micro-batch 16 (the run's: 32)")
    assert phase_options(one, 1, None, 32).endswith("micro-batch auto (the run's: 32)")  # failed before fitting
    phase = Phase("1 GPU", 1, phase_options(one, 1, fitted, 32), micro_batch=fitted, run_micro_batch=32)
    table = CheckReport(run, [phase], None, None, None).table()
    assert any(line.startswith("1 GPU: micro-batch 16, not the run's 32: under FSDP") for line in table), table


def test_the_one_gpu_row_names_and_predicts_the_micro_batch_its_driver_fitted():
    """configs/sdxl-base.yaml's one-GPU phase trains 16 a step twice on an H100 (auto, fitted by its driver); its row
    said micro-batch 32 and predicted 32's memory (86.7 GB, more than the GPU) beside the peak 16 reached."""
    run = load_config(SDXL, [])
    one = phase_config(SDXL, [], 1, micro_batch=_pinned(run, 1, 32))
    micro = fitted_micro_batch(one, "H100", True, SDXL_SHAPES)  # what run_micro_batch resolves on an H100 cluster
    assert micro == 16
    assert phase_options(one, 1, micro, 32).endswith("micro-batch 16 (the run's: 32)")
    predicted = predicted_memory(one, 1, True, micro, SDXL_SHAPES) / 1e9
    assert 65 < predicted < 79, predicted  # an H100's 79.6 GiB holds it (32's: 86.7 GB)


def test_a_phase_starts_from_the_runs_dataset_index_or_the_first_phases_and_reads_no_footer(tmp_path, caplog):
    """Each phase is a new run: its driver read every parquet footer of data.train again (minutes a phase at 1e5
    files). A phase's index is seeded from the configured run's, else from the first phase's; run.start_fresh (a
    phase's run is new) would move the seed aside."""
    from sdtrain.driver.run import check_run

    for i in range(12):
        write_latents(tmp_path / f"train/f{i:03d}.parquet", rows=8, seed=i)
    overrides = [
        f"data.train={tmp_path}/train",
        "model.preset=tiny",
        "train.global_batch_size=8",
        "scaling.num_workers=2",
        "scaling.use_gpu=false",
        f"run.storage_path={tmp_path}/runs",
        "run.name=mine",
        "run.start_fresh=true",
        "export.enabled=false",
    ]
    run = load_config(None, overrides)

    def footers_read(config) -> int:
        """The footers of data.train the driver's checks of ``config`` read (sdtrain.driver.run.check_run)."""
        caplog.clear()
        with caplog.at_level("INFO", logger="sdtrain"):
            check_run(config)
        (read,) = re.findall(r"data\.train: 12 files \(\d+ from the index, (\d+) footers read", caplog.text)
        return int(read)

    first = phase_config(None, overrides, 1, steps=8, stamp="A")
    seed_phase_index(run, first, None)  # no run index yet: nothing to seed
    assert footers_read(first) == 12
    second = phase_config(None, overrides, 2, steps=8, stamp="A")
    seed_phase_index(run, second, first)
    assert footers_read(second) == 0

    # The configured run's own index, where it has one, for every phase.
    footers_read(load_config(None, [*overrides, "run.start_fresh=false"]))
    later = phase_config(None, overrides, 1, steps=8, stamp="B")
    seed_phase_index(run, later, None)
    assert footers_read(later) == 0


def test_compare_compile_on_a_one_worker_run_prints_the_compile_line():
    """scaling.num_workers=1 with --compare-compile has two phases, the second flipped: the line needed three."""
    config = load_config(None, ["data.train=/d", "train.compile=true", "scaling.num_workers=1"])
    one = Phase("1 GPU", 1, "ddp", True, images_per_s_per_gpu=100.0, data_wait=0.0, steps_per_s=1.0)
    flipped = Phase("1 GPU, compile flipped", 1, "ddp", False, images_per_s_per_gpu=80.0, data_wait=0.0)
    table = CheckReport(config, [one, flipped], None, 1.0, None).table()
    assert "compile: 100.0 images/s per GPU compiled, 80.0 eager (+25%) on one GPU" in table, table
    full = Phase("4 GPUs", 4, "ddp", True, images_per_s_per_gpu=90.0, data_wait=0.0)
    three = CheckReport(config, [one, full, flipped], None, 1.0, None).table()
    assert "compile: 100.0 images/s per GPU compiled, 80.0 eager (+25%) on one GPU" in three
    assert not any(line.startswith("compile:") for line in CheckReport(config, [one, full], None, 1.0, None).table())


def test_a_retraining_config_is_refused_naming_data_train_before_any_phase(tmp_path, capsys):
    """configs/retrain.yaml names no data.train (retrain.py sets each round's): validation accepted it, and each
    phase died on a bare assert in the dataset index."""
    from sdtrain.config.learning import Columns
    from sdtrain.data.dataset_index import index_dataset
    from sdtrain.driver.data_check import check_data

    overrides = [
        f"data.val={tmp_path}/val",
        f"retrain.data_root={tmp_path}/daily",
        f"retrain.models_root={tmp_path}/models",
        f"run.storage_path={tmp_path}/runs",
    ]
    argv = ["--steps", "8", "--config", str(REPO / "configs" / "retrain.yaml"), *overrides]
    assert check_main(argv, None) == 2
    error = capsys.readouterr().err
    assert re.search(r"error: data\.train: is empty: .*entrypoints/retrain\.py", error), error
    assert not (tmp_path / "runs").exists()  # before any phase
    config = load_config(str(REPO / "configs" / "retrain.yaml"), overrides)
    with pytest.raises(ConfigError, match=r"^data\.train: .*entrypoints/retrain\.py"):
        check_data(config, f"{tmp_path}/runs/x")  # train.py's path: its driver's data check
    with pytest.raises(DataError, match=r"^data\.train: names no parquet files"):
        index_dataset([], "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
