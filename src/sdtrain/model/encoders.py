"""The encoders around the UNet: a Stable Diffusion model's VAE (images to scaled latents) and its tokenizer and
text encoder (captions to embeddings, as StableDiffusionPipeline.encode_prompt computes them), loaded from a local
directory, a storage URI or a hub id. Preprocessing runs them to write latents (sdtrain.preprocess.encode_stage),
sampling to encode prompts, export to assemble a pipeline."""

from __future__ import annotations

import functools
import json
import os
import posixpath
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import pyarrow.fs as pafs
import torch

from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for, read_bytes
from sdtrain.storage.uris import is_uri

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """auto = float16 on a GPU (the VAE and CLIP run in it in every SD pipeline), float32 on the CPU."""
    if name == "auto":
        return torch.float16 if device == "cuda" else torch.float32
    return DTYPES[name]


def local_model(source: str, *parts: str) -> str:
    """``source`` itself when local or a hub id; for a URI a local directory holding its subfolders ``parts``
    (each downloaded once per process): only what is read, not the model's UNet (gigabytes).

    Args:
        source: a diffusers model directory (local or a storage URI) or a hub id.
        parts: the subfolders to fetch (vae, tokenizer, text_encoder).
    """
    if not is_uri(source):
        return source
    root = source.rstrip("/")
    directory = _MODELS.setdefault(root, tempfile.mkdtemp(prefix="sdtrain-model-"))
    fs, path = filesystem_for(root)
    for part in parts:
        if os.path.isdir(os.path.join(directory, part)):
            continue
        if fs.get_file_info(posixpath.join(path, part)).type != pafs.FileType.Directory:
            raise DataError(
                f"{source} has no {part}/ (a diffusers Stable Diffusion model has vae/, tokenizer/ and text_encoder/)"
            )
        staging = tempfile.mkdtemp(dir=directory)  # whole or not at all: a failed download is not reused
        pafs.copy_files(posixpath.join(path, part), staging, source_filesystem=fs)
        os.replace(staging, os.path.join(directory, part))
    return directory


_MODELS: dict[str, str] = {}


def to_unit_range(pixels: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float32 in [-1, 1], the VAE's input, on the host (what
    :func:`unit_range_on` computes on a device)."""
    return pixels.transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0


def unit_range_on(pixels: np.ndarray, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) in [-1, 1] in ``dtype`` on ``device``: the uint8 moved there first (a
    quarter of float32's bytes over PCIe, no float copy on the host), then scaled there in float32 (the values of
    :func:`to_unit_range`, bit for bit) and cast to ``dtype``."""
    with warnings.catch_warnings():  # Ray Data's batches may be read-only; nothing here writes to them
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        images = torch.from_numpy(np.ascontiguousarray(pixels)).to(device, non_blocking=True)
    return images.permute(0, 3, 1, 2).to(torch.float32).div_(127.5).sub_(1.0).to(dtype)


@contextmanager
def _without_progress_bars() -> Iterator[None]:
    """transformers' and diffusers' progress bars ("Loading weights") off while sdtrain loads a model: each encoder
    actor of a job drew one into the log. Turned back on after, for a caller that shows them (a notebook)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    shown = [lib for lib in (transformers_logging, diffusers_logging) if lib.is_progress_bar_enabled()]
    for lib in shown:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in shown:
            lib.enable_progress_bar()


def load_vae(source: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """The AutoencoderKL of a Stable Diffusion model: the only way sdtrain loads one. Loaded in ``dtype`` (a cast
    after loading would not keep the modules diffusers keeps in float32, and it says so).

    Args:
        source: a model holding a vae/ subfolder (a local directory, a storage URI or a hub id), or a local
            directory that is the VAE itself (``--vae /models/sd2/vae``); ``~`` is expanded.
    """
    from diffusers import AutoencoderKL

    path, subfolder = _vae_location(source)
    with _without_progress_bars():
        vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    return vae.to(device).eval()


def vae_dtype(source: str, dtype: torch.dtype, sdxl: bool | None = None) -> torch.dtype:
    """The dtype to encode images with ``source``'s VAE when ``dtype`` is asked for: float32 for an SDXL-shaped
    model's VAE whose config says force_upcast (SDXL's own), else ``dtype``. In float16 that VAE's activations
    overflow on some images and their latents come out inf or NaN; SDXL's pipelines decode with it in float32 and
    diffusers' SDXL training script encodes in float32. A VAE made for float16 (force_upcast false, as the
    community's fp16-fix VAE) and SD 1/2's VAEs, which every SD pipeline runs in float16, keep ``dtype``.
    ``sdxl``: :func:`has_second_encoder` of ``source`` where the caller has it (None: asked here)."""
    if dtype != torch.float16 or not _is_sdxl(source, sdxl):
        return dtype
    from diffusers import AutoencoderKL

    path, subfolder = _vae_location(source)
    upcast = AutoencoderKL.load_config(path, subfolder=subfolder).get("force_upcast", True)  # diffusers' default
    return torch.float32 if upcast else dtype


def vae_downsampling(source: str) -> int:
    """Pixels to a latent's side of the VAE at ``source`` (see :func:`load_vae`), from its config alone."""
    from diffusers import AutoencoderKL

    path, subfolder = _vae_location(source)
    config = AutoencoderKL.load_config(path, subfolder=subfolder)
    return 2 ** (len(config["block_out_channels"]) - 1)


