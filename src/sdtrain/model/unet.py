"""Build the UNet and the training noise scheduler from config, or from a pretrained model."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.config.schema import ModelConfig
from sdtrain.errors import ConfigError
from sdtrain.model.presets import PRESETS
from sdtrain.storage.filesystems import local_copy
from sdtrain.storage.uris import is_uri


def unet_config(model: ModelConfig) -> dict[str, Any]:
    """The UNet2DConditionModel kwargs a run uses: preset, then overrides (or the pretrained model's own)."""
    if model.pretrained is not None:
        path, subfolder = _pretrained_location(model.pretrained, "unet")
        return json_safe(UNet2DConditionModel.load_config(path, subfolder=subfolder))
    return json_safe({**PRESETS[model.preset], **model.unet})


def build_unet(model: ModelConfig) -> UNet2DConditionModel:
    if model.pretrained is not None:
        path, subfolder = _pretrained_location(model.pretrained, "unet")
        return UNet2DConditionModel.from_pretrained(path, subfolder=subfolder)
    return UNet2DConditionModel(**unet_config(model))


def noise_scheduler_config(model: ModelConfig) -> dict[str, Any]:
    """The DDPM training schedule: SD 2 base's (shipped), or the pretrained model's scheduler/;
    with ``prediction_type`` from model.prediction_type in either case, and ``clip_sample`` off
    (diffusers' DDPMScheduler default, taken when a config omits it, clips each predicted sample to
    [-1, 1]: right for pixels, wrong for latents, whose values go well past 1, and it wrecks samples)."""
    config = None
    if model.pretrained is not None:
        location = _pretrained_location(model.pretrained, "scheduler", required=False)
        if location is not None:
            path, subfolder = location
            config = DDPMScheduler.load_config(path, subfolder=subfolder)
    if config is None:
        shipped = resources.files("sdtrain").joinpath("assets/scheduler_config.json").read_text()
        config = {k: v for k, v in json.loads(shipped).items() if not k.startswith("_")}
    config = {**config, "prediction_type": model.prediction_type, "clip_sample": False}
    return json_safe(dict(DDPMScheduler.from_config(config).config))


def build_noise_scheduler(config: dict[str, Any]) -> DDPMScheduler:
    """The noise scheduler of a stored config, with ``clip_sample`` off whatever it says (see above)."""
    return DDPMScheduler.from_config({**config, "clip_sample": False})


def json_safe(config: Any) -> Any:
    """Plain JSON types (tuples become lists, private ``_`` keys dropped): safe to store anywhere."""
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return json.loads(json.dumps(config))


def _pretrained_location(pretrained: str, subfolder: str, required: bool = True):
    """(path, subfolder) for a diffusers model: a pipeline root with unet/ and scheduler/, or a bare model.

    A directory in object storage (s3://...) is downloaded first; a local directory is
    inspected; anything else is taken to be a hub id with the usual pipeline layout (only
    reachable on a cluster with network access).
    """
    if is_uri(pretrained):
        pretrained = local_copy(pretrained)
    root = Path(pretrained).expanduser()
    if root.is_dir():
        if (root / subfolder / "config.json").is_file() or (root / subfolder / "scheduler_config.json").is_file():
            return str(root), subfolder
        config_name = "config.json" if subfolder == "unet" else "scheduler_config.json"
        if (root / config_name).is_file():
            return str(root), None
        if not required:
            return None
        raise ConfigError(
            f"model.pretrained: {root} has neither {subfolder}/config.json nor config.json; "
            "expected a diffusers model directory (save_pretrained output)"
        )
    if Path(pretrained).is_absolute() or pretrained.startswith((".", "~")):
        raise ConfigError(f"model.pretrained: directory {pretrained} does not exist")
    return pretrained, subfolder
