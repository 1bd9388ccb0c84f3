"""A shard's size, estimated before any work: each output shard is one object, and on S3 one object written in one
request (sdtrain.storage.filesystems.write_bytes: a PutObject; then move_file's CopyObject), which S3 refuses over
5 GiB. A shard too large for it would fail only once its rows were encoded, and again on every re-run, so the job
refuses input.rows_per_shard beyond it at its start.

A row's bytes are fixed by the model and the settings: the latents (C x H/f x W/f float16 of the row's bucket) and,
by output.captions, the caption embeddings (L x D float16, SDXL's two encoders' side by side, and its pooled
embedding, P float16) and/or the token ids (L int32 per tokenizer). They are stored as float16 whatever
encode.dtype (the encoders' weights and activations) and encode.latent (a mean and a sample have one shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from sdtrain.errors import ConfigError
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.model_outputs import model_shape, text_encoder_configs, vae_geometry

GIB = 2**30
S3_SINGLE_PUT_BYTES = 5 * GIB
"""The largest object S3 takes in one PutObject (and copies in one CopyObject)."""
SHARD_TARGET_BYTES = 4 * GIB
"""What a suggested input.rows_per_shard aims under: the estimate leaves out parquet's pages and footer and each
row's caption and key (strings of any length), which the gigabyte to the limit covers."""
ROW_FIXED_BYTES = 16 + 4 * 4
"""Per row beside its tensors: the bucket and placement (4 int32) and the offsets of up to 4 list columns."""


@dataclass(frozen=True)
class RowShape:
    """The tensors of one stored row: the largest bucket's latents (C, h, w), and the captions' L, D and P (D and P
    0 where no embeddings are stored) and how many tokenizers' ids (0 where none)."""

    latents: tuple[int, int, int]
    length: int
    width: int
    pooled: int
    tokenizers: int

    def bytes(self) -> int:
        channels, height, width = self.latents
        values16 = channels * height * width + self.length * self.width + self.pooled
        return 2 * values16 + 4 * self.length * self.tokenizers + ROW_FIXED_BYTES

    def describe(self) -> str:
        parts = ["latents {}x{}x{} float16".format(*self.latents)]
        if self.width:
            parts.append(f"caption embeddings {self.length}x{self.width} float16")
        if self.pooled:
            parts.append(f"pooled {self.pooled} float16")
        if self.tokenizers:
            parts.append(f"token ids {self.tokenizers}x{self.length} int32")
        return ", ".join(parts)


def check_shard_size(config: PreprocessConfig) -> None:
    """Refuse an input.rows_per_shard whose largest shard would be over S3's single-PUT limit, where output.path is
    on s3:// (a local file has no such limit). A WebDataset input is not checked: each tar is a shard of however
    many samples it holds, which only reading it tells."""
    if not config.output.path.startswith("s3://") or config.input.format == "webdataset":
        return
    shape = row_shape(config)
    rows = config.input.rows_per_shard
    # Uncompressed: zstd gains little on float16 latents and embeddings, so the file is about this size.
    estimate = rows * shape.bytes()
    if estimate <= S3_SINGLE_PUT_BYTES:
        return
    fits = max(1, SHARD_TARGET_BYTES // shape.bytes())
    raise ConfigError(
        f"input.rows_per_shard: {rows} rows of {shape.bytes():,} bytes each ({shape.describe()}: encode.model="
        f"{config.encode.model}, image.resolution={config.image.resolution}, output.captions="
        f"{config.output.captions}) make shards of about {estimate / GIB:.1f} GiB, but each shard is one object of "
        f"output.path={config.output.path} written in one request, which S3 refuses over "
        f"{S3_SINGLE_PUT_BYTES / GIB:.0f} GiB: set input.rows_per_shard to at most {fits} "
        f"(shards under {SHARD_TARGET_BYTES / GIB:.0f} GiB)"
    )


def row_shape(config: PreprocessConfig) -> RowShape:
    """A stored row's tensors for this model and these settings, from the configs of the model's VAE and text
    encoders (no weights loaded). With aspect buckets a row's latents are its bucket's, and a shard's rows may all
    fall in one bucket: the largest bucket's are taken. (aspect_buckets makes none over image.resolution² pixels, so
    today that is the square's; taking the largest keeps the bound if buckets change.)"""
    sdxl = model_shape(config.encode.model)  # DataError naming encode.model where it cannot be read
    _, channels, downsampling = vae_geometry(config.encode.model)
    height, width = max(config.image.shapes(), key=lambda hw: (hw[0] // downsampling) * (hw[1] // downsampling))
    latents = (channels, height // downsampling, width // downsampling)
    encoders = text_encoder_configs(config.encode.model, sdxl)
    # The tokenizers pad to the encoder's positions (77 for every SD model's CLIP): what Encoder stores a row of.
    length = int(encoders[0].get("max_position_embeddings", 77))
    embeddings = config.output.captions != "token_ids"
    return RowShape(
        latents=latents,
        length=length,
        width=sum(int(e["hidden_size"]) for e in encoders) if embeddings else 0,
        pooled=int(encoders[-1].get("projection_dim", 0)) if embeddings and sdxl else 0,
        tokenizers=len(encoders) if config.output.captions != "embeddings" else 0,
    )
