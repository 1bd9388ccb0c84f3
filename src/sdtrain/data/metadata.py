"""The parquet schema metadata keys sdtrain writes beside stored latents and reads back: their one owner.

Preprocessing writes them into every shard it outputs; training reads them from the dataset index's checked schema
(sdtrain.data.dataset_index), so a restart opens no file to learn them.
"""

from __future__ import annotations

from collections.abc import Mapping

LATENT_SCALING_FACTOR = "sdtrain.latent_scaling_factor"
"""The factor the stored latents are already multiplied by (the VAE's scaling_factor); absent = raw VAE latents or
latents scaled by a writer that did not say."""
RESOLUTION = "sdtrain.resolution"
"""The image resolution the latents were encoded at."""
VAE_SOURCE = "sdtrain.vae_source"
"""Where the VAE that encoded the latents came from (a local path, s3:// URI or hub id)."""
TEXT_ENCODER_SOURCE = "sdtrain.text_encoder_source"
"""Where the text encoder that encoded the captions came from."""


def latent_scaling(metadata: Mapping[bytes, bytes] | None) -> float | None:
    """The factor a file's schema metadata says its latents carry, or None."""
    value = (metadata or {}).get(LATENT_SCALING_FACTOR.encode())
    return None if value is None else float(value)


def describe_scaling(factor: float | None) -> str:
    return "no factor" if factor is None else f"latents multiplied by {factor:g}"
