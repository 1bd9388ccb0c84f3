"""The training memory model (sdtrain.model.memory): its casts against CUDA autocast's, its prediction against a
real CPU training step's peak, and how the strategy, checkpointing and precision move it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from support.fake_cuda import CudaFactories, fake_cuda
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sdtrain.config.schema import ModelConfig
from sdtrain.model.memory import CudaAutocastRules, TrainingMemory, predict_training_memory
from sdtrain.model.unet import build_unet, unet_config

TINY = unet_config(ModelConfig(preset="tiny"))
TINY_SHAPES = ((4, 16, 16), (77, 32))
MiB = 2**20


class _ComputeLog(TorchDispatchMode):
    """(op, dtype, shape) of every op that computes a new floating tensor on the model's device: no views, no
    factories, nothing on the meta device (fake CUDA's helpers work there)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.muted = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out  # a norm's output, not its statistics
        computes = isinstance(first, torch.Tensor) and first.is_floating_point() and first.device.type != "meta"
        if computes and not self.muted and not func.is_view and any(isinstance(a, torch.Tensor) for a in args):
            self.ops.append((func.__name__, first.dtype, tuple(first.shape)))
        return out


class _OneAttentionOp(TorchFunctionMode):
    """Logs each scaled_dot_product_attention as one op, with the fused kernels' output layout (heads inside
    positions in memory). Fake CUDA has no fused kernel to pick and runs the math one, whose ops, and whose
    (batch, heads, positions) layout that the next reshape copies, a GPU does not have."""

    def __init__(self, log: _ComputeLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.log.muted = True
        try:
            out = func(*args, **(kwargs or {})).transpose(1, 2).contiguous().transpose(1, 2)
        finally:
            self.log.muted = False
        self.log.ops.append(("scaled_dot_product_attention", out.dtype, tuple(out.shape)))
        return out


def _bf16_forward_ops(preset: str, device: str, side: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The ops of one bf16-autocast training forward of the preset's UNet on fake tensors of ``device``: on
    "cuda" under CUDA autocast, on "cpu" under CPU autocast with :class:`CudaAutocastRules`, as the model traces."""
    with torch.device("meta"):
        unet = build_unet(ModelConfig(preset=preset))
    mode = FakeTensorMode()

    def fake(shape, dtype=torch.float32):
        if device == "cuda":
            return fake_cuda(mode, torch.empty(shape, dtype=dtype, device="meta"))
        with mode:
            return torch.empty(shape, dtype=dtype)

    state = {name: fake(t.shape, t.dtype) for name, t in [*unet.named_parameters(), *unet.named_buffers()]}
    latents, timesteps = fake((2, 4, side, side)), fake((2,), torch.long)
    captions = fake((2, 77, unet.config.cross_attention_dim), torch.bfloat16)
    log = _ComputeLog()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(mode)
        stack.enter_context(CudaFactories(mode) if device == "cuda" else CudaAutocastRules())
        stack.enter_context(_OneAttentionOp(log))
        stack.enter_context(log)
        # torch.autocast("cuda") turns itself off on a CPU-only build: switch CUDA autocast on below it.
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, torch.bfloat16)
        torch.autocast_increment_nesting()
        try:
            torch.func.functional_call(unet, state, (latents, timesteps), {"encoder_hidden_states": captions})
        finally:
            torch.autocast_decrement_nesting()
            torch.clear_autocast_cache()
            torch.set_autocast_enabled(device, False)
    return log.ops


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_traced_forward_casts_as_cuda_autocast(preset):
    """The CPU trace's forward computes the ops a CUDA forward computes, each in CUDA autocast's dtype: the bf16
    weight copies, and float32 norms and upsampling (which plain CPU autocast would run in bf16)."""
    on_cuda = _bf16_forward_ops(preset, "cuda", 32)
    on_cpu = _bf16_forward_ops(preset, "cpu", 32)
    assert on_cpu == on_cuda
    dtypes = {(op, dtype) for op, dtype, _ in on_cuda}
    assert {("convolution.default", torch.bfloat16), ("native_group_norm.default", torch.float32)} <= dtypes
    assert ("upsample_nearest2d.default", torch.float32) in dtypes
    assert ("scaled_dot_product_attention", torch.bfloat16) in dtypes


# One real float32 training step on the CPU (a subprocess: the peak RSS is the process's). Measured: the resident
# set before the model is built (base), after a warm-up step at the measured size (state: weights, gradients,
# AdamW's state, plus the thread pools and oneDNN's primitives the first step sets up), and its peak in the measured
# step alone. (A full-suite run of 2026-11-25 measured the tiny case's activations 40% above a run of this file on
# its own, with the peak then spanning the first step at this size; first-time costs are now left out, whether or
# not they were the cause.)
_REAL_STEP = """
import json, os, sys
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

config, latent_shape, caption_shape, batch = json.loads(sys.argv[1])
torch.manual_seed(0)
base = rss()
unet = UNet2DConditionModel(**config)
unet.set_attn_processor(AttnProcessor2_0())
unet.train()
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=True)

def step(batch):
    latents = torch.randn(batch, *latent_shape)
    captions = torch.randn(batch, *caption_shape)
    noise = torch.randn_like(latents)
    noisy = latents * 0.5 + noise * 0.5
    prediction = unet(noisy, torch.randint(0, 1000, (batch,)), encoder_hidden_states=captions).sample
    torch.nn.functional.mse_loss(prediction.float(), noise).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as DDP's buckets do

def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

# A first step at the measured size sets up what a process keeps between steps (oneDNN's primitives for these
# shapes, thread pools); the peak is then taken afresh (clear_refs 5 resets it) over a second step alone.
step(batch)
state = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
step(batch)
peak = peak_rss()
print(json.dumps({"base": base, "state": state, "peak": peak}))
"""


# The real steps' cases: (latents, micro-batch) of each preset.
REAL_STEPS = {"tiny": ((4, 16, 16), 128), "small": ((4, 32, 32), 2)}


def _start_real_step(preset: str) -> subprocess.Popen:
    latent_shape, micro_batch = REAL_STEPS[preset]
    config = unet_config(ModelConfig(preset=preset))
    # glibc serves allocations under its mmap threshold (raised on the fly up to 32 MiB) from heaps that keep freed
    # memory: the resident set would trail the live tensors. A fixed low threshold maps and unmaps each tensor.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    argument = json.dumps([config, latent_shape, (77, config["cross_attention_dim"]), micro_batch])
    return subprocess.Popen(
        [sys.executable, "-c", _REAL_STEP, argument], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def real_steps():
    """Every case's real step, the processes started together when the first test asks: each measures its own
    resident set, which the other's beside it does not change (both peaks, measured so and one after the other on 2
    cores, agreed within 0.1%), and their imports and steps overlap each other and the predictions' traces here.
    Those not waited for (a test deselected or failed) are ended."""
    processes = {preset: _start_real_step(preset) for preset in REAL_STEPS}
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.parametrize("preset", REAL_STEPS)
def test_prediction_matches_a_real_cpu_training_step(preset, real_steps):
    """32-true on one rank: the predicted peak within 20% of a real step's, in total and in activations. The
    micro-batches make the activations hundreds of MiB, against the few tens of MiB of thread stacks and
    oneDNN caches the process adds."""
    latent_shape, micro_batch = REAL_STEPS[preset]
    config = unet_config(ModelConfig(preset=preset))
    caption_shape = (77, config["cross_attention_dim"])
    predicted = predict_training_memory(config, latent_shape, caption_shape, micro_batch, precision="32-true")
    stdout, stderr = real_steps[preset].communicate(timeout=240)
    assert real_steps[preset].returncode == 0, stderr[-3000:]
    measured = json.loads(stdout.strip().splitlines()[-1])
    total, activations = measured["peak"] - measured["base"], measured["peak"] - measured["state"]
    print(
        f"{preset} {latent_shape} x{micro_batch}: predicted {predicted.total_peak / MiB:.0f} MiB "
        f"(activations {predicted.activations_peak / MiB:.0f}), measured {total / MiB:.0f} MiB "
        f"(activations {activations / MiB:.0f})"
    )
    assert activations > 300 * MiB  # a measurement, not noise
    assert predicted.total_peak == pytest.approx(total, rel=0.2)
    assert predicted.activations_peak == pytest.approx(activations, rel=0.2)


def _tiny(micro_batch: int = 8, **options) -> TrainingMemory:
    return predict_training_memory(TINY, *TINY_SHAPES, micro_batch, **options)


def test_state_is_exact_and_fsdp_shards_it():
    params = sum(p.numel() for p in build_unet(ModelConfig(preset="tiny")).parameters())
    tensors = len(list(build_unet(ModelConfig(preset="tiny")).parameters()))
    ddp = _tiny(precision="32-true", strategy="ddp", ema=True)
    assert ddp.parameters == ddp.gradients == ddp.ema == 4 * params
    assert ddp.optimizer_state == 2 * 4 * params + 4 * tensors  # two moments, a step counter a tensor
    assert ddp.fsdp_buffers == 0
    parts = (ddp.parameters, ddp.gradients, ddp.optimizer_state, ddp.ema, ddp.activations_peak)
    assert ddp.total_peak == sum(parts)
    assert _tiny(precision="32-true", strategy="ddp", world_size=4, ema=True) == ddp  # DDP replicates

    fsdp = _tiny(precision="32-true", strategy="fsdp", world_size=4, ema=True)
    for field in ("parameters", "gradients", "ema"):
        # a quarter each, but for the padding of dims 0 that 4 does not divide
        assert getattr(ddp, field) / 4 <= getattr(fsdp, field) <= getattr(ddp, field) / 4 * 1.01
    assert ddp.optimizer_state / 4 <= fsdp.optimizer_state <= ddp.optimizer_state / 4 * 1.01
    assert fsdp.activations_peak == ddp.activations_peak  # the same float32 forward and backward
    assert fsdp.fsdp_buffers > 0
    # what is unsharded is whole on every rank: the buffers do not shrink with the world
    assert _tiny(precision="32-true", strategy="fsdp", world_size=8).fsdp_buffers == fsdp.fsdp_buffers
    assert fsdp.total_peak < ddp.total_peak


def test_gradient_checkpointing_lowers_the_activation_peak():
    for precision in ("32-true", "bf16-mixed"):
        full = _tiny(precision=precision)
        checkpointed = _tiny(precision=precision, gradient_checkpointing=True)
        assert checkpointed.activations_peak < 0.6 * full.activations_peak
        assert checkpointed.parameters == full.parameters


def test_bf16_mixed_lowers_the_activation_peak():
    full = _tiny(32, precision="32-true")
    mixed = _tiny(32, precision="bf16-mixed")
    # Not half: norms, SiLUs and upsampling stay float32 under autocast, and it adds bf16 copies of the weights.
    assert 0.5 * full.activations_peak < mixed.activations_peak < 0.95 * full.activations_peak
    assert mixed.parameters == full.parameters  # float32 master weights either way


def test_a_prediction_asked_again_is_not_traced_again():
    """The same UNet config however it is spelled (key order, lists for tuples), and DDP at any world size: the
    first trace's prediction; another micro-batch is a new trace. FSDP at a world size, or an EMA, is another
    prediction on the same trace (under 32-true its weights are float32 as DDP's)."""
    from sdtrain.model import memory

    first = _tiny(3, precision="32-true")
    before = memory._predicted.cache_info()
    respelled = {key: list(value) if isinstance(value, tuple) else value for key, value in reversed(TINY.items())}
    again = predict_training_memory(respelled, *TINY_SHAPES, 3, precision="32-true", world_size=8)
    after = memory._predicted.cache_info()
    assert again is first and (after.hits, after.misses) == (before.hits + 1, before.misses)
    traces = memory._activation_peak.cache_info()
    sharded = _tiny(3, precision="32-true", strategy="fsdp", world_size=4, ema=True)
    assert sharded.activations_peak == first.activations_peak and sharded.ema > 0 and first.ema == 0
    assert memory._predicted.cache_info().misses == before.misses + 1
    reused = memory._activation_peak.cache_info()
    assert (reused.hits, reused.misses) == (traces.hits + 1, traces.misses)
    assert _tiny(5, precision="32-true").activations_peak > first.activations_peak
    assert memory._predicted.cache_info().misses == before.misses + 2
    assert memory._activation_peak.cache_info().misses == traces.misses + 1


def test_activations_grow_with_the_micro_batch():
    # Linear but for what does not depend on it (autocast's weight copies): 4x the samples, about 4x the bytes.
    assert _tiny(16).activations_peak == pytest.approx(4 * _tiny(4).activations_peak, rel=0.1)


@pytest.mark.parametrize(
    "options",
    [{"precision": "16-mixed"}, {"strategy": "deepspeed"}, {"world_size": 0}],
)
def test_refuses_what_it_does_not_model(options):
    with pytest.raises(ValueError):
        _tiny(**options)


def test_the_text_encoders_a_rank_holds_for_token_ids_are_counted_whole_in_their_dtype(tmp_path):
    """Token-id captions: every rank holds the frozen text encoders (never sharded), counted exactly in their dtype;
    their forward is traced where the step runs it, and the UNet's state is what it was. SDXL base's two encoders
    (tools/text_encoders.py, their published configs) hold 1.64 GB in bf16."""
    from support.tiny_models import write_tiny_sdxl_model
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from sdtrain.model.token_captions import text_encoder_configs
    from tools.text_encoders import sdxl_text_encoder_configs

    root = write_tiny_sdxl_model(str(tmp_path / "sdxl"))
    configs = text_encoder_configs(root)
    real = [
        CLIPTextModel.from_pretrained(f"{root}/text_encoder"),
        CLIPTextModelWithProjection.from_pretrained(f"{root}/text_encoder_2"),
    ]
    numel = sum(t.numel() for model in real for t in (*model.parameters(), *model.buffers()) if t.is_floating_point())
    integer = sum(t.numel() * t.element_size() for m in real for t in m.buffers() if not t.is_floating_point())
    unet, shapes = unet_config(ModelConfig(preset="tiny-sdxl")), ((4, 16, 16), (77, 80))
    plain = predict_training_memory(unet, *shapes, 4, precision="bf16-mixed")
    held = predict_training_memory(unet, *shapes, 4, precision="bf16-mixed", text_encoders=configs)
    assert plain.text_encoders == 0
    assert held.text_encoders == 2 * numel + integer
    assert (held.parameters, held.optimizer_state) == (plain.parameters, plain.optimizer_state)
    assert held.total_peak == held.text_encoders + sum(
        getattr(held, f) for f in ("parameters", "gradients", "optimizer_state", "ema", "activations_peak")
    )
    assert held.activations_peak >= plain.activations_peak  # the encoders' output is held through the step
    fp32 = predict_training_memory(
        unet, *shapes, 4, precision="bf16-mixed", text_encoders=configs, text_encoder_dtype=torch.float32
    )
    assert fp32.text_encoders == 4 * numel + integer

    with torch.device("meta"):
        from sdtrain.model.memory import text_encoder_modules

        sdxl = text_encoder_modules(sdxl_text_encoder_configs())
    bf16 = sum(p.numel() * 2 for m in sdxl for p in m.parameters())
    assert 1.60e9 < bf16 < 1.68e9  # 123.1M + 694.7M parameters
