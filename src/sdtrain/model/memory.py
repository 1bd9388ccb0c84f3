"""Peak GPU memory of one training step on one rank, predicted before a GPU is rented.

What it predicts: the bytes of tensors a rank holds at the peak of a training step of a
``UNet2DConditionModel`` (forward, loss, backward, clipping, AdamW step, EMA update), by category:

- parameters, gradients, AdamW's state (two float32 moments, and a step counter a parameter tensor) and the
  EMA: counted exactly from the parameter shapes, float32 master weights under both precisions. Under FSDP2
  each rank holds one shard of each (dim 0 split into ``world_size`` chunks padded to equal size, as
  ``fully_shard`` does); under DDP each rank holds them whole. DDP's gradient buckets are the gradients
  (``gradient_as_bucket_view=True``, sdtrain.train.strategy.DDP_KWARGS), so they add nothing, and they stay
  allocated through the step: the gradients count in full at the activation peak.
- the activation peak: the most the step holds at once beyond that state (the batch, the activations saved
  for backward, autocast's bf16 copies of the weights, gradients of activations, backward temporaries), traced
  from the real model: one forward and backward of the UNet built from the config, on fake tensors (shapes,
  no memory, no compute) under ``FakeTensorMode``, counted by torch's ``MemTracker`` (each storage from its
  allocation to its release; views and shared storages once).
- the frozen text encoders a rank holds for data of caption token ids (sdtrain.model.token_captions: every rank a
  whole replica, never sharded, in sdtrain.model.token_captions.encoder_dtype: bf16 on a GPU): their parameters and
  buffers counted exactly (``text_encoders``; SD 2's OpenCLIP-H ~0.7 GB, SDXL's two ~1.6 GB), and their forward
  without gradient traced at the start of the step, where the step runs it, under the step's autocast: its
  activations are freed before the UNet's forward and only its output (the hidden states and pooled embedding the
  UNet takes, as embedding data's captions) is held through the step.
- under FSDP2, its all-gather and reduce-scatter buffers (``fsdp_buffers``; a formula over the real units'
  sizes, not a trace): the root unit's parameters stay unsharded from forward to backward, and two other
  units (the one computing, the one prefetched) are unsharded at a time, each with its parameters in the
  param dtype and, in backward, its unsharded gradients and their float32 copy for the reduce-scatter.

Fake CPU tensors, not fake CUDA ones: a CUDA-device FakeTensor runs a forward on a CPU-only torch
(tests/support/fake_cuda.py) but not a backward: autograd asks the CUDA device guard, which a CPU-only build
lacks, for each node's stream, and the process aborts. What differs on the CPU is made CUDA's:

- autocast: CUDA's runs ``group_norm``, ``layer_norm`` and upsampling in float32 (its fp32 list), where the
  CPU's stays in bf16; their float32 outputs are what the SiLUs and convolutions after them save.
  :class:`CudaAutocastRules` adds those rules to CPU autocast; tests/test_memory_model.py checks that the
  traced forward then computes the ops CUDA autocast computes on fake CUDA tensors, each in the same dtype.
- attention: a GPU runs ``scaled_dot_product_attention`` in a fused kernel (flash under bf16, memory-efficient
  under float32) that saves its output and a log-sum-exp, not the attention matrix; the CPU runs its flash
  kernel, which saves the same. (Fake CUDA tensors would run the math kernel and save every attention matrix.)

Checked against real float32 CPU training steps (tiny and small presets, tests/test_memory_model.py): within a
few percent. Left out: the CUDA context and the kernels it loads (~0.5-1 GB, outside PyTorch's allocator), cuDNN
and cuBLAS workspaces, the caching allocator's fragmentation (:data:`CUDA_RUNTIME_MARGIN` is a stated allowance
for these three) and its 512-byte rounding, NCCL's buffers, torch.compile (it usually saves less),
channels_last's layout copies, and validation, sampling and checkpointing, which run between steps. A run
without Ray at world size 1 has no DDP and frees its gradients between steps (zero_grad sets them to None):
its peak can be lower by up to ``gradients``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch.overrides import TorchFunctionMode

from sdtrain.model.conditioning import TIME_IDS, Conditioning, dummy_conditioning, pooled_width
from sdtrain.model.encoders import TextEncoders
from sdtrain.private import torch as torch_private

Precision = Literal["bf16-mixed", "32-true"]
Strategy = Literal["ddp", "fsdp"]

CUDA_RUNTIME_MARGIN = 1 << 30
"""A stated allowance for what a GPU holds beyond the tensors counted here: the CUDA context and its loaded
kernels (~0.5-1 GB), cuDNN and cuBLAS workspaces, allocator fragmentation. NCCL's buffers are not in it."""

