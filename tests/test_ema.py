"""The EMA's decay schedule (sdtrain.model.ema), step by step against diffusers' own EMAModel: no Ray, no Lightning."""

import pytest
import torch
from diffusers.training_utils import EMAModel

from sdtrain.model.ema import ema_decay_at, ema_update_, make_ema


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Conv2d(4, 3, 3))


def _train_step(model: torch.nn.Module, generator: torch.Generator) -> None:
    """A stand-in for an optimizer step: the weights drift away from their initial values."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 + 0.05 * torch.randn(p.shape, generator=generator))


@pytest.mark.parametrize("start_step", [0, 1, 7, 40])
def test_the_ema_is_diffusers_emamodel_with_update_after_step_the_ema_start_step(start_step):
    """train.ema_decay and train.ema_start_step average as diffusers' EMAModel (its default ramp, as
    train_text_to_image.py uses it) with update_after_step = ema_start_step: the same decay and the same EMA weights
    after every step, through the ramp and past the point where it reaches the decay (n = 170 for 0.95)."""
    decay, steps = 0.95, start_step + 220
    model = _model(0)
    ours = make_ema(model)
    theirs = EMAModel(model.parameters(), decay=decay, update_after_step=start_step)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        _train_step(model, generator)
        # Both paths of the update: the plain one and the one with the device skip flag (0: not skipped).
        skipped = torch.zeros(()) if step % 2 else None
        ema_update_(ours.parameters(), model.parameters(), step, decay, start_step, skipped)
        theirs.step(model.parameters())
        assert ema_decay_at(step, decay, start_step) == theirs.cur_decay_value, step
        for a, b in zip(ours.parameters(), theirs.shadow_params, strict=True):
            torch.testing.assert_close(a, b, msg=f"step {step}")
    assert theirs.cur_decay_value == decay  # the ramp was done
    assert not torch.allclose(next(ours.parameters()), next(model.parameters()))


def test_a_fresh_ema_forgets_the_initial_weights_at_0_9999():
    """The review's case: weights that jump from their random initial values (0) to trained ones (1). With the full
    decay from the first step the EMA still held 37% of the initial weights at step 10k; the ramp leaves none."""
    ema, weights = [torch.zeros(1)], [torch.ones(1)]
    for step in range(1, 10_001):
        ema_update_(ema, weights, step, 0.9999, 0, torch.zeros(()))
    assert 1 - ema[0].item() < 1e-6
    assert ema_decay_at(1, 0.9999, 0) == 0.0 and ema_decay_at(2, 0.9999, 0) == 2 / 11
    assert ema_decay_at(10_000, 0.9999, 0) == pytest.approx(10_000 / 10_009)


def test_a_warm_started_ema_keeps_the_full_decay_from_its_first_step():
    """Retraining's warm start: the EMA starts as the production version's EMA (not a copy of the weights trained),
    and averages at the full decay from step 1, keeping that EMA's history; with ema_start_step > 0 it copies the
    weights first, so it is a fresh EMA again and ramps as diffusers' does."""
    decay = 0.9
    model, production_ema = _model(0), _model(5)
    ours = make_ema(model, production_ema)
    expected = [p.detach().clone() for p in production_ema.parameters()]
    generator = torch.Generator().manual_seed(2)
    for step in range(1, 31):
        _train_step(model, generator)
        assert ema_decay_at(step, decay, 0, warm_start=True) == decay
        ema_update_(ours.parameters(), model.parameters(), step, decay, 0, torch.zeros(()), warm_start=True)
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, model.parameters(), strict=True)]
        for a, b in zip(ours.parameters(), expected, strict=True):
            torch.testing.assert_close(a, b, msg=f"step {step}")
    # Production's EMA still weighs decay^30 in it: the ramp would have replaced it at step 1.
    assert not torch.allclose(next(ours.parameters()), next(model.parameters()))

    for step in range(1, 60):
        assert ema_decay_at(step, decay, 5, warm_start=True) == ema_decay_at(step, decay, 5)
