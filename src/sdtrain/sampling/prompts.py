"""Prompts as words: encoded with the tokenizer and text encoder that made the model's training captions
(recorded in the data's parquet metadata or the export), into the caption rows sampling conditions on."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

from sdtrain.artifacts.export import model_sources
from sdtrain.artifacts.loading import LoadedModel
from sdtrain.config.schema import Config
from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, EncoderSources, TokenIds
from sdtrain.errors import ConfigError, DataError
from sdtrain.sampling.captions import Captions
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import is_uri

KEY = "sample_grid.prompts"


def read_prompts_file(path: str, key: str = "--prompts-file") -> list[str]:
    """One prompt a line; blank lines and lines starting with # are left out. ``key``: the flag or config key that
    named the file, for the errors."""
    from sdtrain.storage.filesystems import read_text

    text = read_text(path, key)
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise DataError(f"{key}: {path} holds no prompts (one a line)")
    return prompts


@dataclass(frozen=True)
class GridPrompts:
    """sample_grid.prompts, read and encoded once on the driver: the rows of each of the run's sample grids."""

    prompts: list[str]
    text_encoder: str
    """Where the text encoder that encoded them came from."""
    embeddings: torch.Tensor
    """(N, L, D) float32, a row per prompt."""
    pooled: torch.Tensor | None = None
    """(N, P) float32: SDXL's two encoders' pooled embeddings; None for one encoder."""

    def captions(self) -> Captions:
        return Captions(self.embeddings, list(self.prompts), pooled=self.pooled)


def grid_prompts(
    config: Config, metadata: Mapping[bytes, bytes] | None, token_ids: TokenIds | None, caption_shape: tuple[int, ...]
) -> GridPrompts | None:
    """sample_grid.prompts encoded by the run's text encoder (:func:`grid_text_encoder`); None when it is not set.
    Refuses, naming the key, a file that is missing or empty, a run with no known text encoder, and an encoder whose
    output is not the run's caption shape (L, D), D being the UNet's cross_attention_dim.

    Args:
        metadata: data.train's parquet schema metadata.
        token_ids: what data.train's token-id captions say of their encoder; None for embeddings.
        caption_shape: (L, D) of the captions the UNet trains on.
    """
    from sdtrain.model.encoders import load_text_encoders
    from sdtrain.model.token_captions import text_encoder_configs

    setting = config.sample_grid.prompts
    if setting is None:
        return None
    prompts = _prompt_list(setting)
    source = grid_text_encoder(config, metadata, token_ids)
    try:
        width = sum(int(encoder.hidden_size) for encoder in text_encoder_configs(source))
    except DataError as error:
        raise ConfigError(f"{KEY}: {error}") from None
    if width != caption_shape[-1]:
        raise ConfigError(
            f"{KEY}: the run's text encoder {source} encodes prompts {width} wide, but the UNet's cross_attention_dim "
            f"is {caption_shape[-1]}: prompts need the encoder the captions were made with"
        )
    embeddings, pooled = load_text_encoders(source).encode(prompts)
    if tuple(embeddings.shape[1:]) != tuple(caption_shape):
        raise ConfigError(
            f"{KEY}: {source} encodes a prompt as {tuple(embeddings.shape[1:])} (tokens, width), but data.train's "
            f"captions are {tuple(caption_shape)}: prompts need the tokenizer the captions were made with"
        )
    return GridPrompts(prompts, source, embeddings, pooled)


def _prompt_list(setting: str | list[str]) -> list[str]:
    """The prompts a list holds, or the lines of the file a string names."""
    if isinstance(setting, list):
        return [prompt.strip() for prompt in setting]
    fs, path = filesystem_for(setting)
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise ConfigError(
            f"{KEY}: no file {setting}. A string names a text file of prompts, one a line; prompts in words are a "
            f"list: {KEY}=['a red fox', 'a lighthouse at dusk']"
        )
    return read_prompts_file(setting, KEY)


def grid_text_encoder(config: Config, metadata: Mapping[bytes, bytes] | None, token_ids: TokenIds | None) -> str:
    """The text encoder the run's prompts are encoded with: the one its token-id captions name (training encodes them
    with it), else the one data.train's files record (the captions were made with it), else model.pretrained's."""
    if token_ids is not None:
        return token_ids.text_encoder
    recorded = (metadata or {}).get(TEXT_ENCODER_SOURCE.encode())
    if recorded:
        return recorded.decode()
    pretrained = config.model.pretrained
    if pretrained is not None and _holds_text_encoder(pretrained):
        return pretrained
    raise ConfigError(
        f"{KEY}: no text encoder is known to encode the prompts with: data.train's captions are embeddings whose "
        f"files record no {TEXT_ENCODER_SOURCE} (entrypoints/preprocess.py writes it), and model.pretrained "
        f"({pretrained or 'not set'}) holds no text_encoder/. Name the Stable Diffusion model (tokenizer/ and "
        f"text_encoder/) the captions were encoded with: in data.train's parquet metadata ({TEXT_ENCODER_SOURCE}, "
        "as preprocessing records it), or as model.pretrained when training starts from it; or give the grid "
        "embeddings instead (sample_grid.captions)"
    )


def _holds_text_encoder(source: str) -> bool:
    """Whether a model directory or URI holds text_encoder/config.json; a hub id is taken at its word (it is read
    from the hub, and fails there naming itself, when it does not)."""
    local = os.path.expanduser(source)
    if not is_uri(source) and not os.path.exists(local):
        return True  # a hub id
    fs, path = filesystem_for(source if is_uri(source) else local)
    return fs.get_file_info(f"{path.rstrip('/')}/text_encoder/config.json").type == pafs.FileType.File


def resolve_sources(loaded: LoadedModel, text_encoder: str | None, vae: str | None) -> EncoderSources:
    """The text encoder and VAE to use: the ones given, else those the model's data or export records.

    Args:
        loaded: the model.
        text_encoder: --text-encoder, or None.
        vae: --vae, or None.
    """
    recorded = model_sources(loaded)
    text_encoder = text_encoder or (recorded.text_encoder if recorded else None)
    if text_encoder is None:
        raise DataError(
            f"--prompt: {loaded.source} does not record the text encoder its captions were made with (its data was "
            "not written by entrypoints/preprocess.py, or is not reachable from here); give --text-encoder"
        )
    return EncoderSources(vae=vae or (recorded.vae if recorded else text_encoder), text_encoder=text_encoder)


def encode_prompt_captions(prompts: list[str], text_encoder: str, caption_shape: tuple[int, ...] | None) -> Captions:
    """The prompts' embeddings (N, L, D) (and for SDXL's two encoders their pooled embeddings), checked against the
    caption shape the model was trained with."""
    from sdtrain.model.encoders import load_text_encoders

    embeddings, pooled = load_text_encoders(text_encoder).encode(prompts)
    if caption_shape is not None and tuple(embeddings.shape[1:]) != tuple(caption_shape):
        raise DataError(
            f"--text-encoder: {text_encoder} gives prompt embeddings of shape {tuple(embeddings.shape[1:])}, but the "
            f"model was trained on captions of shape {tuple(caption_shape)}"
        )
    return Captions(embeddings, [p[:40] for p in prompts], pooled=pooled)
