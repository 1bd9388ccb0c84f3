"""model.prediction_type against model.pretrained's scheduler, and min-SNR on a zero-terminal-SNR schedule: an unset
prediction_type takes the pretrained model's (a v-prediction model is not silently retrained on epsilon targets), an
explicit other one trains with a warning, and no resolved schedule pairs zero-terminal SNR with epsilon."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO, tiny_config
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.config.loader import load_config
from sdtrain.errors import ConfigError
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import noise_scheduler_config, resolve_prediction_type
from sdtrain.train.build import checkpoint_meta


def _pretrained(path, prediction_type, zero_terminal_snr=False):
    """A diffusers model directory (unet/, scheduler/) as SD 2 768-v, or sdtrain's own zero-terminal-SNR export."""
    UNet2DConditionModel(**PRESETS["tiny"]).save_pretrained(path / "unet")
    DDPMScheduler(
        prediction_type=prediction_type, rescale_betas_zero_snr=zero_terminal_snr, timestep_spacing="trailing"
    ).save_pretrained(path / "scheduler")
    return str(path)


def _resolved(caplog, *overrides):
    with caplog.at_level("WARNING", logger="sdtrain"):
        return resolve_prediction_type(tiny_config("data.train=/d", *overrides))


def test_an_unset_prediction_type_is_the_pretrained_schedulers_and_reaches_the_workers(tmp_path, caplog):
    pretrained = _pretrained(tmp_path, "v_prediction", zero_terminal_snr=True)
    config = tiny_config("data.train=/d", f"model.pretrained={pretrained}")
    assert config.model.prediction_type is None  # unset: not the old default epsilon
    stored = noise_scheduler_config(config.model)
    assert stored["prediction_type"] == "v_prediction" and stored["rescale_betas_zero_snr"] is True
    resolved = _resolved(caplog, f"model.pretrained={pretrained}")
    assert resolved.model.prediction_type == "v_prediction" and not caplog.records
    assert resolved.to_dict()["model"]["prediction_type"] == "v_prediction"  # what the workers and plots read
    assert checkpoint_meta(resolved, (4, 16, 16), (77, 32)).noise_scheduler_config["prediction_type"] == "v_prediction"
    # Retraining's warm start replaces model.pretrained with production's location: it keeps production's objective.
    warm = dataclasses.replace(tiny_config("data.train=/d").model, pretrained=pretrained)
    assert noise_scheduler_config(warm)["prediction_type"] == "v_prediction"
    # Without model.pretrained an unset prediction_type is epsilon, as before.
    assert resolve_prediction_type(tiny_config("data.train=/d")).model.prediction_type == "epsilon"


def test_resolving_the_prediction_type_reads_the_pretrained_scheduler_once(tmp_path, monkeypatch):
    """An s3:// model.pretrained is downloaded by each location lookup: resolving reads its scheduler/ once."""
    from sdtrain.model import unet

    looked_up = []
    lookup = unet._pretrained_location

    def counted(pretrained, subfolder, required=True):
        looked_up.append(subfolder)
        return lookup(pretrained, subfolder, required)

    monkeypatch.setattr(unet, "_pretrained_location", counted)
    pretrained = _pretrained(tmp_path, "v_prediction")
    resolved = resolve_prediction_type(tiny_config("data.train=/d", f"model.pretrained={pretrained}"))
    assert resolved.model.prediction_type == "v_prediction" and looked_up == ["scheduler"]


def test_epsilon_on_a_pretrained_zero_terminal_snr_schedule_is_refused(tmp_path):
    pretrained = _pretrained(tmp_path, "v_prediction", zero_terminal_snr=True)
    config = tiny_config("data.train=/d", f"model.pretrained={pretrained}", "model.prediction_type=epsilon")
    message = (
        r"model\.prediction_type: epsilon cannot train on a zero-terminal-SNR schedule \(rescale_betas_zero_snr, "
        rf"from model\.pretrained={pretrained}'s scheduler\).*set model\.prediction_type: v_prediction"
    )
    with pytest.raises(ConfigError, match=message):
        resolve_prediction_type(config)
    with pytest.raises(ConfigError, match=message):
        checkpoint_meta(config, (4, 16, 16), (77, 32))
    # An epsilon model's scheduler, zero-terminal SNR asked for and prediction_type unset: epsilon inherited, refused.
    epsilon = _pretrained(tmp_path / "eps", "epsilon")
    with pytest.raises(ConfigError, match=r"unset, so model\.pretrained's epsilon cannot .*train\.zero_terminal_snr"):
        resolve_prediction_type(
            tiny_config("data.train=/d", f"model.pretrained={epsilon}", "train.zero_terminal_snr=true")
        )
    # Without model.pretrained, unset with zero_terminal_snr is epsilon: refused at load.
    with pytest.raises(ConfigError, match=r"train\.zero_terminal_snr: .*v_prediction, got epsilon"):
        tiny_config("data.train=/d", "train.zero_terminal_snr=true")


@pytest.mark.parametrize(("inherited", "explicit"), [("epsilon", "v_prediction"), ("v_prediction", "epsilon")])
def test_an_explicit_other_prediction_type_trains_with_a_warning_naming_both(tmp_path, caplog, inherited, explicit):
    pretrained = _pretrained(tmp_path, inherited)
    resolved = _resolved(caplog, f"model.pretrained={pretrained}", f"model.prediction_type={explicit}")
    assert resolved.model.prediction_type == explicit
    assert noise_scheduler_config(resolved.model)["prediction_type"] == explicit
    [record] = caplog.records
    assert record.name == "sdtrain" and record.levelname == "WARNING"
    assert f"model.prediction_type: {explicit} retrains model.pretrained ({pretrained})" in record.message
    assert f"whose scheduler predicts {inherited}" in record.message
    caplog.clear()
    assert _resolved(caplog, f"model.pretrained={pretrained}", f"model.prediction_type={inherited}")
    assert not caplog.records  # the same value: nothing to say


def test_min_snr_on_a_zero_terminal_snr_schedule_warns_that_the_terminal_timesteps_get_no_weight(tmp_path, caplog):
    v = ["model.prediction_type=v_prediction"]
    _resolved(caplog, *v, "train.zero_terminal_snr=true", "train.snr_gamma=5")
    [record] = caplog.records
    assert record.levelname == "WARNING" and record.message.startswith("train.snr_gamma: 5 on a zero-terminal-SNR")
    assert "terminal timesteps (pure noise), which zero-terminal SNR exists to train, get about no weight" in (
        record.message
    )
    caplog.clear()
    pretrained = _pretrained(tmp_path, "v_prediction", zero_terminal_snr=True)  # the schedule inherited
    _resolved(caplog, f"model.pretrained={pretrained}", "train.snr_gamma=5")
    assert [r.message.split(":")[0] for r in caplog.records] == ["train.snr_gamma"]
    caplog.clear()
    _resolved(caplog, *v, "train.zero_terminal_snr=true")
    _resolved(caplog, *v, "train.snr_gamma=5")
    assert not caplog.records


def test_the_shipped_sdxl_config_trains_zero_terminal_snr_without_min_snr(caplog):
    config = load_config(REPO / "configs" / "sdxl-base.yaml", ["model.preset=tiny-sdxl"])
    assert config.train.zero_terminal_snr and config.model.prediction_type == "v_prediction"
    assert config.train.snr_gamma is None
    with caplog.at_level("WARNING", logger="sdtrain"):
        assert resolve_prediction_type(config).model.prediction_type == "v_prediction"
    assert not caplog.records
