"""Export a trained UNet in diffusers format: what users take away from a run.

::

    <destination>/unet/config.json, diffusion_pytorch_model.safetensors   UNet2DConditionModel.save_pretrained
    <destination>/scheduler/scheduler_config.json                         the training noise schedule (DDPMScheduler,
                                                                          with the run's prediction_type)
    <destination>/unconditional_caption.npy                               the empty-prompt embedding trained with
                                                                          (L x D)
    <destination>/sdtrain.json                                            where it came from: checkpoint, step, weights
                                                                          (ema or raw), data shapes, latent scaling;
                                                                          written last: without it there is no export

``UNet2DConditionModel.from_pretrained(destination, subfolder="unet")`` loads it, and it drops into a
``StableDiffusionPipeline`` as its ``unet`` (with a matching VAE and text encoder). Weights are
safetensors: loading them never unpickles anything.

When the VAE and text encoder the latents and captions came from are known, the export is a whole pipeline
instead (:mod:`sdtrain.artifacts.pipelines` says which class and components): ``model_index.json``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``unet/``, and in ``scheduler/`` a DPM-Solver++ sampler on the training schedule, so
``DiffusionPipeline.from_pretrained(destination)("a red fox")`` works; plus a model card (README.md) showing
``sample_grid.png``: the latest sample grid training drew at or before the exported step
(run_dir/samples/step_<N>.png), else one this pipeline renders at export from the first captions of the run's data.
They are known from (the first that names them, :func:`model_sources`): ``base_model`` (generate.py --base-model), the
run's ``export.base_model``, the parquet metadata of its data (written by ``entrypoints/preprocess.py``). Only a model
whose data's latents are read without a VAE (they name a latent classifier) exports the UNet alone; any other model
whose encoders are unknown is refused. An SDXL UNet's pipeline is a StableDiffusionXLPipeline (both text encoders).
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile

import numpy as np
import pyarrow.fs as pafs

from sdtrain import __version__
from sdtrain.artifacts.loading import (
    EXPORT_INCOMPLETE_FILE,
    VERSION_MANIFEST_FILE,
    LoadedModel,
    Weights,
    is_export,
    load_model,
)
from sdtrain.artifacts.model_card import (
    TRAINED_AS_KEY,
    render_grid,
    sampling_guidance,
    trained_as,
    training_grid,
    write_model_card,
)
from sdtrain.artifacts.pipelines import (
    BASE_MODEL_KEY,
    STABLE_DIFFUSION_XL,
    PipelineKind,
    assemble_pipeline,
    check_pipeline_sources,
    copy_tokenizers,
    pipeline_kind,
    pipeline_sources,
)
from sdtrain.data.metadata import EncoderSources, encoder_sources
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.errors import SdtrainError
from sdtrain.logs import log
from sdtrain.storage.filesystems import delete_file, filesystem_for, write_bytes
from sdtrain.storage.run_layout import (
    EXPORT_INFO_FILE,
    EXPORT_SAMPLE_GRID_FILE,
    UNCONDITIONAL_FILE,
)
from sdtrain.storage.uris import is_uri

_INCOMPLETE_NOTE = (
    f"An sdtrain export is being written here, or its writing was interrupted: it is complete only once "
    f"{EXPORT_INFO_FILE} is here. Exporting again replaces it.\n"
).encode()


def export_checkpoint(checkpoint: str, destination: str, weights: Weights = "auto") -> str:
    """Export the (EMA, by default) UNet of ``checkpoint`` to ``destination`` (local or a storage URI)."""
    return write_export(load_model(checkpoint, weights), destination)


def write_export(loaded: LoadedModel, destination: str, base_model: str | None = None) -> str:
    """Write ``loaded`` into ``destination``, replacing what was there; returns ``destination``.

    Args:
        loaded: a model from :func:`sdtrain.artifacts.loading.load_model`.
        destination: a directory, local or a storage URI.
        base_model: the Stable Diffusion model whose VAE, text encoder and tokenizer go into the pipeline, over
            what the model records (:func:`model_sources`).
    """
    fs, path = filesystem_for(destination)
    _check_replaceable(fs, path, destination, loaded.source)
    pipeline = _export_sources(loaded, base_model)
    sources = pipeline[1] if pipeline is not None else None
    side = square_side(loaded)
    if side is not None:
        # A pipeline's default size is its UNet's sample_size: the trained one, not the preset's (sd2-base's 64 is
        # 512 px; configs/sd2-base.yaml trains at 256). A model of non-square latents alone keeps it: diffusers'
        # pipelines take an int there.
        loaded.unet.register_to_config(sample_size=side)
    with tempfile.TemporaryDirectory() as local:
        if pipeline is not None:
            _write_pipeline(loaded, *pipeline, local)
        else:
            loaded.unet.save_pretrained(os.path.join(local, "unet"), safe_serialization=True)
            loaded.noise_scheduler.save_pretrained(os.path.join(local, "scheduler"))
        _publish(local, fs, path, destination, write_model_record(loaded, local, sources))
    return destination


def write_model_record(loaded: LoadedModel, local: str, sources: EncoderSources | None = None) -> bytes:
    """What an export (or a registry version) keeps of ``loaded`` besides its weights, for
    :func:`sdtrain.artifacts.loading.load_model` to give back: the empty-prompt embedding written into the local
    directory ``local`` (UNCONDITIONAL_FILE), and the content of EXPORT_INFO_FILE returned (where it came from, data
    shapes, latent scaling; ``sources``: the VAE and text encoder its pipeline takes; how it was trained, for the card
    of an export written from it), for the caller to write last.
    """
    info = {
        "sdtrain_version": __version__,
        "source_checkpoint": loaded.source,
        "global_step": loaded.global_step,
        "weights": loaded.weights,
        "prediction_type": loaded.noise_scheduler.config.prediction_type,
        "latent_shape": list(loaded.latent_shape) if loaded.latent_shape else None,
        "bucket_shapes": [list(b) for b in loaded.bucket_shapes] if loaded.bucket_shapes else None,
        "caption_shape": list(loaded.caption_shape) if loaded.caption_shape else None,
        "latent_scaling_factor": loaded.latent_scaling_factor,
        "vae_downsampling": loaded.vae_downsampling,
        "latent_classifier": loaded.latent_classifier,
        "vae_source": sources.vae if sources else None,
        "text_encoder_source": sources.text_encoder if sources else None,
        TRAINED_AS_KEY: trained_as(loaded),
    }
    if loaded.unconditional_caption is not None:
        np.save(os.path.join(local, UNCONDITIONAL_FILE), loaded.unconditional_caption.float().numpy())
    return json.dumps(info, indent=2).encode()


def _publish(local: str, fs: pafs.FileSystem, path: str, destination: str, info: bytes) -> None:
    """Replace what ``destination`` holds with the export staged in ``local`` and then ``info`` as EXPORT_INFO_FILE.

    EXPORT_INFO_FILE is the export's commit: a driver killed at any point leaves a complete export (old or new) or a
    directory without it, which export_source takes for no export (the driver's finish exports again, rather than
    keep truncated weights, or none: an S3 upload killed mid-way never completes) and _check_replaceable lets the
    next export replace (EXPORT_INCOMPLETE_FILE, there before the old export is touched and until the new one is
    whole). Hence the order: that mark, the old EXPORT_INFO_FILE out before any other old file, then the rest of the
    old, the staged files (one threaded copy: small ones land long before the weights), EXPORT_INFO_FILE alone.
    """
    incomplete = posixpath.join(destination, EXPORT_INCOMPLETE_FILE)
    fs.create_dir(path)  # a local file:// URI's writes need it (write_bytes makes a plain path's own)
    write_bytes(incomplete, _INCOMPLETE_NOTE)
    delete_file(posixpath.join(destination, EXPORT_INFO_FILE))
    for item in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if item.base_name == EXPORT_INCOMPLETE_FILE:
            continue
        if item.type == pafs.FileType.Directory:
            fs.delete_dir(item.path)
        else:
            fs.delete_file(item.path)
    pafs.copy_files(local, path, destination_filesystem=fs)
    write_bytes(posixpath.join(destination, EXPORT_INFO_FILE), info)
    delete_file(incomplete)


def _check_replaceable(fs: pafs.FileSystem, path: str, destination: str, source: str) -> None:
    """An export replaces what ``destination`` holds: refused for a directory that holds anything but an earlier
    export, whole or cut short (a typo naming a run directory would delete its checkpoints), or the model being
    exported."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise SdtrainError(f"export: {destination} is a file; name a directory to write the export into")
    if info.type != pafs.FileType.Directory:
        return
    inside = {item.base_name for item in fs.get_file_info(pafs.FileSelector(path))}
    if VERSION_MANIFEST_FILE in inside:  # it records what an export does, and is no export to replace
        raise SdtrainError(
            f"export: {destination} is a registry version ({VERSION_MANIFEST_FILE}), which an export must not "
            "replace: name a new or empty directory"
        )
    if inside and not inside & {EXPORT_INFO_FILE, EXPORT_INCOMPLETE_FILE}:
        raise SdtrainError(
            f"export: {destination} holds {len(inside)} file(s) or folder(s) (e.g. {min(inside)}) and is no export "
            f"(no {EXPORT_INFO_FILE}); an export replaces what its directory holds: name a new or empty directory"
        )
    if is_uri(source):
        within = source.startswith(destination.rstrip("/") + "/")
    else:
        within = os.path.abspath(source).startswith(os.path.abspath(destination) + os.sep)
    if within:
        raise SdtrainError(f"export: {destination} holds the model it would export ({source}); name another directory")


