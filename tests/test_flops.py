"""The FLOP counter behind bench/gpu_throughput.py's MFU, checked on CPU: against a count done by
hand for a tiny UNet, and against PyTorch's own FlopCounterMode."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from sdtrain.model.flops import TRAIN_STEP_FACTOR, count_forward_flops, mfu, unet_forward_flops
from sdtrain.model.presets import PRESETS

# One resolution level, no down/up-sampling, a cross-attention mid block: small enough to count by hand.
HAND_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(8,),
    down_block_types=("DownBlock2D",),
    up_block_types=("UpBlock2D",),
    cross_attention_dim=16,
    attention_head_dim=4,
    norm_num_groups=4,
)


def conv(c_in, c_out, k, hw=8 * 8):
    return 2 * hw * c_out * c_in * k * k


def linear(d_in, d_out, tokens=1):
    return 2 * tokens * d_in * d_out


def test_hand_count_of_a_tiny_unet():
    """Latents 4x8x8 (64 positions), captions 5x16, channels C = 8, time embedding T = 32."""
    C, T, N, M = 8, 32, 64, 5
    resnet = conv(C, C, 3) + linear(T, C) + conv(C, C, 3)  # conv1, time projection, conv2
    # Up-block resnets take the skip connection concatenated: 2C in, C out, plus a 1x1 shortcut.
    up_resnet = conv(2 * C, C, 3) + linear(T, C) + conv(C, C, 3) + conv(2 * C, C, 1)
    self_attention = 4 * linear(C, C, N) + 2 * 2 * N * N * C  # q, k, v, out; Q K^T and A V
    cross_attention = 2 * linear(C, C, N) + 2 * linear(16, C, M) + 2 * 2 * N * M * C  # q, out; k, v from captions
    feed_forward = linear(C, 2 * 4 * C, N) + linear(4 * C, C, N)  # GEGLU (value and gate), then down
    transformer = conv(C, C, 1) + self_attention + cross_attention + feed_forward + conv(C, C, 1)  # proj_in/out 1x1
    expected = (
        conv(4, C, 3)  # conv_in
        + linear(C, T)
        + linear(T, T)  # timestep embedding MLP
        + resnet  # down block (the only level: no downsampler)
        + resnet
        + transformer
        + resnet  # mid block
        + 2 * up_resnet  # up block: layers_per_block + 1 resnets
        + conv(C, 4, 3)  # conv_out
    )
    flops = unet_forward_flops(HAND_CONFIG, latent_shape=(4, 8, 8), caption_shape=(M, 16))
    assert flops.total == expected == 1_304_064
    assert flops.attention == 2 * 2 * N * N * C + 2 * 2 * N * M * C
    assert flops.train_step == TRAIN_STEP_FACTOR * expected == 3 * expected


@pytest.mark.parametrize("config", [HAND_CONFIG, PRESETS["tiny"]], ids=["hand", "tiny"])
def test_matches_torch_flop_counter(config):
    """FlopCounterMode counts the same operations (mm, addmm, bmm, convolution). On the meta device
    attention runs as explicit bmm's, which it counts too (CPU's fused attention kernel it does not)."""
    size = config["sample_size"]
    latent_shape, caption_shape = (4, size, size), (77, config["cross_attention_dim"])
    ours = unet_forward_flops(config, latent_shape, caption_shape, batch_size=2)

    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
        latents, captions = torch.empty(2, *latent_shape), torch.empty(2, *caption_shape)
        timesteps = torch.zeros(2, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        unet(latents, timesteps, encoder_hidden_states=captions)
    assert ours.total == counter.get_total_flops()
    assert ours.total == 2 * unet_forward_flops(config, latent_shape, caption_shape).total  # linear in batch


def test_real_forward_counts_the_same_as_meta():
    """The hooks count a real CPU forward pass exactly as they count the meta-device one."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**HAND_CONFIG)
    real = count_forward_flops(
        unet, torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 999]), encoder_hidden_states=torch.randn(3, 5, 16)
    )
    assert real == unet_forward_flops(HAND_CONFIG, (4, 8, 8), (5, 16), batch_size=3)


def test_preset_magnitudes_and_mfu():
    """Sanity of the figures the GPU benchmark uses: SD 2's UNet is ~0.8 TFLOP a 512 px image forward,
    about 4x its 256 px cost (attention grows faster than 4x); MFU is achieved over peak."""
    sd2 = PRESETS["sd2-base"]
    at_512 = unet_forward_flops(sd2, (4, 64, 64), (77, 1024)).total
    at_256 = unet_forward_flops(sd2, (4, 32, 32), (77, 1024)).total
    assert 0.7e12 < at_512 < 0.9e12
    assert 3.5 < at_512 / at_256 < 4.5
    assert mfu(100.0, 3 * at_256, 312e12) == pytest.approx(100 * 3 * at_256 / 312e12)
