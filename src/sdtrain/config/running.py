"""The sections that say where and how a run runs: scaling, run, checkpoint, sample_grid, eval, tracking, export,
failure, storage, retrain.

Each field's docstring is its reference (``train.py --help``, docs/configuration.md); values are checked in
``__post_init__``, on the driver, before Ray starts. Import them from :mod:`sdtrain.config.schema`.
"""

from __future__ import annotations

import datetime
import posixpath
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from sdtrain.config.coercion import Section
from sdtrain.config.secrets import refuse_userinfo
from sdtrain.storage.s3 import DEFAULT_MAX_ATTEMPTS

EVAL_METRICS = {
    "fd_dinov2": "dinov2",
    "fd_inception": "inception",
    "clip_score": "clip",
    "class_agreement": "class_agreement",
}
"""Each metric an evaluation can report, and the eval key that turns it on."""
RESOURCE_RANGE = (1e-4, 1e6)
"""CPUs or GPUs a Ray task or worker may ask for: Ray counts them in integers of 0.0001 and refuses a finer fraction
when the task is submitted (an evaluation's, after training started); no node has a million."""
HIGHER_IS_BETTER = ("clip_score", "class_agreement")
"""The eval metrics whose higher values are better (the Frechet distances are better lower)."""


@dataclass
class ScalingConfig(Section):
    section: ClassVar[str] = "scaling"

    num_workers: int | list[int] = 1
    """Training workers: an int, or [min, max] for elastic training that starts with what the cluster can give."""
    use_gpu: Literal["auto"] | bool = "auto"
    """One GPU per worker; auto = yes when the cluster has GPUs when the job starts. Set true on autoscaling
    clusters."""
    cpus_per_worker: Literal["auto"] | float = "auto"
    """CPUs reserved per worker, shared by its training loop and its data reads; auto = 1 with GPUs, else
    min(1, the cluster's CPUs / the most workers)."""
    resize_check_s: float = 60.0
    """With num_workers [min, max]: how often Ray Train looks for room for more workers and, finding it, restarts the
    group larger from the latest checkpoint (losing the steps since it); Ray's
    ScalingConfig.elastic_resize_monitor_interval_s."""

    def __post_init__(self):
        if isinstance(self.num_workers, list):
            if len(self.num_workers) != 2 or not 1 <= self.num_workers[0] <= self.num_workers[1]:
                self._fail("num_workers", f"as a list must be [min, max] with 1 <= min <= max, got {self.num_workers}")
        elif self.num_workers < 1:
            self._fail("num_workers", f"must be >= 1, got {self.num_workers}")
        self._within("cpus_per_worker", *RESOURCE_RANGE, also="auto")
        if not self.resize_check_s > 0:
            self._fail("resize_check_s", f"must be > 0 seconds, got {self.resize_check_s}")

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, list) else self.num_workers


