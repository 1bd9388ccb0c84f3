"""Prompts as words: encoded with the tokenizer and text encoder that made the model's training captions
(recorded in the data's parquet metadata or the export), into the caption rows sampling conditions on."""

from __future__ import annotations

from sdtrain.artifacts.export import model_sources
from sdtrain.artifacts.loading import LoadedModel
from sdtrain.data.metadata import EncoderSources
from sdtrain.errors import DataError
from sdtrain.sampling.captions import Captions


def read_prompts_file(path: str) -> list[str]:
    """One prompt a line; blank lines and lines starting with # are left out."""
    from sdtrain.storage.filesystems import read_text

    text = read_text(path, "--prompts-file")
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise DataError(f"--prompts-file: {path} holds no prompts (one a line)")
    return prompts


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
    """The prompts' embeddings (N, L, D), checked against the caption shape the model was trained with."""
    from sdtrain.model.encoders import encode_prompts, load_text_encoder

    tokenizer, model = load_text_encoder(text_encoder)
    embeddings = encode_prompts(tokenizer, model, prompts)
    if caption_shape is not None and tuple(embeddings.shape[1:]) != tuple(caption_shape):
        raise DataError(
            f"--text-encoder: {text_encoder} gives prompt embeddings of shape {tuple(embeddings.shape[1:])}, but the "
            f"model was trained on captions of shape {tuple(caption_shape)}"
        )
    return Captions(embeddings, [p[:40] for p in prompts])
