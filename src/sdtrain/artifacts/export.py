"""Export a trained UNet in diffusers format: what users take away from a run.

::

    <destination>/unet/config.json, diffusion_pytorch_model.safetensors   UNet2DConditionModel.save_pretrained
    <destination>/scheduler/scheduler_config.json                         the training noise schedule (DDPMScheduler,
                                                                          with the run's prediction_type)
    <destination>/unconditional_caption.npy                               the empty-prompt embedding trained with
                                                                          (L x D)
    <destination>/sdtrain.json                                            where it came from: checkpoint, step, weights
                                                                          (ema or raw), data shapes, latent scaling

``UNet2DConditionModel.from_pretrained(destination, subfolder="unet")`` loads it, and it drops into a
``StableDiffusionPipeline`` as its ``unet`` (with a matching VAE and text encoder). Weights are
safetensors: loading them never unpickles anything.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from sdtrain import __version__
from sdtrain.artifacts.loading import LoadedModel, Weights, load_checkpoint
from sdtrain.storage.filesystems import filesystem_for, local_copy

EXPORT_DIR = "export"
INFO_FILE = "sdtrain.json"
UNCONDITIONAL_FILE = "unconditional_caption.npy"


def export_checkpoint(checkpoint: str, destination: str, weights: Weights = "auto") -> str:
    """Export the (EMA, by default) UNet of ``checkpoint`` to ``destination`` (local or a storage URI)."""
    loaded = load_checkpoint(checkpoint, weights)
    return write_export(loaded, destination, source=checkpoint)


def write_export(loaded: LoadedModel, destination: str, source: str | None = None) -> str:
    """Write ``loaded`` into ``destination``, replacing what was there; returns ``destination``."""
    meta = loaded.meta
    info = {
        "sdtrain_version": __version__,
        "source_checkpoint": source,
        "global_step": meta.get("global_step"),
        "weights": meta.get("weights"),
        "prediction_type": loaded.noise_scheduler.config.prediction_type,
        "latent_shape": meta.get("latent_shape"),
        "caption_shape": meta.get("caption_shape"),
        "latent_scaling_factor": meta.get("latent_scaling_factor"),
        "demo": bool(meta.get("config", {}).get("data", {}).get("demo", False)),
    }
    fs, path = filesystem_for(destination)
    with tempfile.TemporaryDirectory() as local:
        loaded.unet.save_pretrained(os.path.join(local, "unet"), safe_serialization=True)
        loaded.noise_scheduler.save_pretrained(os.path.join(local, "scheduler"))
        if loaded.unconditional_caption is not None:
            np.save(os.path.join(local, UNCONDITIONAL_FILE), loaded.unconditional_caption.float().numpy())
        with open(os.path.join(local, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            fs.delete_dir_contents(path)
        fs.create_dir(path)
        pafs.copy_files(local, path, destination_filesystem=fs)
    return destination


def export_source(path: str) -> str | None:
    """The checkpoint the export at ``path`` was written from; None if there is no complete export."""
    fs, fs_path = filesystem_for(path)
    if not is_export(path) or fs.get_file_info(os.path.join(fs_path, INFO_FILE)).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(os.path.join(fs_path, INFO_FILE)) as f:
        return json.loads(f.read()).get("source_checkpoint")


def is_export(path: str) -> bool:
    fs, fs_path = filesystem_for(path)
    return fs.get_file_info(os.path.join(fs_path, "unet", "config.json")).type == pafs.FileType.File


def load_export(path: str) -> LoadedModel:
    """An exported model back (local or a storage URI), in the form ``load_checkpoint`` returns."""
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel

    local = local_copy(path) if "://" in path else path
    unet = UNet2DConditionModel.from_pretrained(local, subfolder="unet").eval()
    scheduler = DDPMScheduler.from_pretrained(local, subfolder="scheduler")
    info: dict[str, Any] = {}
    if os.path.isfile(os.path.join(local, INFO_FILE)):
        with open(os.path.join(local, INFO_FILE)) as f:
            info = json.load(f)
    uncond = None
    if os.path.isfile(os.path.join(local, UNCONDITIONAL_FILE)):
        with open(os.path.join(local, UNCONDITIONAL_FILE), "rb") as f:
            uncond = torch.from_numpy(np.load(io.BytesIO(f.read()), allow_pickle=False))
    return LoadedModel(unet, scheduler, info, uncond)