@dataclass
class RunConfig(Section):
    section: ClassVar[str] = "run"

    name: str = "sdtrain"
    """Run name; the run lives in run.storage_path/run.name. Re-running with the same name resumes it."""
    storage_path: str = "runs"
    """Where runs are stored: s3://bucket/prefix (needed on a multi-node cluster), a shared filesystem path, or a local
    directory (relative to the current directory)."""
    start_fresh: bool = False
    """Start from step 0 even if run.storage_path/run.name holds a run; the old run is kept, renamed to
    <name>.replaced-<UTC time>. For one-off command lines, not a retried job (each retry would start over)."""
    log_every_n_steps: int = 50
    """Log a progress line and report metrics every this many steps."""
    val_every_n_steps: int | None = None
    """Compute the validation loss on data.val every this many steps; null = at every checkpoint."""
    stall_timeout_s: float | None = 1800.0
    """A worker that completes no optimizer step for this many seconds, not counting start-up, validation,
    checkpoints and sample grids (run.slow_phase_timeout_s bounds those), logs what it was doing (waiting for data,
    in a step's collectives, reporting) and ends, so Ray Train restarts the group from the latest checkpoint or the
    job fails visibly instead of hanging. null = no watchdog."""
    slow_phase_timeout_s: float | None = 7200.0
    """The longest a worker may spend in one slow phase between steps: start-up (building the model, restoring the
    checkpoint, joining the other ranks), a validation, a checkpoint's save, upload and barrier, a sample grid, or
    the hold before a reclaim deadline (6 minutes at most: sdtrain.train.preemption); beyond it the worker logs the
    phase and ends as for run.stall_timeout_s. Keep it above the longest of them. null = unbounded."""
    gpu_hour_cost: float | None = None
    """What one GPU-hour costs, in your currency (each worker holds one GPU; on CPU workers, what one worker-hour
    costs): the metric cost_per_million_images at each report, from the throughput since the previous one, and the
    run's cost in the final summary, this price x the run's GPU-hours (docs/observability.md). null = no cost."""

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            self._fail("name", f"must be letters, digits, '.', '_' or '-' (it names a directory), got {self.name!r}")
        if not self.storage_path:
            self._fail("storage_path", "must be a directory path")
        if self.log_every_n_steps < 1:
            self._fail("log_every_n_steps", f"must be >= 1, got {self.log_every_n_steps}")
        if self.val_every_n_steps is not None and self.val_every_n_steps < 1:
            self._fail("val_every_n_steps", f"must be >= 1 or null, got {self.val_every_n_steps}")
        for key in ("stall_timeout_s", "slow_phase_timeout_s"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                self._fail(key, f"must be > 0 seconds or null, got {getattr(self, key)}")
        if self.gpu_hour_cost is not None and self.gpu_hour_cost < 0:
            cost = self.gpu_hour_cost
            self._fail("gpu_hour_cost", f"must be a price >= 0 (per GPU-hour, in your currency) or null, got {cost}")

    @property
    def directory(self) -> str:
        """The run's directory, run.storage_path/run.name (local or s3://): its one spelling."""
        return posixpath.join(self.storage_path, self.name)


@dataclass
class CheckpointConfig(Section):
    section: ClassVar[str] = "checkpoint"

    every_n_steps: int = 1000
    """Report a checkpoint every this many optimizer steps, and always at the end."""
    num_to_keep: int | None = 3
    """Checkpoints to keep (the newest); null keeps all."""
    score_attribute: (
        Literal["val_loss", "loss", "fd_dinov2", "fd_inception", "clip_score", "class_agreement"] | None
    ) = None
    """Keep the checkpoint.num_to_keep checkpoints with the best value of this metric (the lowest; clip_score's and
    class_agreement's highest) plus the latest, which a resume starts from, instead of the newest; null = the newest.
    The eval metrics come from eval: a checkpoint waiting for its evaluation is kept, one never evaluated ranks last,
    as does a reclaim notice's checkpoint with val_loss (it is taken off the validation schedule)."""
    upload: Literal["async", "sync"] = "async"
    """async: training goes on while Ray Train uploads a checkpoint to run.storage_path (committed, and older ones
    pruned, once it is all there); sync: wait for the upload. The wait shows in the metric checkpoint_stall_s."""
    staging_dir: str | None = None
    """Local directory (each node's own disk) where checkpoints are written before their upload and a restored
    checkpoint is downloaded to. It needs room for about two checkpoints, and, while a worker group restores from
    object storage, one more: the node's local rank 0 downloads it once for the node's ranks and removes it once all
    have restored. null = the system's temporary directory. What a killed worker left there (a staged checkpoint,
    a restore copy) is removed when a worker group of the run next starts on that node, however many workers it
    runs there and whichever ranks they hold."""
    record_rows: bool = False
    """Save into each checkpoint, as samples.npy, the sample index (row number in data.train's files, in order) of
    every row trained on since the previous checkpoint, all ranks: an exact record of what the model saw."""

    def __post_init__(self):
        if self.every_n_steps < 1:
            self._fail("every_n_steps", f"must be >= 1, got {self.every_n_steps}")
        if self.num_to_keep is not None and self.num_to_keep < 1:
            self._fail("num_to_keep", f"must be >= 1 or null (keep all), got {self.num_to_keep}")


@dataclass
class SampleGridConfig(Section):
    section: ClassVar[str] = "sample_grid"

    every_n_steps: int | None = None
    """Rank 0 samples a fixed grid (sample_grid.prompts or .captions, fixed seed, the EMA weights) every this many
    steps and at the end, saved as samples/step_<N>.png in the run directory and sent to tracking.trackers; null =
    with each checkpoint. Under train.strategy=fsdp every rank takes part (each holds a shard of the weights). No grid
    when none of sample_grid.prompts, sample_grid.captions and data.val is set."""
    prompts: str | list[str] | None = None
    """Prompts in words for the sample grid's rows, a row each, labelled with its text: a list, or the path or s3://
    URI of a text file of one prompt a line (blank lines and # comments left out). Encoded once, on the driver before
    Ray starts, by the run's text encoder: the one its token-id captions name, else the one data.train's files record
    (sdtrain.text_encoder_source, which entrypoints/preprocess.py writes), else model.pretrained's text_encoder/.
    generate.py samples a run's prompts when given no captions. null = sample_grid.captions."""
    captions: str | None = None
    """Captions of the sample grid's rows: a .npy of embeddings ((L, D) or (N, L, D)) or parquet with
    data.caption_column; null = data.val (one row per label when it has a label column, else its first
    sample_grid.rows)."""
    rows: int = 4
    """Rows (captions) of the sample grid, when its captions are not one per label."""
    columns: int = 4
    """Samples per caption in the sample grid."""
    sampler: Literal["ddim", "dpm"] = "ddim"
    """Sampler of the sample grid: ddim or dpm (DPM-Solver++)."""
    steps: int = 20
    """Denoising steps per sample of the sample grid."""
    guidance_scale: float = 3.0
    """Classifier-free guidance scale of the sample grid (1 or below = none, as in diffusers' pipelines)."""

    def __post_init__(self):
        if self.every_n_steps is not None and self.every_n_steps < 1:
            self._fail("every_n_steps", f"must be >= 1 or null, got {self.every_n_steps}")
        if self.prompts is not None and self.captions is not None:
            self._fail("prompts", "and sample_grid.captions both name the grid's rows; set one of them")
        named = [self.prompts] if isinstance(self.prompts, str) else self.prompts
        if named is not None and not (named and all(p.strip() for p in named)):
            self._fail("prompts", f"must name prompts (a list of them, or a file of one a line), got {self.prompts!r}")
        for key in ("rows", "columns", "steps"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        if self.guidance_scale < 0:
            self._fail("guidance_scale", f"must be >= 0 (1 or below: no guidance), got {self.guidance_scale}")


@dataclass
class EvalConfig(Section):
    section: ClassVar[str] = "eval"

    dinov2: str | None = None
    """A DINOv2 model (transformers Dinov2Model: local directory, s3:// URI or hub id): the Frechet distance of its
    features between images sampled from each evaluated checkpoint and data.val's own images is the metric fd_dinov2;
    null = not measured."""
    inception: str | None = None
    """FID's Inception network as a TorchScript file (inception-2015-12-05.pt, as StyleGAN3 and clean-fid use it:
    local path or s3:// URI): the Frechet distance of its features, as for eval.dinov2, is the metric fd_inception;
    null = not measured."""
    clip: str | None = None
    """A CLIP model (transformers CLIPModel with its tokenizer, in one directory, s3:// URI or hub id) scoring each
    sampled image against its caption's text (metric clip_score, 0-100); needs eval.text_column in data.val; null = not
    measured."""
    text_column: str = "caption"
    """data.val's column of caption texts, for clip_score (preprocessing keeps it)."""
    class_agreement: bool = False
    """The share of sampled latents that data.val's latent classifier reads as their caption's label (metric
    class_agreement; data.val's label column): a module its files name (parquet metadata sdtrain.latent_classifier,
    sdtrain.sampling.latent_classifier) that reads latents without a VAE. Refused before Ray for data that names
    none."""
    vae: str | None = None
    """The VAE that decodes sampled and data.val's latents into images (a Stable Diffusion model or its vae/); null =
    the one data.val's files record (preprocessing's sdtrain.vae_source)."""
    num_samples: int = 1000
    """Images sampled per evaluation: one each for the first this many rows of data.val (their captions), from the
    same seeded noise every time, with sample_grid's sampler, steps and guidance scale."""
    every_n_checkpoints: int = 1
    """Evaluate every this many checkpoints (and the final one); one still running when the next is due is not
    waited for: that checkpoint is skipped (metric evaluations_skipped)."""
    num_cpus: float = 1
    """CPUs of the Ray task that evaluates a committed checkpoint, beside the training workers."""
    num_gpus: float = 0
    """GPUs of that task (1 on a GPU cluster: sampling num_samples images on CPUs takes long)."""
    batch_size: int = 32
    """Images sampled, decoded and embedded at once by the evaluation task."""
    timeout_s: float = 3600
    """An evaluation still running after this many seconds is cancelled (reported, training goes on)."""

    @property
    def enabled(self) -> bool:
        return bool(self.metrics)

    @property
    def metrics(self) -> list[str]:
        """The metrics each evaluation reports."""
        return [metric for metric, key in EVAL_METRICS.items() if getattr(self, key)]

    @property
    def needs_vae(self) -> bool:
        """Whether evaluations decode latents into images (every metric but class agreement)."""
        return any(metric != "class_agreement" for metric in self.metrics)

    def __post_init__(self):
        for key in ("num_samples", "every_n_checkpoints", "batch_size"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        for metric in ("fd_dinov2", "fd_inception"):
            if metric in self.metrics and self.num_samples < 2:
                self._fail("num_samples", f"must be >= 2 for {metric} (a covariance), got {self.num_samples}")
        for key in ("num_cpus", "num_gpus"):
            if getattr(self, key) != 0:
                self._within(key, *RESOURCE_RANGE, also="0")
        if not self.timeout_s > 0:
            self._fail("timeout_s", f"must be > 0, got {self.timeout_s}")
        if not self.text_column:
            self._fail("text_column", "must be a column name, got an empty string")


@dataclass
class TrackingConfig(Section):
    section: ClassVar[str] = "tracking"

    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 logs the full config, every reported metric at its step and the sample grids to
    (one tracker run per training run, continued across restarts; ids in trackers.json in the run directory):
    tensorboard (event files in the run directory's tensorboard/), mlflow (tracking.mlflow_tracking_uri), wandb
    (project tracking.wandb_project; credentials and WANDB_MODE from the environment). [] = none."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server for tracking.trackers' mlflow (e.g. http://mlflow:5000); null = MLFLOW_TRACKING_URI."""
    mlflow_experiment: str | None = None
    """MLflow experiment the run is logged under; null = MLFLOW_EXPERIMENT_NAME, else sdtrain."""
    mlflow_register_as: str | None = None
    """Register the final export as a new version of this MLflow model (needs mlflow in tracking.trackers and
    export.enabled); null = only attach it to the run."""
    wandb_project: str = "sdtrain"
    """W&B project the run is logged under."""

    def __post_init__(self):
        # The config goes into tracker params, checkpoint metadata and registry manifests: never a secret.
        refuse_userinfo(
            f"{self.section}.mlflow_tracking_uri",
            self.mlflow_tracking_uri,
            instead="set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the "
            "environment",
        )
        if len(set(self.trackers)) != len(self.trackers):
            self._fail("trackers", f"names a tracker twice: {self.trackers}")


@dataclass
class ExportConfig(Section):
    section: ClassVar[str] = "export"

    enabled: bool = True
    """At the end of the run, export the final (EMA) model as a diffusers pipeline (StableDiffusionPipeline: the UNet,
    a sampler on its noise schedule, the VAE, text encoder and tokenizer, a model card) to
    run.storage_path/run.name/export/. The VAE and text encoder are those export.base_model names, else those
    data.train's files record (preprocessing's); a run whose data and config name neither is refused before Ray.
    Data whose latents are read without a VAE (its files name a latent classifier) exports the UNet and noise
    scheduler alone. An SDXL-shaped UNet's pipeline is a StableDiffusionXLPipeline (both text encoders)."""
    base_model: str | None = None
    """The Stable Diffusion model whose VAE, text encoder and tokenizer made the training latents and captions (a
    local diffusers directory, an s3:// URI or a hub id on a networked cluster): the export's pipeline takes them.
    Set, it wins over what the data's files record (the same model may sit elsewhere where training runs); checked
    before Ray: its text encoder's width must be the UNet's cross_attention_dim and its VAE's latent channels the
    data's. null = what the data records."""

    def __post_init__(self):
        if self.base_model is not None and not self.base_model.strip():
            self._fail("base_model", "must be a model directory, s3:// URI or hub id, or null")


@dataclass
class FailureConfig(Section):
    section: ClassVar[str] = "failure"

    max_failures: int = 3
    """Worker-group restarts (each resumes from the latest checkpoint) before the run fails; -1 = unlimited.
    Preemptions are not counted here."""
    max_preemptions: int = -1
    """Restarts after a node was reclaimed (a spot instance, a drained node) before the run fails; -1 = unlimited.
    A notice of the reclaim makes the workers save a checkpoint at once, which the restart resumes from."""

    def __post_init__(self):
        for key in ("max_failures", "max_preemptions"):
            if getattr(self, key) < -1:
                self._fail(key, f"must be >= -1, got {getattr(self, key)}")


@dataclass
class StorageConfig(Section):
    section: ClassVar[str] = "storage"

    endpoint_url: str | None = None
    """S3-compatible endpoint (e.g. http://minio:9000) for every s3:// URI; null = AWS_ENDPOINT_URL_S3 or
    AWS_ENDPOINT_URL if set, else AWS S3. Credentials never go here."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts per S3 request, with exponential backoff, before a throttled or dropped request fails (1: no retry)."""

    def __post_init__(self):
        if self.endpoint_url is not None:
            refuse_userinfo(f"{self.section}.endpoint_url", self.endpoint_url)  # before a message repeats the URI
            if not re.fullmatch(r"https?://[^/\s]+/?", self.endpoint_url):
                self._fail("endpoint_url", f"must be http(s)://host[:port], got {self.endpoint_url!r}")
        if self.max_attempts < 1:
            self._fail("max_attempts", f"must be >= 1 (1 = no retries), got {self.max_attempts}")


@dataclass
class RetrainConfig(Section):
    section: ClassVar[str] = "retrain"

    data_root: str | None = None
    """Directory of date partitions (date=YYYY-MM-DD/, parquet files) entrypoints/retrain.py takes new data from."""
    models_root: str | None = None
    """Where retraining keeps model versions (versions/vNNNN/) and the production pointer (production.json)."""
    metric: Literal["val_loss", "fd_dinov2", "fd_inception", "clip_score", "class_agreement"] = "val_loss"
    """What the gate compares: the held-out val_loss, or an eval metric of both models' samples (the same data.val
    captions and seeds; the eval key that measures it required). Every measured metric is recorded in the manifest."""
    tolerance: float = 0.0
    """Promote a retrained model if its retrain.metric <= the production model's x (1 + tolerance) (clip_score and
    class_agreement: >= x (1 - tolerance))."""
    date: str | None = None
    """Schedule date (YYYY-MM-DD) a retrain run is for: it takes partitions up to it, once; null = in an Anyscale job,
    the UTC date of the job's first attempt (its retries keep it, even after midnight), else today (UTC). A date after
    today (UTC) is refused with complete_marker null, which would take today's partition while it still fills."""
    complete_marker: str | None = "_SUCCESS"
    """A partition is taken once it holds this file, written last by the partition's writer; null = take only
    partitions dated before the schedule date (the schedule date's may still be filling)."""

    def __post_init__(self):
        if self.date is not None:
            try:
                datetime.date.fromisoformat(self.date)
            except ValueError:
                self._fail("date", f"must be a date YYYY-MM-DD, got {self.date!r}")
        if self.tolerance < 0:
            self._fail("tolerance", f"must be >= 0, got {self.tolerance}")
        if self.complete_marker is not None and (not self.complete_marker or "/" in self.complete_marker):
            # '' would name the partition directory itself, which is no file: every partition incomplete, for good.
            self._fail("complete_marker", f"must be a file name (e.g. _SUCCESS) or null, got {self.complete_marker!r}")
        if (self.data_root is None) != (self.models_root is None):
            missing = "models_root" if self.models_root is None else "data_root"
            self._fail(missing, "is required with the other retrain key")