def _export_sources(loaded: LoadedModel, base_model: str | None) -> tuple[PipelineKind, EncoderSources] | None:
    """The pipeline the export is and its sources, checked against the model (their config files only); None for an
    export of the UNet alone (a model whose latents are read without a VAE and no base model);
    refused for any other model whose encoders are unknown."""
    kind = pipeline_kind(loaded.unet.config)
    sources = model_sources(loaded, base_model)
    if sources is None and loaded.latent_classifier is not None:
        return None
    if sources is None:
        raise SdtrainError(
            f"export: {loaded.source} does not record the VAE and text encoder its latents and captions were made with "
            f"(its run set no {BASE_MODEL_KEY}, and its data names none in its parquet metadata or is not reachable "
            "from here), and an export is a diffusers pipeline that needs them: give the Stable Diffusion model they "
            "came from (generate.py --base-model: a local directory, s3:// URI or hub id)"
        )
    channels = loaded.latent_shape[0] if loaded.latent_shape else loaded.unet.config.in_channels
    origin = f"export of {loaded.source}"
    check_pipeline_sources(kind, sources, origin, channels, loaded.unet.config)
    return kind, sources


def model_sources(loaded: LoadedModel, base_model: str | None = None) -> EncoderSources | None:
    """The VAE and text encoder that made the model's training data: ``base_model`` when given, else the run's
    export.base_model (which wins over the data's record: sdtrain.artifacts.pipelines says why), else those recorded
    in the export (its own vae/ and text_encoder/, or sdtrain.json) or in the parquet metadata of the run's
    data.train files; None if unknown.

    Args:
        loaded: a model from :func:`sdtrain.artifacts.loading.load_model`.
        base_model: a Stable Diffusion model (local directory, storage URI or hub id), or None.
    """
    configured = (loaded.meta.config.get("export") or {}).get("base_model") if loaded.meta is not None else None
    chosen = base_model or configured
    return pipeline_sources(chosen, None if chosen else _recorded_sources(loaded))


