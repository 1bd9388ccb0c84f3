"""The training checks of tests/test_options.py on a CUDA GPU (``pytest -m gpu``; skipped where
CUDA is absent): every precision the config accepts, clipping and EMA, a NaN step, compile,
channels_last, gradient checkpointing, both attention kernels, FSDP on one device, save and
resume. The same code path as a Ray worker (sdtrain.train.build.build_training), without Ray, which
a lent GPU machine does not have (docs/gpu.md).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_config
from support.training import FIT, batches, fit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = "scaling.use_gpu=true"


def gpu_fit(cfg, n=3, nan_at=(), same=False, **kwargs):
    # Host batches, as Ray Data hands them: the fit pins them and copies them to the GPU (a CUDA tensor cannot be
    # pinned: the first GPU session found that).
    return fit(cfg, batches(n, nan_at=nan_at, same=same), use_gpu=True, **kwargs)


@pytest.mark.parametrize("ema", [None, 0.9])
@pytest.mark.parametrize("clip", [0.0, 0.01])
@pytest.mark.parametrize("precision", ["auto", "bf16-mixed", "16-mixed", "32-true"])
def test_every_precision_with_and_without_clipping_and_ema_trains_on_the_gpu(precision, clip, ema):
    cfg = tiny_config(
        *FIT, GPU, f"train.precision={precision}", f"train.grad_clip_norm={clip}", f"train.ema_decay={ema or 'null'}"
    )
    module, trainer, steps = gpu_fit(cfg)
    assert all(s["device"] == "cuda" for s in steps)  # after fit, Lightning's teardown has moved it to the CPU
    assert trainer.global_step == 3 and all(0 < s["loss"] < 10 for s in steps)
    auto = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    assert trainer.precision == (auto if precision == "auto" else precision)
    if clip:  # a step the GradScaler skipped for overflow keeps its non-finite gradients
        counts = [0] + [s["skipped"] for s in steps]
        skipped = [after > before for before, after in itertools.pairwise(counts)]
        assert all(s["grad_norm"] <= clip * 1.001 for s, skip in zip(steps, skipped, strict=True) if not skip)
    assert not torch.equal(steps[0]["weight"], steps[-1]["weight"])
    if ema:
        assert not torch.equal(steps[0]["ema"], steps[-1]["ema"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_nan_step_is_skipped_and_counted_as_bad_on_the_gpu(precision):
    cfg = tiny_config(*FIT, GPU, f"train.precision={precision}", "train.ema_decay=0.9")
    module, trainer, steps = gpu_fit(cfg, nan_at=[1])
    assert trainer.global_step == 3 and steps[-1]["streak"] == 1  # a NaN loss is bad under a scaler too
    assert torch.equal(steps[1]["weight"], steps[0]["weight"]) and torch.equal(steps[1]["ema"], steps[0]["ema"])
    assert torch.isfinite(steps[2]["weight"]).all() and not torch.equal(steps[2]["weight"], steps[1]["weight"])


@pytest.mark.parametrize(
    "options",
    [
        ("train.compile=true",),
        ("train.channels_last=true",),
        ("train.gradient_checkpointing=true",),
        ("train.attention=eager",),
        ("train.attention=sdpa",),
        ("train.compile=true", "train.channels_last=true", "train.gradient_checkpointing=true"),
        ("train.strategy=fsdp", "train.ema_decay=0.9"),
        ("train.strategy=fsdp", "train.compile=true", "train.gradient_checkpointing=true"),
    ],
)
def test_each_gpu_option_trains_under_bf16(options, tmp_path):
    cfg = tiny_config(*FIT, GPU, "train.precision=bf16-mixed", *options)
    _, trainer, steps = gpu_fit(cfg, default_root_dir=str(tmp_path))
    _, _, plain = gpu_fit(tiny_config(*FIT, GPU, "train.precision=bf16-mixed"))
    assert trainer.global_step == 3 and all(0 < s["loss"] < 10 for s in steps)
    assert steps[0]["loss"] == pytest.approx(plain[0]["loss"], rel=5e-2)  # bf16: the same function, roughly


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_bf16_checkpoint_resumes_on_the_gpu(strategy, tmp_path):
    options = (GPU, "train.precision=bf16-mixed", "train.ema_decay=0.9", f"train.strategy={strategy}")
    _, trainer, _ = gpu_fit(tiny_config(*FIT, *options, steps=2), n=4, same=True, default_root_dir=str(tmp_path))
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    resumed, trainer, steps = gpu_fit(
        tiny_config(*FIT, *options, steps=4),
        n=4,
        same=True,
        ckpt_path=str(tmp_path / "step2.ckpt"),
        default_root_dir=str(tmp_path),
    )
    assert trainer.global_step == 4 and [s["step"] for s in steps] == [3, 4]
    assert all(0 < s["loss"] < 10 for s in steps)


def test_the_device_settings_are_set_and_host_batches_train_pinned():
    """fit_without_ray applies the worker's GPU settings (sdtrain.train.device_settings) and trains on float16 batches
    from host memory, pinned and copied non_blocking, as the Ray worker's stream hands them over."""
    cfg = tiny_config(*FIT, GPU, "train.precision=bf16-mixed")
    host = [{k: v.half() for k, v in batch.items()} for batch in batches(3)]
    module, trainer, steps = fit(cfg, host, use_gpu=True)
    assert all(s["device"] == "cuda" for s in steps) and module.caption_dtype == torch.bfloat16
    assert torch.backends.cudnn.benchmark and torch.get_float32_matmul_precision() == "high"
    assert trainer.global_step == 3 and all(0 < s["loss"] < 10 for s in steps)
