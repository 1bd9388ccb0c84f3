"""What the model preprocessing encodes with decides about its output: the VAE's geometry, the columns and schema
metadata the shards carry (SDXL's two encoders add the pooled column), and the empty prompt training drops captions
to (a file beside the shards, or zeros for SDXL)."""

from __future__ import annotations

import contextlib
import io
import json
import posixpath
from collections.abc import Iterator
from typing import Any

import numpy as np

from sdtrain.data.metadata import (
    LATENT,
    LATENT_SCALING_FACTOR,
    RESOLUTION,
    TEXT_ENCODER_SOURCE,
    TOKEN_ID_COLUMNS,
    TOKEN_VOCAB_SIZE,
    VAE_DOWNSAMPLING,
    VAE_SOURCE,
)
from sdtrain.errors import DataError, StorageUnavailable
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.outputs import join
from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import UNCONDITIONAL_FILE, UNCONDITIONAL_IDS_FILE
from sdtrain.storage.uris import is_uri


def ids_key(tokenizer: int) -> str:
    """The batch key of the ``tokenizer``-th (from 0) tokenizer's ids: ``token_ids``, ``token_ids_2``."""
    return "token_ids" if tokenizer == 0 else f"token_ids_{tokenizer + 1}"


def exists(uri: str) -> bool:
    """Whether a file is at ``uri`` (local or a storage URI)."""
    import pyarrow.fs as pafs

    from sdtrain.storage.filesystems import filesystem_for

    fs, path = filesystem_for(uri)
    return fs.get_file_info(path).type == pafs.FileType.File


def check_model(model: str) -> bool:
    """Whether encode.model is SDXL-shaped (decided once, on the driver, and handed to the encoders), its VAE's
    config, its tokenizers and its text encoders' folders read too: before the output records anything, a model that
    cannot be found or read is a DataError naming encode.model, the model and why (a typo in its path, or a missing
    tokenizer, recorded in _settings.json, refused the corrected run)."""
    from sdtrain.model.encoders import load_tokenizers

    sdxl = model_shape(model)
    with _named(model):
        _check_text_folders(model, sdxl)
        load_tokenizers(model, sdxl)  # every output needs them: the vocabulary bounds the stored ids
    return sdxl


def model_shape(model: str) -> bool:
    """Whether encode.model is SDXL-shaped, its VAE's config read: what a shard's size is estimated from (configs
    alone, no tokenizer or weights), a model that cannot be read a DataError as :func:`check_model`'s."""
    from sdtrain.model.encoders import has_second_encoder

    with _named(model):
        sdxl = has_second_encoder(model)
        vae_geometry(model)
    return sdxl


@contextlib.contextmanager
def _named(model: str) -> Iterator[None]:
    """Errors reading ``model`` as one-line DataErrors naming encode.model."""
    try:
        yield
    except StorageUnavailable:  # a store failing for now: the run may be retried (exit 75)
        raise
    except (DataError, OSError, ValueError) as e:  # ours name the model; diffusers' and the hub's, not always
        cause = " ".join(str(e).split())  # one line, as every error of the command line
        said = cause if isinstance(e, DataError) else f"cannot load {model}: {cause}"
        raise DataError(f"encode.model: {said}") from None


def _check_text_folders(model: str, sdxl: bool) -> None:
    """A local model's tokenizer and text encoder folders, each named where missing: transformers' own error for a
    missing tokenizer names no folder. A stored or hub model's are fetched by what loads them."""
    import os

    parts = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2") if sdxl else ("tokenizer", "text_encoder")
    missing = [f"{part}/" for part in parts if os.path.isdir(model) and not os.path.isdir(os.path.join(model, part))]
    if missing:
        expected = ", ".join(f"{part}/" for part in ("vae", *parts))
        raise DataError(f"{model} has no {', '.join(missing)}: a diffusers model holds {expected}")


def vae_geometry(model: str) -> tuple[float, int, int]:
    """The VAE's scaling factor, latent channels and downsampling (pixels to a latent's side), from its config: for a
    model on a storage URI, vae/config.json alone (the driver never loads the VAE's weights, which the encoders fetch;
    this once downloaded all of vae/ to the driver: ~335 MB for SD 2's and SDXL's)."""
    if is_uri(model):
        config = component_config(model, "vae")
    else:
        from diffusers import AutoencoderKL

        config = AutoencoderKL.load_config(model, subfolder="vae")
    downsampling = 2 ** (len(config.get("block_out_channels", [0] * 4)) - 1)
    return float(config.get("scaling_factor", 0.18215)), int(config.get("latent_channels", 4)), downsampling


