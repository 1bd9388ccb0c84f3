"""Retraining's val_loss gate across training objectives: val_loss is the error against the model's own training
target (the noise for epsilon, the velocity for v_prediction, at its schedule's noise levels), so the losses of an
epsilon and a v-prediction model are no comparison, however alike their weights."""

import math

import torch
from conftest import write_latents
from diffusers import DDPMScheduler, UNet2DConditionModel
from test_retrain_rules import _rules_config

from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.driver.retrain_gate import OTHER_OBJECTIVE, best_served, gate_decision, gate_scores
from sdtrain.evaluation.results import measured_with
from sdtrain.model.presets import PRESETS


def _served(registry, val, loss, prediction_type):
    """A version that served, its val_loss measured as a model trained for ``prediction_type``."""
    recorded = {"data": {"val": val}, "train": {"seed": 0}, "model": {"prediction_type": prediction_type}}
    manifest = {"schedule_date": "2026-11-01", "parent": registry.production(), "promoted": True, "reason": "test"}
    torch.manual_seed(0)
    version = registry.write_version(
        UNet2DConditionModel(**PRESETS["tiny"]),
        DDPMScheduler(prediction_type=prediction_type),
        manifest | {"metrics": {"val_loss": loss}, "config": recorded},
    )
    registry.set_production(version, expected=registry.production(), kind="promote")
    return version


def test_a_val_loss_measured_for_another_prediction_type_is_no_bar(tmp_path):
    config = _rules_config(tmp_path, "model.prediction_type=v_prediction")
    registry = ModelRegistry(str(tmp_path / "models"))
    _served(registry, config.data.val, 0.10, "epsilon")  # lower, for another target: no bar for v-prediction
    _served(registry, config.data.val, 0.30, "v_prediction")
    best, not_compared = best_served(registry, config)
    assert best == ("v0002", 0.30)
    assert not_compared == [
        "v0001's 0.10000 was measured with model.prediction_type='epsilon', this run's is 'v_prediction'"
    ]
    assert measured_with(config, "val_loss")["model.prediction_type"] == "v_prediction"
    assert measured_with(config, "val_loss")["train.zero_terminal_snr"] is False
    assert "model.prediction_type" not in measured_with(config, "fd_dinov2")  # images compare across objectives
    # Production (epsilon) re-scored with its own target: not compared, as a production without a value; the best
    # that served with this objective is the bar.
    differs = "prediction_type='epsilon', the new model's 'v_prediction'"
    new, production = {"val_loss": 0.35}, {"val_loss": math.nan, OTHER_OBJECTIVE: differs}
    promote, reason = gate_decision(config, new, production, "v0003", best)
    assert (promote, reason) == (
        False,
        "val_loss 0.35000 > v0002's 0.30000 x (1 + 0) (v0002 is the best that served); v0003's val_loss is not "
        f"compared (trained for another objective: {differs}): not a bar",
    )
    # Production is the best that served: the value it served with was measured for its objective too.
    promote, reason = gate_decision(config, new, production, "v0001", ("v0001", 0.10))
    assert (promote, reason) == (
        True,
        f"val_loss 0.35000; v0001's val_loss is not compared (trained for another objective: {differs}; nor is the "
        "value it served with): not a bar, and no other model to compare with",
    )


def test_gate_scores_leave_production_trained_for_another_objective_unmeasured(tmp_path):
    config = _rules_config(tmp_path, "model.prediction_type=v_prediction")
    write_latents(tmp_path / "val" / "part-0.parquet", rows=6)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**PRESETS["tiny"])

    def loaded(scheduler):
        return LoadedModel(unet, scheduler, None, "ckpt", "raw", 2, (4, 16, 16), (77, 32), None, None, None)

    new = loaded(DDPMScheduler(prediction_type="v_prediction"))
    new_scores, production_scores = gate_scores(config, new, loaded(DDPMScheduler()))  # the same weights
    assert math.isfinite(new_scores["val_loss"]) and math.isnan(production_scores["val_loss"])
    assert production_scores[OTHER_OBJECTIVE] == "prediction_type='epsilon', the new model's 'v_prediction'"
    same = gate_scores(config, new, loaded(DDPMScheduler(prediction_type="v_prediction")))
    assert same[0] == same[1] == new_scores  # one objective: compared as before
    rescaled = loaded(DDPMScheduler(prediction_type="v_prediction", rescale_betas_zero_snr=True))
    assert gate_scores(config, new, rescaled)[1][OTHER_OBJECTIVE] == (
        "rescale_betas_zero_snr=True, the new model's False"
    )
