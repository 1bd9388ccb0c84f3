"""One way to get a trained model back: :func:`load_model` takes any path a run leaves.

- a run directory (its latest checkpoint reported to Ray Train),
- a checkpoint directory or its ``checkpoint.ckpt`` (:mod:`sdtrain.artifacts.checkpoint_format`),
- an export (:mod:`sdtrain.artifacts.export`) or a registry version (``ModelRegistry.location``),

local or on object storage; no config file is needed. A registry version records what an export does (its
EXPORT_INFO_FILE and empty-prompt embedding); one written before versions did is given them from the checkpoint its
manifest names, where that is still readable.
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
from sdtrain.logs import log
from sdtrain.model.conditioning import pooled_width
from sdtrain.model.unet import RAW_UNET_SUBFOLDER, build_noise_scheduler
from sdtrain.storage.filesystems import filesystem_for, local_copy, ray_storage, uri_for
from sdtrain.storage.run_layout import CHECKPOINT_FILE, EXPORT_INFO_FILE, UNCONDITIONAL_FILE
from sdtrain.storage.uris import is_uri

Weights = Literal["auto", "ema", "raw"]
VERSION_MANIFEST_FILE = "manifest.json"
"""In a registry version's directory (sdtrain.artifacts.registry), beside unet/ and scheduler/."""
EXPORT_INCOMPLETE_FILE = "sdtrain.incomplete"
"""Beside an export while it is written (and after an export killed while writing): the directory is an export's
that the next one may replace, though without EXPORT_INFO_FILE it is none (sdtrain.artifacts.export)."""