def _recorded_sources(loaded: LoadedModel) -> EncoderSources | None:
    """The VAE and text encoder the export (its own vae/ and text_encoder/, or sdtrain.json) or the parquet metadata
    of the run's data.train files record."""
    if loaded.meta is None:
        fs, root = filesystem_for(loaded.source)
        if all(_is_file(fs, posixpath.join(root, d, "config.json")) for d in ("vae", "text_encoder")):
            return EncoderSources(vae=loaded.source, text_encoder=loaded.source)
        info_path = posixpath.join(root, EXPORT_INFO_FILE)
        if _is_file(fs, info_path):
            with fs.open_input_stream(info_path) as f:
                info = json.loads(f.read())
            if info.get("vae_source") and info.get("text_encoder_source"):
                return EncoderSources(vae=info["vae_source"], text_encoder=info["text_encoder_source"])
        return None
    train = loaded.meta.config.get("data", {}).get("train") or []
    try:
        files = resolve_parquet_files(list(train), "data.train")
        return encoder_sources(files)
    except (SdtrainError, OSError):  # the data moved or is not reachable from here: unknown
        return None


def _write_pipeline(loaded: LoadedModel, kind: PipelineKind, sources: EncoderSources, local: str) -> None:
    from diffusers import DPMSolverMultistepScheduler

    # A sampler on the training schedule (same betas and prediction type) with clip_sample off: what a user
    # of the pipeline wants to sample with, where the training DDPMScheduler would need 1000 steps.
    scheduler = DPMSolverMultistepScheduler.from_config({**loaded.noise_scheduler.config, "clip_sample": False})
    pipeline = assemble_pipeline(kind, sources, loaded.unet, scheduler, loaded.latent_scaling_factor)
    pipeline.save_pretrained(local, safe_serialization=True)
    copy_tokenizers(kind, sources, local)
    guidance = sampling_guidance(loaded, kind)
    _warn_of_zeros_empty_prompt(loaded, kind)
    grid = training_grid(loaded) or render_grid(loaded, pipeline, guidance)
    if grid is not None:
        with open(os.path.join(local, EXPORT_SAMPLE_GRID_FILE), "wb") as f:
            f.write(grid[0])
    write_model_card(loaded, sources, os.path.join(local, "README.md"), grid[1] if grid else None, guidance, kind)


