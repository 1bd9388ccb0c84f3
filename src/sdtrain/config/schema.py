"""The run configuration: the tree of sections, one typed dataclass each with a docstring per field.

The sections live in :mod:`sdtrain.config.learning` (data, model, train) and :mod:`sdtrain.config.running`
(scaling, run, failure, storage, retrain); import them from here. The field docstrings are the reference
(``train.py --help``, docs/configuration.md: see :mod:`sdtrain.config.keys`). Values are checked in
``__post_init__`` so that a bad config fails on the driver, before Ray starts, with an error that names the key
and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from sdtrain.config.coercion import ConfigTree, Section
from sdtrain.config.learning import PRESETS, DataConfig, ModelConfig, TrainConfig
from sdtrain.config.placeholders import refuse_placeholder
from sdtrain.config.running import (
    EVAL_METRICS,
    CheckpointConfig,
    EvalConfig,
    ExportConfig,
    FailureConfig,
    RetrainConfig,
    RunConfig,
    SampleGridConfig,
    ScalingConfig,
    StorageConfig,
    TrackingConfig,
)
from sdtrain.config.secrets import refuse_userinfo
from sdtrain.errors import ConfigError

__all__ = [
    "PRESETS",
    "BatchLayout",
    "CheckpointConfig",
    "EvalConfig",
    "ExportConfig",
    "SampleGridConfig",
    "TrackingConfig",
    "SECTIONS",
    "Config",
    "DataConfig",
    "FailureConfig",
    "ModelConfig",
    "RetrainConfig",
    "RunConfig",
    "ScalingConfig",
    "StorageConfig",
    "TrainConfig",
]


@dataclass(frozen=True)
class BatchLayout:
    """How a run's global batch falls on the workers at one world size (:meth:`Config.batch_layout`)."""

    world_size: int
    micro_batch: int
    """Samples per worker per forward/backward pass."""
    accumulation: int
    """Micro-batches per optimizer step."""

    @property
    def rows_per_step(self) -> int:
        """Rows each worker trains on per optimizer step."""
        return self.micro_batch * self.accumulation