@dataclass
class LoadedModel:
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler
    unconditional_caption: torch.Tensor | None
    """(L, D) empty-prompt embedding trained with; None where the source did not record one."""
    source: str
    """The checkpoint or export the weights were read from."""
    weights: Literal["ema", "raw"] | None
    """Which weights of the run these are; None where the export or version does not record it."""
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
    unrecorded: str | None = None
    """Why the trained shapes and empty-prompt embedding are unknown, where a registry version cannot tell them."""

    def trained_shapes(self, needed_by: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(latent_shape, caption_shape); an SdtrainError naming the model and what is missing where either is
        unknown. ``needed_by``: what needs them (for the message)."""
        if self.latent_shape is not None and self.caption_shape is not None:
            return self.latent_shape, self.caption_shape
        missing = " and ".join(
            name for name, value in (("latent", self.latent_shape), ("caption", self.caption_shape)) if value is None
        )
        why = self.unrecorded or f"it holds no {EXPORT_INFO_FILE} recording them"
        raise SdtrainError(
            f"model: {needed_by} needs the {missing} shape {self.source} was trained at, which it does not record: "
            f"{why}"
        )

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
        return _from_export(path, weights)
    return _from_checkpoint(_latest_reported_checkpoint(path), weights)


def load_trained(checkpoint: str) -> tuple[LoadedModel, UNet2DConditionModel | None]:
    """``load_model(checkpoint)`` (the EMA weights if the run kept an EMA, else the trained ones), and with an EMA
    the trained (raw) weights too, from one read of the checkpoint (None without an EMA): what a registry version
    keeps, so that the next warm start continues both."""
    data = read_checkpoint(checkpoint)
    loaded = _from_checkpoint(checkpoint, "auto", data)
    if loaded.weights != "ema":
        return loaded, None
    assert loaded.meta is not None  # loaded from a checkpoint
    return loaded, _unet_of(loaded.meta, data["state_dict"], "unet.")


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


def _from_checkpoint(path: str, weights: Weights, checkpoint: dict[str, Any] | None = None) -> LoadedModel:
    checkpoint = read_checkpoint(path) if checkpoint is None else checkpoint
    meta = _meta_of(path, checkpoint)
    state = checkpoint["state_dict"]
    has_ema = any(k.startswith("ema_unet.") for k in state)
    if weights == "ema" and not has_ema:
        raise SdtrainError(f"model: {path} holds no EMA weights (the run had train.ema_decay: null); use raw")
    chosen: Literal["ema", "raw"] = "ema" if weights == "ema" or (weights == "auto" and has_ema) else "raw"
    return LoadedModel(
        unet=_unet_of(meta, state, "ema_unet." if chosen == "ema" else "unet."),
        noise_scheduler=build_noise_scheduler(meta.noise_scheduler_config),
        unconditional_caption=state.get("unconditional_caption"),
        source=path,
        weights=chosen,
        global_step=int(checkpoint["global_step"]),
        **_recorded_in(meta),
    )


def _meta_of(path: str, checkpoint: dict[str, Any]) -> CheckpointMeta:
    if CHECKPOINT_META_KEY not in checkpoint:
        raise SdtrainError(f"model: {path} is a Lightning checkpoint without sdtrain's metadata")
    return CheckpointMeta.from_dict(checkpoint[CHECKPOINT_META_KEY], path)


def _unet_of(meta: CheckpointMeta, state: dict[str, Any], prefix: str) -> UNet2DConditionModel:
    unet = UNet2DConditionModel(**meta.unet_config)
    unet.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return unet.eval()


def _recorded_in(meta: CheckpointMeta) -> dict[str, Any]:
    """The LoadedModel fields a checkpoint's metadata gives."""
    return dict(
        latent_shape=meta.latent_shape,
        caption_shape=meta.caption_shape,
        latent_scaling_factor=meta.latent_scaling_factor,
        latent_classifier=meta.latent_classifier,
        meta=meta,
        bucket_shapes=tuple(tuple(b) for b in meta.bucket_shapes) if meta.bucket_shapes else None,
        vae_downsampling=meta.vae_downsampling,
    )


def _from_export(path: str, weights: Weights) -> LoadedModel:
    """An export or a registry version: its unet/ (raw_unet/ for weights=raw, where a version holds the trained
    weights beside the EMA ones), scheduler/ and what EXPORT_INFO_FILE and UNCONDITIONAL_FILE record."""
    fs, root = filesystem_for(path)
    _check_complete(path, fs, root)
    info_text = _read_small(fs, posixpath.join(root, EXPORT_INFO_FILE))
    info: dict[str, Any] = json.loads(info_text) if info_text is not None else {}
    has_raw_unet = _is_file(fs, posixpath.join(root, RAW_UNET_SUBFOLDER, "config.json"))
    unet_dir = _unet_dir(path, weights, info.get("weights"), has_raw_unet)
    unet = _from_pretrained(UNet2DConditionModel, path, unet_dir).eval()
    scheduler = _from_pretrained(DDPMScheduler, path, "scheduler")
    if info_text is None and _is_file(fs, posixpath.join(root, VERSION_MANIFEST_FILE)):
        loaded = _unrecorded_version(path, fs, root, unet, scheduler)
        if weights == "ema" and loaded.weights == "raw":
            raise SdtrainError(_raw_only(path, f"the checkpoint its {VERSION_MANIFEST_FILE} names"))
        loaded.weights = "raw" if unet_dir == RAW_UNET_SUBFOLDER else loaded.weights
        return loaded
    uncond_bytes = _read_small(fs, posixpath.join(root, UNCONDITIONAL_FILE))
    uncond = torch.from_numpy(np.load(io.BytesIO(uncond_bytes), allow_pickle=False)) if uncond_bytes else None
    shape = info.get("latent_shape")
    caption_shape = info.get("caption_shape")
    return LoadedModel(
        unet=unet,
        noise_scheduler=scheduler,
        unconditional_caption=uncond,
        source=path,
        weights="raw" if unet_dir == RAW_UNET_SUBFOLDER else info.get("weights"),
        global_step=info.get("global_step"),
        latent_shape=tuple(shape) if shape else None,
        caption_shape=tuple(caption_shape) if caption_shape else None,
        latent_scaling_factor=info.get("latent_scaling_factor"),
        latent_classifier=info.get("latent_classifier"),
        meta=None,
        bucket_shapes=tuple(tuple(b) for b in info["bucket_shapes"]) if info.get("bucket_shapes") else None,
        vae_downsampling=int(info.get("vae_downsampling") or 8),
    )


def _check_complete(path: str, fs: pafs.FileSystem, root: str) -> None:
    """Refuse an export cut short (its writer killed: sdtrain.artifacts.export commits an export by writing
    EXPORT_INFO_FILE last): loaded anyway, its weights may be half written and what EXPORT_INFO_FILE records (the
    latents' scaling, the trained shapes) would be missing without a word. A directory of sdtrain's files but no
    EXPORT_INFO_FILE and no VERSION_MANIFEST_FILE is one too; a diffusers model saved elsewhere (no sdtrain files)
    loads as it is."""
    inside = {item.base_name for item in fs.get_file_info(pafs.FileSelector(root))}
    if EXPORT_INCOMPLETE_FILE in inside:
        why = f"it holds {EXPORT_INCOMPLETE_FILE}, left while an export is written"
    elif UNCONDITIONAL_FILE in inside and not inside & {EXPORT_INFO_FILE, VERSION_MANIFEST_FILE}:
        why = f"it holds sdtrain's {UNCONDITIONAL_FILE} but not {EXPORT_INFO_FILE}, which an export writes last"
    else:
        return
    raise SdtrainError(
        f"model: {path} is an sdtrain export that was cut short ({why}): its weights may be incomplete. Export it "
        "again (generate.py CHECKPOINT --export-to the same directory replaces it), or load the checkpoint it was "
        "exported from"
    )


def _unet_dir(path: str, weights: Weights, recorded: str | None, has_raw_unet: bool) -> str:
    """The subfolder holding the ``weights`` asked for, where EXPORT_INFO_FILE records which weights unet/ holds
    (``recorded``: ema, raw, or None where it does not say) and a registry version keeps the trained ones beside
    the EMA ones (``has_raw_unet``); refused where the export holds other weights than those asked for."""
    if weights == "raw" and has_raw_unet:
        return RAW_UNET_SUBFOLDER
    if weights == "raw" and recorded != "raw":
        holds = "the EMA weights alone" if recorded == "ema" else "one set of weights, not recorded as the raw ones"
        raise SdtrainError(
            f"model: {path} is an export or version that holds {holds} ({EXPORT_INFO_FILE}: weights {recorded}); "
            "weights=raw needs the checkpoint it was exported from"
        )
    if weights == "ema" and recorded == "raw":
        raise SdtrainError(_raw_only(path, EXPORT_INFO_FILE))
    return "unet"


def _raw_only(path: str, record: str) -> str:
    return (
        f"model: {path} holds the raw (trained) weights alone ({record} says so: the run kept no EMA, "
        "train.ema_decay: null), not the EMA weights asked for; use weights raw or auto"
    )


def _from_pretrained(cls: Any, path: str, subfolder: str) -> Any:
    """``cls.from_pretrained`` of ``path``'s ``subfolder``, a file there that is unreadable or cut short (an OSError
    or ValueError from diffusers) refused naming it; object storage failing for now is left to its caller."""
    local = _local_dir(path, subfolder)
    try:
        return cls.from_pretrained(local)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:300]
        raise SdtrainError(
            f"model: {path}: its {subfolder}/ could not be loaded as a diffusers {cls.__name__} "
            f"({type(e).__name__}: {reason}); a file there is missing, truncated or corrupt (an export or copy cut "
            "short?): export the model again, or copy it whole"
        ) from None


