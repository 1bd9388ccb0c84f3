"""sdtrain: Stable Diffusion UNet pretraining from parquet latents on Ray Train + Lightning."""

__version__ = "0.1.0"
