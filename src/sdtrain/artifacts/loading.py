"""Rebuilding a trained model from a checkpoint alone (the layout: :mod:`sdtrain.artifacts.checkpoint_format`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow.fs as pafs
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_FILE
from sdtrain.model.unet import build_noise_scheduler
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.train.module import CHECKPOINT_META_KEY


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint dict from a checkpoint directory (local or a storage URI) or its checkpoint.ckpt, on the CPU."""
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.Directory:
        fs_path = posixpath.join(fs_path, CHECKPOINT_FILE)
    with fs.open_input_file(fs_path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


Weights = Literal["auto", "ema", "raw"]


@dataclass
class LoadedModel:
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler
    meta: dict[str, Any]  # the checkpoint's sdtrain metadata, plus global_step and weights ("ema" or "raw")
    unconditional_caption: torch.Tensor | None  # (L, D); None in checkpoints from before caption dropout


def load_model(path: str, weights: Weights = "auto") -> tuple[UNet2DConditionModel, DDPMScheduler, dict[str, Any]]:
    """(UNet with trained weights, noise scheduler, metadata) from a checkpoint, with no config file needed.

    ``weights``: auto = the EMA weights if the run kept an EMA, else the trained weights; ema; raw.
    """
    loaded = load_checkpoint(path, weights)
    return loaded.unet, loaded.noise_scheduler, loaded.meta


def load_checkpoint(path: str, weights: Weights = "auto") -> LoadedModel:
    """Everything a checkpoint holds for inference (see ``load_model``)."""
    checkpoint = read_checkpoint(path)
    meta = checkpoint[CHECKPOINT_META_KEY]
    state = checkpoint["state_dict"]
    has_ema = any(k.startswith("ema_unet.") for k in state)
    if weights == "ema" and not has_ema:
        raise ValueError(f"{path} holds no EMA weights (the run had train.ema_decay: null); use the raw weights")
    chosen = "ema" if weights == "ema" or (weights == "auto" and has_ema) else "raw"
    prefix = "ema_unet." if chosen == "ema" else "unet."
    unet = UNet2DConditionModel(**meta["unet_config"])
    unet.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    unet.eval()
    meta = {**meta, "global_step": checkpoint["global_step"], "weights": chosen}
    return LoadedModel(
        unet, build_noise_scheduler(meta["noise_scheduler_config"]), meta, state.get("unconditional_caption")
    )