def _unrecorded_version(
    path: str, fs: pafs.FileSystem, root: str, unet: UNet2DConditionModel, scheduler: DDPMScheduler
) -> LoadedModel:
    """A registry version written before versions recorded EXPORT_INFO_FILE: its weights, with what the checkpoint
    its manifest names records (data shapes, empty-prompt embedding), where that checkpoint is still readable; else
    without them, saying why (:meth:`LoadedModel.trained_shapes` raises it where they are needed)."""
    manifest = json.loads(_read_small(fs, posixpath.join(root, VERSION_MANIFEST_FILE)) or b"{}")
    checkpoint = manifest.get("checkpoint")
    loaded = LoadedModel(
        unet=unet,
        noise_scheduler=scheduler,
        unconditional_caption=None,
        source=path,
        weights=None,
        global_step=manifest.get("steps"),
        latent_shape=None,
        caption_shape=None,
        latent_scaling_factor=None,
        latent_classifier=None,
        meta=None,
    )
    try:
        if not isinstance(checkpoint, str):
            raise SdtrainError(f"its {VERSION_MANIFEST_FILE} names no checkpoint")
        data = read_checkpoint(checkpoint)
        meta, state, step = _meta_of(checkpoint, data), data["state_dict"], int(data["global_step"])
    except (OSError, SdtrainError, KeyError, ValueError) as e:
        loaded.unrecorded = (
            f"it is a registry version written before versions recorded {EXPORT_INFO_FILE} and {UNCONDITIONAL_FILE}, "
            f"and the checkpoint its {VERSION_MANIFEST_FILE} names ({checkpoint}) could not be read for them ({e})"
        )
        log.warning(f"model: {path}: {loaded.unrecorded}")
        return loaded
    # What load_model(checkpoint) gave when the version was written: the EMA weights if the run kept an EMA.
    loaded.weights = "ema" if any(k.startswith("ema_unet.") for k in state) else "raw"
    loaded.unconditional_caption = state.get("unconditional_caption")
    loaded.global_step = step
    for field, value in _recorded_in(meta).items():
        setattr(loaded, field, value)
    return loaded


def _local_dir(path: str, subfolder: str) -> str:
    """``path``'s ``subfolder``, downloaded first from object storage (that folder alone)."""
    return local_copy(posixpath.join(path, subfolder)) if is_uri(path) else os.path.join(path, subfolder)


def _read_small(fs: pafs.FileSystem, path: str) -> bytes | None:
    """A small file's bytes; None where there is none."""
    if not _is_file(fs, path):
        return None
    with fs.open_input_stream(path) as f:
        return f.read()


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
