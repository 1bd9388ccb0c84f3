"""An evaluation's result file, ``<run dir>/evaluation/step_<N>.json`` (its metrics, or its error): written by the
evaluation task (:mod:`sdtrain.evaluation.checkpoint_eval`), read by rank 0 and the driver; and what makes two values
of a metric comparable. Light on purpose: the training workers import it, and nothing here loads a model."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from sdtrain.config.running import EVAL_METRICS
from sdtrain.config.schema import Config
from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import EVALUATION_DIR, evaluation_file


def measured_with(config: Config, metric: str) -> dict[str, Any]:
    """The settings a value of ``metric`` (val_loss or an eval metric) depends on, by config key: two values compare
    only where these agree. Retraining's gate leaves out a version measured otherwise; an evaluation keys its
    reference statistics by them."""
    settings: dict[str, Any] = {
        "data.val": config.data.val,
        "data.latent_column": config.data.latent_column,
        "data.latent_scaling_factor": config.data.latent_scaling_factor,
        "train.seed": config.train.seed,
    }
    if metric in EVAL_METRICS:  # the sampled images and what measures them
        model_key = EVAL_METRICS[metric]
        settings[f"eval.{model_key}"] = getattr(config.eval, model_key)
        for key in ("eval.vae", "eval.num_samples", "sample_grid.sampler", "sample_grid.steps"):
            settings[key] = _value(config, key)
        settings["sample_grid.guidance_scale"] = config.sample_grid.guidance_scale
    return settings


def _value(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def write_evaluation(run_dir: str, step: int, result: dict[str, Any]) -> None:
    write_bytes(posixpath.join(run_dir, EVALUATION_DIR, evaluation_file(step)), json.dumps(result).encode())


def read_evaluation(run_dir: str, step: int) -> dict[str, Any] | None:
    """The result of the evaluation of ``step``'s checkpoint, or None while there is none."""
    data = read_bytes(posixpath.join(run_dir, EVALUATION_DIR, evaluation_file(step)))
    return json.loads(data) if data is not None else None
