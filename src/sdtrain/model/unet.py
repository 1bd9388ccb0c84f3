"""Build the UNet and the training noise scheduler from config, or from a pretrained model."""

from __future__ import annotations

import dataclasses
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.config.schema import Config, ModelConfig
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.model.conditioning import dummy_conditioning
from sdtrain.model.ema import set_ema_start
from sdtrain.model.presets import PRESETS
from sdtrain.model.recipe import PREDICTION_TYPES
from sdtrain.storage.filesystems import local_copy
from sdtrain.storage.uris import is_uri

RAW_UNET_SUBFOLDER = "raw_unet"
"""Beside unet/ in a registry version of a run that kept an EMA: the trained (raw) weights, unet/ holding the EMA's."""


def unet_config(model: ModelConfig) -> dict[str, Any]:
    """The UNet2DConditionModel kwargs a run uses: preset, then overrides (or the pretrained model's own)."""
    if model.pretrained is not None:
        path, subfolder = _pretrained_location(model.pretrained, "unet")
        try:
            return json_safe(UNet2DConditionModel.load_config(path, subfolder=subfolder))
        except OSError as e:  # a hub id that is unknown or unreachable (no network, no token)
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"model.pretrained: {model.pretrained} is not a local directory, and as a Hugging Face hub id its "
                f"unet/config.json could not be fetched ({first_line}); give a diffusers model directory (local or "
                "s3://) or a hub id this machine can reach"
            ) from None
    return json_safe({**PRESETS[model.preset], **model.unet})


def check_unet(model: ModelConfig, latent_shape: tuple[int, ...], caption_shape: tuple[int, ...]) -> None:
    """Build the run's UNet on the meta device (no memory) and run one forward and backward pass with the data's
    shapes, on the driver: a model.unet combination diffusers refuses, one that cannot take these latents and
    captions, one whose prediction is not of the latents' shape, or one with parameters the loss does not reach (which
    DDP refuses on every worker) fails here in a second instead of on every worker."""
    import torch

    config = unet_config(model)
    source = f"model.pretrained={model.pretrained}" if model.pretrained else f"model.preset={model.preset}"
    source += f" with model.unet={model.unet}" if model.unet and not model.pretrained else ""
    try:
        with torch.device("meta"):
            unet = UNet2DConditionModel(**config)
            conditioning = dummy_conditioning(config, 1, caption_shape)
            latents = torch.zeros(1, *latent_shape)
            prediction = unet(latents, torch.zeros(1, dtype=torch.long), **conditioning.kwargs()).sample
    except Exception as e:  # diffusers raises ValueError, TypeError, RuntimeError, AssertionError...
        raise ConfigError(
            f"model.unet: {source} does not give a UNet2DConditionModel that takes latents of shape "
            f"{tuple(latent_shape)} and captions of shape {tuple(caption_shape)}: {type(e).__name__}: {e}"
        ) from None
    if tuple(prediction.shape) != tuple(latents.shape):
        raise ConfigError(
            f"model.unet: {source} predicts tensors of shape {tuple(prediction.shape[1:])} for latents of shape "
            f"{tuple(latent_shape)} (out_channels={config.get('out_channels')}, the data's latents have "
            f"{latent_shape[0]} channels); the loss compares the two, so they must match: "
            + (
                f"use a model.pretrained of {latent_shape[0]} out_channels"
                if model.pretrained
                else f"set model.unet.out_channels to {latent_shape[0]} or remove it"
            )
        )
    try:
        prediction.sum().backward()
    except Exception as e:  # a backward the meta device lacks: no verdict on the parameters, the workers will tell
        log.debug(f"check_unet: no meta-device backward ({type(e).__name__}: {e}); unused parameters not checked")
        return
    _refuse_unused_parameters(unet, config, source, bool(model.pretrained))


