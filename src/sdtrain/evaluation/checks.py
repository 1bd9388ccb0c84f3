"""What checkpoint evaluation needs, checked on the driver before Ray starts (nothing is loaded)."""

from __future__ import annotations

import os
import posixpath
from typing import Any

import pyarrow.fs as pafs

from sdtrain.config.schema import Config
from sdtrain.data.metadata import LATENT_CLASSIFIER, VAE_SOURCE, latent_classifier
from sdtrain.errors import ConfigError, DataError
from sdtrain.sampling.latent_classifier import load_latent_classifier
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import is_uri


def check_evaluation(config: Config, val_metadata: dict | Any, val_columns: list[str]) -> str | None:
    """Before Ray starts: what eval needs is there (the models' configs where they are local or in storage, the
    Inception file, the text column for clip_score, a VAE; for class agreement the label column and the latent
    classifier data.val's files name). Returns the VAE evaluations decode with: eval.vae, else the one data.val
    records; None when no metric needs images.

    Args:
        val_metadata: data.val's schema metadata (from its dataset index).
        val_columns: data.val's columns.
    """
    if config.eval.class_agreement:
        if "label" not in val_columns:
            raise ConfigError(
                f"eval.class_agreement: data.val has no column 'label' (its columns: {', '.join(val_columns)}); "
                "set eval.class_agreement=false for this data"
            )
        name = latent_classifier(val_metadata)
        if name is None:
            raise ConfigError(
                f"eval.class_agreement: data.val's files name no latent classifier (parquet metadata "
                f"{LATENT_CLASSIFIER}: the digits demo's files name theirs); set eval.class_agreement=false for "
                "this data"
            )
        try:
            load_latent_classifier(name, f"eval.class_agreement: data.val's {LATENT_CLASSIFIER}")
        except DataError as error:
            raise ConfigError(str(error)) from None
    if not config.eval.needs_vae:
        return None
    recorded = (val_metadata or {}).get(VAE_SOURCE.encode())
    vae = config.eval.vae or (recorded.decode() if recorded else None)
    if vae is None:
        raise ConfigError(
            "eval.vae: data.val's files record no VAE (parquet metadata sdtrain.vae_source, written by preprocessing); "
            "set eval.vae to the VAE its latents were encoded with"
        )
    if config.eval.clip is not None and config.eval.text_column not in val_columns:
        raise ConfigError(
            f"eval.text_column: data.val has no column {config.eval.text_column!r} of caption texts, which clip_score "
            f"needs (its columns: {', '.join(val_columns)})"
        )
    check_eval_models(config, vae)
    return vae


def check_eval_models(config: Config, vae: str) -> None:
    """The models eval names are there (the DINOv2 and CLIP models' configs where they are local or in storage, the
    Inception file) and ``vae``, the VAE evaluations decode with; nothing is loaded."""
    for key, source, wanted in (
        ("eval.dinov2", config.eval.dinov2, "config.json"),
        ("eval.clip", config.eval.clip, "config.json"),
    ):
        if source is not None and not _has_file(source, wanted):
            raise ConfigError(f"{key}: {source} holds no {wanted} (a transformers model directory is expected)")
    inception = config.eval.inception
    if inception is not None:
        fs, path = filesystem_for(inception)
        if fs.get_file_info(path).type != pafs.FileType.File:
            raise ConfigError(
                f"eval.inception: {inception} is not a file (FID's Inception network as TorchScript, "
                "inception-2015-12-05.pt, is expected)"
            )
    if not (_has_file(vae, "vae/config.json") or _has_file(vae, "config.json")):
        raise ConfigError(f"eval.vae: {vae} holds neither vae/config.json nor config.json (a diffusers VAE)")


def _has_file(source: str, name: str) -> bool:
    """Whether the model at ``source`` has the file ``name``; a hub id is taken as it is (no network here)."""
    if not is_uri(source) and not os.path.exists(os.path.expanduser(source)):
        return "/" in source and not source.startswith((".", "/", "~"))  # owner/name: a hub id
    fs, path = filesystem_for(posixpath.join(source, name))
    return fs.get_file_info(path).type == pafs.FileType.File
