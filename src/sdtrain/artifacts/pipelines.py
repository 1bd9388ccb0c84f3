"""The diffusers pipeline an export is, in one place: its class, the components it takes from a base model beside
the trained UNet and the scheduler, where they come from, and whether they fit the UNet and its latents.

A Stable Diffusion UNet goes into a ``StableDiffusionPipeline`` (one text encoder and tokenizer); an SDXL UNet
(``addition_embed_type: text_time``) into a ``StableDiffusionXLPipeline`` (``text_encoder_2`` and ``tokenizer_2``
beside them: the two encoders' widths add up to the UNet's cross_attention_dim, and the second's projection is the
pooled embedding the UNet takes). :func:`pipeline_kind` says which; the checks and the export follow the kind.

Where the components come from (:func:`pipeline_sources`): ``export.base_model`` when it is set, else the VAE and
text encoder the data records (preprocessing's parquet metadata). The key wins over the record rather than a
difference between them being refused: the record says where preprocessing found its models (a path on the machine
it ran on, a hub id on a networked cluster), and the same model is often somewhere else where training runs (a
copy on s3://, a local mirror), which no comparison of names can tell from another model. What can be compared is:
the base model's text encoder must be as wide as the UNet's cross-attention and its VAE must make latents of the
data's channels (:func:`check_pipeline_sources`), and the driver logs the record the key replaces.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, VAE_SOURCE, EncoderSources
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import is_uri

BASE_MODEL_KEY = "export.base_model"
# A hub id is exactly "owner/name" (as for model.pretrained); anything else that is not a URI is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class PipelineKind:
    """A diffusers pipeline class and what it takes from the base model."""

    class_name: str
    """The diffusers class: model_index.json names it, and DiffusionPipeline.from_pretrained builds it."""
    components: tuple[str, ...]
    """The base model's subfolders the pipeline takes, besides the trained unet/ and the scheduler/."""
    text_encoders: tuple[str, ...]
    """Those of ``components`` whose output widths, added up, are what the UNet cross-attends to."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further constructor arguments of the class."""


