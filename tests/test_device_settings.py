"""The GPU settings of a training process (sdtrain.train.device_settings) as configuration: which flags are set for
which config and device, what the step feeds the UNet, and, on fake CUDA tensors, what channels_last costs a
GroupNorm on a GPU. The settings trained in a real Trainer: tests/test_options.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from support.fake_cuda import OpLog, fake_cuda, forward_on_fake_cuda, group_norm_copies
from support.training import CAPTIONS, FIT, LATENTS
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from sdtrain.model.unet import build_unet
from sdtrain.train.build import build_training, checkpoint_meta
from sdtrain.train.device_settings import CHANNELS_LAST_WITHOUT_COMPILE, device_settings


@pytest.fixture
def flags():
    """Put back every flag the settings may set (they are process-wide), exactly as they were."""

    def read():
        return {
            "cuda.matmul": torch.backends.cuda.matmul.fp32_precision,
            "mkldnn.matmul": torch.backends.mkldnn.matmul.fp32_precision,
            "cudnn.conv": torch.backends.cudnn.conv.fp32_precision,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
        }

    before = read()
    yield read
    torch.backends.cuda.matmul.fp32_precision = before["cuda.matmul"]
    torch.backends.mkldnn.matmul.fp32_precision = before["mkldnn.matmul"]
    torch.backends.cudnn.conv.fp32_precision = before["cudnn.conv"]
    torch.backends.cudnn.benchmark = before["cudnn.benchmark"]
    assert read() == before


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
@pytest.mark.parametrize("use_gpu", [True, False])
def test_each_device_and_precision_gets_its_settings(use_gpu, precision):
    settings = device_settings(tiny_config(*FIT).train, precision, use_gpu)
    assert settings.device_type == ("cuda" if use_gpu else "cpu")
    assert settings.tf32 == settings.cudnn_benchmark == settings.pin_memory == use_gpu
    assert (
        settings.caption_dtype
        == {
            "bf16-mixed": torch.bfloat16,
            "16-mixed": torch.float16,
            "32-true": torch.float32,
        }[precision]
    )
    assert settings.advice == ()


@pytest.mark.parametrize(
    ("options", "use_gpu", "advised"),
    [
        (("train.channels_last=true",), True, True),
        (("train.channels_last=true", "train.compile=true"), True, False),
        (("train.channels_last=true",), False, False),  # CPU kernels keep channels-last through GroupNorm
        ((), True, False),
    ],
)
def test_channels_last_without_compile_on_a_gpu_is_advised_against(options, use_gpu, advised):
    settings = device_settings(tiny_config(*FIT, *options).train, "bf16-mixed", use_gpu)
    assert settings.advice == ((CHANNELS_LAST_WITHOUT_COMPILE,) if advised else ())


def test_an_unresolved_precision_is_refused():
    with pytest.raises(ValueError, match="precision 'auto'"):
        device_settings(tiny_config(*FIT).train, "auto", True)


def test_a_gpu_process_gets_tf32_and_autotuning_and_a_cpu_process_nothing(flags):
    before = flags()
    assert device_settings(tiny_config(*FIT).train, "32-true", False).apply() == {}
    assert flags() == before
    applied = device_settings(tiny_config(*FIT).train, "bf16-mixed", True).apply()
    assert applied == {"float32_matmul_precision": "high", "cudnn.allow_tf32": True, "cudnn.benchmark": True}
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.benchmark
    # Lightning asks this on Ampere and later GPUs; it raises when the backends were set through mixed APIs.
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("use_gpu", [True, False])
def test_build_training_applies_the_settings_of_its_device(use_gpu, flags):
    """The builder the worker and fit_without_ray share: the flags of its device, and the captions at autocast's
    dtype. (use_gpu=True builds the Trainer's arguments without a GPU; nothing here touches one.)"""
    cfg = tiny_config(*FIT, "train.precision=bf16-mixed")
    before = flags()
    module, _ = build_training(cfg, checkpoint_meta(cfg, LATENTS, CAPTIONS), use_gpu=use_gpu)
    assert module.caption_dtype == torch.bfloat16
    assert (flags() != before) == use_gpu
    assert torch.backends.cudnn.benchmark == (use_gpu or before["cudnn.benchmark"])


def _tiny_unet():
    torch.manual_seed(0)
    return build_unet(tiny_config(*FIT).model).eval()


class _Attention(TorchFunctionMode):
    """What each scaled_dot_product_attention call gets: query dtype, head dim, mask, dropout."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0]
            self.calls.append((query.dtype, query.shape[-1], kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0)))
        return func(*args, **kwargs)


def test_captions_at_autocast_dtype_give_the_same_prediction_with_two_casts_fewer_per_cross_attention():
    """Captions handed over in bf16 under bf16 autocast: the prediction is bitwise the float32 handover's (autocast
    would round them to bf16 at each key and value projection anyway), and those casts are gone.

    And nothing to set for attention: every SDPA call gets bf16 queries, keys and values, no mask, no dropout and a
    head dim within flash's 256, so PyTorch's default order (flash, memory-efficient, math) picks flash on a GPU."""
    unet = _tiny_unet()
    g = torch.Generator().manual_seed(1)
    noisy, captions = torch.randn(2, *LATENTS, generator=g), torch.randn(2, *CAPTIONS, generator=g).half()
    t = torch.tensor([10, 500])
    cross_attentions = sum(getattr(m, "is_cross_attention", False) for m in unet.modules())
    results = {}
    attention = _Attention()
    for dtype in (torch.float32, torch.bfloat16):
        log = OpLog()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), attention, log:
            out = unet(noisy, t, encoder_hidden_states=captions.to(dtype)).sample
        casts = sum(func is torch.ops.aten._to_copy.default for func, *_ in log.calls)
        results[dtype] = (out, casts)
    assert cross_attentions == 4
    assert torch.equal(results[torch.float32][0], results[torch.bfloat16][0])
    assert results[torch.float32][1] - results[torch.bfloat16][1] == 2 * cross_attentions
    assert len(attention.calls) == 2 * 8  # two forwards, 4 transformer blocks: self- and cross-attention
    assert all(call == (torch.bfloat16, call[1], None, 0.0) and call[1] <= 256 for call in attention.calls)
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_group_norm_copies_a_channels_last_input_back_to_nchw_on_cuda_but_not_on_cpu():
    """aten::group_norm's CUDA branch (the same C++ code a GPU runs, dispatched on a fake CUDA tensor) copies a
    channels-last input to NCHW and returns NCHW; the CPU kernel keeps channels-last, so CPU runs cannot see it."""
    x = torch.randn(2, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.ones(64), torch.zeros(64)
    mode = FakeTensorMode()
    cuda_log, cpu_log = OpLog(), OpLog()
    with mode, cuda_log:
        on_cuda = F.group_norm(fake_cuda(mode, x), 32, fake_cuda(mode, weight), fake_cuda(mode, bias))
    with cpu_log:
        on_cpu = F.group_norm(x, 32, weight, bias)
    assert on_cuda.device.type == "cuda" and on_cuda.is_contiguous()
    assert not on_cuda.is_contiguous(memory_format=torch.channels_last)
    assert len(group_norm_copies(cuda_log)) == 1
    assert on_cpu.is_contiguous(memory_format=torch.channels_last) and group_norm_copies(cpu_log) == []


def test_a_channels_last_unet_copies_layouts_back_and_forth_on_cuda():
    """The tiny UNet's training forward on fake CUDA tensors, convolutions given cuDNN's layout: channels_last
    makes 11 of its 21 GroupNorms copy their input back to NCHW and 19 convolutions copy an NCHW input back to
    channels-last (small and sd2-base: docs/gpu.md); in NCHW there is neither."""
    counts = {}
    for memory_format in (torch.contiguous_format, torch.channels_last):
        unet = _tiny_unet().train().to(memory_format=memory_format)  # training's layouts (dropout's differ)

        def inputs(mode, memory_format=memory_format):
            sample = torch.empty(2, *LATENTS).contiguous(memory_format=memory_format)
            return (fake_cuda(mode, sample), fake_cuda(mode, torch.zeros(2, dtype=torch.long))), {
                "encoder_hidden_states": fake_cuda(mode, torch.empty(2, *CAPTIONS))
            }

        log = forward_on_fake_cuda(unet, inputs)
        norms = sum(func is torch.ops.aten.native_group_norm.default for func, *_ in log.calls)
        counts[memory_format] = (norms, len(group_norm_copies(log)), len(log.conv_copies))
    assert counts == {torch.contiguous_format: (21, 0, 0), torch.channels_last: (21, 11, 19)}
