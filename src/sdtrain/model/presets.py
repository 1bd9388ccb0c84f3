"""UNet2DConditionModel architectures selected by ``model.preset``."""

from typing import Any

_CROSS_ATTN_DOWN = "CrossAttnDownBlock2D"
_CROSS_ATTN_UP = "CrossAttnUpBlock2D"

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train on 2 CPU cores in minutes (demo, tests): 16x16 latents, 32-wide captions.
    "tiny": dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=(_CROSS_ATTN_DOWN, "DownBlock2D"),
        up_block_types=("UpBlock2D", _CROSS_ATTN_UP),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    ),
    # The Anyscale notebook's UNet: SD 2 layout at half width, 1024-wide (OpenCLIP-H) captions.
    "small": dict(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(160, 320, 640, 640),
        down_block_types=(_CROSS_ATTN_DOWN, _CROSS_ATTN_DOWN, _CROSS_ATTN_DOWN, "DownBlock2D"),
        up_block_types=("UpBlock2D", _CROSS_ATTN_UP, _CROSS_ATTN_UP, _CROSS_ATTN_UP),
        cross_attention_dim=1024,
        attention_head_dim=8,
        norm_num_groups=32,
        act_fn="silu",
        center_input_sample=False,
        downsample_padding=1,
        flip_sin_to_cos=True,
        freq_shift=0,
        mid_block_scale_factor=1,
        norm_eps=1e-5,
    ),
    # stabilityai/stable-diffusion-2-base unet/config.json (865.9M parameters).
    "sd2-base": dict(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=(_CROSS_ATTN_DOWN, _CROSS_ATTN_DOWN, _CROSS_ATTN_DOWN, "DownBlock2D"),
        up_block_types=("UpBlock2D", _CROSS_ATTN_UP, _CROSS_ATTN_UP, _CROSS_ATTN_UP),
        cross_attention_dim=1024,
        attention_head_dim=(5, 10, 20, 20),
        use_linear_projection=True,
        upcast_attention=False,
        dual_cross_attention=False,
        norm_num_groups=32,
        act_fn="silu",
        center_input_sample=False,
        downsample_padding=1,
        flip_sin_to_cos=True,
        freq_shift=0,
        mid_block_scale_factor=1,
        norm_eps=1e-5,
    ),
    # SDXL's layout at test size, with its conditioning (two text encoders' hidden states, 32 + 48 wide; the
    # second's pooled 32-wide projection and six time ids in the added embedding). The test fixtures'
    # write_tiny_sdxl_model builds the encoders it is trained with.
    "tiny-sdxl": dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", _CROSS_ATTN_DOWN),
        up_block_types=(_CROSS_ATTN_UP, "UpBlock2D"),
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=80,
        attention_head_dim=(4, 8),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
        norm_num_groups=8,
    ),
    # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (2.57B parameters): CLIP ViT-L's and OpenCLIP
    # ViT-bigG's penultimate hidden states concatenated (768 + 1280), bigG's pooled 1280-wide projection and six time
    # ids of 256 each in the added embedding (1280 + 6 x 256 = 2816).
    "sdxl-base": dict(
        sample_size=128,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", _CROSS_ATTN_DOWN, _CROSS_ATTN_DOWN),
        up_block_types=(_CROSS_ATTN_UP, _CROSS_ATTN_UP, "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048,
        attention_head_dim=(5, 10, 20),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_embed_type_num_heads=64,
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
        upcast_attention=False,
        dual_cross_attention=False,
        norm_num_groups=32,
        act_fn="silu",
        center_input_sample=False,
        downsample_padding=1,
        flip_sin_to_cos=True,
        freq_shift=0,
        mid_block_scale_factor=1,
        norm_eps=1e-5,
    ),
}
