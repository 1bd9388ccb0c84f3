"""Live MFU and cost (sdtrain.train.efficiency): the GPU peak table (sdtrain.model.hardware), the arithmetic, and
what the progress line, metrics.csv and the final summary show with and without a GPU."""

import csv

import pytest
from conftest import tiny_config

from sdtrain.artifacts.run_outputs import LossLabels
from sdtrain.artifacts.run_totals import hours_so_far, run_totals
from sdtrain.model.flops import unet_train_step_flops
from sdtrain.model.hardware import (
    A10,
    A10G,
    A100,
    B200,
    H100_NVL,
    H100_PCIE,
    H100_SXM,
    H200_NVL,
    H200_SXM,
    L4,
    L40S,
    TERA,
    device_gpu,
    peak_flops,
)
from sdtrain.storage.run_layout import METRICS_FILE
from sdtrain.train.build import build_training, checkpoint_meta
from sdtrain.train.efficiency import Efficiency, cost_per_million_images
from sdtrain.train.live_files import LiveOutputs
from sdtrain.train.reporting import _progress_line

# torch.cuda.get_device_name's strings, as drivers report them -> the datasheet's dense bf16 TFLOP/s.
NAMED = [
    ("NVIDIA A10G", A10G, 70),
    ("NVIDIA A10", A10, 125),
    ("NVIDIA L4", L4, 121),
    ("NVIDIA L40S", L40S, 362.05),
    ("NVIDIA A100-SXM4-80GB", A100, 312),
    ("NVIDIA A100-SXM4-40GB", A100, 312),
    ("NVIDIA A100-PCIE-40GB", A100, 312),
    ("NVIDIA A100 80GB PCIe", A100, 312),
    ("NVIDIA H100 80GB HBM3", H100_SXM, 989.5),
    ("NVIDIA H100 PCIe", H100_PCIE, 756.5),
    ("NVIDIA H100 NVL", H100_NVL, 835.5),
    ("NVIDIA H200", H200_SXM, 989.5),
    ("NVIDIA H200 NVL", H200_NVL, 835.5),
    ("NVIDIA B200", B200, 2250),
]


@pytest.mark.parametrize(("name", "peak", "bf16_tflops"), NAMED)
def test_each_named_device_gets_its_datasheet_peak(name, peak, bf16_tflops):
    assert device_gpu(name) is peak
    assert peak.bf16 == pytest.approx(bf16_tflops * TERA)


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100",  # no variant: SXM and PCIe are 24% apart
        "NVIDIA GH200 480GB",  # not an H200
        "NVIDIA L40",  # not an L40S
        "Tesla T4",
        "NVIDIA GeForce RTX 4090",
        "cpu",
        "",
    ],
)
def test_an_unknown_or_ambiguous_device_has_no_peak(name):
    assert device_gpu(name) is None


def test_the_precision_picks_the_peak():
    assert peak_flops(H100_SXM, "bf16-mixed", tf32=False) == 989.5 * TERA
    assert peak_flops(A10G, "16-mixed", tf32=False) == 70 * TERA
    # 32-true: TF32 tensor cores when torch allows them, else plain float32.
    assert peak_flops(A100, "32-true", tf32=True) == 156 * TERA
    assert peak_flops(A100, "32-true", tf32=False) == 19.5 * TERA
    assert peak_flops(A100, "64-true", tf32=True) is None


def test_mfu_and_cost_arithmetic():
    # 8 A100s at 2,000 images/s, 100 GFLOP per image: 250 images/s per GPU x 1e11 FLOP / 3.12e14 FLOP/s.
    efficiency = Efficiency(flops_per_image=100e9, peak_flops=A100.bf16, gpu_hour_cost=2.0, on_gpu=True)
    figures = efficiency.window(samples_per_s=2000.0, workers=8, shapes={})
    assert figures["mfu"] == pytest.approx(250 * 100e9 / 312e12)
    # 8 GPUs x 2 an hour = 16 an hour, for 7.2M images an hour.
    assert figures["cost_per_million_images"] == pytest.approx(16 / 7.2)
    assert cost_per_million_images(2000.0, 8, 2.0) == figures["cost_per_million_images"]
    assert efficiency.window(samples_per_s=0.0, workers=8, shapes={}) == {}  # a window without a step shows no rate
    assert Efficiency(100e9, A100.bf16, None, True).window(2000.0, 8, {}).keys() == {"mfu"}  # no price: no cost