def _vae_location(source: str) -> tuple[str, str | None]:
    """The directory (or hub id) and subfolder diffusers loads the VAE of ``source`` from."""
    if is_uri(source):
        return local_model(source, "vae"), "vae"
    path = os.path.expanduser(source)
    vae_itself = os.path.isdir(path) and not os.path.isdir(os.path.join(path, "vae"))
    return path, None if vae_itself else "vae"  # else a model directory, or a hub id (needs network)


def load_tokenizer(source: str) -> Any:
    """The tokenizer of ``source``'s tokenizer/ subfolder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_model(source, "tokenizer"), subfolder="tokenizer")


def load_text_encoder(source: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(tokenizer, text encoder) from ``source``'s tokenizer/ and text_encoder/ subfolders, loaded in ``dtype``."""
    from transformers import CLIPTextModel

    local = local_model(source, "tokenizer", "text_encoder")
    with _without_progress_bars():
        text_encoder: Any = CLIPTextModel.from_pretrained(local, subfolder="text_encoder", dtype=dtype)
    return load_tokenizer(local), text_encoder.to(device).eval()


def tokenize(tokenizer: Any, prompts: list[str]) -> Any:
    """The tokenizer's output for ``prompts`` as StableDiffusionPipeline.encode_prompt makes it: padded to the
    tokenizer's max length (77 for SD) and truncated. ``.input_ids`` are what output.captions: token_ids stores."""
    return tokenizer(
        prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    )


@torch.no_grad()
def encode_prompts(tokenizer: Any, text_encoder: Any, prompts: list[str]) -> torch.Tensor:
    """(N, L, D) float32 embeddings: the text encoder's last hidden state of :func:`tokenize`'s ids, with the
    attention mask only where the model asks for one (as StableDiffusionPipeline.encode_prompt does)."""
    device = next(text_encoder.parameters()).device
    tokens = tokenize(tokenizer, prompts)
    mask = tokens.attention_mask.to(device) if getattr(text_encoder.config, "use_attention_mask", False) else None
    return text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0].float().cpu()


SECOND_ENCODER = ("tokenizer_2", "text_encoder_2")
"""SDXL's second tokenizer and text encoder (OpenCLIP ViT-bigG, with its projection), beside tokenizer/ and
text_encoder/ (CLIP ViT-L)."""


