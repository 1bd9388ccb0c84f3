"""An evaluation's result file, ``<run dir>/evaluation/step_<N>.json`` (its metrics, or its error): written by the
evaluation task (:mod:`sdtrain.evaluation.checkpoint_eval`), read into the run's metric rows by rank 0 while training
runs and by the driver at its end; and what makes two values of a metric comparable. Light on purpose: the training
workers import it, and nothing here loads a model."""

from __future__ import annotations

import json
import posixpath
import time
from typing import Any

from sdtrain.config.running import EVAL_METRICS
from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import EVALUATION_DIR, evaluation_file

RESULT_KEYS = (*EVAL_METRICS, "eval_nonfinite_samples", "eval_s")
"""What an evaluation adds to its checkpoint's row (eval_failed instead when it failed)."""
NO_RESULT = "no result: the evaluation task ended without one (timeout or killed)"
"""The error recorded for an evaluation asked for whose task wrote no result (Ray Train cancels one past
eval.timeout_s with force; a task killed with its node or driver writes none either)."""


INITIAL_NOISE = "seeded by train.seed and the latent shape"
"""How an evaluation's initial noise is drawn (sdtrain.sampling.sampler.shape_seed), in :func:`measured_with`: values
measured with noise drawn otherwise (before, every shape from train.seed alone) are not compared."""


def measured_with(config: Config, metric: str) -> dict[str, Any]:
    """The settings a value of ``metric`` (val_loss or an eval metric) depends on, by config key: two values compare
    only where these agree. Retraining's gate leaves out a version measured otherwise; an evaluation keys its
    reference statistics by them. val_loss's include the training objective as the config gives it
    (model.prediction_type, unset where inherited from model.pretrained, and train.zero_terminal_snr): an epsilon and a
    v-prediction model's losses are errors of different targets."""
    settings: dict[str, Any] = {
        "data.val": config.data.val,
        "data.latent_column": config.data.latent_column,
        "data.latent_scaling_factor": config.data.latent_scaling_factor,
        "train.seed": config.train.seed,
    }
    if metric not in EVAL_METRICS:  # val_loss: the MSE against the training target, which the objective defines
        settings["model.prediction_type"] = config.model.prediction_type
        settings["train.zero_terminal_snr"] = config.train.zero_terminal_snr
    else:  # the sampled images and what measures them
        model_key = EVAL_METRICS[metric]
        settings[f"eval.{model_key}"] = getattr(config.eval, model_key)
        for key in ("eval.vae", "eval.num_samples", "sample_grid.sampler", "sample_grid.steps"):
            settings[key] = _value(config, key)
        settings["sample_grid.guidance_scale"] = config.sample_grid.guidance_scale
        settings["eval.initial_noise"] = INITIAL_NOISE
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


def record_no_result(run_dir: str, step: int, why: str) -> dict[str, Any]:
    """The result of an evaluation whose task ended without writing one (:data:`NO_RESULT`), written in its place."""
    result = {"step": step, "error": f"{NO_RESULT}; {why}", "time": time.time()}
    write_evaluation(run_dir, step, result)
    return result


def final_results(run_dir: str, history: list[dict[str, float]]) -> dict[int, dict[str, Any]]:
    """:func:`awaited_results` at the end of a run, when Ray Train has waited for every evaluation: a row still without
    one gets the :data:`NO_RESULT` record (written), so metrics.csv says why it has no metrics."""
    found = awaited_results(run_dir, history)
    for row in history:
        step = int(row["step"])
        if awaits(row) and step not in found:
            found[step] = record_no_result(run_dir, step, "the run ended without it")
    return found


def awaited_results(run_dir: str, history: list[dict[str, float]]) -> dict[int, dict[str, Any]]:
    """The results written for the rows of ``history`` that asked for an evaluation and hold none yet: one read
    each, of those few (usually the last one or two), not of every evaluation the run ever made."""
    found = {}
    for row in history:
        if awaits(row):
            result = read_evaluation(run_dir, int(row["step"]))
            if result is not None:
                found[int(row["step"])] = result
    return found


def merge_results(history: list[dict[str, float]], results: dict[int, dict[str, Any]]) -> list[tuple[int, dict]]:
    """Each result into the row of its step (once); a failed one as ``eval_failed`` = 1, its error logged. Returns
    the (step, metrics) added, for the trackers."""
    if not results:  # every report asks: a long run's history is not walked for nothing
        return []
    rows = {int(row["step"]): row for row in history}
    added = []
    for step, result in sorted(results.items()):
        row = rows.get(step)
        if row is None or _has_result(row):
            continue
        if "error" in result:
            log.warning("evaluation of the checkpoint of step %d failed: %s", step, result["error"])
            metrics = {"eval_failed": 1.0}
        else:
            metrics = {key: float(result[key]) for key in RESULT_KEYS if key in result}
            log.info("evaluation of step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        row.update(metrics)
        added.append((step, metrics))
    return added


def _has_result(row: dict[str, Any]) -> bool:
    return "eval_s" in row or "eval_failed" in row


def awaits(row: dict[str, Any]) -> bool:
    """Whether the row asked for an evaluation whose result it does not hold yet."""
    return bool(row.get("evaluation_asked")) and not _has_result(row)
