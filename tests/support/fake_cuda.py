"""Fake CUDA tensors on a machine without CUDA: the shapes, strides and dtypes a CUDA run would see, from
torch's own CUDA dispatch decisions (composite ops, meta kernels), with no memory and no compute.

On a CPU-only build of torch ``torch.empty(..., device="cuda")`` fails even under FakeTensorMode (torch is not
linked with CUDA), but a FakeTensor built from a meta tensor with a CUDA device dispatches: composite ops such
as ``aten::group_norm`` then take their CUDA branch, and the meta kernels give CUDA's output layout, except a
convolution's, which depends on cuDNN (:class:`OpLog`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)


def fake_cuda(mode: FakeTensorMode, like: torch.Tensor) -> FakeTensor:
    """A fake CUDA tensor with ``like``'s shape, strides and dtype (its values are not kept)."""
    with unset_fake_temporarily():
        meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    return FakeTensor(mode, meta, CUDA)


class CudaFactories(TorchFunctionMode):
    """Factory calls for a CUDA device (``torch.arange(..., device=x.device)``), and Python indexing and
    ``contiguous()`` of a CUDA tensor, made on the meta device and returned as fake CUDA tensors: on a CPU-only
    build their bindings initialize the CUDA device, which fails. (Indexing returns a tensor of the view's shape
    and strides, not a view: enough to follow layouts.)"""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and args[0].device.type == "cuda":
            with unset_fake_temporarily():
                twin = torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype, device="meta")
                view = twin[args[1]]
            return fake_cuda(self.mode, view)
        if func is torch.Tensor.contiguous and args[0].device.type == "cuda":  # its binding also holds a device guard
            memory_format = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            if args[0].is_contiguous(memory_format=memory_format):
                return args[0]
            return torch.ops.aten.clone.default(args[0], memory_format=memory_format)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            return fake_cuda(self.mode, func(*args, **{**kwargs, "device": "meta"}))
        return func(*args, **kwargs)


class OpLog(TorchDispatchMode):
    """Every aten op dispatched inside it: (op, args, kwargs, output).

    ``cudnn_layouts``: give CUDA convolutions cuDNN's output layout. A CPU-only build has no cuDNN, so fake CUDA
    convolutions come out NCHW whatever their inputs; on a GPU cuDNN computes channels-last when the input or the
    weight is channels-last (ATen's cudnn_conv_suggest_memory_format), converting the other operand first. With it
    on, such a convolution's output is channels-last, and its conversion of an NCHW input is logged as the
    ``clone`` cuDNN's wrapper makes (``conv_copies`` counts them).
    """

    def __init__(self, cudnn_layouts: bool = False):
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []
        self.cudnn_layouts = cudnn_layouts
        self.conv_copies: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.cudnn_layouts and func is torch.ops.aten.convolution.default and out.device.type == "cuda":
            data, weight = args[0], args[1]
            if weight.dim() == 4 and (_channels_last(data) or _channels_last(weight)):
                if not _channels_last(data):
                    self.conv_copies.append(data)
                out = torch.ops.aten.clone.default(out, memory_format=torch.channels_last)  # below this mode: unlogged
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def forward_on_fake_cuda(
    module: torch.nn.Module, inputs: Callable[[FakeTensorMode], tuple[tuple, dict]], cudnn_layouts: bool = True
) -> OpLog:
    """Run ``module``'s forward with its parameters and buffers as fake CUDA tensors (same layout as the module's
    own) on the inputs ``inputs(mode)`` returns (args, kwargs), logging every aten op.

    Args:
        module: a module on the CPU or the meta device.
        inputs: builds the forward's (args, kwargs) in the given mode (:func:`fake_cuda`).
        cudnn_layouts: convolutions take cuDNN's output layout (:class:`OpLog`).
    """
    mode = FakeTensorMode()
    state = {name: fake_cuda(mode, t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    args, kwargs = inputs(mode)
    log = OpLog(cudnn_layouts)
    with torch.no_grad(), mode, CudaFactories(mode), log:
        torch.func.functional_call(module, state, args, kwargs)
    return log


def group_norm_copies(log: OpLog) -> list[torch.Tensor]:
    """The inputs of the GroupNorms in ``log`` that were copies made for them: a ``clone`` to NCHW (contiguous) of a
    tensor that was not, read by the next ``native_group_norm``."""
    copies = []
    pending: dict[int, torch.Tensor] = {}
    for func, args, kwargs, out in log.calls:
        if func is torch.ops.aten.clone.default and kwargs.get("memory_format") == torch.contiguous_format:
            if not args[0].is_contiguous():
                pending[id(out)] = out
        elif func is torch.ops.aten.native_group_norm.default and id(args[0]) in pending:
            copies.append(pending.pop(id(args[0])))
    return copies
