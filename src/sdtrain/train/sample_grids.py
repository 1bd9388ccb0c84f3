"""Sample grids while a run trains: rank 0 samples the same captions from the same noise every
sample_grid.every_n_steps with the weights that export and generation use (the EMA's when there is one),
so the grids of successive steps show what the model learned in between. Under FSDP each rank holds a shard of the
weights and every forward pass is a collective: every rank samples the grid in step, and rank 0 writes it."""

from __future__ import annotations

import contextlib
import io
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.artifacts.run_outputs import write_whole
from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.unet import default_guidance_rescale, noise_scheduler_config
from sdtrain.sampling.captions import Captions, Encode, read_captions
from sdtrain.sampling.images import grid_image, latent_preview
from sdtrain.sampling.sampler import check_sampler_steps, sample_latents
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import SAMPLES_DIR, sample_grid_file
from sdtrain.storage.s3 import is_transient, storage_unavailable
from sdtrain.train.strategy import uncompiled


@dataclass
class Grid:
    """One grid: the picture (H x W x 3 uint8)."""

    image: np.ndarray
    path: str
    seconds: float


def grid_captions(
    config: Config,
    caption_dim: int,
    encode: Encode | None = None,
    prompts: Captions | None = None,
    pooled: bool = False,
) -> Captions | None:
    """The captions of the grid's rows: sample_grid.prompts, else sample_grid.captions, else data.val's (one row per
    label when it has labels); None when none is set.

    Args:
        caption_dim: the UNet's cross-attention width.
        encode: for data of token ids, the run's text encoders (ids -> hidden states and pooled embeddings).
        prompts: sample_grid.prompts as the driver encoded them (sdtrain.sampling.prompts.GridPrompts), a row each.
        pooled: the UNet takes a pooled text embedding (SDXL-shaped): read with data.pooled_caption_column.
    """
    if config.sample_grid.prompts is not None:
        if prompts is None:  # the driver encodes them before the workers start: a caller that did not is wrong
            raise ConfigError("sample_grid.prompts: set, but not encoded by the driver (sdtrain.driver.run.check_run)")
        return prompts
    source = config.sample_grid.captions or (config.data.val[0] if config.data.val else None)
    if source is None:
        return None
    try:
        return read_captions(
            source,
            caption_dim,
            column=config.data.caption_column,
            rows=config.sample_grid.rows,
            encode=encode,
            pooled_column=config.data.pooled_caption_column if pooled else None,
        )
    except (OSError, ValueError, EOFError, DataError) as error:  # a missing or damaged file, the wrong width or column
        transient = _transient_cause(error)
        if transient is None:
            raise ConfigError(
                f"sample_grid.captions: cannot read the sample grid's captions from {source}: {error}"
            ) from None
    # Rank 0 reads these at every start, restarts included (data.val on S3 by default): a storage failure that outlasted
    # the client's retries fails the attempt, and Ray Train restarts it. Raised outside the handler: the controller's
    # failure callback finds a DataError in an exception's __context__ too, and would stop the run on it.
    key = "sample_grid.captions" if config.sample_grid.captions else "data.val"
    raise storage_unavailable(transient, f"{key}: {source}") from transient


def _transient_cause(error: BaseException) -> BaseException | None:
    """``error``, or what it was raised from, when that is a storage failure that outlasted the client's retries
    (:func:`sdtrain.storage.s3.is_transient`): a .npy file's read fails with the storage's own OSError, the parquet
    reads with a StorageUnavailable named for --captions (named for the key here), and a DataError raised ``from None``
    keeps a storage failure only as its __context__."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if is_transient(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def check_grid_captions(config: Config, caption_dim: int, pooled: bool) -> None:
    """On the driver before Ray starts: sample_grid.captions, when it names the grid's rows, read as rank 0 reads it
    (its width against the UNet's, an SDXL-shaped UNet's pooled embeddings), so a wrong file stops the run before a
    worker starts instead of after. Token ids are read, not encoded: that takes the text encoder the workers load.
    Also sample_grid.steps against the training schedule, which the grids and evaluations sample on."""
    schedule = noise_scheduler_config(config.model, config.train.zero_terminal_snr)
    check_sampler_steps(config.sample_grid.steps, config.sample_grid.sampler, schedule, "sample_grid.steps")
    if config.sample_grid.captions is None or config.sample_grid.prompts is not None:
        return

    def read_only(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.zeros(len(ids), 1, caption_dim), torch.zeros(len(ids), 1) if pooled else None

    grid_captions(config, caption_dim, encode=read_only, pooled=pooled)


class SampleGrids:
    """A rank's grids: due at every sample_grid.every_n_steps (null: with each checkpoint) and at the last step."""

    def __init__(
        self,
        config: Config,
        meta: CheckpointMeta,
        captions: Captions,
        run_dir: str,
        unconditional: torch.Tensor,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        writes: bool = True,
    ):
        """Args:
        config: the run's config.
        meta: the run's checkpoint metadata (latent shape, scheduler, the latent classifier).
        captions: the grid's rows (:func:`grid_captions`).
        run_dir: run.storage_path/run.name (grids go to its samples/).
        unconditional: the empty-prompt embedding for classifier-free guidance.
        autocast: the training step's autocast, entered for each grid (sdtrain.train.device_settings.training_autocast).
        writes: save the grid (rank 0); False on the other ranks of a sharded model, which only take part.
        """
        self.writes = writes
        self.autocast = autocast
        self.config = config
        self.meta = meta
        self.captions = captions
        self.unconditional = unconditional
        self.every = config.sample_grid.every_n_steps or config.checkpoint.every_n_steps
        self.filesystem, self.dir = filesystem_for(posixpath.join(run_dir, SAMPLES_DIR))

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.every == 0 or step >= max_steps

    def sample(self, unet: torch.nn.Module, step: int) -> Grid | None:
        """The grid of ``step`` from ``unet``, saved as samples/step_<step>.png; None on a rank that does not write."""
        started = time.perf_counter()
        grid = self.config.sample_grid
        columns = grid.columns
        captions = self.captions.conditioning(columns)
        was_training = unet.training
        unet.eval()
        try:
            # Eager: the grid's guided batch would be one more graph of a compiled UNet, counted against its limit.
            with self.autocast(), uncompiled():
                latents = sample_latents(
                    unet,
                    self.meta.noise_scheduler_config,
                    captions,
                    self.unconditional,
                    tuple(self.meta.latent_shape),
                    sampler=grid.sampler,
                    steps=grid.steps,
                    guidance_scale=grid.guidance_scale,
                    guidance_rescale=default_guidance_rescale(self.meta.noise_scheduler_config),
                    seed=self.config.train.seed,
                    vae_downsampling=self.meta.vae_downsampling,
                ).numpy()
        finally:
            unet.train(was_training)
        if not self.writes:
            return None
        rows = len(self.captions.names)
        tiles = latent_preview(latents, self.meta.latent_classifier)
        picture = grid_image(tiles.reshape(rows, columns, *tiles.shape[1:]), self.captions.names, zoom=2)
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        path = posixpath.join(self.dir, sample_grid_file(step))
        write_whole(self.filesystem, path, buffer.getvalue())
        return Grid(np.asarray(picture.convert("RGB")), path, time.perf_counter() - started)