_FLOAT32 = 4
_ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, float32 like the master weights
_FSDP_UNITS_IN_FLIGHT = 2  # the unit computing and the one prefetched (FSDP2's default, one unit ahead)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one rank holds at the peak of a training step (see the module docstring), by category."""

    parameters: int
    gradients: int
    optimizer_state: int
    ema: int
    activations_peak: int
    fsdp_buffers: int
    text_encoders: int
    total_peak: int

    @property
    def with_runtime_margin(self) -> int:
        """``total_peak`` plus :data:`CUDA_RUNTIME_MARGIN`: what to compare with a GPU's memory."""
        return self.total_peak + CUDA_RUNTIME_MARGIN


def predict_training_memory(
    unet_config: Mapping[str, Any],
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    *,
    precision: Precision = "bf16-mixed",
    strategy: Strategy = "ddp",
    world_size: int = 1,
    ema: bool = False,
    gradient_checkpointing: bool = False,
    text_encoders: Sequence[Any] = (),
    text_encoder_dtype: torch.dtype = torch.bfloat16,
) -> TrainingMemory:
    """Peak memory of one training step of ``UNet2DConditionModel(**unet_config)`` on one rank.

    Args:
        unet_config: the UNet's keyword arguments (sdtrain.model.unet.unet_config of a ModelConfig).
        latent_shape: one sample's latents, (C, H, W).
        caption_shape: one sample's caption embeddings, (L, D).
        micro_batch: samples per forward pass on this rank.
        precision: Lightning's precision: bf16-mixed (float32 weights, bf16 autocast) or 32-true.
        strategy: ddp (every rank holds the whole state) or fsdp (FSDP2: every rank holds a shard).
        world_size: ranks the state is sharded over under fsdp; under ddp it changes nothing.
        ema: the run keeps an EMA of the weights (train.ema_decay): one more float32 copy of the parameters.
        gradient_checkpointing: the UNet recomputes its blocks' activations in backward
            (``enable_gradient_checkpointing``, train.gradient_checkpointing).
        text_encoders: for token-id captions, the CLIPTextConfigs of the encoders the step runs (SD 1/2's one,
            SDXL's two: sdtrain.model.token_captions.text_encoder_configs); empty for caption embeddings.
        text_encoder_dtype: the dtype the encoders are held in (sdtrain.model.token_captions.encoder_dtype).

    A trace takes seconds (tens for sdxl-base): a prediction asked for again in the same process (auto trying
    sizes, the check job's phases, the docs' tables) is the first one's, and one that differs from an earlier one
    only in what the trace does not see (the world size, the EMA; the strategy under 32-true) reuses its trace.
    """
    _check_modelled(precision, strategy, world_size, micro_batch)
    return _predicted(
        json.dumps(dict(unet_config), sort_keys=True),
        tuple(latent_shape),
        tuple(caption_shape),
        micro_batch,
        precision,
        strategy,
        world_size if strategy == "fsdp" else 1,  # DDP's ranks hold the same
        ema,
        gradient_checkpointing,
        tuple(config.to_json_string() for config in text_encoders),
        str(text_encoder_dtype).removeprefix("torch."),
    )


@functools.lru_cache(maxsize=64)
def _predicted(
    unet_json: str,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    precision: Precision,
    strategy: Strategy,
    world_size: int,
    ema: bool,
    gradient_checkpointing: bool,
    text_encoders_json: tuple[str, ...],
    text_encoder_dtype: str,
) -> TrainingMemory:
    """predict_training_memory's, from arguments that key a cache: the configs as JSON, the dtype by name."""
    unet, encoders = _meta_modules(unet_json, text_encoders_json)
    fsdp = strategy == "fsdp"
    state = _state(unet, world_size if fsdp else 1, ema)
    # Under bf16-mixed FSDP2 gathers the weights already in bf16 (sdtrain.train.strategy.mixed_precision), so
    # autocast makes no copies of them: the trace runs on bf16 weights.
    half = precision == "bf16-mixed"
    param_dtype = torch.bfloat16 if half and fsdp else torch.float32
    activations = _activation_peak(
        unet_json,
        latent_shape,
        caption_shape,
        micro_batch,
        half,
        str(param_dtype).removeprefix("torch."),
        gradient_checkpointing,
        text_encoders_json,
        text_encoder_dtype,
    )
    buffers = _fsdp_buffers(unet, param_dtype) if fsdp else 0
    frozen = sum(_held_bytes(encoder, getattr(torch, text_encoder_dtype)) for encoder in encoders)
    return TrainingMemory(
        **state,
        activations_peak=activations,
        fsdp_buffers=buffers,
        text_encoders=frozen,
        total_peak=sum(state.values()) + activations + buffers + frozen,
    )


