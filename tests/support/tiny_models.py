"""Stable Diffusion encoders built from configs with random weights, for tests and benchmarks that must not
download: a tiny model directory (vae/, tokenizer/, text_encoder/; the real classes at toy size), and SD 2's VAE
and text encoder at full size (what encoding costs does not depend on the weights)."""

from __future__ import annotations

import json
import os
from typing import Any


def _byte_characters() -> list[str]:
    """CLIP's byte-to-unicode table: every byte as a printable character (its BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            characters.append(256 + extra)
            extra += 1
    return [chr(c) for c in characters]


def write_tokenizer(directory: str) -> dict[str, int]:
    """A character-level CLIP tokenizer (77 tokens) saved to ``directory``; returns its vocabulary.

    Args:
        directory: the tokenizer/ folder (created).
    """
    from transformers import CLIPTokenizer

    characters = _byte_characters()
    vocab = {c: i for i, c in enumerate(characters)}
    vocab.update({c + "</w>": len(characters) + i for i, c in enumerate(characters)})
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")  # no merges: one token per character
    tokenizer = CLIPTokenizer(
        os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"), model_max_length=77
    )
    tokenizer.save_pretrained(directory)
    return vocab


def sd2_text_encoder_config(vocab: dict[str, int] | None = None) -> Any:
    """The CLIPTextConfig of Stable Diffusion 2's text encoder (OpenCLIP ViT-H: 23 layers, 1024 wide, 49408 tokens);
    its special tokens from ``vocab`` (a tokenizer's), else CLIP's (49406 and 49407)."""
    from transformers import CLIPTextConfig

    start, end = (vocab["<|startoftext|>"], vocab["<|endoftext|>"]) if vocab is not None else (49406, 49407)
    return CLIPTextConfig(
        vocab_size=49408,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=23,
        num_attention_heads=16,
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=512,
        bos_token_id=start,
        eos_token_id=end,
        pad_token_id=end,
    )


def sd2_shaped_encoders(tokenizer_dir: str) -> tuple[Any, Any, Any]:
    """(tokenizer, text encoder, VAE) with the architectures of Stable Diffusion 2's (OpenCLIP ViT-H: 23 layers,
    1024 wide, 49408 tokens; the VAE: 128-256-512-512 channels, 2 layers a block) and random weights: encoding
    costs what it costs with the real ones. Built in memory; the tokenizer (character-level) goes to
    ``tokenizer_dir``.

    Args:
        tokenizer_dir: where to write the tokenizer.
    """
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel

    vocab = write_tokenizer(tokenizer_dir)
    text_encoder = CLIPTextModel(sd2_text_encoder_config(vocab))
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=512,
        scaling_factor=0.18215,
    )
    return AutoTokenizer.from_pretrained(tokenizer_dir), text_encoder.eval(), vae.eval()


def write_tiny_sd_model(root: str, caption_dim: int = 32, vae_blocks: int = 2) -> str:
    """Write a tiny SD model to ``root``: a character-level CLIP tokenizer (77 tokens), a 2-layer CLIPTextModel of
    width ``caption_dim`` and an AutoencoderKL that downsamples by 2 ** (vae_blocks - 1). Returns ``root``.

    Args:
        root: the model directory (created).
        caption_dim: the text encoder's width: the UNet's cross_attention_dim (32 for model.preset=tiny).
        vae_blocks: the VAE's encoder blocks.
    """
    import torch
    from transformers import CLIPTextModel

    vocab = write_tokenizer(os.path.join(root, "tokenizer"))
    # Seeded on their own (the caller's RNG kept): a test's numbers must not depend on the tests that ran before it.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        CLIPTextModel(_tiny_text_config(vocab, caption_dim)).save_pretrained(os.path.join(root, "text_encoder"))
        vae = _tiny_vae(vae_blocks)
    vae.save_pretrained(os.path.join(root, "vae"))
    return root


def _tiny_vae(vae_blocks: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=tuple(16 * 2**i for i in range(vae_blocks)),
        down_block_types=("DownEncoderBlock2D",) * vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=32,
    )


def write_tiny_sdxl_model(root: str, vae_blocks: int = 2) -> str:
    """Write a tiny SDXL-layout model to ``root``, for model.preset=tiny-sdxl: two character-level CLIP tokenizers (77
    tokens; the second pads with "!", as SDXL's does), a 2-layer CLIPTextModel 32 wide (text_encoder/) and a 2-layer
    CLIPTextModelWithProjection 48 wide with a 32-wide projection (text_encoder_2/): hidden states 32 + 48 = 80 wide,
    pooled 32, as the preset takes them; and a tiny AutoencoderKL (see write_tiny_sd_model). Returns ``root``.

    Args:
        root: the model directory (created).
        vae_blocks: the VAE's encoder blocks.
    """
    import torch
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    write_tiny_sd_model(root, caption_dim=32, vae_blocks=vae_blocks)
    vocab = write_tokenizer(os.path.join(root, "tokenizer_2"))
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(root, "tokenizer_2"), pad_token="!")
    tokenizer.save_pretrained(os.path.join(root, "tokenizer_2"))
    config = _tiny_text_config(vocab, 48)
    config.projection_dim = 32
    config.pad_token_id = vocab["!"]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        CLIPTextModelWithProjection(config).save_pretrained(os.path.join(root, "text_encoder_2"))
    assert CLIPTextModel.from_pretrained(os.path.join(root, "text_encoder")).config.hidden_size == 32
    return root


def write_tiny_dinov2(path: str, image_size: int = 28) -> str:
    """A 2-layer, 32-wide transformers Dinov2Model with random weights (seeded) saved to ``path``: the feature model
    of eval.dinov2 at toy size. Returns ``path``."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        patch_size=14,
        image_size=image_size,
    )
    Dinov2Model(config).save_pretrained(path)
    return path


def write_tiny_inception(path: str) -> str:
    """A TorchScript file at ``path`` with the interface of FID's Inception detector (inception-2015-12-05.pt:
    ``model(uint8 images (N, 3, H, W), return_features=True)`` -> (N, D) features, resizing inside), two random
    convolutions (seeded) and 16 features: the extractor of eval.inception at toy size. Returns ``path``."""
    import torch

    torch.manual_seed(0)
    torch.jit.script(_tiny_inception()()).save(path)
    return path


def _tiny_inception() -> Any:
    import torch
    import torch.nn.functional as F

    class TinyInception(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3, stride=2)
            self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2)
            self.logits = torch.nn.Linear(16, 10)

        def forward(self, img: torch.Tensor, return_features: bool = False) -> torch.Tensor:
            x = F.interpolate(img.float() / 127.5 - 1, size=(48, 48), mode="bilinear", align_corners=False)
            features = F.relu(self.conv2(F.relu(self.conv1(x)))).mean(dim=(2, 3))
            return features if return_features else self.logits(features).softmax(dim=-1)

    return TinyInception


def write_tiny_clip(path: str) -> str:
    """A 2-layer CLIPModel (text and vision towers 32 wide, 32 px images) with random weights (seeded) and the
    character-level tokenizer, saved together to ``path``: the model of eval.clip at toy size. Returns ``path``."""
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

    vocab = write_tokenizer(path)
    torch.manual_seed(5)  # with 0, every image-caption pair of the tests scores 0 (a cosine clamped)
    text = _tiny_text_config(vocab, 32)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    CLIPModel(
        CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    ).save_pretrained(path)
    return path


def _tiny_text_config(vocab: dict[str, int], width: int) -> Any:
    """A 2-layer CLIPTextConfig of ``width`` for the character-level tokenizer's ``vocab``."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
