"""The FLOP count behind bench/gpu_throughput.py's MFU (torch's FlopCounterMode on the meta device), on CPU."""

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import Attention
from torch import nn

from sdtrain.config.schema import ModelConfig
from sdtrain.model.flops import TRAIN_STEP_FACTOR, forward_flops, mfu, unet_forward_flops, unet_train_step_flops
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import build_unet, unet_config

TINY = PRESETS["tiny"]
# The tiny preset without attention: every FLOP left but the time embedding's is per position.
NO_ATTENTION = {
    **TINY,
    "down_block_types": ("DownBlock2D",) * 2,
    "up_block_types": ("UpBlock2D",) * 2,
    "mid_block_type": "UNetMidBlock2D",
}


def test_single_layers_match_a_hand_count():
    with torch.device("meta"):
        conv = nn.Conv2d(6, 8, kernel_size=3, padding=1, groups=2)
        linear = nn.Linear(16, 5)
        images, tokens = torch.empty(2, 6, 10, 10), torch.empty(4, 7, 16)
    # multiply-add = 2: outputs x inputs each output sums over
    assert forward_flops(conv, images) == 2 * (2 * 8 * 10 * 10) * (6 // 2 * 3 * 3)
    assert forward_flops(linear, tokens) == 2 * (4 * 7 * 5) * 16


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_attention_is_counted_whichever_kernel_runs_it(device):
    """Meta runs scaled_dot_product_attention as bmm's, CPU as a fused kernel torch has no formula for:
    both count the projections and the two attention matmuls."""
    B, N, M, C, D, heads, dim_head = 2, 64, 5, 8, 16, 2, 4
    inner = heads * dim_head
    with torch.device(device):
        attention = Attention(query_dim=C, cross_attention_dim=D, heads=heads, dim_head=dim_head)
        hidden, context = torch.randn(B, N, C), torch.randn(B, M, D)
    projections = 2 * B * (N * C * inner + 2 * M * D * inner + N * inner * C)  # q; k and v; out
    matmuls = 2 * 2 * B * N * M * inner  # Q K^T and softmax(.) V
    assert forward_flops(attention, hidden, encoder_hidden_states=context) == projections + matmuls


def test_tiny_unet_count_on_meta():
    model = ModelConfig(preset="tiny")
    with torch.device("meta"):
        unet = build_unet(model)
        latents, captions = torch.empty(2, 4, 16, 16), torch.empty(2, 77, 32)
        timesteps = torch.zeros(2, dtype=torch.long)
    built = forward_flops(unet, latents, timesteps, encoder_hidden_states=captions)
    assert built == unet_forward_flops(unet_config(model), (4, 16, 16), (77, 32), batch_size=2)
    one = unet_forward_flops(TINY, (4, 16, 16), (77, 32))
    assert one > 0 and built == 2 * one  # linear in the batch
    assert unet_train_step_flops(TINY, (4, 16, 16), (77, 32)) == TRAIN_STEP_FACTOR * one == 3 * one

    # Doubling the latent side: 4x the positions, so 4x the FLOPs, less the time embedding's fixed few;
    # with self-attention, which is quadratic in the positions, more.
    plain_16, plain_32 = (unet_forward_flops(NO_ATTENTION, (4, side, side), (77, 32)) for side in (16, 32))
    assert 3.99 < plain_32 / plain_16 < 4.0
    assert unet_forward_flops(TINY, (4, 32, 32), (77, 32)) / one > 4.5


def test_real_forward_counts_the_same_as_meta():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY)
    real = forward_flops(
        unet, torch.randn(2, 4, 16, 16), torch.tensor([1, 999]), encoder_hidden_states=torch.randn(2, 77, 32)
    )
    assert real == unet_forward_flops(TINY, (4, 16, 16), (77, 32), batch_size=2)


def test_preset_magnitudes_and_mfu():
    """The figures the GPU benchmark uses: SD 2's UNet is ~0.8 TFLOP a 512 px image forward, a little
    over 4x its 256 px cost (attention grows faster); MFU is achieved over peak."""
    sd2 = PRESETS["sd2-base"]
    at_512 = unet_forward_flops(sd2, (4, 64, 64), (77, 1024))
    at_256 = unet_forward_flops(sd2, (4, 32, 32), (77, 1024))
    assert 0.7e12 < at_512 < 0.9e12
    assert 4.0 < at_512 / at_256 < 4.6
    assert mfu(100.0, 3 * at_256, 312e12) == pytest.approx(100 * 3 * at_256 / 312e12)
