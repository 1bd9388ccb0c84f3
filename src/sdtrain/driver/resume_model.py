"""A run's committed checkpoint held to the model the config builds, on the driver before Ray starts: a run re-run
under its run.name with another model is refused naming what changed, instead of after Ray's start and the
checkpoint's download (where :meth:`sdtrain.train.module.DiffusionModule.on_load_checkpoint` refuses checkpoints
written before they recorded their model beside the weights)."""

from __future__ import annotations

import json
import posixpath

import ray.train

from sdtrain.artifacts.checkpoint_format import CheckpointMeta, resume_refusal
from sdtrain.errors import ConfigError
from sdtrain.storage.filesystems import uri_for
from sdtrain.storage.run_layout import MODEL_FILE


def check_resume_model(checkpoint: ray.train.Checkpoint, current: CheckpointMeta, ema: bool) -> None:
    """The ConfigError naming the config keys whose change keeps the run from resuming ``checkpoint`` with the model
    ``current`` (with an EMA or not); nothing when it can, or when the checkpoint records no model beside its
    weights (one GET)."""
    assert checkpoint.filesystem is not None  # Ray Train's committed checkpoints name theirs
    try:
        with checkpoint.filesystem.open_input_stream(posixpath.join(checkpoint.path, MODEL_FILE)) as f:
            saved = json.loads(f.read())
    except FileNotFoundError:  # written before MODEL_FILE: checked as it loads
        return
    refusal = resume_refusal(saved, None, current, ema)
    if refusal is not None:
        raise ConfigError(f"run: {uri_for(checkpoint.filesystem, checkpoint.path)}: {refusal}")
