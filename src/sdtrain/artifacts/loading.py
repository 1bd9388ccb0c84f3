"""One way to get a trained model back: :func:`load_model` takes any path a run leaves.

- a run directory (its latest checkpoint reported to Ray Train),
- a checkpoint directory or its ``checkpoint.ckpt`` (:mod:`sdtrain.artifacts.checkpoint_format`),
- an export (:mod:`sdtrain.artifacts.export`) or a registry version (``ModelRegistry.location``),

local or on object storage; no config file is needed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow.fs as pafs
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_META_KEY, CheckpointMeta
from sdtrain.errors import SdtrainError
from sdtrain.model.conditioning import pooled_width
from sdtrain.model.unet import build_noise_scheduler
from sdtrain.storage.filesystems import filesystem_for, local_copy, ray_storage, uri_for
from sdtrain.storage.run_layout import CHECKPOINT_FILE, EXPORT_INFO_FILE, UNCONDITIONAL_FILE
from sdtrain.storage.uris import is_uri

Weights = Literal["auto", "ema", "raw"]
# An export's files besides unet/ and scheduler/ (written by sdtrain.artifacts.export).


@dataclass
class LoadedModel:
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler
    unconditional_caption: torch.Tensor | None
    """(L, D) empty-prompt embedding trained with; None where the source did not record one."""
    source: str
    """The checkpoint or export the weights were read from."""
    weights: Literal["ema", "raw"] | None
    """Which weights of the run these are; None for a registry version (not recorded)."""
    global_step: int | None
    latent_shape: tuple[int, ...] | None
    """(C, H, W) the model was trained at: the data's one shape, or the aspect-ratio bucket most rows had."""
    caption_shape: tuple[int, ...] | None
    latent_scaling_factor: float | None
    """What decoding with a VAE divides by; None: the VAE's own scaling factor."""
    latent_classifier: str | None
    """The module the training data named as the reader of its latents without a VAE, if any."""
    meta: CheckpointMeta | None
    """The full metadata when loaded from a checkpoint (an export keeps the summary above)."""
    bucket_shapes: tuple[tuple[int, ...], ...] | None = None
    """The latent shape of each aspect-ratio bucket the model trained on; None: one shape (latent_shape)."""
    vae_downsampling: int = 8
    """Pixels per latent side of the VAE its data was encoded with (SDXL's size conditioning is in pixels)."""

    @property
    def pooled_width(self) -> int | None:
        """The pooled text embedding an SDXL-shaped UNet takes; None for SD 1/2."""
        return pooled_width(self.unet.config)

    @property
    def caption_dropout_prob(self) -> float | None:
        return self.meta.caption_dropout_prob if self.meta is not None else None


def load_model(path: str, weights: Weights = "auto") -> LoadedModel:
    """The trained model at ``path`` (see the module docstring for what ``path`` may be).

    Args:
        path: a run directory, checkpoint, export or registry version; local or a storage URI.
        weights: auto = the EMA weights if the run kept an EMA, else the trained ones; ema; raw.
    """
    fs, fs_path = filesystem_for(path)
    info = fs.get_file_info(fs_path)
    if info.type == pafs.FileType.NotFound:
        raise SdtrainError(f"model: {path} does not exist")
    if info.type == pafs.FileType.File or _is_file(fs, posixpath.join(fs_path, CHECKPOINT_FILE)):
        return _from_checkpoint(path, weights)
    if is_export(path):
        if weights == "raw":
            raise SdtrainError(
                f"model: {path} is an export, which holds one set of weights; weights=raw needs a checkpoint"
            )
        return _from_export(path)
    return _from_checkpoint(_latest_reported_checkpoint(path), weights)


def read_checkpoint(path: str) -> dict[str, Any]:
    """The raw checkpoint dict (state dict, optimizer, metadata) from a checkpoint directory or its
    checkpoint.ckpt, local or a storage URI, on the CPU."""
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.Directory:
        fs_path = posixpath.join(fs_path, CHECKPOINT_FILE)
    with fs.open_input_file(fs_path) as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            # torch's message would suggest weights_only=False: unpickling code from a file that is no checkpoint.
            reason = " ".join(str(e).split()).split(". ")[0][:200]
            raise SdtrainError(
                f"model: {path} is no sdtrain checkpoint (a torch checkpoint of plain data and tensors): it could not "
                f"be read ({type(e).__name__}: {reason}). Name a run directory, a checkpoint or an export"
            ) from None