def test_on_cpu_the_flops_are_counted_and_no_mfu_is_made_up():
    cfg = tiny_config("data.train=/unused")
    meta = checkpoint_meta(cfg, (4, 16, 16), (77, 32))
    module, trainer_kwargs = build_training(cfg, meta, use_gpu=False)
    efficiency = Efficiency.of_run(module, trainer_kwargs["precision"], gpu_hour_cost=0.5)
    assert efficiency.flops_per_image == unet_train_step_flops(meta.unet_config, (4, 16, 16), (77, 32)) > 0
    assert efficiency.peak_flops is None and not efficiency.on_gpu and efficiency.hours_key == "worker_hours"
    # The cost needs only the throughput and the price: a CPU worker's hour, as the user priced it.
    figures = efficiency.window(samples_per_s=10.0, workers=2, shapes={})
    assert figures == {"cost_per_million_images": pytest.approx(2 * 0.5 / 36_000 * 1e6)}
    assert Efficiency.of_run(module, "32-true", gpu_hour_cost=None).window(10.0, 2, {}) == {}


def test_a_bucketed_run_counts_each_buckets_flops_and_its_mfu_weighs_the_windows_buckets(caplog):
    """Aspect-ratio buckets: the module counts each window's samples by latent shape in a real Lightning fit, and MFU
    divides the FLOPs of each bucket's images (counted the first time a bucket is seen) by the peak."""
    import dataclasses

    import lightning.pytorch as pl
    import torch

    from sdtrain.model.flops import mfu

    cfg = tiny_config("data.train=/unused", batch=4)
    buckets = [(4, 16, 16), (4, 16, 24)]
    meta = checkpoint_meta(cfg, (4, 16, 16), (77, 32), bucket_shapes=buckets)
    module, kwargs = build_training(cfg, meta, use_gpu=False)
    batches = [{"latents": torch.randn(4, *shape), "captions": torch.randn(4, 77, 32)} for shape in buckets * 2]
    trainer = pl.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    shapes = module.take_window_shapes()
    assert shapes == {(4, 16, 16): 8, (4, 16, 24): 4} and module.take_window_shapes() == {}

    on_cpu = Efficiency.of_run(module, kwargs["precision"], gpu_hour_cost=None)
    assert on_cpu.count is not None and on_cpu.window(64.0, 2, shapes) == {}  # a CPU has no peak: no MFU
    gpu = dataclasses.replace(on_cpu, peak_flops=A100.bf16)
    square, wide = (unet_train_step_flops(meta.unet_config, shape, (77, 32)) for shape in buckets)
    assert wide > square > 0
    with caplog.at_level("INFO", logger="sdtrain"):
        figures = gpu.window(2000.0, 8, shapes)
    assert figures["mfu"] == pytest.approx(mfu(2000.0 / 8, (8 * square + 4 * wide) / 12, A100.bf16))
    assert f"bucket 4x16x24: {wide / 1e9:.3f} GFLOP per image" in caplog.text
    # Data of one shape: every image at flops_per_image, whatever the window.
    single = Efficiency(square, A100.bf16, None, True)
    assert single.window(2000.0, 8, shapes)["mfu"] == pytest.approx(mfu(250.0, square, A100.bf16))


def _metrics(**extra):
    base = {"step": 10, "loss": 0.5, "skipped_steps": 0, "skipped_samples": 0, "lr": 1e-4, "steps_per_s": 2.0}
    return {**base, "samples_per_s": 64.0, "data_wait_fraction": 0.01, **extra}


