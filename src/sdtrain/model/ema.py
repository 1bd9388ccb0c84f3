"""Exponential moving average (EMA) of the UNet weights.

The EMA is a second UNet whose parameters never get gradients. After every optimizer step ``step`` (1-based),

    ema <- weights                                  (step <= train.ema_start_step + 1)
    ema <- d * ema + (1 - d) * weights              (after it)
    d    = min(train.ema_decay, (1 + n) / (10 + n)),   n = step - train.ema_start_step - 1

exactly diffusers' ``EMAModel`` (``training_utils``: its ``get_decay`` without ``use_ema_warmup``, as
``train_text_to_image.py`` uses it) with ``update_after_step = train.ema_start_step``. The ramp matters: an EMA
that starts at the full decay from the weights of step 1 (random, from scratch) keeps decay^n of them after n
more steps, 0.37 at 10k steps for 0.9999, and validation, sample grids, checkpoint evaluations and mid-run exports
all use the EMA. The decay is a pure function of the step, on the host: a resumed run averages as an
uninterrupted one does, with no state beyond the EMA weights the checkpoint holds.

A warm start whose EMA continues another run's EMA (a registry version that keeps its EMA beside its trained
weights: :func:`set_ema_start`, retraining's next day) with train.ema_start_step 0 has no ramp: it averages at the
full decay from step 1. There the EMA starts as production's EMA, the history the warm start exists to keep, not
as a copy of the weights being trained: the ramp would replace it with the new weights at step 1 (diffusers'
copy), and even without that copy would keep a share of 6e-5 of it after 10 steps and 2e-12 after 100. With
train.ema_start_step > 0 the copies replace that EMA before it averages, so it ramps as a fresh one does.

A step skipped for non-finite gradients leaves the EMA untouched too. The update runs on the device with no host
sync (the skip flag is a device tensor). Being parameters of the Lightning module, the EMA weights are saved in
every checkpoint under ``ema_unet.`` and restored on resume. Under DDP every rank holds the same weights, so the
rank-local EMA is the same everywhere and needs no communication; under FSDP each rank averages its own shard of
the weights into its own shard of the EMA, which is the same thing, sharded.
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


def ema_decay_at(step: int, decay: float, start_step: int, warm_start: bool = False) -> float:
    """The decay of the EMA update after optimizer step ``step`` (1-based): 0.0 (a copy of the weights) through
    step ``start_step + 1``, then ``min(decay, (1 + n) / (10 + n))`` with ``n = step - start_step - 1``, as
    diffusers' ``EMAModel.get_decay`` with ``update_after_step = start_step``. A ``warm_start`` EMA (another run's
    EMA, see the module docstring) with ``start_step`` 0 takes the full ``decay`` from step 1: it is no fresh copy
    of the weights to ramp from, and a ramp would trade its history for the first steps' weights."""
    if warm_start and start_step == 0:
        return decay
    n = step - start_step - 1
    return 0.0 if n <= 0 else min(decay, (1 + n) / (10 + n))


@torch.no_grad()
def ema_update_(
    ema_params: Iterable[torch.Tensor],
    params: Iterable[torch.Tensor],
    step: int,
    decay: float,
    start_step: int,
    skipped: torch.Tensor | None = None,
    warm_start: bool = False,
) -> None:
    """Update ``ema_params`` in place after optimizer step number ``step`` (1-based), with the decay of
    :func:`ema_decay_at`.

    ``skipped`` is a 0-d device tensor, 1.0 when the step did not update the weights. ``warm_start``: the EMA
    began as another run's EMA (:func:`take_ema_start`), not as a copy of ``params``.
    """
    ema_params, params = [local_tensor(e) for e in ema_params], [local_tensor(p) for p in params]
    weight = 1.0 - ema_decay_at(step, decay, start_step, warm_start)  # a host float: no device sync
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
