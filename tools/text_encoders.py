"""The text encoders a rank of the shipped SDXL config holds to encode its captions' token ids in the step, as configs
(no weights): what the memory model counts (sdtrain.model.memory) and the performance model times, for the generated
docs and the tests, where no model can be downloaded.

The values are those of stabilityai/stable-diffusion-xl-base-1.0's ``text_encoder/config.json`` (CLIP ViT-L/14's
text tower, a CLIPTextModel) and ``text_encoder_2/config.json`` (OpenCLIP ViT-bigG/14's, a
CLIPTextModelWithProjection): 123.1M and 694.7M parameters, 1.64 GB in bf16.
"""

from __future__ import annotations

from typing import Any

_SHARED: dict[str, Any] = dict(
    vocab_size=49408,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
    attention_dropout=0.0,
    dropout=0.0,
    initializer_factor=1.0,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
CLIP_VIT_L: dict[str, Any] = dict(
    _SHARED,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    hidden_act="quick_gelu",
    projection_dim=768,
)
"""SDXL's text_encoder/ (CLIP ViT-L/14's text tower)."""
OPENCLIP_BIGG: dict[str, Any] = dict(
    _SHARED,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
)
"""SDXL's text_encoder_2/ (OpenCLIP ViT-bigG/14's text tower and its projection)."""


def sdxl_text_encoder_configs() -> list[Any]:
    """The CLIPTextConfigs of SDXL base 1.0's two text encoders, in the order the model holds them."""
    from transformers import CLIPTextConfig

    return [CLIPTextConfig(**CLIP_VIT_L), CLIPTextConfig(**OPENCLIP_BIGG)]