@functools.lru_cache(maxsize=64)
def _activation_peak(
    unet_json: str,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    autocast: bool,
    param_dtype: str,
    gradient_checkpointing: bool,
    text_encoders_json: tuple[str, ...],
    text_encoder_dtype: str,
) -> int:
    """:func:`_traced_activation_peak` of fresh meta modules, cached on all that the trace depends on: the trace
    replaces their parameters by fake ones, and predictions at other world sizes or with an EMA trace the same step."""
    unet, encoders = _meta_modules(unet_json, text_encoders_json)
    return _traced_activation_peak(
        unet,
        latent_shape,
        caption_shape,
        micro_batch,
        autocast=autocast,
        param_dtype=getattr(torch, param_dtype),
        gradient_checkpointing=gradient_checkpointing,
        encoders=(encoders, getattr(torch, text_encoder_dtype)),
    )


def _meta_modules(
    unet_json: str, text_encoders_json: tuple[str, ...]
) -> tuple[UNet2DConditionModel, list[torch.nn.Module]]:
    """The UNet and text encoders of these JSON configs on the meta device: shapes only."""
    from transformers import CLIPTextConfig

    with torch.device("meta"):
        unet = UNet2DConditionModel(**json.loads(unet_json))
        encoders = text_encoder_modules([CLIPTextConfig(**json.loads(config)) for config in text_encoders_json])
    return unet, encoders


def _state(unet: torch.nn.Module, shards: int, ema: bool) -> dict[str, int]:
    """The float32 weights, gradients, AdamW state and EMA a rank holds, each a ``shards``-th under FSDP."""
    shapes = [tuple(p.shape) for p in unet.parameters()]
    weights = _FLOAT32 * sum(_shard_numel(shape, shards) for shape in shapes)
    optimizer = _ADAMW_MOMENTS * weights + _FLOAT32 * len(shapes)  # the step counters: one float32 a tensor
    return dict(parameters=weights, gradients=weights, optimizer_state=optimizer, ema=weights if ema else 0)


def _check_modelled(precision: str, strategy: str, world_size: int, micro_batch: int) -> None:
    if precision not in ("bf16-mixed", "32-true"):
        raise ValueError(f"precision {precision!r}: expected bf16-mixed or 32-true")
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy {strategy!r}: expected ddp or fsdp")
    if world_size < 1 or micro_batch < 1:
        raise ValueError(f"world_size and micro_batch must be >= 1, got {world_size} and {micro_batch}")


def text_encoder_modules(configs: Sequence[Any]) -> list[torch.nn.Module]:
    """The text encoders of ``configs`` as sdtrain.model.encoders.load_text_encoders loads them (SDXL's second, of
    two, with its pooled projection: CLIPTextModelWithProjection), built on the current device (the meta device
    here: shapes only)."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    pooled = len(configs) == 2
    return [
        (CLIPTextModelWithProjection if pooled and i == 1 else CLIPTextModel)(config)
        for i, config in enumerate(configs)
    ]


def _held_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module`` loaded in ``dtype``: its floating parameters and buffers in it, the others as they are."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


class CudaAutocastRules(TorchFunctionMode):
    """Inside it, CPU autocast casts a UNet's ops as CUDA autocast does: ``group_norm``, ``layer_norm`` and
    ``interpolate`` run in float32 (on CUDA autocast's fp32 list; CPU autocast would run them in its lower
    dtype), on inputs cast up by ``Tensor.float``: casts autograd records, as it records CUDA autocast's.
    Outside autocast it changes nothing. Public for the test that compares its casts with CUDA's."""

    _FLOAT32 = (torch.nn.functional.group_norm, torch.nn.functional.layer_norm, torch.nn.functional.interpolate)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._FLOAT32 or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        args, kwargs = torch_private.tree_map_only(torch.Tensor, _float32, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)


