"""Retraining's promotion rules, without training: the gate, and finishing an interrupted promotion."""

import datetime

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.config.loader import load_config
from sdtrain.model.presets import PRESETS
from sdtrain.retrain import _decide, retrain


def test_the_gate_holds_against_production_and_the_best_model_ever_promoted():
    assert _decide(1.0, None, None, None, 0.05) == (
        True,
        "first version (val_loss 1.00000); there is no production model to compare with",
    )
    assert _decide(float("nan"), 1.0, "v0001", ("v0001", 1.0), 0.05)[0] is False
    # Within 5% of production, which is itself the best: promoted.
    assert _decide(1.04, 1.0, "v0003", ("v0003", 1.0), 0.05)[0] is True
    # Production drifted to 1.04 from the best 1.0 (v0001): 1.09 is within 5% of 1.04, not of 1.0.
    promote, reason = _decide(1.09, 1.04, "v0003", ("v0001", 1.0), 0.05)
    assert promote is False
    assert (
        reason == "val_loss 1.09000 <= v0003's 1.04000 and > v0001's 1.00000 x (1 + 0.05) (v0001 is the best promoted)"
    )


def test_an_interrupted_promotion_is_finished_only_if_production_is_still_its_parent(tmp_path):
    root = tmp_path / "daily"
    (root / "date=2026-11-01").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    config = load_config(
        None,
        [
            f"retrain.data_root={root}",
            f"retrain.models_root={tmp_path}/models",
            f"data.val={tmp_path}/val",
            f"run.storage_path={tmp_path}/runs",
        ],
    )
    registry = ModelRegistry(str(tmp_path / "models"))
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()

    def version(day, parent, promoted=True):
        manifest = {"schedule_date": day, "parent": parent, "promoted": promoted, "reason": "test"}
        return registry.write_version(unet, scheduler, {**manifest, "metrics": {"val_loss": 1.0}})

    torch.manual_seed(0)
    registry.set_production(version("2026-11-01", None))
    # D's run wrote v0002 to replace v0001, and died before moving the pointer...
    version("2026-11-02", "v0001")
    # ...then D+1 compared v0003 with v0001 and promoted it.
    registry.set_production(version("2026-11-03", "v0001"))

    # A retry of D must not put v0002 (never compared with v0003) in production.
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.version, registry.production()) == ("superseded", "v0002", "v0003")
    assert "production is now v0003, which it was never compared with" in outcome.message

    # Had nothing been promoted since, the retry finishes the promotion.
    registry.set_production("v0001")
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, registry.production()) == ("completed-promotion", "v0002")
    assert not (tmp_path / "runs").exists()  # neither retry trained
