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
from sdtrain.model.encoders import TextEncoders
from sdtrain.storage.uris import is_uri


def encoder_dtype(use_gpu: bool) -> torch.dtype:
    """bf16 on a GPU (the encoder needs no float32 master weights: it never trains), float32 on the CPU."""
    return torch.bfloat16 if use_gpu else torch.float32


def text_encoder_config(source: str, subfolder: str = "text_encoder") -> Any:
    """The CLIPTextConfig of ``source``'s ``subfolder`` (a local directory, a storage URI or a hub id): the data
    check reads only this, not the weights."""
    from transformers import CLIPTextConfig

    if is_uri(source):
        from sdtrain.storage.filesystems import filesystem_for

        uri = posixpath.join(source.rstrip("/"), subfolder, "config.json")
        fs, path = filesystem_for(uri)
        try:
            with fs.open_input_stream(path) as f:
                return CLIPTextConfig(**json.loads(f.read()))
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the text encoder's config {uri}: {e}") from None
    try:
        return CLIPTextConfig.from_pretrained(source, subfolder=subfolder)
    except OSError as e:
        raise DataError(f"cannot load the text encoder config of {source} ({subfolder}/config.json): {e}") from None


def text_encoder_configs(source: str) -> list[Any]:
    """The configs of ``source``'s text encoders: SD 1/2's one, or SDXL's two (text_encoder_2/ too)."""
    from sdtrain.model.encoders import has_second_encoder

    second = ["text_encoder_2"] if has_second_encoder(source) else []
    return [text_encoder_config(source, subfolder) for subfolder in ["text_encoder", *second]]


def check_text_encoder(ids: TokenIds, where: str, cross_attention_dim: int, pooled_width: int | None = None) -> None:
    """Refuse, before any worker starts, text encoders whose output width is not the UNet's, whose pooled embedding
    is not the one the UNet takes, or whose vocabulary does not cover the stored ids (every one below the tokenizer's
    vocabulary size the files record, which the data check holds the first row to), naming both.

    Args:
        ids: what the data says of its ids (the encoders' source, the tokenizers' vocabulary size).
        where: the file and column, for the error.
        cross_attention_dim: the UNet's.
        pooled_width: the pooled text embedding an SDXL-shaped UNet takes (sdtrain.model.conditioning.pooled_width);
            None for SD 1/2.
    """
    configs = text_encoder_configs(ids.text_encoder)
    width = sum(int(config.hidden_size) for config in configs)
    if width != cross_attention_dim:
        parts = " + ".join(str(config.hidden_size) for config in configs)
        raise DataError(
            f"{where} holds token ids for the text encoder(s) {ids.text_encoder}, whose output is {parts} wide, but "
            f"the UNet's cross_attention_dim is {cross_attention_dim}; set model.unet.cross_attention_dim={width} (or "
            "a preset of that width), or re-encode the captions with text encoders of the UNet's width"
        )
    pooled = int(configs[-1].projection_dim) if len(configs) == 2 else None
    if pooled != pooled_width:
        raise DataError(
            f"{where} holds token ids for {ids.text_encoder}, whose pooled text embedding is "
            f"{pooled or 'none'} wide (SDXL's text_encoder_2 projection), but the UNet takes "
            f"{pooled_width or 'none'}: an SDXL-shaped UNet trains on captions of SDXL's two text encoders, an SD 1/2 "
            "UNet on one"
        )
    largest = ids.vocab_size - 1
    for config in configs:
        if largest >= config.vocab_size:
            raise DataError(
                f"{where} holds token ids up to {largest} (a tokenizer of {ids.vocab_size} ids), but the text "
                f"encoder {ids.text_encoder} has a vocabulary of {config.vocab_size}: its embedding table does not "
                "cover them. The ids were made with another tokenizer than this encoder's"
            )


class CaptionEncoder:
    """Token ids (N, T x L) -> what the UNet is conditioned on, as the pipeline computes it from the same ids
    (sdtrain.model.encoders.TextEncoders): SD 1/2's last hidden state (padding encoded like any token: SD's text
    encoders take no attention mask; one that asks for it is refused, as the ids alone cannot say where padding
    starts), or SDXL's two encoders' penultimate hidden states and the second's pooled embedding."""

    def __init__(self, encoders: TextEncoders):
        first = encoders.encoders[0]
        if not encoders.pooled and getattr(first.config, "use_attention_mask", False):
            raise DataError(
                f"{encoders.source}: its text encoder asks for an attention mask (use_attention_mask), which stored "
                "token ids do not carry; store embeddings (output.captions: embeddings) for it"
            )
        self.encoders = encoders
        self.source = encoders.source

    @classmethod
    def load(cls, source: str, use_gpu: bool) -> CaptionEncoder:
        """The text encoders of ``source`` (sdtrain.model.encoders.load_text_encoders: the one way they are loaded),
        frozen: eval mode, no gradient, in :func:`encoder_dtype`; on the CPU until :meth:`to` moves them."""
        from sdtrain.model.encoders import load_text_encoders

        return cls(load_text_encoders(source, "cpu", encoder_dtype(use_gpu)))

    @property
    def text_encoder(self) -> Any:
        """The (first) text encoder."""
        return self.encoders.encoders[0]

    @property
    def width(self) -> int:
        return self.encoders.width

    def to(self, device: torch.device | str) -> CaptionEncoder:
        self.encoders.to(device)
        return self

    def encode(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, pooled embedding or None) of ``ids``, computed where the encoders are (the training device
        once fit starts), returned on the device of ``ids``."""
        if ids.device.type == "cpu":
            self._check(ids)
        hidden, pooled = self.encoders.encode_ids(ids)
        return hidden.to(ids.device), None if pooled is None else pooled.to(ids.device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states of ``ids`` (see :meth:`encode`)."""
        return self.encode(ids)[0]

    def _check(self, ids: torch.Tensor) -> None:
        """A DataError naming the row and value of the first id outside the encoders' vocabularies, where the ids are
        on the CPU: ids read another way than the training and validation streams (which check every id against the
        vocabulary its file records as they read it: sdtrain.data.decode.check_token_ids), e.g. the retraining gate's.
        Ids on an accelerator are not checked here: that would wait for the device every micro-batch, a host sync the
        step otherwise avoids; they came through the streams."""
        vocab = min(int(encoder.config.vocab_size) for encoder in self.encoders.encoders)
        if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab):
            return
        first = tuple(int(i) for i in torch.nonzero((ids < 0) | (ids >= vocab))[0])
        raise DataError(
            f"row {first[0]} of a batch holds token id {int(ids[first])}, outside the vocabulary of {vocab} of the "
            f"text encoder {self.source}: the ids were made with another tokenizer or written wrongly"
        )