def _refuse_unused_parameters(unet: UNet2DConditionModel, config: dict[str, Any], source: str, pretrained: bool):
    """After the meta-device backward: parameters no gradient reached, which every worker's DDP would refuse at the
    first step ("parameters that were not used in producing the loss")."""
    unused = [name for name, parameter in unet.named_parameters() if parameter.grad is None]
    if not unused:
        return
    named = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    cause = (
        f"time_cond_proj_dim={config['time_cond_proj_dim']}, a guidance-embedding input (an LCM-distilled model's) "
        "that sdtrain's training step does not feed: "
        + (
            "start from a model.pretrained without it (the base model)"
            if pretrained
            else "remove model.unet.time_cond_proj_dim"
        )
        if config.get("time_cond_proj_dim")
        else "an input of the UNet's config that sdtrain's training step does not feed: use a UNet without it"
    )
    raise ConfigError(
        f"model.unet: {source} has parameters the training loss never reaches ({named}), which DDP refuses on every "
        f"worker; likely cause: {cause}"
    )


def build_unet(model: ModelConfig) -> UNet2DConditionModel:
    """The run's initial UNet. From a model.pretrained that holds trained weights beside its EMA ones (a registry
    version, RAW_UNET_SUBFOLDER beside unet/): the trained weights, with the EMA's attached for the run's EMA to
    start from (sdtrain.model.ema.take_ema_start), so that a warm start continues both."""
    if model.pretrained is not None:
        path, subfolder = _pretrained_location(model.pretrained, "unet")
        unet = UNet2DConditionModel.from_pretrained(path, subfolder=subfolder)
        if subfolder == "unet" and (Path(path) / RAW_UNET_SUBFOLDER / "config.json").is_file():
            raw = UNet2DConditionModel.from_pretrained(path, subfolder=RAW_UNET_SUBFOLDER)
            set_ema_start(raw, unet)
            return raw
        return unet
    return UNet2DConditionModel(**unet_config(model))


def noise_scheduler_config(model: ModelConfig, zero_terminal_snr: bool = False) -> dict[str, Any]:
    """The DDPM training schedule: SD 2 base's (shipped), or the pretrained model's scheduler/;
    with ``prediction_type`` from model.prediction_type, or where that is unset the pretrained scheduler's (else
    epsilon), and ``clip_sample`` off (diffusers' DDPMScheduler default, taken when a config omits it, clips each
    predicted sample to [-1, 1]: right for pixels, wrong for latents, whose values go well past 1, and it wrecks
    samples). ``zero_terminal_snr`` (train.zero_terminal_snr): the betas rescaled so the last timestep is pure noise
    (diffusers' ``rescale_betas_zero_snr``), and timesteps spaced from the last one ("trailing") wherever the
    config makes a sampler: what the schedule's samplers and an exported pipeline need. A zero-terminal-SNR
    schedule, set here or inherited from the pretrained one, with any prediction_type but v_prediction is refused."""
    return _training_schedule(model, pretrained_scheduler_config(model), zero_terminal_snr)