def is_export(path: str) -> bool:
    """Whether ``path`` holds a diffusers-format UNet (an export or a registry version)."""
    fs, fs_path = filesystem_for(path)
    return _is_file(fs, posixpath.join(fs_path, "unet", "config.json"))


def _from_checkpoint(path: str, weights: Weights) -> LoadedModel:
    checkpoint = read_checkpoint(path)
    if CHECKPOINT_META_KEY not in checkpoint:
        raise SdtrainError(f"model: {path} is a Lightning checkpoint without sdtrain's metadata")
    meta = CheckpointMeta.from_dict(checkpoint[CHECKPOINT_META_KEY], path)
    state = checkpoint["state_dict"]
    has_ema = any(k.startswith("ema_unet.") for k in state)
    if weights == "ema" and not has_ema:
        raise SdtrainError(f"model: {path} holds no EMA weights (the run had train.ema_decay: null); use raw")
    chosen: Literal["ema", "raw"] = "ema" if weights == "ema" or (weights == "auto" and has_ema) else "raw"
    prefix = "ema_unet." if chosen == "ema" else "unet."
    unet = UNet2DConditionModel(**meta.unet_config)
    unet.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return LoadedModel(
        unet=unet.eval(),
        noise_scheduler=build_noise_scheduler(meta.noise_scheduler_config),
        unconditional_caption=state.get("unconditional_caption"),
        source=path,
        weights=chosen,
        global_step=int(checkpoint["global_step"]),
        latent_shape=meta.latent_shape,
        caption_shape=meta.caption_shape,
        latent_scaling_factor=meta.latent_scaling_factor,
        latent_classifier=meta.latent_classifier,
        meta=meta,
        bucket_shapes=tuple(tuple(b) for b in meta.bucket_shapes) if meta.bucket_shapes else None,
        vae_downsampling=meta.vae_downsampling,
    )


def _from_export(path: str) -> LoadedModel:
    local = local_copy(path) if is_uri(path) else path
    unet = UNet2DConditionModel.from_pretrained(local, subfolder="unet").eval()
    scheduler = DDPMScheduler.from_pretrained(local, subfolder="scheduler")
    info: dict[str, Any] = {}
    if os.path.isfile(os.path.join(local, EXPORT_INFO_FILE)):
        with open(os.path.join(local, EXPORT_INFO_FILE)) as f:
            info = json.load(f)
    uncond = None
    if os.path.isfile(os.path.join(local, UNCONDITIONAL_FILE)):
        with open(os.path.join(local, UNCONDITIONAL_FILE), "rb") as f:
            uncond = torch.from_numpy(np.load(io.BytesIO(f.read()), allow_pickle=False))
    shape = info.get("latent_shape")
    caption_shape = info.get("caption_shape")
    return LoadedModel(
        unet=unet,
        noise_scheduler=scheduler,
        unconditional_caption=uncond,
        source=path,
        weights=info.get("weights"),
        global_step=info.get("global_step"),
        latent_shape=tuple(shape) if shape else None,
        caption_shape=tuple(caption_shape) if caption_shape else None,
        latent_scaling_factor=info.get("latent_scaling_factor"),
        latent_classifier=info.get("latent_classifier"),
        meta=None,
        bucket_shapes=tuple(tuple(b) for b in info["bucket_shapes"]) if info.get("bucket_shapes") else None,
        vae_downsampling=int(info.get("vae_downsampling") or 8),
    )


def _latest_reported_checkpoint(path: str) -> str:
    """The latest checkpoint Ray Train recorded for the run directory at ``path``."""
    from ray.train import Result

    storage_filesystem, run_path = ray_storage(path)
    try:
        checkpoint = Result.from_path(run_path, storage_filesystem=storage_filesystem).checkpoint
    except Exception as e:  # not a run directory
        raise SdtrainError(
            f"model: {path} is neither an export (unet/config.json), a checkpoint ({CHECKPOINT_FILE}) nor a run "
            f"directory with a reported checkpoint ({e})"
        ) from None
    if checkpoint is None:
        raise SdtrainError(f"model: the run {path} has reported no checkpoint yet")
    return uri_for(checkpoint.filesystem, checkpoint.path)


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File
