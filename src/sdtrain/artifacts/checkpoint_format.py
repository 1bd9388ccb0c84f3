"""The checkpoint format: a checkpoint directory's name, the files in it, and its metadata.

A checkpoint is a directory ``checkpoint_<step>/`` holding ``checkpoint.ckpt``: Lightning's
full training state (weights, optimizer, LR scheduler, loop progress) plus, under
:data:`CHECKPOINT_META_KEY`, a :class:`CheckpointMeta` as plain data; the state dict holds the
UNet (``unet.``), its EMA when train.ema_decay is set (``ema_unet.``) and the unconditional
caption embedding (``unconditional_caption``); ``history.json``, the metric rows reported up to
that step; ``data_state.json``, the data position to resume from; and ``model.json``, the metadata again,
readable without the weights (a resume's model is checked against it before Ray starts). Only plain data and tensors
are stored, so loading never unpickles code (``torch.load(weights_only=True)``;
:mod:`sdtrain.artifacts.loading` loads them).

This module imports nothing heavy: Ray Train's controller loads it (through
:mod:`sdtrain.controller.data_hook`, which reads the data position), where importing diffusers and
Lightning would delay every run's start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# The key of checkpoint.ckpt's top-level dict that holds CheckpointMeta.to_dict().
CHECKPOINT_META_KEY = "sdtrain"


@dataclass(frozen=True)
class CheckpointMeta:
    """What every checkpoint of a run stores besides the weights: enough to rebuild the model
    from the checkpoint alone, with no config file."""

    sdtrain_version: str
    """The sdtrain version that wrote the checkpoint."""
    unet_config: dict[str, Any]
    """``UNet2DConditionModel``'s constructor arguments."""
    noise_scheduler_config: dict[str, Any]
    """``DDPMScheduler``'s constructor arguments: the training noise schedule and prediction type."""
    latent_shape: tuple[int, ...]
    """C x H x W of the training latents."""
    caption_shape: tuple[int, ...]
    """L x D of the caption embeddings the UNet sees (for token-id data: the text encoder's output)."""
    latent_scale: float = 1.0
    """The factor training multiplies stored latents by as it reads them (1.0: stored already scaled)."""
    latent_scaling_factor: float | None = None
    """The VAE scaling factor the model's latents carry relative to raw VAE latents, when known
    (what decoding samples divides by)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config (``Config.to_dict()``)."""
    text_encoder: str | None = None
    """For data of caption token ids: the text encoder (local path, storage URI or hub id) every worker encodes them
    with in the step (sdtrain.model.token_captions); None: the data holds embeddings."""
    latent_classifier: str | None = None
    """The module the training data names as the reader of its latents without a VAE
    (sdtrain.sampling.latent_classifier); None: the data names none."""
    bucket_shapes: list[list[int]] | None = None
    """Aspect-ratio buckets: the latent shape (C, H, W) of each bucket the model trained on (``latent_shape`` is the
    one most rows had); None: every row had ``latent_shape``."""
    vae_downsampling: int = 8
    """Pixels per latent side of the data's VAE: what an SDXL-shaped UNet's size conditioning is measured in
    (sdtrain.model.conditioning), in training and in sampling."""
    grid_prompts: list[str] | None = None
    """sample_grid.prompts as the driver read them (a file's lines): the rows of the run's sample grids, and what
    generate.py samples from the run when given no captions; None: the run had none."""
    grid_text_encoder: str | None = None
    """The text encoder (local path, storage URI or hub id) that encoded ``grid_prompts``."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) for ``torch.load(weights_only=True)`` and JSON."""
        raw = dataclasses.asdict(self)
        raw["latent_shape"], raw["caption_shape"] = list(self.latent_shape), list(self.caption_shape)
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> CheckpointMeta:
        """The metadata of the checkpoint at ``source`` (named in the error if a key is missing)."""
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING} - {"config"}
        missing = sorted(required - raw.keys())
        if missing:
            raise ValueError(
                f"{source}: the checkpoint's {CHECKPOINT_META_KEY!r} metadata lacks {', '.join(missing)}; "
                "it was not written by sdtrain's training"
            )
        values = {k: v for k, v in raw.items() if k in known}
        values["latent_shape"], values["caption_shape"] = tuple(raw["latent_shape"]), tuple(raw["caption_shape"])
        return cls(**values)

    @property
    def caption_dropout_prob(self) -> float | None:
        """The train.caption_dropout_prob the model was trained with (None: not recorded)."""
        return self.config.get("train", {}).get("caption_dropout_prob")


def resume_refusal(
    saved: dict[str, Any], state_keys: Iterable[str] | None, current: CheckpointMeta, ema: bool
) -> str | None:
    """Why a run cannot resume from a checkpoint whose metadata is ``saved`` and whose state dict has ``state_keys``
    (None: not in hand), its own model being ``current`` (with an EMA or not), naming the config keys that changed
    since; None if it can.
    Checked as the checkpoint loads, before its weights: otherwise torch's load_state_dict fails with a list of
    tensor names, an error that is not sdtrain's, so Ray Train restarts the workers on it until failure.max_failures
    is spent, downloading the checkpoint each time."""
    was, now = saved.get("config", {}), current.config
    changed = []
    if saved.get("unet_config", current.unet_config) != current.unet_config:
        before, after = was.get("model", {}), now.get("model", {})
        keys = [f"model.{key}" for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
        changed.append(f"its UNet ({', '.join(keys) or 'the same keys: its preset changed'})")
    if tuple(saved.get("caption_shape", current.caption_shape)) != tuple(current.caption_shape):
        changed.append(f"its captions' shape ({tuple(saved['caption_shape'])}, now {tuple(current.caption_shape)})")
    decay = was.get("train", {}).get("ema_decay")
    # The weights' names where the strategy leaves them in the checkpoint (FSDP's loads them itself), else the config.
    had_ema = any(key.startswith("ema_unet.") for key in state_keys) if state_keys is not None else decay is not None
    if had_ema != ema:
        after = now.get("train", {}).get("ema_decay")
        changed.append(f"its EMA (train.ema_decay was {_yaml(decay)}, now {_yaml(after)})")
    if not changed:
        return None
    return (
        f"the run's latest checkpoint was trained with another model: {'; '.join(changed)}. A run resumes only the "
        "model it trained: set those keys back, or train the new model as a new run (another run.name, or "
        "run.start_fresh=true, which moves this run aside)"
    )


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value)