@dataclass
class Config(ConfigTree):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample_grid: SampleGridConfig = field(default_factory=SampleGridConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)

    SECTIONS: ClassVar[dict[str, type[Section]]] = {
        "data": DataConfig,
        "model": ModelConfig,
        "train": TrainConfig,
        "scaling": ScalingConfig,
        "run": RunConfig,
        "checkpoint": CheckpointConfig,
        "sample_grid": SampleGridConfig,
        "eval": EvalConfig,
        "tracking": TrackingConfig,
        "export": ExportConfig,
        "failure": FailureConfig,
        "storage": StorageConfig,
        "retrain": RetrainConfig,
    }

    RENAMED: ClassVar[dict[str, str]] = {
        "data.image_column": "data.latent_column",
        "data.on_change": "data.on_resume_change",
        "train.max_bad_steps": "train.max_nonfinite_steps",
        "run.checkpoint_every_n_steps": "checkpoint.every_n_steps",
        "run.num_to_keep": "checkpoint.num_to_keep",
        "run.checkpoint_score_attribute": "checkpoint.score_attribute",
        "run.checkpoint_upload": "checkpoint.upload",
        "run.staging_dir": "checkpoint.staging_dir",
        "run.record_samples": "checkpoint.record_rows",
        "run.sample_every_n_steps": "sample_grid.every_n_steps",
        "run.sample_captions": "sample_grid.captions",
        "run.sample_rows": "sample_grid.rows",
        "run.sample_columns": "sample_grid.columns",
        "run.sample_sampler": "sample_grid.sampler",
        "run.sample_steps": "sample_grid.steps",
        "run.sample_guidance_scale": "sample_grid.guidance_scale",
        "run.trackers": "tracking.trackers",
        "run.mlflow_tracking_uri": "tracking.mlflow_tracking_uri",
        "run.mlflow_experiment": "tracking.mlflow_experiment",
        "run.mlflow_register_as": "tracking.mlflow_register_as",
        "run.wandb_project": "tracking.wandb_project",
        "run.export": "export.enabled",
    }
    """Keys renamed before any release (the run section was split): an old name is refused, its error naming the new
    one; none is accepted, so that each key has one name (an old name on the command line over a config setting the
    new one would be set twice)."""

    def __post_init__(self):
        for key, uri in self.storage_uris():
            refuse_userinfo(key, uri)
        if not self.data.train and self.retrain.data_root is None:
            raise ConfigError("data.train: is required: give a parquet file, directory, glob or list of them")
        if self.retrain.data_root is not None and not self.data.val:
            raise ConfigError(
                "data.val: retraining needs a fixed held-out set to compare the new and production models on"
            )
        # Unset with model.pretrained, prediction_type is its scheduler's: checked once that is read
        # (sdtrain.model.unet.noise_scheduler_config, which also refuses a pretrained zero-terminal-SNR schedule).
        prediction_type = self.model.prediction_type or ("epsilon" if self.model.pretrained is None else None)
        if self.train.zero_terminal_snr and prediction_type not in (None, "v_prediction"):
            raise ConfigError(
                "train.zero_terminal_snr: the last timestep is then pure noise, where an epsilon prediction recovers "
                f"nothing of the image; it needs model.prediction_type: v_prediction, got {prediction_type}"
            )
        if self.train.precision == "16-mixed" and self.scaling.use_gpu is False:
            raise ConfigError(
                "train.precision: 16-mixed needs GPUs (CPUs have no fp16 autocast); use bf16-mixed or 32-true"
            )
        if self.checkpoint.score_attribute == "val_loss":
            if not self.data.val:
                raise ConfigError("checkpoint.score_attribute: val_loss needs data.val")
            every = self.run.val_every_n_steps
            if every is not None and self.checkpoint.every_n_steps % every:
                raise ConfigError(
                    f"checkpoint.score_attribute: val_loss needs a validation loss with every checkpoint, but "
                    f"run.val_every_n_steps={every} does not divide "
                    f"checkpoint.every_n_steps={self.checkpoint.every_n_steps}"
                )
        self._refuse_intervals_between_reports()
        self._refuse_registering_nothing()
        if self.eval.enabled and not self.data.val:
            raise ConfigError("eval: evaluating checkpoints needs data.val (its captions and images are the reference)")
        for key, metric in (
            ("retrain.metric", self.retrain.metric),
            ("checkpoint.score_attribute", self.checkpoint.score_attribute),
        ):
            if metric in EVAL_METRICS and metric not in self.eval.metrics:
                raise ConfigError(f"{key}: {metric} needs eval.{EVAL_METRICS[metric]}, which measures it")
        for world_size in range(self.scaling.min_workers, self.scaling.max_workers + 1):
            self.batch_layout(world_size)
        self._refuse_uneven_bucket_lanes()

    def _refuse_uneven_bucket_lanes(self) -> None:
        """data.bucket_steps > 1 cuts each run of steps into lanes of a chunk, each step taking an equal part of every
        lane (sdtrain.data.bucket_turns): the global batch must be whole lanes' parts."""
        steps, chunk, batch = self.data.bucket_steps, self.data.shuffle_chunk_rows, self.train.global_batch_size
        if steps == "auto":  # picks only steps whose lanes make the batch (sdtrain.data.bucket_turns)
            return
        part = chunk // steps
        if steps > 1 and batch % part:
            raise ConfigError(
                f"data.bucket_steps: {steps} steps of one bucket take {part} rows of each chunk of "
                f"data.shuffle_chunk_rows={chunk} a step, which does not divide train.global_batch_size={batch}; "
                "pick a train.global_batch_size that is a multiple of it, or another data.bucket_steps"
            )

    def _refuse_intervals_between_reports(self) -> None:
        """Validation and sample grids run only at report steps (sdtrain.train.cadence: every run.log_every_n_steps,
        and each checkpoint): an interval that is a multiple of neither would silently run less often than it says.
        One of train.max_steps or more runs at the last step only, as it says."""
        log_every, checkpoint_every = self.run.log_every_n_steps, self.checkpoint.every_n_steps
        for key, every, what in (
            ("run.val_every_n_steps", self.run.val_every_n_steps, "the validation loss is computed"),
            ("sample_grid.every_n_steps", self.sample_grid.every_n_steps, "sample grids are drawn"),
        ):
            if (
                every is None
                or every >= self.train.max_steps
                or every % log_every == 0
                or every % checkpoint_every == 0
            ):
                continue
            raise ConfigError(
                f"{key}: {every} is a multiple of neither run.log_every_n_steps={log_every} nor "
                f"checkpoint.every_n_steps={checkpoint_every}, and {what} only at those report steps: it would run "
                f"every {math.lcm(every, log_every)} steps, not {every}; set {key} to a multiple of "
                f"run.log_every_n_steps (e.g. {max(log_every, every // log_every * log_every)}) or "
                "run.log_every_n_steps to a divisor of it"
            )

    def _refuse_registering_nothing(self) -> None:
        """The export is registered from the MLflow run that tracked it (sdtrain.driver.trackers.log_export): without
        that run or without an export, tracking.mlflow_register_as would register nothing, without a word."""
        name, trackers = self.tracking.mlflow_register_as, self.tracking.trackers
        if name is None:
            return
        if "mlflow" not in trackers:
            raise ConfigError(
                f"tracking.mlflow_register_as: {name!r} registers the export from the run's MLflow run, but "
                f"tracking.trackers={trackers} has no mlflow, so nothing would be registered; add mlflow to "
                "tracking.trackers, or set tracking.mlflow_register_as to null"
            )
        if not self.export.enabled:
            raise ConfigError(
                f"tracking.mlflow_register_as: {name!r} registers the run's final export, but export.enabled is "
                "false and writes none, so nothing would be registered; set export.enabled to true, or "
                "tracking.mlflow_register_as to null"
            )

    def batch_layout(self, world_size: int) -> BatchLayout:
        """How train.global_batch_size falls on ``world_size`` workers: the one derivation the driver, the data
        hook and the workers use."""
        batch, micro = self.train.global_batch_size, self.train.micro_batch_size
        if batch % world_size:
            raise ConfigError(
                f"train.global_batch_size: {batch} does not divide evenly over {world_size} worker(s), which "
                f"scaling.num_workers={self.scaling.num_workers} allows; pick a multiple of every allowed world size"
            )
        if micro is None or micro == "auto":  # auto until the driver knows the GPUs (sdtrain.driver.memory_fit)
            micro = self.common_micro_batch()
        per_worker = batch // world_size
        if per_worker % micro:
            raise ConfigError(
                f"train.micro_batch_size: {micro} does not divide the {per_worker} samples each of {world_size} "
                f"worker(s) takes per step (train.global_batch_size={batch}); use a divisor of it, or null"
            )
        return BatchLayout(world_size, micro, per_worker // micro)

    def common_micro_batch(self) -> int:
        """The largest micro-batch that divides the per-worker batch at every allowed world size (null's); every
        divisor of it does too."""
        batch = self.train.global_batch_size
        allowed = range(self.scaling.min_workers, self.scaling.max_workers + 1)
        return math.gcd(*(batch // n for n in allowed if batch % n == 0))

    def refuse_placeholders(self) -> None:
        """Raise a ConfigError naming the first path that still holds the shipped configs' placeholder bucket
        (:mod:`sdtrain.config.placeholders`). Called by every command that runs the config (train, retrain, check)
        before it lists anything or starts Ray, not at load: the shipped configs load as they are."""
        for key, path in self.storage_uris():
            refuse_placeholder(key, path)

    def storage_uris(self) -> list[tuple[str, str]]:
        """(key, path) for every path or URI the config names: data, models and storage."""
        named: list[tuple[str, str | None]] = [(f"data.train[{i}]", p) for i, p in enumerate(self.data.train)]
        named += [(f"data.val[{i}]", p) for i, p in enumerate(self.data.val)]
        if self.data.unconditional_caption not in ("zeros", "auto"):
            named.append(("data.unconditional_caption", self.data.unconditional_caption))
        named += [("model.pretrained", self.model.pretrained), ("run.storage_path", self.run.storage_path)]
        named += [("eval.dinov2", self.eval.dinov2), ("eval.inception", self.eval.inception)]
        named += [("eval.clip", self.eval.clip), ("eval.vae", self.eval.vae)]
        named.append(("export.base_model", self.export.base_model))
        named += [("retrain.data_root", self.retrain.data_root), ("retrain.models_root", self.retrain.models_root)]
        named.append(("sample_grid.captions", self.sample_grid.captions))
        if isinstance(self.sample_grid.prompts, str):  # a file of them
            named.append(("sample_grid.prompts", self.sample_grid.prompts))
        return [(key, path) for key, path in named if path is not None]


SECTIONS = Config.SECTIONS  # for the reference and help (sdtrain.config.keys)
