"""Retraining's gate with an eval metric and a model whose samples diverge: metrics_of gives such a model a finite
stand-in (the largest float for a Frechet distance, 0 for clip_score), which ranks checkpoints but, taken for
production's measure, was a bar any model passed, and recorded in a manifest, a best-ever bar any model passes."""

import datetime
import math

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel
from test_retrain_operations import _partition, _Stubs
from test_retrain_rules import _rules_config

from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.driver.retrain import retrain
from sdtrain.driver.retrain_gate import NONFINITE, best_served, decide, gate_decision
from sdtrain.evaluation.measures import WORST_HIGH, WORST_LOW
from sdtrain.model.presets import PRESETS

_FD = ("retrain.metric=fd_dinov2", "eval.dinov2=/models/dinov2")


def _scores(fd: float | None, diverged: int = 0) -> dict:
    """A model's scores as gate_scores gives them: NaN for each eval metric of a model with a diverged sample."""
    return {"val_loss": 0.5, "fd_dinov2": math.nan if diverged else fd, NONFINITE: float(diverged)}


def test_production_whose_samples_diverged_is_no_bar_and_the_best_that_served_is(tmp_path):
    config = _rules_config(tmp_path, *_FD)
    best = ("v0003", 20.0)  # production served with fd_dinov2 20.0; re-measured today, one of its samples diverged
    promote, reason = gate_decision(config, _scores(95.0), _scores(None, diverged=1), "v0003", best)
    assert (promote, reason) == (
        False,
        "fd_dinov2 95.00000 > v0003's 20.00000 x (1 + 0) (v0003 is the best that served); "
        "v0003's fd_dinov2 is not measured (1 of its eval samples diverged): not a bar",
    )
    assert gate_decision(config, _scores(19.0), _scores(None, diverged=1), "v0003", best)[0] is True
    # metrics_of's stand-in, given as production's value, is no bar either (the largest float: every model passed).
    promote, reason = decide(95.0, WORST_HIGH, "v0003", best, 0.0, "fd_dinov2")
    assert promote is False and reason.endswith(
        f"v0003's fd_dinov2 is {WORST_HIGH:g}, the stand-in of a model whose samples diverged: not a bar"
    )
    assert decide(0.05, WORST_LOW, "v0003", ("v0003", 0.31), 0.0, "clip_score")[0] is False
    # clip_score (higher the better): its stand-in, 0, was a bar as empty.
    clip = _rules_config(tmp_path, "retrain.metric=clip_score", "eval.clip=/models/clip")
    new, production = {"clip_score": 0.05, NONFINITE: 0.0}, {"clip_score": math.nan, NONFINITE: 3.0}
    assert gate_decision(clip, new, production, "v0003", ("v0003", 0.31))[0] is False


def test_a_new_model_whose_samples_diverged_is_rejected_saying_so_whatever_production_measured(tmp_path):
    config = _rules_config(tmp_path, *_FD)
    for production in (_scores(20.0), _scores(None, diverged=2)):  # production healthy, or diverged too
        promote, reason = gate_decision(config, _scores(None, diverged=1), production, "v0003", ("v0003", 20.0))
        assert (promote, reason) == (
            False,
            "the new model diverged: 1 of its eval samples hold NaN or inf, so its fd_dinov2 is not measured",
        )
    assert gate_decision(config, _scores(None, diverged=1), {}, None, None)[0] is False  # a first version too
    # Both diverged, as metrics_of's stand-ins: a tie was promoted.
    assert decide(WORST_HIGH, WORST_HIGH, "v0003", ("v0003", 20.0), 0.0, "fd_dinov2") == (
        False,
        f"the new model's fd_dinov2 is {WORST_HIGH:g}, the stand-in of a model whose samples diverged",
    )
    assert decide(WORST_LOW, WORST_LOW, "v0003", None, 0.0, "clip_score")[0] is False


def test_a_diverged_value_is_recorded_as_null_and_an_older_manifests_stand_in_is_no_bar(tmp_path, monkeypatch):
    config = _rules_config(tmp_path, *_FD)
    registry = ModelRegistry(str(tmp_path / "models"))
    # v0001 served with the stand-in recorded, as the gate wrote it before: no bar, not the best that served.
    manifest = {"schedule_date": "2026-11-01", "parent": None, "promoted": True, "reason": "", "partitions_seen": []}
    torch.manual_seed(0)
    v0001 = registry.write_version(
        UNet2DConditionModel(**PRESETS["tiny"]),
        DDPMScheduler(),
        manifest | {"metrics": {"val_loss": 0.5, "fd_dinov2": WORST_HIGH}, "config": config.to_dict()},
    )
    registry.set_production(v0001, expected=None, kind="promote")
    assert best_served(registry, config, "fd_dinov2") == (None, [])
    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.5)
    _partition(tmp_path, "2026-11-02")
    stubs.scores = _scores(None, diverged=2), _scores(30.0)
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, registry.production()) == ("rejected", "v0001")
    metrics = registry.manifest("v0002")["metrics"]
    assert metrics["fd_dinov2"] is None and metrics[NONFINITE] == 2  # strict JSON: null, the count says why
    assert metrics["production_fd_dinov2"] == 30.0 and metrics[f"production_{NONFINITE}"] == 0

    _partition(tmp_path, "2026-11-03")
    stubs.scores = _scores(40.0), _scores(None, diverged=1)  # production diverged today, no best-ever bar
    outcome = retrain(config, datetime.date(2026, 11, 3))
    assert (outcome.status, registry.production()) == ("promoted", "v0003")
    assert registry.manifest("v0003")["metrics"]["production_fd_dinov2"] is None
    assert registry.manifest("v0003")["reason"] == (
        "fd_dinov2 40.00000; v0001's fd_dinov2 is not measured (1 of its eval samples diverged): not a bar, and no "
        "other model to compare with"
    )