def text_encoder_configs(model: str, sdxl: bool) -> list[dict[str, Any]]:
    """The configs of ``model``'s text encoders (SDXL's two), no weights read; a DataError naming encode.model."""
    with _named(model):
        return [component_config(model, part) for part in ("text_encoder", "text_encoder_2")[: 1 + sdxl]]


def component_config(model: str, subfolder: str) -> dict[str, Any]:
    """``model``'s ``subfolder``/config.json alone: for a model on a storage URI, not the subfolder's weights,
    which the driver never loads (an SDXL text_encoder_2/ is gigabytes)."""
    if is_uri(model):
        data = read_bytes(posixpath.join(model.rstrip("/"), subfolder, "config.json"))
        if data is None:
            raise DataError(f"{model} has no {subfolder}/config.json: expected a diffusers model")
        loaded: dict[str, Any] = json.loads(data)
        return loaded
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(model, subfolder=subfolder)
    return config


def write_unconditional(config: PreprocessConfig) -> tuple[int, dict[str, str]]:
    """The empty prompt's embedding (computed once on the driver, CPU, float32) and/or its token ids, as
    output.captions stores captions; returns the tokenizers' largest vocabulary (the bound of every stored id) and,
    for the manifest, what each caption column's data.unconditional_caption is. An SDXL model's is "zeros": it drops
    captions to zeros, hidden states and pooled embedding alike (force_zeros_for_empty_prompt), so no file is
    written."""
    from sdtrain.model.encoders import (
        encode_prompts,
        has_second_encoder,
        load_text_encoder,
        load_tokenizers,
        tokenize_each,
    )

    tokenizers = load_tokenizers(config.encode.model)
    vocab_size = max(len(tokenizer) for tokenizer in tokenizers)
    files = {}
    if config.output.captions != "token_ids":
        files[config.output.caption_column, UNCONDITIONAL_FILE] = lambda: encode_prompts(
            *load_text_encoder(config.encode.model), [""]
        )[0].numpy()
    if config.output.captions != "embeddings":
        files[config.output.token_id_column, UNCONDITIONAL_IDS_FILE] = lambda: (
            tokenize_each(tokenizers, [""])[0].numpy().astype(np.int32)
        )
    if has_second_encoder(config.encode.model):
        return vocab_size, {column: "zeros" for column, _ in files}
    for (_, name), make in files.items():
        path = join(config.output.path, name)
        if not exists(path):
            buffer = io.BytesIO()
            np.save(buffer, make(), allow_pickle=False)
            write_bytes(path, buffer.getvalue())
    return vocab_size, {column: name for column, name in files}


def output_columns(
    config: PreprocessConfig, scaling_factor: float, downsampling: int, vocab_size: int
) -> tuple[dict[str, str], dict[str, str]]:
    """The encoders' output columns with the names the shards store them under, and the shards' schema metadata."""
    from sdtrain.model.encoders import has_second_encoder

    metadata = {
        LATENT_SCALING_FACTOR: repr(scaling_factor),
        VAE_DOWNSAMPLING: str(downsampling),
        RESOLUTION: str(config.image.resolution),
        VAE_SOURCE: config.encode.model,
        TEXT_ENCODER_SOURCE: config.encode.model,
        LATENT: config.encode.latent,
    }
    columns = {"latents": config.output.latent_column}
    if config.output.captions != "token_ids":
        columns["embeddings"] = config.output.caption_column
        if has_second_encoder(config.encode.model):  # SDXL's UNet also takes the second encoder's pooled embedding
            columns["pooled"] = config.output.pooled_column
    if config.output.captions != "embeddings":
        # One column per tokenizer (SDXL's two), named in order in the files: training joins them as its encoders do.
        names = config.output.token_id_columns(2 if has_second_encoder(config.encode.model) else 1)
        columns.update({ids_key(t): name for t, name in enumerate(names)})
        metadata[TOKEN_VOCAB_SIZE] = str(vocab_size)
        metadata[TOKEN_ID_COLUMNS] = json.dumps(names)
    return columns, metadata