def checkpoint_with_cuda_rules(module: torch.nn.Module, *args: Any) -> Any:
    """diffusers' default checkpointing function (non-reentrant ``torch.utils.checkpoint``), recomputing under
    :class:`CudaAutocastRules`: torch function modes are not active in backward, where the recomputation runs,
    and without the rules it would save other dtypes than the forward did (checkpoint refuses that). For every trace
    of a checkpointed UNet under the rules (this module's, sdtrain.model.op_costs')."""

    def run(*inputs: Any) -> Any:
        with CudaAutocastRules():
            return module(*inputs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _traced_activation_peak(
    unet: UNet2DConditionModel,
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    autocast: bool,
    param_dtype: torch.dtype,
    gradient_checkpointing: bool,
    encoders: tuple[list[torch.nn.Module], torch.dtype] = ([], torch.bfloat16),
) -> int:
    """The transient peak of one training step of ``unet`` (built on the meta device; its parameters are
    replaced by fake ones), as sdtrain.train.module.DiffusionModule.training_step runs it: float32 latents,
    the captions in autocast's dtype (for token ids: the frozen ``encoders``, in their dtype, encode them first,
    without gradient, under the step's autocast), the noise and the target, the loss in float32, backward outside
    autocast."""
    unet.set_attn_processor(AttnProcessor2_0())  # train.attention=sdpa, the default
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing(checkpoint_with_cuda_rules)
    unet.train()
    modules, encoder_dtype = encoders
    mode = torch_private.fake_tensor_mode()
    with mode:
        _fake_weights(unet, param_dtype)
        for encoder in modules:
            _fake_weights(encoder.eval(), encoder_dtype)  # requires_grad kept: MemTracker hooks each parameter
        # The batch's token ids, as the batch's embeddings are (not traced): what the data stream hands the step.
        ids = torch.zeros(micro_batch, len(modules) * caption_shape[0], dtype=torch.long)
    # MemTracker keeping the peak of the step's activations, temporaries and unattributed tensors only.
    tracker = torch_private.transient_memory_tracker()()
    tracker.track_external(unet, *modules)
    caption_dtype = torch.bfloat16 if autocast else torch.float32  # sdtrain.train.device_settings.CAPTION_DTYPES
    forward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with mode, tracker, CudaAutocastRules():
        latents = torch.empty(micro_batch, *latent_shape)
        with forward:
            conditioning = _conditioning(unet, modules, ids, caption_shape, caption_dtype)
        timesteps = torch.zeros(micro_batch, dtype=torch.long)
        noise = torch.randn_like(latents)
        noisy = latents * 0.5 + noise * 0.5  # the scheduler's add_noise: one more latent-sized tensor
        with forward:
            prediction = unet(noisy, timesteps, **conditioning.kwargs()).sample
            loss = torch.nn.functional.mse_loss(prediction.float(), noise)
        loss.backward()
    return tracker.transient_peak


def _conditioning(
    unet: UNet2DConditionModel,
    encoders: list[torch.nn.Module],
    ids: torch.Tensor,
    caption_shape: tuple[int, int],
    dtype: torch.dtype,
) -> Conditioning:
    """What the step conditions the UNet on: the batch's embeddings, or the frozen encoders' output of its token ids
    (sdtrain.model.encoders.TextEncoders.encode_ids, as sdtrain.model.conditioning.Conditioner calls it)."""
    if not encoders:
        return dummy_conditioning(unet.config, len(ids), caption_shape, dtype)
    hidden, pooled = TextEncoders("the memory model", [], encoders).encode_ids(ids)
    if pooled is None or pooled_width(unet.config) is None:
        return Conditioning(hidden.to(dtype))
    return Conditioning(hidden.to(dtype), pooled.to(dtype), torch.empty(len(ids), TIME_IDS))


def _fake_weights(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module``'s parameters (in ``dtype``) and buffers replaced by fake tensors of their shapes, in the fake mode
    the caller has entered."""
    for child in module.modules():
        for name, param in list(child.named_parameters(recurse=False)):
            fake = torch.empty_strided(param.shape, param.stride(), dtype=dtype)
            child._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(child.named_buffers(recurse=False)):
            child._buffers[name] = torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype)


def _fsdp_buffers(unet: torch.nn.Module, param_dtype: torch.dtype) -> int:
    """FSDP2's unsharded parameters and gradients at its peak (module docstring), with sdtrain.train.strategy's
    units: every ResnetBlock2D and Transformer2DModel, the rest in the root unit."""
    units = [m for m in unet.modules() if isinstance(m, (ResnetBlock2D, Transformer2DModel))]
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    root = sum(p.numel() for p in unet.parameters()) - sum(sizes)
    param_bytes = param_dtype.itemsize
    largest = max(sizes, default=0)
    # In flight: a unit's gathered parameters, its unsharded gradients (param dtype) and their float32 copy
    # that the reduce-scatter reads.
    return root * param_bytes + _FSDP_UNITS_IN_FLIGHT * largest * (2 * param_bytes + _FLOAT32)


def _shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one rank's shard of a parameter: FSDP2 splits dim 0 into ``shards`` chunks padded to equal size."""
    if not shape:
        return 1
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])