def has_second_encoder(source: str) -> bool:
    """Whether ``source`` (a local directory, a storage URI or a hub id) is SDXL-shaped: its model_index.json names
    a text_encoder_2 (a directory without one: whether it has text_encoder_2/). Never guessed: a hub id is answered
    from the local Hugging Face cache, else from the hub; where neither answers, a DataError naming ``source`` and
    the cause (taken for SD 1/2, an SDXL model would be encoded to the wrong width, its VAE in float16)."""
    if is_uri(source):
        fs, path = filesystem_for(source.rstrip("/"))
        index = read_bytes(posixpath.join(source.rstrip("/"), MODEL_INDEX))
        directory = fs.get_file_info(posixpath.join(path, SECOND_ENCODER[1])).type == pafs.FileType.Directory
        return _names_second_encoder(source, index, directory)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        index_path = os.path.join(path, MODEL_INDEX)
        index = open(index_path, "rb").read() if os.path.isfile(index_path) else None
        return _names_second_encoder(source, index, os.path.isdir(os.path.join(path, SECOND_ENCODER[1])))
    if source.startswith(("/", "./", "../", "~")) or os.path.exists(path):
        raise DataError(
            f"{source} is not a directory (a model is a diffusers model directory, a storage URI or a hub id)"
        )
    return _names_second_encoder(source, _hub_model_index(source), None)


MODEL_INDEX = "model_index.json"


def _is_sdxl(source: str, sdxl: bool | None) -> bool:
    """``sdxl`` where a caller decided it (preprocessing's driver, once for all its actors), else asked."""
    return has_second_encoder(source) if sdxl is None else sdxl


@functools.lru_cache(maxsize=16)
def _hub_model_index(repo_id: str) -> bytes:
    """The hub model ``repo_id``'s model_index.json: from the local cache where it is there (offline, or the hub
    rate-limiting), else downloaded (once a process)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, MODEL_INDEX)
        path = cached if isinstance(cached, str) else hf_hub_download(repo_id, MODEL_INDEX)
        with open(path, "rb") as f:
            return f.read()
    except Exception as e:  # offline and not cached, no such repository, no network, rate-limited: said, not guessed
        cause = " ".join(f"{type(e).__name__}: {e}".split())
        raise DataError(
            f"{repo_id}: cannot tell whether this hub model is SDXL-shaped: its {MODEL_INDEX} is not in the local "
            f"Hugging Face cache and could not be read from the hub ({cause}); download the model first "
            f"(huggingface-cli download {repo_id}) or name a local directory"
        ) from None


def _names_second_encoder(source: str, index: bytes | None, directory: bool | None) -> bool:
    """Whether a model_index.json (None: the model has none) names a text_encoder_2, else whether ``directory``
    (text_encoder_2/ is there; None for a hub id); a DataError where the index names one the directory lacks."""
    if index is None:
        return bool(directory)
    try:
        component = json.loads(index).get(SECOND_ENCODER[1])
    except (ValueError, AttributeError) as e:
        raise DataError(f"{source}: its {MODEL_INDEX} is not a JSON object: {e}") from None
    named = isinstance(component, list) and bool(component) and component[0] is not None
    if named and directory is False:
        raise DataError(f"{source}: its {MODEL_INDEX} names {SECOND_ENCODER[1]}, but it has no {SECOND_ENCODER[1]}/")
    return named


class TextEncoders:
    """A model's tokenizers and text encoders, as its pipeline encodes prompts: SD 1/2's one (the last hidden state,
    with an attention mask only where the encoder asks for one), or SDXL's two (StableDiffusionXLPipeline
    .encode_prompt: each one's penultimate hidden state, concatenated, and the second's pooled projection).

    A batch's token ids hold each tokenizer's ids in turn (T x L a row, T = 1 or 2; stored one column per tokenizer:
    sdtrain.data.metadata.TOKEN_ID_COLUMNS): :meth:`tokenize` makes them, :meth:`encode_ids` encodes them.
    """

    def __init__(self, source: str, tokenizers: list[Any], encoders: list[Any]):
        self.source = source
        self.tokenizers = tokenizers
        self.encoders = encoders

    @property
    def pooled(self) -> bool:
        """Whether they make a pooled embedding (SDXL)."""
        return len(self.encoders) == 2

    @property
    def width(self) -> int:
        """D of the (L, D) hidden states the UNet cross-attends to."""
        return sum(int(encoder.config.hidden_size) for encoder in self.encoders)

    @property
    def length(self) -> int:
        """L: the tokenizers' padded length."""
        return int(self.tokenizers[0].model_max_length)

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """(N, T x L) int64 ids of ``prompts``: each tokenizer's, padded and truncated, in turn."""
        return tokenize_each(self.tokenizers, prompts)

    @torch.no_grad()
    def encode_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states (N, L, D), pooled (N, P) or None) of stored ids, on the encoders' device, in their dtype."""
        device = next(self.encoders[0].parameters()).device
        ids = ids.to(device).long()
        if not self.pooled:
            return self.encoders[0](ids)[0], None
        parts = ids.reshape(len(ids), len(self.encoders), -1)
        hidden, pooled = [], None
        for i, encoder in enumerate(self.encoders):
            output = encoder(parts[:, i], output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
            pooled = output[0]  # the last encoder's: CLIPTextModelWithProjection's text_embeds
        return torch.cat(hidden, dim=-1), pooled

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, pooled or None) of ``prompts``, float32 on the CPU."""
        if not self.pooled and getattr(self.encoders[0].config, "use_attention_mask", False):
            return encode_prompts(self.tokenizers[0], self.encoders[0], prompts), None
        hidden, pooled = self.encode_ids(self.tokenize(prompts))
        return hidden.float().cpu(), None if pooled is None else pooled.float().cpu()

    def to(self, device: torch.device | str) -> TextEncoders:
        for encoder in self.encoders:
            encoder.to(device)
        return self


def tokenize_each(tokenizers: list[Any], prompts: list[str]) -> torch.Tensor:
    """(N, T x L) int64 ids of ``prompts``: each of ``tokenizers``' (:func:`tokenize`), in turn: what
    :meth:`TextEncoders.tokenize` makes, from the tokenizers alone."""
    return torch.cat([tokenize(tokenizer, prompts).input_ids for tokenizer in tokenizers], dim=1)


def load_tokenizers(source: str, sdxl: bool | None = None) -> list[Any]:
    """The tokenizers :func:`load_text_encoders` gives ``source``'s text encoders (tokenizer/, and SDXL's
    tokenizer_2/), without the encoders' weights: all that stored token ids need to be made."""
    from transformers import AutoTokenizer

    if not _is_sdxl(source, sdxl):
        return [load_tokenizer(source)]
    local = local_model(source, "tokenizer", SECOND_ENCODER[0])
    return [load_tokenizer(local), AutoTokenizer.from_pretrained(local, subfolder=SECOND_ENCODER[0])]


