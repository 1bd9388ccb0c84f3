"""The preprocessing job's configuration: typed sections with one docstring per field, loaded as training's is
(``sdtrain.config.loader.load_config(path, overrides, PreprocessConfig)``: one grammar), checked before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from sdtrain.config.coercion import ConfigTree, Section
from sdtrain.config.schema import StorageConfig
from sdtrain.config.secrets import refuse_userinfo
from sdtrain.errors import ConfigError
from sdtrain.preprocess.buckets import aspect_buckets


@dataclass
class InputConfig(Section):
    section: ClassVar[str] = "input"

    paths: list[str] = field(default_factory=list)
    """Where the images are, local or s3://: parquet files or directories (format parquet), .tar shards or directories
    of them (webdataset), or one directory of images (folder)."""
    format: Literal["parquet", "webdataset", "folder"] = "parquet"
    """parquet: img2dataset/LAION-style rows of image bytes and a caption; webdataset: tar shards of
    <key>.jpg/.png/... with <key>.txt or <key>.json (img2dataset's layout); folder: image files with a captions file
    (input.captions_file)."""
    image_column: str = "jpg"
    """parquet: the column of encoded image bytes (img2dataset writes jpg)."""
    caption_column: str = "caption"
    """parquet: the caption column; folder: the caption field of the captions file; webdataset: the caption key of
    <key>.json when there is no <key>.txt."""
    captions_file: str | None = None
    """folder: a .jsonl or .csv file mapping each image to its caption; null = <folder>/captions.jsonl."""
    file_column: str = "file_name"
    """folder: the field of the captions file that names the image, relative to the folder (a name that leaves it:
    absolute, '..' above it or a URI, is skipped and counted as file_outside_folder)."""
    rows_per_shard: int = 1000
    """parquet and folder inputs are cut into shards of this many rows; each shard becomes one output file (a
    WebDataset tar is one shard). Sets the output files' size."""

    def __post_init__(self):
        named = [(f"paths[{i}]", p) for i, p in enumerate(self.paths)] + [("captions_file", self.captions_file)]
        _refuse_credentials(self, named)
        if self.rows_per_shard < 1:
            self._fail("rows_per_shard", f"must be >= 1, got {self.rows_per_shard}")
        if self.format == "folder" and len(self.paths) > 1:
            self._fail("paths", f"format folder reads one directory, got {len(self.paths)} paths")
        if self.captions_file is not None and not self.captions_file.endswith((".jsonl", ".csv")):
            self._fail("captions_file", f"must be a .jsonl or .csv file, got {self.captions_file!r}")


def _refuse_credentials(section: Section, named: list[tuple[str, str | None]]) -> None:
    """Training's refusal (sdtrain.config.secrets), for this section's URIs: a secret in one would be copied into the
    manifest, the shards' metadata and logs."""
    for key, uri in named:
        refuse_userinfo(f"{section.section}.{key}", uri)


@dataclass
class ImageConfig(Section):
    section: ClassVar[str] = "image"

    resolution: int = 256
    """Output image side in pixels (a multiple of 8), or with aspect buckets the side of the square of the buckets'
    area."""
    buckets: Literal["square", "aspect"] = "square"
    """square: every image is resized (short side to image.resolution) and center-cropped to one square. aspect:
    aspect-ratio buckets of about image.resolution² pixels each (sides multiples of image.bucket_step, ratios up to
    image.max_aspect): each image goes to the one nearest its aspect ratio, resized to cover it and center-cropped
    to it; its row records its bucket, its original size and the crop's top-left corner (docs/preprocessing.md)."""
    bucket_step: int = 64
    """aspect: every bucket side is a multiple of this many pixels (a multiple of 8: the VAE's and the UNet's
    downsampling must divide the latents' sides; smaller for tiny test models)."""
    max_aspect: float = 2.0
    """aspect: the widest and the tallest bucket's ratio; an image beyond it is cropped to that bucket."""
    small_images: Literal["skip", "upscale"] = "skip"
    """An image smaller than its bucket (the square: its short side below image.resolution): skip it (counted in the
    manifest) or upscale it."""

    def __post_init__(self):
        if self.resolution < 8 or self.resolution % 8:
            self._fail("resolution", f"must be a positive multiple of 8, got {self.resolution}")
        if self.bucket_step < 8 or self.bucket_step % 8:
            self._fail("bucket_step", f"must be a positive multiple of 8, got {self.bucket_step}")
        if self.buckets == "aspect" and self.resolution % self.bucket_step:
            self._fail(
                "resolution", f"must be a multiple of image.bucket_step={self.bucket_step}, got {self.resolution}"
            )
        if not 1.0 <= self.max_aspect <= 8.0:
            self._fail("max_aspect", f"must be in [1, 8], got {self.max_aspect}")

    def shapes(self) -> list[tuple[int, int]]:
        """The (height, width) buckets images go to, in pixels."""
        if self.buckets == "square":
            return [(self.resolution, self.resolution)]
        return aspect_buckets(self.resolution, self.bucket_step, self.max_aspect)


@dataclass
class EncodeConfig(Section):
    section: ClassVar[str] = "encode"

    model: str = "stabilityai/stable-diffusion-2-base"
    """Diffusers Stable Diffusion model (local directory or hub id) whose vae/, tokenizer/ and text_encoder/
    subfolders encode the images and captions; recorded in the output's metadata."""
    latent: Literal["mean", "sample"] = "mean"
    """Which latent of the VAE's distribution to store: its mean, or a sample (seeded by encode.seed and the row)."""
    seed: int = 0
    """Seed of the latent samples (encode.latent: sample)."""
    batch_size: int = 32
    """Images per encoder batch."""
    concurrency: int = 1
    """Encoder actors (each loads the VAE and text encoder once)."""
    num_gpus: Literal["auto"] | float = "auto"
    """GPUs per encoder actor; auto = 1 when the cluster has GPUs as the job starts, else 0 (CPU actors, warned of):
    GPU nodes an autoscaling cluster has yet to start are not seen, so set 1 there."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Encoder weights and activations: auto = float16 on GPU, float32 on CPU. An SDXL VAE whose config says
    force_upcast (SDXL's own) encodes in float32 where float16 is asked: in float16 it overflows on some images."""

    def __post_init__(self):
        _refuse_credentials(self, [("model", self.model)])
        for key in ("batch_size", "concurrency"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.seed < 2**63:  # numpy's generators take no negative seed
            self._fail("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.num_gpus != "auto" and self.num_gpus < 0:
            self._fail("num_gpus", f"must be >= 0 or auto, got {self.num_gpus}")
        if not self.model:
            self._fail("model", "must be a model directory or hub id")


@dataclass
class OutputConfig(Section):
    section: ClassVar[str] = "output"

    path: str = ""
    """Directory (local or s3://) the parquet files, the empty prompt's embedding and the manifest are written to;
    give it to training as data.train."""
    latent_column: str = "image_latents_256"
    """Column of the latents (C*H*W float16 values a row): training's data.latent_column."""
    captions: Literal["embeddings", "token_ids", "both"] = "embeddings"
    """What is stored of each caption: the text encoder's embeddings (77*D float16 a row, in output.caption_column;
    for SDXL both encoders' side by side, and the pooled embedding in output.pooled_column), the tokenizer's ids (77
    int32 a row in output.token_id_column; for SDXL each tokenizer's in a column of its own: ~500x smaller for SD 2;
    training encodes them in its step with the text encoders the files name), or both. docs/data.md says when to
    choose which."""
    caption_column: str = "caption_latents"
    """Column of the caption embeddings (77*D float16 values a row): training's data.caption_column."""
    pooled_column: str = "caption_pooled"
    """Column of the second text encoder's pooled embedding (P float16 values a row), written for an SDXL model
    (one with text_encoder_2/) where output.captions stores embeddings: training's data.pooled_caption_column."""
    token_id_column: str = "caption_ids"
    """Column of the caption token ids (77 int32 values a row; output.captions token_ids or both): give it to
    training as data.caption_column. An SDXL model's second tokenizer's ids go to the same name with ``_2``
    (caption_ids_2), and the files name both columns in order (sdtrain.token_id_columns)."""
    row_group_rows: int = 64
    """Rows per parquet row group: training's data.shuffle_chunk_rows (the reader reads whole row groups)."""

    def __post_init__(self):
        _refuse_credentials(self, [("path", self.path)])
        if not self.path:
            self._fail("path", "is required: the directory to write the latents to")
        if self.row_group_rows < 1:
            self._fail("row_group_rows", f"must be >= 1, got {self.row_group_rows}")
        if self.latent_column == self.caption_column:
            self._fail("caption_column", f"must differ from output.latent_column ({self.latent_column!r})")
        taken = (self.latent_column, self.caption_column, self.pooled_column)
        if any(column in taken for column in self.token_id_columns(2)):
            self._fail(
                "token_id_column",
                f"must differ, and so must {self.token_id_columns(2)[1]!r} (an SDXL model's second tokenizer's), "
                "from output.latent_column, output.caption_column and output.pooled_column",
            )

    def token_id_columns(self, tokenizers: int) -> list[str]:
        """The columns of each tokenizer's ids: output.token_id_column, then ``_2`` for SDXL's second tokenizer."""
        return [self.token_id_column, *(f"{self.token_id_column}_{i + 1}" for i in range(1, tokenizers))]


@dataclass
class PreprocessConfig(ConfigTree):
    input: InputConfig = field(default_factory=InputConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    SECTIONS: ClassVar[dict[str, type[Section]]] = {
        "input": InputConfig,
        "image": ImageConfig,
        "encode": EncodeConfig,
        "output": OutputConfig,
        "storage": StorageConfig,  # training's section: the same endpoint and retries for every s3:// path
    }
    RENAMED: ClassVar[dict[str, str]] = {"output.image_column": "output.latent_column"}  # training's name for it

    def __post_init__(self):
        if not self.input.paths:
            raise ConfigError("input.paths: is required: the parquet files, tar shards or image folder to read")


SECTIONS = PreprocessConfig.SECTIONS