def _training_schedule(model: ModelConfig, config: dict[str, Any] | None, zero_terminal_snr: bool) -> dict[str, Any]:
    """noise_scheduler_config from ``config``, model.pretrained's scheduler config as already read (None: none)."""
    inherited = config is not None
    if config is None:
        shipped = resources.files("sdtrain").joinpath("assets/scheduler_config.json").read_text()
        config = {k: v for k, v in json.loads(shipped).items() if not k.startswith("_")}
    prediction_type = model.prediction_type or config.get("prediction_type") or "epsilon"
    config = {**config, "prediction_type": prediction_type, "clip_sample": False}
    if zero_terminal_snr:
        config = {**config, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    config = json_safe(dict(DDPMScheduler.from_config(config).config))
    _refuse_unusable_schedule(model, config, zero_terminal_snr, inherited)
    return config


def pretrained_scheduler_config(model: ModelConfig) -> dict[str, Any] | None:
    """The scheduler config of model.pretrained as it is stored, or None: no model.pretrained, or a bare UNet."""
    location = _pretrained_location(model.pretrained, "scheduler", required=False) if model.pretrained else None
    if location is None:
        return None
    return dict(DDPMScheduler.load_config(location[0], subfolder=location[1]))


def _refuse_unusable_schedule(model: ModelConfig, config: dict[str, Any], zero_terminal_snr: bool, inherited: bool):
    """``inherited``: the schedule is model.pretrained's scheduler/ (its prediction_type too, where unset)."""
    prediction_type = config["prediction_type"]
    if model.prediction_type is not None:
        given = prediction_type
    else:
        source = "model.pretrained's" if inherited else "the default"
        given = f"unset, so {source} {prediction_type}"
    if prediction_type not in PREDICTION_TYPES:
        raise ConfigError(
            f"model.prediction_type: {given}, which sdtrain does not train; set one of {', '.join(PREDICTION_TYPES)}"
        )
    if config.get("rescale_betas_zero_snr") and prediction_type != "v_prediction":
        schedule = f"model.pretrained={model.pretrained}'s scheduler"
        schedule = "train.zero_terminal_snr" if zero_terminal_snr else schedule
        raise ConfigError(
            f"model.prediction_type: {given} cannot train on a zero-terminal-SNR schedule (rescale_betas_zero_snr, "
            f"from {schedule}): its last timestep is pure noise, where an epsilon prediction recovers nothing of the "
            "image; set model.prediction_type: v_prediction"
        )


def resolve_prediction_type(config: Config) -> Config:
    """``config`` with model.prediction_type concrete: the value noise_scheduler_config trains with (refusing what it
    refuses), so that everything downstream (workers, loss plots, checkpoints) reads one value. On the driver, once
    per run, after model.pretrained is located: it also warns of an explicit prediction_type that changes the
    pretrained model's objective, and of min-SNR weighting on a zero-terminal-SNR schedule."""
    model = config.model
    pretrained = pretrained_scheduler_config(model)  # read once: an s3:// model.pretrained is a download
    scheduler = _training_schedule(model, pretrained, config.train.zero_terminal_snr)
    inherited = pretrained.get("prediction_type", "epsilon") if pretrained is not None else None
    if model.prediction_type is not None and inherited not in (None, model.prediction_type):
        log.warning(
            f"model.prediction_type: {model.prediction_type} retrains model.pretrained ({model.pretrained}), whose "
            f"scheduler predicts {inherited}: the run changes its objective (fine when meant); unset "
            f"model.prediction_type to keep {inherited}"
        )
    if config.train.snr_gamma is not None and scheduler.get("rescale_betas_zero_snr"):
        log.warning(
            f"train.snr_gamma: {config.train.snr_gamma:g} on a zero-terminal-SNR schedule: v-prediction's min-SNR "
            "weight min(SNR, gamma) / (SNR + 1) goes to 0 with the SNR, so the terminal timesteps (pure noise), which "
            "zero-terminal SNR exists to train, get about no weight (under 2e-5 at t=990 of 1000, 0 at the last); "
            "unset train.snr_gamma"
        )
    return dataclasses.replace(config, model=dataclasses.replace(model, prediction_type=scheduler["prediction_type"]))


def default_guidance_rescale(noise_scheduler_config: dict[str, Any]) -> float:
    """Guidance rescale a model samples with unless told otherwise: 0.7 for a zero-terminal-SNR schedule (Lin et al.
    2023, section 3.4: without it, guidance over-exposes images at SNR 0), else none."""
    return 0.7 if noise_scheduler_config.get("rescale_betas_zero_snr") else 0.0


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
    # A hub id is exactly "owner/name"; anything else that is not a directory is a missing local path.
    if not _HUB_ID.fullmatch(pretrained) or Path(pretrained).parent.is_dir():
        raise ConfigError(
            f"model.pretrained: directory {pretrained} does not exist (relative paths are taken from "
            f"{Path.cwd()}); expected a diffusers model directory, an s3:// URI or a hub id owner/name"
        )
    return pretrained, subfolder


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
