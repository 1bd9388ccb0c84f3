"""The checkpoint format, and rebuilding a trained model from a checkpoint alone.

A checkpoint is a directory ``checkpoint_<step>/`` holding ``checkpoint.ckpt``: Lightning's
full training state (weights, optimizer, LR scheduler, loop progress) plus, under the
``sdtrain`` key, the UNet and noise-scheduler configs, the data shapes and the run config; the
state dict holds the UNet (``unet.``), its EMA when train.ema_decay is set (``ema_unet.``) and
the unconditional caption embedding (``unconditional_caption``);
``history.json``, the metric rows reported up to that step; and ``data_state.json``, the data
position to resume from. Only plain data and tensors are stored, so loading never unpickles code
(``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Literal, Optional

import pyarrow.fs as pafs

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.files import filesystem_for
from sdtrain.model import build_noise_scheduler
from sdtrain.module import CHECKPOINT_META_KEY

CHECKPOINT_FILE = "checkpoint.ckpt"
# The metric rows reported up to the checkpoint's step: the run's curve, readable without the weights.
HISTORY_FILE = "history.json"
# The step and the data position after it (sdtrain.sampling.DataState): where the data stream resumes.
DATA_STATE_FILE = "data_state.json"
# With run.record_samples: (world size, rows) sample indices trained on since the previous checkpoint.
SAMPLES_FILE = "samples.npy"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


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
    unconditional_caption: Optional[torch.Tensor]  # (L, D); None in checkpoints from before caption dropout


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
    return LoadedModel(unet, build_noise_scheduler(meta["noise_scheduler_config"]), meta, state.get("unconditional_caption"))
