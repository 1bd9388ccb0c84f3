"""sdtrain: Stable Diffusion UNet pretraining from parquet latents on Ray Train + Lightning."""

__version__ = "0.2.0"