def test_the_progress_line_shows_mfu_and_cost_only_where_they_exist():
    gpu = _progress_line(_metrics(mfu=0.3125, cost_per_million_images=2.2222), max_steps=100)
    assert "64.0 samples/s | MFU 31.2% | 2.22/M images | data wait" in gpu
    cpu = _progress_line(_metrics(cost_per_million_images=0.01234), max_steps=100)
    assert "MFU" not in cpu and "64.0 samples/s | 0.0123/M images | data wait" in cpu
    assert "MFU" not in _progress_line(_metrics(), 100) and "/M images" not in _progress_line(_metrics(), 100)


def test_metrics_csv_of_a_cpu_run_has_a_cost_column_and_no_mfu_column(tmp_path):
    cpu = Efficiency(flops_per_image=1e9, peak_flops=None, gpu_hour_cost=1.5, on_gpu=False)
    rows = [
        {**_metrics(step=s), **cpu.window(64.0, 2, {}), "worker_hours": s / 1000, "time_to_first_step_s": 1.0}
        for s in (2, 4)
    ]
    live = LiveOutputs(str(tmp_path / "run"), LossLabels("epsilon", None))
    live.update(rows)
    assert live.writer.flush(timeout=60)
    with open(tmp_path / "run" / METRICS_FILE) as f:
        written = list(csv.DictReader(f))
    assert "mfu" not in written[0] and "gpu_hours" not in written[0]
    assert [float(r["cost_per_million_images"]) for r in written] == [pytest.approx(2 * 1.5 / (64 * 3600) * 1e6)] * 2
    assert [float(r["worker_hours"]) for r in written] == [0.002, 0.004]


def test_the_run_mfu_is_its_flops_over_its_gpu_hours_of_peak_across_a_restart_and_a_resize():
    """Rows built as rank 0 builds them (each window's MFU, hours adding workers x seconds); a restart continues
    the hours from the checkpoint's last row. The run's MFU must be all its images' FLOPs over the peak FLOPs
    of all its GPU-seconds, whatever the windows' lengths and world sizes."""
    gpu = Efficiency(flops_per_image=500e9, peak_flops=H100_SXM.bf16, gpu_hour_cost=3.0, on_gpu=True)
    batch, history, hours, step = 64, [], 0.0, 0
    windows = [(10, 0.4, 4), (10, 0.3, 4), (20, 0.5, 8), (10, 0.12, 8)]  # steps, seconds, workers
    for steps, seconds, workers in windows:
        step += steps
        hours += workers * seconds / 3600
        row = {"step": step, **gpu.window(steps * batch / seconds, workers, {}), gpu.hours_key: hours}
        history.append(row)
    assert hours_so_far(history) == hours  # where a restarted worker group starts counting
    totals = run_totals(history, batch, gpu_hour_cost=3.0)
    gpu_seconds = sum(workers * seconds for _, seconds, workers in windows)
    assert totals.images == 50 * batch
    assert totals.hours == pytest.approx(gpu_seconds / 3600) and totals.on_gpu
    assert totals.mfu == pytest.approx(50 * batch * 500e9 / (gpu_seconds * H100_SXM.bf16))
    assert totals.cost == pytest.approx(3.0 * gpu_seconds / 3600)
    # 7.76 GPU-seconds; 3,200 x 500 GFLOP / (7.76 s x 989.5 TFLOP/s) = 20.8%.
    assert totals.line() == (
        "3,200 images trained in 0.002156 GPU-hours, MFU 20.8%, cost 0.00647 (run.gpu_hour_cost x GPU-hours)"
    )


def test_a_cpu_run_totals_worker_hours_and_no_mfu():
    history = [{"step": 4, "worker_hours": 0.01}, {"step": 8, "worker_hours": 0.03}]
    totals = run_totals(history, 16, gpu_hour_cost=None)
    assert (totals.images, totals.hours, totals.on_gpu, totals.mfu, totals.cost) == (128, 0.03, False, None, None)
    assert totals.line() == "128 images trained in 0.03 worker-hours, no MFU on CPU workers"
    priced = run_totals(history, 16, gpu_hour_cost=2.0)
    assert priced.cost == pytest.approx(0.06) and priced.line().endswith("cost 0.06 (run.gpu_hour_cost x worker-hours)")
    # Rows from before these metrics: images only.
    assert run_totals([{"step": 8}], 16, 2.0).line() == "128 images trained, no MFU on CPU workers"