def _warn_of_zeros_empty_prompt(loaded: LoadedModel, kind: PipelineKind) -> None:
    """A Stable Diffusion pipeline guides a plain ``pipe(prompt)`` against its text encoder's output for "", which a
    model that trained on zeros as its empty prompt never saw: its images are guided wrongly, with no error. The
    config's default stays: SDXL wants it, and a run's sample grids guide against zeros as they should."""
    uncond = loaded.unconditional_caption
    if kind is STABLE_DIFFUSION_XL or uncond is None or bool(uncond.any()):
        return
    log.warning(
        f"export of {loaded.source}: it trained with data.unconditional_caption: zeros, which its pipeline does not "
        f'use by itself (a plain call guides against the encoded ""): callers must pass the model card\'s '
        f"negative_prompt_embeds ({UNCONDITIONAL_FILE}, a row per prompt), or guidance goes wrong"
    )


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def export_source(path: str) -> str | None:
    """The checkpoint the export at ``path`` was written from; None if there is no complete export.

    An export is complete when its EXPORT_INFO_FILE is there: :func:`write_export` writes that file alone, after every
    other file of the export is whole, and deletes an earlier export's before it touches any other file of it. A
    directory cut short at any point (the driver killed while it wrote it) thus holds no EXPORT_INFO_FILE.
    """
    fs, fs_path = filesystem_for(path)
    info_path = os.path.join(fs_path, EXPORT_INFO_FILE)
    if not is_export(path) or fs.get_file_info(info_path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(info_path) as f:
        return json.loads(f.read()).get("source_checkpoint")


def square_side(loaded: LoadedModel) -> int | None:
    """The latent side of the square images the model trained on: its latents', or its square bucket's (bucketed
    data's latent_shape is its most common bucket, often not square; preprocessing's buckets always hold the square
    at image.resolution); None where it trained on none."""
    shapes = loaded.bucket_shapes or ((loaded.latent_shape,) if loaded.latent_shape else ())
    squares = [int(shape[-1]) for shape in shapes if shape[-2] == shape[-1]]
    return squares[0] if squares else None
