"""FLOPs and bytes of every op of a UNet's training step, for the per-op performance model (tools/performance_model.py).

One forward, loss and backward of the real ``UNet2DConditionModel`` on fake tensors (shapes, no memory, no compute),
under bf16 autocast with CUDA's casting rules (sdtrain.model.memory.CudaAutocastRules: what a GPU's bf16-mixed step
runs), the SDPA attention kernel and float32 weights, as sdtrain.train.module's step runs it. Each aten op is recorded
with:

- its kind: ``matmul`` (mm, addmm, bmm, baddbmm), ``conv`` (convolution and its backward), ``attention`` (the fused
  SDPA kernels, forward and backward) or ``memory`` (everything else: casts, GroupNorm, LayerNorm, SiLU, GELU, adds,
  copies, concatenations, reductions): the first three are bounded by FLOPs or bytes, the last by bytes;
- its FLOPs, by torch's FlopCounterMode formulas (multiply-add = 2), for the first three kinds;
- the bytes it reads and writes: each distinct tensor argument once, each output once; views move nothing.

What a compiled step moves is derived from the same trace under a stated assumption (inductor's fusion): the
``memory`` ops fuse into kernels of their own between the matmuls, convolutions and attention (which stay library
kernels), so a tensor costs bytes only where it crosses between them: read once by fused code where a library kernel,
the step's inputs or the other pass (forward against backward) produced it, written once where a library kernel or
the other pass reads it or nothing in the step does (the gradients). Tensors passed between memory ops stay in
registers. That is an upper bound on fusion (inductor leaves some chains apart, and saves some tensors for the
backward pass that it could recompute): compiled figures are more likely high than low.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from sdtrain.model.conditioning import dummy_conditioning
from sdtrain.private import torch as torch_private

KINDS = ("matmul", "conv", "attention", "memory")
_MATMUL = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
_CONV = {"aten.convolution", "aten._convolution", "aten.convolution_backward"}
# Ops that only relabel a tensor (torch's schema does not mark _unsafe_view a view).
_NO_DATA = {
    "aten._unsafe_view",
    "aten.lift_fresh",
    "aten.empty",
    "aten.empty_strided",
    "aten.empty_like",
    "aten.new_empty_strided",
}


@shape_wrapper
def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


@shape_wrapper
def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# The fake step runs the CPU's flash kernel, which saves and reads what CUDA's does; torch has no formula for it.
_FORMULAS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


@dataclass(frozen=True)
class OpCost:
    """One op of the step.

    Args:
        name: the aten op (``aten.mm``).
        kind: one of :data:`KINDS`.
        flops: its FLOPs (0 for ``memory`` ops).
        bytes: what it reads and writes, run on its own (eager).
        backward: it runs in the backward pass.
    """

    name: str
    kind: str
    flops: int
    bytes: int
    backward: bool


@dataclass(frozen=True)
class StepOps:
    """The ops of one micro-batch's forward and backward.

    Args:
        micro_batch: samples in the micro-batch.
        ops: every op that moves data, in order (eager: each its own kernel).
        fused_memory_bytes: what the ``memory`` ops move together once compiled (module docstring), forward and
            backward.
        gradients_ready: (parameter, ops recorded before it) for each parameter in the order its gradient is ready in
            the backward pass (its index in ``unet.parameters()``): DDP's buckets fill in this order.
    """

    micro_batch: int
    ops: tuple[OpCost, ...]
    fused_memory_bytes: tuple[int, int]
    gradients_ready: tuple[tuple[int, int], ...]

    def totals(self, kind: str) -> tuple[int, int, int]:
        """(FLOPs, bytes, ops) of the ops of ``kind``."""
        chosen = [op for op in self.ops if op.kind == kind]
        return sum(op.flops for op in chosen), sum(op.bytes for op in chosen), len(chosen)


@dataclass
class _Tensor:
    nbytes: int
    producer: int | None = None  # index of the op that wrote it last; None: made before the trace
    consumers: list[int] = field(default_factory=list)


def count_step_ops(
    unet_config: Mapping[str, Any],
    latent_shape: tuple[int, int, int],
    caption_shape: tuple[int, int],
    micro_batch: int,
    *,
    gradient_checkpointing: bool = False,
    precision: str = "bf16-mixed",
) -> StepOps:
    """The ops of one training micro-batch of ``UNet2DConditionModel(**unet_config)``: forward, loss and backward
    (not the optimizer step: per-parameter passes the performance model adds).

    Args:
        unet_config: the UNet's keyword arguments (sdtrain.model.unet.unet_config of a ModelConfig).
        latent_shape: one sample's latents, (C, H, W).
        caption_shape: one sample's caption embeddings, (L, D).
        micro_batch: samples in the micro-batch.
        gradient_checkpointing: the blocks recompute their forward in the backward pass.
        precision: bf16-mixed (what GPUs train in) or 32-true.
    """
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    from sdtrain.model.memory import CudaAutocastRules, checkpoint_with_cuda_rules

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config)
    unet.set_attn_processor(AttnProcessor2_0())
    if gradient_checkpointing:  # recomputed in backward under the rules the forward ran under
        unet.enable_gradient_checkpointing(checkpoint_with_cuda_rules)
    unet.train()
    mode = torch_private.fake_tensor_mode()
    with mode:
        for module in unet.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                module._parameters[name] = torch.nn.Parameter(torch.empty_strided(param.shape, param.stride()))
            for name, buffer in list(module.named_buffers(recurse=False)):
                module._buffers[name] = torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype)
    with mode, CudaAutocastRules():
        latents = torch.empty(micro_batch, *latent_shape)
        half = precision == "bf16-mixed"
        # The captions in autocast's dtype, as sdtrain.train.device_settings.CAPTION_DTYPES hands them.
        conditioning = dummy_conditioning(
            unet_config, micro_batch, caption_shape, torch.bfloat16 if half else torch.float32
        )
        timesteps = torch.zeros(micro_batch, dtype=torch.long)

        def loss() -> torch.Tensor:
            noise = torch.randn_like(latents)
            noisy = latents * 0.5 + noise * 0.5  # the scheduler's add_noise
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                prediction = unet(noisy, timesteps, **conditioning.kwargs()).sample
                return torch.nn.functional.mse_loss(prediction.float(), noise)

        return record_step(list(unet.parameters()), loss, micro_batch)


def record_step(parameters: list[torch.Tensor], loss: Callable[[], torch.Tensor], micro_batch: int) -> StepOps:
    """The ops of ``loss()`` and its backward pass, which fills the gradients of ``parameters``.

    Args:
        parameters: the leaves whose gradients the backward pass makes, in the order DDP would number them.
        loss: the forward pass, returning a scalar.
        micro_batch: the samples it covers.
    """
    trace = _Trace()
    ready: list[tuple[int, int]] = []
    for index, param in enumerate(parameters):
        param.register_post_accumulate_grad_hook(lambda _, index=index: ready.append((index, len(trace.ops))))
    with _recorder(trace):
        value = loss()
        trace.phase = 1
        value.backward()
    return StepOps(micro_batch, tuple(trace.ops), trace.fused_memory_bytes(), tuple(ready))


class _Trace:
    """Each op's cost and which tensors it reads and writes, in the order they ran."""

    def __init__(self) -> None:
        self.phase = 0  # 0: forward, 1: backward
        self.ops: list[OpCost] = []
        self.phases: list[int] = []
        self.reads: list[list[int]] = []
        self.writes: list[list[int]] = []
        self.tensors: list[_Tensor] = []
        # id of a live tensor -> its entry in tensors (a view's: its base's). Only live ones: an id is reused
        # once its tensor dies, and holding them would change the step (autograd steals a gradient only
        # when nothing else holds it).
        self.keys: dict[int, int] = {}

    def view(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        for tensor in outputs:  # a view's bytes are its base's
            if id(tensor) not in self.keys:
                self._track(tensor, self._key(inputs[0]) if inputs else None)

    def record(self, func: Any, args: Any, kwargs: Any, out: Any, inputs: list, outputs: list) -> None:
        index = len(self.ops)
        name = str(func.overloadpacket)
        formula = _FORMULAS.get(func.overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        read = {id(t): t for t in inputs}
        written = {id(t): t for t in outputs}
        nbytes = sum(_nbytes(t) for t in read.values()) + sum(_nbytes(t) for t in written.values())
        self.ops.append(OpCost(name, op_kind(name), flops, nbytes, bool(self.phase)))
        self.phases.append(self.phase)
        self.reads.append([self._key(t) for t in read.values()])
        for key in self.reads[-1]:
            self.tensors[key].consumers.append(index)
        # An op's output is a new tensor, unless it writes in place (add_, copy_): then the same one.
        self.writes.append([self.keys[id(t)] if id(t) in read else self._track(t, None) for t in written.values()])
        for key in self.writes[-1]:
            self.tensors[key].producer = index

    def fused_memory_bytes(self) -> tuple[int, int]:
        """The module docstring's compiled bytes, forward and backward: each tensor crossing into or out of fused
        code, once."""
        crossing: set[tuple[int, int, str]] = set()
        for index, op in enumerate(self.ops):
            if op.kind != "memory":
                continue
            phase = self.phases[index]
            for key in self.reads[index]:
                producer = self.tensors[key].producer
                if producer is None or self.ops[producer].kind != "memory" or self.phases[producer] != phase:
                    crossing.add((key, phase, "read"))
            for key in self.writes[index]:
                later = [c for c in self.tensors[key].consumers if c > index]
                if not later or any(self.ops[c].kind != "memory" or self.phases[c] != phase for c in later):
                    crossing.add((key, phase, "write"))
        forward, backward = (sum(self.tensors[k].nbytes for k, p, _ in crossing if p == phase) for phase in (0, 1))
        return forward, backward

    def _track(self, tensor: torch.Tensor, key: int | None) -> int:
        if key is None:
            key = len(self.tensors)
            self.tensors.append(_Tensor(tensor.untyped_storage().nbytes()))
        self.keys[id(tensor)] = key
        weakref.finalize(tensor, self.keys.pop, id(tensor), None)
        return key

    def _key(self, tensor: torch.Tensor) -> int:
        key = self.keys.get(id(tensor))
        return self._track(tensor, None) if key is None else key


def _recorder(trace: _Trace) -> Any:
    """A dispatch mode recording each op into ``trace`` (a class made on demand: its base is torch's private
    TorchDispatchMode)."""

    class Recorder(torch_private.dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func.overloadpacket)
            inputs = list(_tensors((args, kwargs)))
            outputs = list(_tensors(out))
            if not name.startswith("aten.") or name in _NO_DATA or func.is_view:
                trace.view(outputs, inputs)
            else:
                trace.record(func, args, kwargs, out, inputs, outputs)
            return out

    return Recorder()


def op_kind(name: str) -> str:
    """The kind (:data:`KINDS`) of the aten op ``name``: ``aten.mm``, or as torch's profiler names it, ``aten::mm``,
    with the backend ops that launch the kernels beneath the traced ones (``aten::cudnn_convolution``,
    ``aten::_flash_attention_forward``)."""
    name = name.replace("::", ".")
    if name in _MATMUL:
        return "matmul"
    if name in _CONV or "convolution" in name:
        return "conv"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    return "memory"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)
