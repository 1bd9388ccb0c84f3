"""Captions stored as token ids and encoded in the training step by the frozen text encoder the data names.

A stored SD 2 caption embedding is 77 x 1024 float16 (157,696 bytes a row); its token ids are 77 int32 (308 bytes).
Preprocessing writes the ids exactly as the pipeline's ``encode_prompt`` pads and truncates them
(``output.captions: token_ids``), and names the text encoder in the files' metadata (sdtrain.data.metadata.TokenIds);
each training worker loads that encoder once and runs it on every micro-batch, without gradient. It is held outside
the LightningModule's parameters: never in the optimizer, never in a checkpoint, not wrapped by DDP or sharded by
FSDP (every rank holds a whole replica: OpenCLIP-H's text tower is ~354M parameters, ~0.7 GB in bf16).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import torch

from sdtrain.data.metadata import TokenIds
from sdtrain.errors import DataError
from sdtrain.storage.uris import is_uri


def encoder_dtype(use_gpu: bool) -> torch.dtype:
    """bf16 on a GPU (the encoder needs no float32 master weights: it never trains), float32 on the CPU."""
    return torch.bfloat16 if use_gpu else torch.float32


def text_encoder_config(source: str) -> Any:
    """The CLIPTextConfig of ``source``'s text_encoder/ (a local directory, a storage URI or a hub id): the data
    check reads only this, not the weights."""
    from transformers import CLIPTextConfig

    if is_uri(source):
        from sdtrain.storage.filesystems import filesystem_for

        uri = posixpath.join(source.rstrip("/"), "text_encoder", "config.json")
        fs, path = filesystem_for(uri)
        try:
            with fs.open_input_stream(path) as f:
                return CLIPTextConfig(**json.loads(f.read()))
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the text encoder's config {uri}: {e}") from None
    try:
        return CLIPTextConfig.from_pretrained(source, subfolder="text_encoder")
    except OSError as e:
        raise DataError(f"cannot load the text encoder config of {source} (text_encoder/config.json): {e}") from None


def check_text_encoder(ids: TokenIds, where: str, cross_attention_dim: int) -> None:
    """Refuse, before any worker starts, a text encoder whose output width is not the UNet's or whose vocabulary
    does not cover the stored ids (every one below the tokenizer's vocabulary size the files record, which the data
    check holds the first row to), naming both.

    Args:
        ids: what the data says of its ids (the encoder's source, the tokenizer's vocabulary size).
        where: the file and column, for the error.
        cross_attention_dim: the UNet's.
    """
    config = text_encoder_config(ids.text_encoder)
    if config.hidden_size != cross_attention_dim:
        raise DataError(
            f"{where} holds token ids for the text encoder {ids.text_encoder}, whose output is "
            f"{config.hidden_size} wide, but the UNet's cross_attention_dim is {cross_attention_dim}; set "
            f"model.unet.cross_attention_dim={config.hidden_size} (or a preset of that width), or re-encode the "
            "captions with a text encoder of the UNet's width"
        )
    largest = ids.vocab_size - 1
    if largest >= config.vocab_size:
        raise DataError(
            f"{where} holds token ids up to {largest} (a tokenizer of {ids.vocab_size} ids), but the text "
            f"encoder {ids.text_encoder} has a vocabulary of {config.vocab_size}: its embedding table does not "
            "cover them. The ids were made with another tokenizer than this encoder's"
        )


class CaptionEncoder:
    """Token ids (N, L) -> the embeddings (N, L, D) the UNet cross-attends to, as StableDiffusionPipeline.encode_prompt
    computes them from the same ids: the last hidden state, padding encoded like any token (SD's text encoders take
    no attention mask; one that asks for it is refused, as the ids alone cannot say where padding starts)."""

    def __init__(self, text_encoder: Any, source: str = "the text encoder"):
        if getattr(text_encoder.config, "use_attention_mask", False):
            raise DataError(
                f"{source}: its text encoder asks for an attention mask (use_attention_mask), which stored token ids "
                "do not carry; store embeddings (output.captions: embeddings) for it"
            )
        self.text_encoder = text_encoder
        self.source = source

    @classmethod
    def load(cls, source: str, use_gpu: bool) -> CaptionEncoder:
        """The text encoder of ``source`` (sdtrain.model.encoders.load_text_encoder: the one way one is loaded),
        frozen: eval mode, no gradient, in :func:`encoder_dtype`; on the CPU until :meth:`to` moves it."""
        from sdtrain.model.encoders import load_text_encoder

        _, text_encoder = load_text_encoder(source, "cpu", encoder_dtype(use_gpu))
        text_encoder.requires_grad_(False)
        return cls(text_encoder, source)

    @property
    def width(self) -> int:
        return int(self.text_encoder.config.hidden_size)

    def to(self, device: torch.device | str) -> CaptionEncoder:
        self.text_encoder.to(device)
        return self

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``ids``, computed where the encoder is (the training device once fit starts), returned on
        the device of ``ids``."""
        if ids.device.type == "cpu":
            self._check(ids)
        device = next(self.text_encoder.parameters()).device
        return self.text_encoder(ids.to(device).long())[0].to(ids.device)

    def _check(self, ids: torch.Tensor) -> None:
        """A DataError naming the row and value of the first id outside the encoder's vocabulary, where the ids are on
        the CPU: ids read another way than the training and validation streams (which check every id against the
        vocabulary its file records as they read it: sdtrain.data.decode.check_token_ids), e.g. the retraining gate's.
        Ids on an accelerator are not checked here: that would wait for the device every micro-batch, a host sync the
        step otherwise avoids; they came through the streams."""
        vocab = int(self.text_encoder.config.vocab_size)
        if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab):
            return
        first = tuple(int(i) for i in torch.nonzero((ids < 0) | (ids >= vocab))[0])
        raise DataError(
            f"row {first[0]} of a batch holds token id {int(ids[first])}, outside the vocabulary of {vocab} of the "
            f"text encoder {self.source}: the ids were made with another tokenizer or written wrongly"
        )
