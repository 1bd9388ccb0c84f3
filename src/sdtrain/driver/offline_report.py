"""What an offline evaluation (entrypoints/evaluate.py) writes: ``evaluation.json`` (each model's metrics, the set, the
reference and the settings they were measured with), ``evaluation.md`` (a table, a column per model), and the
reference statistics it measured (``reference/``, for a later call's ``--reference``)."""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Any

from sdtrain.config.running import HIGHER_IS_BETTER
from sdtrain.evaluation.measures import metrics_of
from sdtrain.evaluation.offline import FRECHET, PartResult, write_reference
from sdtrain.logs import log
from sdtrain.storage.filesystems import write_bytes

if TYPE_CHECKING:
    from sdtrain.driver.offline_checks import Prepared

RESULTS_FILE = "evaluation.json"
TABLE_FILE = "evaluation.md"
REFERENCE_DIR = "reference"


def report(prepared: Prepared, merged: PartResult, out: str, tasks: int) -> list[str]:
    """Write the outputs to ``out`` (local or a storage URI) and log the table; returns the paths written."""
    results = results_of(prepared, merged, tasks)
    written = []
    if merged.reference:
        directory = posixpath.join(out, REFERENCE_DIR)
        models = {metric: getattr(prepared.config.eval, FRECHET[metric]) for metric in merged.reference}
        scaling = prepared.config.data.latent_scaling_factor  # what read_reference's caller checks a later call's by
        info = {**results["reference"], "vae": prepared.task.vae, "latent_scaling_factor": scaling, "models": models}
        write_reference(directory, merged.reference, info)
        written.append(directory)
    table = markdown(results)
    for path, data in ((RESULTS_FILE, json.dumps(results, indent=2)), (TABLE_FILE, table)):
        write_bytes(posixpath.join(out, path), data.encode())
        written.append(posixpath.join(out, path))
    for line in table.splitlines():
        log.info(line)
    return written


def results_of(prepared: Prepared, merged: PartResult, tasks: int) -> dict[str, Any]:
    """The JSON of evaluation.json."""
    config, task = prepared.config, prepared.task
    references = prepared.given_reference or merged.reference
    models = []
    for name, loaded, measures in zip(task.models, prepared.loaded, merged.measures, strict=True):
        models.append(
            {
                "model": name,
                "source": loaded.source,
                "weights": loaded.weights,
                "global_step": loaded.global_step,
                "metrics": metrics_of(config, measures, references),
            }
        )
    given = {"captions": task.captions} if task.captions is not None else {"prompts": task.prompts_file}
    reference = {k: v for k, v in prepared.reference_info.items() if k in ("source", "kind", "measured_from")}
    if references:
        reference["samples"] = next(iter(references.values())).count
    return {
        "models": models,
        "set": {**given, "samples": merged.measures[0].samples},
        "reference": reference,
        "settings": {
            **{f"eval.{key}": getattr(config.eval, key) for key in ("dinov2", "inception", "clip", "class_agreement")},
            "eval.num_samples": config.eval.num_samples,
            "vae": task.vae,
            "text_encoder": task.text_encoder,
            "sample_grid.sampler": config.sample_grid.sampler,
            "sample_grid.steps": config.sample_grid.steps,
            "sample_grid.guidance_scale": config.sample_grid.guidance_scale,
            "train.seed": config.train.seed,
            "weights": task.weights,
        },
        "tasks": tasks,
        "notes": prepared.notes,
    }


def markdown(results: dict[str, Any]) -> str:
    """A table of the metrics, a column per model, and what they were measured on."""
    models = results["models"]
    header = ["metric", "", *(m["model"] for m in models)]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(models)]
    for metric in models[0]["metrics"]:
        values = [_number(m["metrics"][metric]) for m in models]
        lines.append("| " + " | ".join([metric, _better(metric), *values]) + " |")
    settings, given, reference = results["settings"], results["set"], results["reference"]
    what = f"--captions {given['captions']}" if "captions" in given else f"--prompts {given['prompts']}"
    lines += [
        "",
        f"Set: {what}, {given['samples']} samples, each model from the same seeded noise (train.seed "
        f"{settings['train.seed']}): {settings['sample_grid.sampler']}, {settings['sample_grid.steps']} steps, "
        f"guidance {settings['sample_grid.guidance_scale']}, decoded by {settings['vae']}.",
    ]
    if reference:
        lines.append(f"Reference: {reference['kind']} of {reference['source']} ({reference.get('samples', 0)} images).")
    return "\n".join(lines) + "\n"


def _better(metric: str) -> str:
    if metric in ("eval_samples", "eval_nonfinite_samples"):
        return ""
    return "higher is better" if metric in HIGHER_IS_BETTER else "lower is better"


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 1 else f"{value:.5g}"