def load_text_encoders(
    source: str, device: str = "cpu", dtype: torch.dtype = torch.float32, sdxl: bool | None = None
) -> TextEncoders:
    """The tokenizers and text encoders of ``source`` (tokenizer/ and text_encoder/, and SDXL's tokenizer_2/ and
    text_encoder_2/ where it has them), frozen in eval mode: the one way sdtrain loads a model's text encoders."""
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    if not _is_sdxl(source, sdxl):
        tokenizer, encoder = load_text_encoder(source, device, dtype)
        return TextEncoders(source, [tokenizer], [encoder.requires_grad_(False)])
    local = local_model(source, "tokenizer", "text_encoder", *SECOND_ENCODER)
    tokenizer, first = load_text_encoder(local, device, dtype)
    with _without_progress_bars():
        second: Any = CLIPTextModelWithProjection.from_pretrained(local, subfolder="text_encoder_2", dtype=dtype)
    tokenizer_2 = AutoTokenizer.from_pretrained(local, subfolder="tokenizer_2")
    encoders = [first.requires_grad_(False), second.to(device).eval().requires_grad_(False)]
    return TextEncoders(source, [tokenizer, tokenizer_2], encoders)


@torch.no_grad()
def encode_images(
    vae: Any, pixels: np.ndarray, latent: Literal["mean", "sample"], seeds: list[int] | None = None
) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, C, H/f, W/f) float32 latents times the VAE's scaling_factor (applied here, once).

    Args:
        vae: an AutoencoderKL.
        pixels: the CPU stage's output.
        latent: the distribution's mean, or a sample.
        seeds: one seed per row for ``sample``: a row's latent does not depend on its batch.
    """
    param = next(vae.parameters())
    images = unit_range_on(pixels, param.device, param.dtype)
    dist = vae.encode(images).latent_dist
    latents = dist.mean
    if latent == "sample":
        noise = torch.stack(
            [torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds or []]
        )
        latents = latents + dist.std * noise.to(latents)
    return latents.float().cpu() * float(vae.config.scaling_factor)