STABLE_DIFFUSION = PipelineKind(
    "StableDiffusionPipeline",
    components=("vae", "text_encoder", "tokenizer"),
    text_encoders=("text_encoder",),
    # A trained-from-scratch model ships without the NSFW checker's CLIP: none, and no warning that it is off.
    options={"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
)

STABLE_DIFFUSION_XL = PipelineKind(
    "StableDiffusionXLPipeline",
    components=("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
    text_encoders=("text_encoder", "text_encoder_2"),
    # The empty prompt as zeros: how sdtrain drops SDXL captions (data.unconditional_caption: zeros). No invisible
    # watermark (an optional package, and a model trained here is not Stability's) for this pipeline only: diffusers
    # writes add_watermarker into no file, so a reload watermarks wherever invisible-watermark is installed unless
    # it passes add_watermarker=False to from_pretrained, as the model card's example does.
    options={"force_zeros_for_empty_prompt": True, "add_watermarker": False},
)

_COMPONENT_FILES = {
    "vae": "config.json",
    "text_encoder": "config.json",
    "text_encoder_2": "config.json",
    "tokenizer": "tokenizer_config.json",
    "tokenizer_2": "tokenizer_config.json",
}
"""The file of each component that says it is there (and, for models, its shape)."""


def pipeline_kind(unet_config: Mapping[str, Any]) -> PipelineKind:
    """The pipeline a UNet of ``unet_config`` goes into: SDXL's for text and time embeddings added to its
    timestep's, else Stable Diffusion's."""
    if unet_config.get("addition_embed_type") == "text_time":
        return STABLE_DIFFUSION_XL
    return STABLE_DIFFUSION


def pipeline_sources(base_model: str | None, recorded: EncoderSources | None) -> EncoderSources | None:
    """Where the pipeline's VAE and text encoder come from: ``base_model`` (export.base_model, or generate.py
    --base-model) for both, else what the data records; None if neither names them (see the module docstring)."""
    if base_model:
        return EncoderSources(vae=base_model, text_encoder=base_model)
    return recorded


def source_of(component: str, sources: EncoderSources) -> str:
    """The model a component is taken from: the VAE's, or the text encoder's (text encoders and tokenizers)."""
    return sources.vae if component == "vae" else sources.text_encoder


def local_base_model(source: str | None) -> str | None:
    """``source`` with a local path made absolute (a checkpoint's config is read from other directories later);
    URIs and hub ids as they are."""
    if source is None or is_uri(source) or _is_hub_id(source):
        return source
    return os.path.abspath(os.path.expanduser(source))


def check_export_sources(
    base_model: str | None,
    metadata: Mapping[bytes, bytes] | None,
    where: str,
    latent_channels: int,
    unet: Mapping[str, Any],
    latent_classifier: str | None,
) -> EncoderSources | None:
    """Before Ray starts, with export.enabled: the VAE and text encoder the export's pipeline takes are named (by
    ``base_model`` or data.train's files), reachable, and fit the UNet and the data; None for data whose latents are
    read without a VAE (they name a latent classifier) and no base model: that export is the UNet alone.

    Args:
        base_model: export.base_model.
        metadata: data.train's schema metadata (its dataset index's).
        where: data.train's file that metadata is from, for the errors.
        latent_channels: data.train's latent channels.
        unet: the UNet's config.
        latent_classifier: the module data.train's files name as the reader of their latents, if any.
    """
    kind = pipeline_kind(unet)
    metadata = metadata or {}
    vae, text_encoder = (metadata.get(k.encode()) for k in (VAE_SOURCE, TEXT_ENCODER_SOURCE))
    recorded = EncoderSources(vae.decode(), text_encoder.decode()) if vae and text_encoder else None
    sources = pipeline_sources(base_model, recorded)
    if sources is None:
        if latent_classifier is not None:
            return None
        raise ConfigError(
            f"{BASE_MODEL_KEY}: export.enabled is on, and the export is a diffusers pipeline, which needs the VAE, "
            "text encoder and tokenizer the latents and captions were made with; data.train's files do not name them "
            f"({where} has no parquet metadata {VAE_SOURCE} and {TEXT_ENCODER_SOURCE}: it was not written by "
            f"entrypoints/preprocess.py). Set {BASE_MODEL_KEY} to that Stable Diffusion model (a local diffusers "
            "directory with vae/, text_encoder/ and tokenizer/, an s3:// URI of one, or a hub id this machine can "
            "reach), or export.enabled: false to export nothing"
        )
    if base_model and recorded is not None and recorded != sources:
        log.info(
            f"{BASE_MODEL_KEY}: the export takes the VAE and text encoder of {base_model}, not those {where} records "
            f"(VAE {recorded.vae}, text encoder {recorded.text_encoder})"
        )
    origin = BASE_MODEL_KEY if base_model else f"data.train: {where}: parquet metadata {VAE_SOURCE}"
    check_pipeline_sources(kind, sources, origin, latent_channels, unet)
    return sources


def check_pipeline_sources(
    kind: PipelineKind, sources: EncoderSources, origin: str, latent_channels: int, unet: Mapping[str, Any]
) -> None:
    """Each component of ``kind`` is at its source, the VAE makes latents of ``latent_channels``, the text encoders'
    widths add up to the ``unet``'s cross_attention_dim, and SDXL's second encoder projects to the pooled width the
    UNet takes: a ConfigError starting with ``origin`` (the key or flag that named the source) naming both values
    otherwise. Reads the components' small config files only."""
    from sdtrain.model.conditioning import pooled_width

    cross_attention_dim = unet["cross_attention_dim"]
    configs = {name: _component_config(origin, source_of(name, sources), name) for name in kind.components}
    channels = configs["vae"].get("latent_channels")
    if channels != latent_channels:
        raise ConfigError(
            f"{origin}: the VAE of {sources.vae} makes latents of {channels} channels, but the data's latents have "
            f"{latent_channels}: they were encoded with another VAE. Name the model whose VAE made them"
        )
    width = sum(int(configs[name].get("hidden_size", 0)) for name in kind.text_encoders)
    if width != cross_attention_dim:
        raise ConfigError(
            f"{origin}: the text encoder of {sources.text_encoder} is {width} wide, but the UNet's "
            f"cross_attention_dim is {cross_attention_dim}: its prompt embeddings are not what the UNet was trained "
            "on. Name the model whose text encoder made the captions"
        )
    pooled = pooled_width(unet)
    projection = configs.get("text_encoder_2", {}).get("projection_dim")
    if pooled is not None and projection != pooled:
        raise ConfigError(
            f"{origin}: the second text encoder of {sources.text_encoder} projects to a pooled embedding {projection} "
            f"wide, but the UNet takes {pooled}: name the SDXL model whose text encoders made the captions"
        )


def _component_config(origin: str, source: str, component: str) -> dict[str, Any]:
    """The JSON file that says ``component`` is in the model at ``source`` (a local directory, a storage URI or a
    hub id, which is fetched: on a machine without network it is refused here, not at the end of the run)."""
    name = _COMPONENT_FILES[component]
    if not is_uri(source) and _is_hub_id(source):
        from huggingface_hub import hf_hub_download

        try:
            with open(hf_hub_download(source, name, subfolder=component)) as f:
                return json.load(f)
        except Exception as error:  # huggingface_hub's errors for an unknown repo, a missing file, no network
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"{origin}: {source} is not a local directory, and as a Hugging Face hub id its {component}/{name} "
                f"could not be fetched ({first}); give a diffusers model directory (local or s3://) or a hub id this "
                "machine can reach"
            ) from None
    fs, root = filesystem_for(source)
    if not is_uri(source) and not os.path.isdir(root):
        raise ConfigError(
            f"{origin}: directory {source} does not exist (relative paths are taken from {os.getcwd()}); expected a "
            "diffusers Stable Diffusion model directory (vae/, text_encoder/, tokenizer/), an s3:// URI or a hub id "
            "owner/name"
        )
    try:
        with fs.open_input_stream(posixpath.join(root, component, name)) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{origin}: {source} has no readable {component}/{name} ({error}); expected a diffusers Stable Diffusion "
            "model with vae/, text_encoder/ and tokenizer/ (save_pretrained output)"
        ) from None


