"""The Ray task Ray Train runs a checkpoint's evaluation in (driver: ``ValidationConfig``).

It gives up its CPU priority before anything else, so that on a node it shares with training workers it only runs on
CPU time they leave idle: importing torch, diffusers and transformers (seconds of CPU in every new process) and the
evaluation's own CPU work then never take a core from a training step or its data reads. On CPUs nobody else wants it
runs at full speed. Light on purpose: Ray imports this module to call the task, before the priority is lowered.
"""

from __future__ import annotations

from typing import Any

from sdtrain.evaluation.cpu_priority import lowest_cpu_priority


def evaluate_in_task(checkpoint: Any, config: dict[str, Any], run_dir: str, vae: str | None) -> dict[str, float]:
    """Ray Train's validation function: :func:`sdtrain.evaluation.checkpoint_eval.evaluate_checkpoint` at the lowest
    CPU priority, its scores finite (:func:`sdtrain.evaluation.scores.finite_scores`).

    Args:
        checkpoint: the ray.train.Checkpoint Ray Train committed.
        config: the run's config as a dict (the task's arguments must be JSON).
        run_dir: run.storage_path/run.name.
        vae: the VAE that decodes latents (None when no metric needs images).
    """
    lowest_cpu_priority()
    from sdtrain.evaluation.checkpoint_eval import evaluate_checkpoint  # torch and the models: after the line above
    from sdtrain.evaluation.scores import finite_scores

    return finite_scores(evaluate_checkpoint(checkpoint, config, run_dir, vae))
