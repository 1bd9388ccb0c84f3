"""Exponential moving average (EMA) of the UNet weights.

The EMA is a second UNet whose parameters never get gradients. After every optimizer step,

    ema <- decay * ema + (1 - decay) * weights      (step > train.ema_start_step)
    ema <- weights                                  (step <= train.ema_start_step)

and a step skipped for non-finite gradients leaves the EMA untouched too. The update runs on the
device with no host sync (the skip flag is a device tensor). Being parameters of the Lightning
module, the EMA weights are saved in every checkpoint under ``ema_unet.`` and restored on
resume. Under DDP every rank holds the same weights, so the rank-local EMA is the same
everywhere and needs no communication; under FSDP each rank averages its own shard of the
weights into its own shard of the EMA, which is the same thing, sharded.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)
_EMA_START = "_sdtrain_ema_start"


def make_ema(model: M, start: M | None = None) -> M:
    """A frozen copy of ``model`` (or ``start``, taken as it is: the EMA weights a warm start continues, of the same
    architecture): its parameters require no grad, so DDP neither reduces nor broadcasts them."""
    ema = copy.deepcopy(model) if start is None else start
    ema.requires_grad_(False)  # left in train mode like the UNet: the UNet has no dropout or batch norm by default
    return ema.train(model.training)


def set_ema_start(model: nn.Module, start: nn.Module) -> None:
    """Attach to ``model`` (trained weights) the EMA weights its run's EMA is to start from, until
    :func:`take_ema_start`: a plain attribute, not a submodule, so it is in no state dict, optimizer or copy."""
    model.__dict__[_EMA_START] = start


def take_ema_start(model: nn.Module) -> nn.Module | None:
    """The EMA start :func:`set_ema_start` attached to ``model``, detached from it; None if none."""
    return model.__dict__.pop(_EMA_START, None)


@torch.no_grad()
def ema_update_(
    ema_params: Iterable[torch.Tensor],
    params: Iterable[torch.Tensor],
    step: int,
    decay: float,
    start_step: int,
    skipped: torch.Tensor | None = None,
) -> None:
    """Update ``ema_params`` in place after optimizer step number ``step`` (1-based).

    ``skipped`` is a 0-d device tensor, 1.0 when the step did not update the weights.
    """
    ema_params, params = [local_tensor(e) for e in ema_params], [local_tensor(p) for p in params]
    weight = 1.0 if step <= start_step else 1.0 - decay
    if skipped is None:
        torch._foreach_lerp_(ema_params, params, weight)
        return
    device_weight = (1.0 - skipped.to(ema_params[0].device, torch.float32)) * weight
    for ema_group, param_group in _by_dtype(ema_params, params):
        # One weight tensor per parameter: the overload that keeps the weight on the device. A single
        # tensor weight would be read back as a Python scalar, a host sync every step.
        weight_tensor = device_weight.to(ema_group[0].dtype)
        torch._foreach_lerp_(ema_group, param_group, [weight_tensor] * len(ema_group))


def _by_dtype(ema_params, params):
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for e, p in zip(ema_params, params, strict=True):
        pair = groups.setdefault(e.dtype, ([], []))
        pair[0].append(e)
        pair[1].append(p.detach())
    return groups.values()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter or gradient (a DTensor); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
