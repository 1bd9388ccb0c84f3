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

import json
import os
import tempfile

import numpy as np
import pyarrow.fs as pafs

from sdtrain import __version__
from sdtrain.artifacts.loading import EXPORT_INFO_FILE, UNCONDITIONAL_FILE, LoadedModel, Weights, is_export, load_model
from sdtrain.storage.filesystems import filesystem_for

EXPORT_DIR = "export"


def export_checkpoint(checkpoint: str, destination: str, weights: Weights = "auto") -> str:
    """Export the (EMA, by default) UNet of ``checkpoint`` to ``destination`` (local or a storage URI)."""
    return write_export(load_model(checkpoint, weights), destination)


def write_export(loaded: LoadedModel, destination: str) -> str:
    """Write ``loaded`` into ``destination``, replacing what was there; returns ``destination``."""
    info = {
        "sdtrain_version": __version__,
        "source_checkpoint": loaded.source,
        "global_step": loaded.global_step,
        "weights": loaded.weights,
        "prediction_type": loaded.noise_scheduler.config.prediction_type,
        "latent_shape": list(loaded.latent_shape) if loaded.latent_shape else None,
        "caption_shape": list(loaded.caption_shape) if loaded.caption_shape else None,
        "latent_scaling_factor": loaded.latent_scaling_factor,
        "demo": loaded.trained_on_demo,
    }
    fs, path = filesystem_for(destination)
    with tempfile.TemporaryDirectory() as local:
        loaded.unet.save_pretrained(os.path.join(local, "unet"), safe_serialization=True)
        loaded.noise_scheduler.save_pretrained(os.path.join(local, "scheduler"))
        if loaded.unconditional_caption is not None:
            np.save(os.path.join(local, UNCONDITIONAL_FILE), loaded.unconditional_caption.float().numpy())
        with open(os.path.join(local, EXPORT_INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            fs.delete_dir_contents(path)
        fs.create_dir(path)
        pafs.copy_files(local, path, destination_filesystem=fs)
    return destination


def export_source(path: str) -> str | None:
    """The checkpoint the export at ``path`` was written from; None if there is no complete export."""
    fs, fs_path = filesystem_for(path)
    info_path = os.path.join(fs_path, EXPORT_INFO_FILE)
    if not is_export(path) or fs.get_file_info(info_path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(info_path) as f:
        return json.loads(f.read()).get("source_checkpoint")