def _is_hub_id(source: str) -> bool:
    return bool(_HUB_ID.fullmatch(source)) and not os.path.isdir(os.path.dirname(os.path.expanduser(source)))


def assemble_pipeline(
    kind: PipelineKind, sources: EncoderSources, unet: Any, scheduler: Any, latent_scaling_factor: float | None
) -> Any:
    """The diffusers pipeline of ``kind``: the trained ``unet`` and ``scheduler`` with the base model's components.
    Its VAE divides latents by the factor the model's latents carry (``latent_scaling_factor``, when known), which
    for latents made elsewhere need not be the VAE's own."""
    import diffusers

    parts = _load_components(kind, sources)
    vae = parts["vae"]
    if latent_scaling_factor is not None and vae.config.scaling_factor != latent_scaling_factor:
        vae.register_to_config(scaling_factor=latent_scaling_factor)
    return getattr(diffusers, kind.class_name)(unet=unet, scheduler=scheduler, **parts, **kind.options)


def _load_components(kind: PipelineKind, sources: EncoderSources) -> dict[str, Any]:
    """The components of ``kind`` from ``sources``: the VAE, and the text encoders and tokenizers as sdtrain loads
    them for training and sampling (sdtrain.model.encoders.load_text_encoders: text_encoder_2 and tokenizer_2 are
    SDXL's second)."""
    from sdtrain.model.encoders import load_text_encoders, load_vae

    text = load_text_encoders(sources.text_encoder)
    parts: dict[str, Any] = {"vae": load_vae(sources.vae)}
    for i, (tokenizer, encoder) in enumerate(zip(text.tokenizers, text.encoders, strict=True)):
        suffix = f"_{i + 1}" if i else ""
        parts[f"tokenizer{suffix}"], parts[f"text_encoder{suffix}"] = tokenizer, encoder
    missing = [name for name in kind.components if name not in parts]
    if missing:
        raise ConfigError(f"export: {sources.text_encoder} has no {', '.join(missing)} for a {kind.class_name}")
    return {name: parts[name] for name in kind.components}


def copy_tokenizers(kind: PipelineKind, sources: EncoderSources, saved: str) -> None:
    """Replace the tokenizer folders of the pipeline saved in the local directory ``saved`` with the base model's,
    byte for byte, where they are files (a local directory or a storage URI; a hub id's stay as saved).

    Re-saved through transformers a tokenizer loses files: a fast one writes tokenizer.json alone, without the
    vocab.json and merges.txt that the slow CLIPTokenizer model_index.json names needs (transformers 4), and what it
    writes need not be what the captions were tokenized with."""
    source = sources.text_encoder
    if not is_uri(source) and _is_hub_id(source):
        return
    fs, root = filesystem_for(source)
    for name in kind.components:
        if not name.startswith("tokenizer"):
            continue
        folder = posixpath.join(root, name)
        if fs.get_file_info(posixpath.join(folder, _COMPONENT_FILES[name])).type != pafs.FileType.File:
            continue  # loaded from elsewhere (load_text_encoders), and saved as loaded
        target = os.path.join(saved, name)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)  # pyarrow's copy makes no local directories
        pafs.copy_files(folder, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
