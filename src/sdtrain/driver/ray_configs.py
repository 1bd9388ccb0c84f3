"""How a run's config becomes Ray Train's: its RunConfig (name, storage, failure policy, checkpoint retention, the
controller's callbacks) and the ValidationConfig of its checkpoint evaluations."""

from __future__ import annotations

import ray
import ray.train

from sdtrain.config.running import HIGHER_IS_BETTER
from sdtrain.config.schema import Config
from sdtrain.controller.failures import StopOnDeterministicErrors
from sdtrain.controller.snapshot_copy import SnapshotCopy
from sdtrain.storage.filesystems import ray_storage


def ray_run_config(config: Config) -> ray.train.RunConfig:
    """The run's name and storage (checkpoints in run.storage_path), failure policy and checkpoint retention."""
    # Ray Train's controller and workers get the storage filesystem and the S3 settings from
    # here: on a cluster started separately they see neither storage.endpoint_url nor this
    # process's environment.
    storage_filesystem, storage_path = ray_storage(config.run.storage_path)
    return ray.train.RunConfig(
        name=config.run.name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        failure_config=failure_config(config),
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=config.checkpoint.num_to_keep,
            checkpoint_score_attribute=config.checkpoint.score_attribute,
            checkpoint_score_order="max" if config.checkpoint.score_attribute in HIGHER_IS_BETTER else "min",
        ),
        # The two ignores: ray/train/__init__.py imports Ray Train v1's RunConfig and then, when v2 is
        # enabled (the default, and what runs), v2's over it; mypy keeps the first, which lacks
        # logging_config and types callbacks as v1 (Tune) callbacks.
        # Ray Train logs every report at INFO; our own progress line already says it all.
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # type: ignore[call-arg]
        callbacks=[StopOnDeterministicErrors(), SnapshotCopy.of(config)],  # type: ignore[list-item]
    )


def validation_config(config: Config, run_dir: str, vae: str | None) -> ray.train.ValidationConfig:
    """Ray Train's evaluation of committed checkpoints (sdtrain.evaluation.checkpoint_eval) in a task with eval's
    resources; one still running after eval.timeout_s is cancelled."""
    from sdtrain.evaluation.cpu_priority import EVALUATION_TASK_ENV
    from sdtrain.evaluation.eval_task import evaluate_in_task

    return ray.train.ValidationConfig(
        fn=evaluate_in_task,  # type: ignore[arg-type]  # named keyword arguments: the protocol says **kwargs
        task_config=ray.train.ValidationTaskConfig(
            fn_kwargs={"config": config.to_dict(), "run_dir": run_dir, "vae": vae}, timeout_s=config.eval.timeout_s
        ),
        # No retry: an evaluation that failed says why in its result and the next checkpoint's is asked for anyway.
        # Its own environment variable gives the task a pool of worker processes of its own: one whose CPU
        # priority an evaluation lowered for good is never lent to another task (Ray Data's reads).
        ray_remote_kwargs={
            "num_cpus": config.eval.num_cpus,
            "num_gpus": config.eval.num_gpus,
            "max_retries": 0,
            "runtime_env": {"env_vars": {EVALUATION_TASK_ENV: "1"}},  # merged into the job's
        },
    )


def failure_config(config: Config) -> ray.train.FailureConfig:
    # Ray Train v2's FailureConfig; mypy sees v1's, which lacks max_preemption_failures (see RunConfig in train()).
    return ray.train.FailureConfig(  # type: ignore[call-arg]
        max_failures=config.failure.max_failures, max_preemption_failures=config.failure.max_preemptions
    )
