"""The run configuration's sections as typed dataclasses, one docstring per field.

The field docstrings are the reference (``train.py --help``, docs/configuration.md: see
:mod:`sdtrain.config.keys`). Values are checked in ``__post_init__`` so that a bad config fails
on the driver, before Ray starts, with an error that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from sdtrain.config.coercion import Section, build_section, suggest
from sdtrain.errors import ConfigError
from sdtrain.storage.s3 import DEFAULT_MAX_ATTEMPTS
from sdtrain.storage.uris import has_userinfo, redact

PRESETS = ("tiny", "small", "sd2-base")


@dataclass
class DataConfig(Section):
    section: ClassVar[str] = "data"

    train: list[str] = field(default_factory=list)
    """Training parquet files: a file, a directory (all *.parquet below it), a glob, or a list of these; local or
    s3://bucket/prefix (retraining picks its own from retrain.data_root)."""
    val: list[str] = field(default_factory=list)
    """Validation parquet files, in the same forms as data.train; empty means no validation."""
    image_column: str = "image_latents_256"
    """Column holding the image latents, C*H*W values a row (flat list, fixed-size list or Ray tensor)."""
    caption_column: str = "caption_latents"
    """Column holding the caption embeddings, L*D values a row, D = the UNet's cross_attention_dim."""
    demo: bool = False
    """Generate the digits demo dataset into data.train / data.val (one directory each) if they are empty."""
    prefetch_batches: int = 2
    """Batches each worker fetches ahead of the one being trained on."""
    reads_per_worker: int = 2
    """Windows each worker's training stream reads at once, in Ray Data tasks on the worker's node that take no CPU of
    their own: they share the CPUs the worker reserves (scaling.cpus_per_worker), so any group Ray Train can place,
    after any resize, can read."""
    shuffle_chunk_rows: int = 64
    """Each epoch reads the training files as a seeded shuffle of chunks of this many consecutive rows of a file."""
    shuffle_window_rows: int = 512
    """Each worker reads its chunks in windows of this many rows (one Ray Data block) and shuffles rows within a
    window."""
    on_change: Literal["fail", "new_epoch"] = "fail"
    """When data.train, train.seed or the shuffle sizes changed since the checkpoint a run resumes from (its data
    position would read rows twice or never): fail says what changed, before Ray starts; new_epoch resumes the
    weights and starts the next epoch on the data as it is now."""
    on_read_error: Literal["fail", "skip"] = "fail"
    """A training file that cannot be read mid-run: fail stops the run at once naming the file (no retries); skip
    leaves its rows out of the loss and counts them (metric skipped_samples)."""
    latent_scaling_factor: float | None = None
    """Multiply the stored latents by this, once, as training reads them: set it (0.18215 for SD's VAE) when the files
    hold raw VAE latents; null = they are already scaled (the Anyscale notebook's files, the demo). Refused if a
    file's parquet metadata says its latents are already scaled (key sdtrain.latent_scaling_factor)."""
    unconditional_caption: str = "zeros"
    """The caption embedding of the empty prompt, which caption dropout substitutes and classifier-free guidance
    samples against: zeros, or a .npy file (L x D, the text encoder's output for "") readable by every node."""

    def __post_init__(self):
        if self.demo and (len(self.train) != 1 or len(self.val) > 1):
            self._fail("demo", "needs data.train (and data.val, if set) to be a single directory each")
        for key in ("shuffle_chunk_rows", "shuffle_window_rows"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        if self.prefetch_batches < 0:
            self._fail("prefetch_batches", f"must be >= 0, got {self.prefetch_batches}")
        if self.reads_per_worker < 1:
            self._fail("reads_per_worker", f"must be >= 1, got {self.reads_per_worker}")
        for key in ("image_column", "caption_column"):
            if not getattr(self, key):
                self._fail(key, "must be a column name, got an empty string")
        if self.latent_scaling_factor is not None and not self.latent_scaling_factor > 0:
            self._fail("latent_scaling_factor", f"must be > 0 or null, got {self.latent_scaling_factor}")
        if self.unconditional_caption != "zeros" and not self.unconditional_caption.endswith(".npy"):
            self._fail(
                "unconditional_caption", f"must be zeros or the path of a .npy file, got {self.unconditional_caption!r}"
            )


@dataclass
class ModelConfig(Section):
    section: ClassVar[str] = "model"

    preset: Literal["tiny", "small", "sd2-base"] = "small"
    """UNet architecture: tiny (CPU tests and demo), small (the Anyscale notebook's UNet), sd2-base (Stable Diffusion 2
    base)."""
    unet: dict[str, Any] = field(default_factory=dict)
    """UNet2DConditionModel keyword arguments that override the preset, e.g. model.unet.cross_attention_dim=768."""
    pretrained: str | None = None
    """Local directory, s3:// URI or hub id of a diffusers model (unet/ and scheduler/ subfolders, or a bare UNet) to
    start from."""
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    """What the UNet predicts: epsilon (the noise) or v_prediction (velocity, from the scheduler's get_velocity).
    Written into the noise scheduler config, so validation, the exported scheduler and sampling all follow it."""

    def __post_init__(self):
        from diffusers import UNet2DConditionModel

        allowed = set(inspect.signature(UNet2DConditionModel.__init__).parameters) - {"self"}
        for key in self.unet:
            if key not in allowed:
                self._fail(f"unet.{key}", "is not a UNet2DConditionModel argument" + suggest(key, allowed))
        if self.pretrained is not None and self.unet:
            self._fail("unet", "cannot override the architecture of model.pretrained; remove one of them")


@dataclass
class TrainConfig(Section):
    section: ClassVar[str] = "train"

    max_steps: int = 550_000
    """Optimizer steps to train for; the run ends exactly here, across restarts."""
    global_batch_size: int = 32
    """Samples per optimizer step across all workers, at every world size: world size x train.micro_batch_size x
    gradient accumulation."""
    micro_batch_size: int | None = None
    """Samples per worker per forward/backward pass; gradients accumulate until global_batch_size. null = the largest
    size that divides the per-worker batch at every allowed world size."""
    lr: float = 1e-4
    """AdamW peak learning rate, reached after train.warmup_steps and then held."""
    warmup_steps: int = 10_000
    """Steps of linear learning-rate warmup from 0."""
    weight_decay: float = 1e-2
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["auto", "bf16-mixed", "16-mixed", "32-true"] = "auto"
    """Lightning precision; auto = bf16-mixed on GPU (16-mixed where bf16 is unsupported), 32-true on CPU. 16-mixed
    (fp16 with a GradScaler, whose overflow steps are skipped without counting toward train.max_bad_steps) needs
    GPUs and ddp."""
    seed: int = 0
    """Seed for weight init, and with rank and step for each step's noise and timesteps; also the validation noise."""
    max_bad_steps: int = 20
    """Stop the run after this many consecutive steps skipped for a NaN/inf gradient (checked at each log step)."""
    snr_gamma: float | None = None
    """Min-SNR-gamma loss weighting (arXiv 2303.09556): each sample's MSE is weighted by min(SNR, gamma)/SNR (epsilon)
    or min(SNR, gamma)/(SNR+1) (v_prediction); 5.0 is the paper's value; null = unweighted."""
    noise_offset: float = 0.0
    """Offset noise: add noise_offset x N(0,1) per sample and channel to the noise (0.05-0.1 typical); 0 = off."""
    input_perturbation: float = 0.0
    """Input perturbation: noise the UNet input with noise + input_perturbation x N(0,1) while the target keeps the
    noise (0.1 typical); 0 = off."""
    caption_dropout_prob: float = 0.0
    """Probability that a sample's caption is replaced by data.unconditional_caption, so the model also learns the
    unconditional prediction that classifier-free guidance needs (0.1 typical)."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the UNet weights with this decay (e.g. 0.9999), saved in checkpoints and
    used for validation, export and generation; null = no EMA."""
    ema_start_step: int = 0
    """Until this step the EMA copies the weights; after it, it averages them with train.ema_decay."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Distributed strategy: ddp (Ray's RayDDPStrategy: every worker holds the whole model) or fsdp (FSDP2, torch's
    fully_shard: weights, gradients, optimizer state and EMA sharded over the workers, for UNets too large for ddp;
    checkpoints are the same full files as ddp's, resumable at any world size)."""
    compile: bool = False
    """torch.compile the UNet (the first steps are slow while it compiles)."""
    channels_last: bool = False
    """Store the UNet's weights and activations channels-last (faster convolutions on tensor-core GPUs)."""
    gradient_checkpointing: bool = False
    """Recompute the UNet's activations in the backward pass instead of storing them: less memory, about 30% slower."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel: sdpa (torch's scaled_dot_product_attention: flash or memory-efficient kernels on GPUs) or
    eager (plain matmul and softmax)."""

    def __post_init__(self):
        for key in ("max_steps", "global_batch_size", "max_bad_steps"):
            if getattr(self, key) <= 0:
                self._fail(key, f"must be > 0, got {getattr(self, key)}")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            self._fail("micro_batch_size", f"must be > 0 or null, got {self.micro_batch_size}")
        if not self.lr > 0:
            self._fail("lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.seed < 2**63:  # numpy's generators (the read order, noise) take no negative seed
            self._fail("seed", f"must be in [0, 2**63), got {self.seed}")
        for key in (
            "warmup_steps",
            "weight_decay",
            "grad_clip_norm",
            "noise_offset",
            "input_perturbation",
            "ema_start_step",
        ):
            if getattr(self, key) < 0:
                self._fail(key, f"must be >= 0, got {getattr(self, key)}")
        if self.snr_gamma is not None and not self.snr_gamma > 0:
            self._fail("snr_gamma", f"must be > 0 or null, got {self.snr_gamma}")
        if not 0 <= self.caption_dropout_prob < 1:
            self._fail("caption_dropout_prob", f"must be in [0, 1), got {self.caption_dropout_prob}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            self._fail("ema_decay", f"must be in (0, 1) or null, got {self.ema_decay}")
        if self.strategy == "fsdp" and self.channels_last:
            self._fail(
                "channels_last",
                "cannot be used with train.strategy=fsdp: FSDP2 shards only contiguous parameters (torch: "
                '"FSDP does not support non-contiguous parameters"); turn one of them off',
            )
        if self.strategy == "fsdp" and self.precision == "16-mixed":
            self._fail(
                "precision",
                "16-mixed cannot run with train.strategy=fsdp (a GradScaler would skip a step on one rank's "
                "overflowed shard only); use bf16-mixed, or ddp",
            )


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
        if self.cpus_per_worker != "auto" and not self.cpus_per_worker > 0:
            self._fail("cpus_per_worker", f"must be > 0 or auto, got {self.cpus_per_worker}")
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
    checkpoint_every_n_steps: int = 1000
    """Report a checkpoint every this many optimizer steps, and always at the end."""
    num_to_keep: int | None = 3
    """Checkpoints to keep (the newest); null keeps all."""
    log_every_n_steps: int = 50
    """Log a progress line and report metrics every this many steps."""
    val_every_n_steps: int | None = None
    """Compute the validation loss on data.val every this many steps; null = at every checkpoint."""
    checkpoint_upload: Literal["async", "sync"] = "async"
    """async: training goes on while Ray Train uploads a checkpoint to run.storage_path (committed, and older ones
    pruned, once it is all there); sync: wait for the upload. The wait shows in the metric checkpoint_stall_s."""
    stall_timeout_s: float | None = 1800.0
    """A worker that completes no optimizer step for this many seconds, not counting start-up, validation,
    checkpoints and sample grids (run.slow_phase_timeout_s bounds those), logs what it was doing (waiting for data,
    in a step's collectives, reporting) and ends, so Ray Train restarts the group from the latest checkpoint or the
    job fails visibly instead of hanging. null = no watchdog."""
    slow_phase_timeout_s: float | None = 7200.0
    """The longest a worker may spend in one slow phase between steps: start-up (building the model, restoring the
    checkpoint, joining the other ranks), a validation, a checkpoint's save, upload and barrier, or a sample grid;
    beyond it the worker logs the phase and ends as for run.stall_timeout_s. Keep it above the longest of them.
    null = unbounded."""
    record_samples: bool = False
    """Save into each checkpoint, as samples.npy, the sample index (row number in data.train's files, in order) of
    every row trained on since the previous checkpoint, all ranks: an exact record of what the model saw."""
    staging_dir: str | None = None
    """Local directory (each node's own disk) where checkpoints are written before their upload and a restored
    checkpoint is downloaded to; it needs room for about two checkpoints. null = the system's temporary directory.
    What a killed worker left there is removed when the run's next worker group starts."""
    start_fresh: bool = False
    """Start from step 0 even if run.storage_path/run.name holds a run; the old run is kept, renamed to
    <name>.replaced-<UTC time>. For one-off command lines, not a retried job (each retry would start over)."""
    checkpoint_score_attribute: Literal["val_loss", "loss"] | None = None
    """Keep the run.num_to_keep checkpoints with the lowest value of this metric (plus the latest, which a resume
    starts from) instead of the newest; null = the newest."""
    export: bool = True
    """At the end of the run, export the final (EMA) UNet and noise scheduler in diffusers format to
    run.storage_path/run.name/export/."""
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 logs the full config, every reported metric at its step and the sample grids to
    (one tracker run per training run, continued across restarts; ids in trackers.json in the run directory):
    tensorboard (event files in the run directory's tensorboard/), mlflow (run.mlflow_tracking_uri), wandb
    (project run.wandb_project; credentials and WANDB_MODE from the environment). [] = none."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server for run.trackers' mlflow (e.g. http://mlflow:5000); null = MLFLOW_TRACKING_URI."""
    mlflow_experiment: str = "sdtrain"
    """MLflow experiment the run is logged under."""
    mlflow_register_as: str | None = None
    """Register the final export as a new version of this MLflow model; null = only attach it to the run."""
    wandb_project: str = "sdtrain"
    """W&B project the run is logged under."""
    sample_every_n_steps: int | None = None
    """Rank 0 samples a fixed grid (run.sample_captions, fixed seed, the EMA weights) every this many steps and at
    the end, saved as samples/step_<N>.png in the run directory and sent to run.trackers; null = with each
    checkpoint. No grid when neither run.sample_captions nor data.val is set, or under train.strategy=fsdp."""
    sample_captions: str | None = None
    """Captions of the sample grid's rows: a .npy of embeddings ((L, D) or (N, L, D)) or parquet with
    data.caption_column; null = data.val (one row per label for the digits demo, else its first run.sample_rows)."""
    sample_rows: int = 4
    """Rows (captions) of the sample grid, when its captions are not one per label."""
    sample_columns: int = 4
    """Samples per caption in the sample grid."""
    sample_sampler: Literal["ddim", "dpm"] = "ddim"
    """Sampler of the sample grid: ddim or dpm (DPM-Solver++)."""
    sample_steps: int = 20
    """Denoising steps per sample of the sample grid."""
    sample_guidance_scale: float = 3.0
    """Classifier-free guidance scale of the sample grid (1 = none)."""

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            self._fail("name", f"must be letters, digits, '.', '_' or '-' (it names a directory), got {self.name!r}")
        if not self.storage_path:
            self._fail("storage_path", "must be a directory path")
        for key in ("checkpoint_every_n_steps", "log_every_n_steps"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        if self.num_to_keep is not None and self.num_to_keep < 1:
            self._fail("num_to_keep", f"must be >= 1 or null (keep all), got {self.num_to_keep}")
        if self.val_every_n_steps is not None and self.val_every_n_steps < 1:
            self._fail("val_every_n_steps", f"must be >= 1 or null, got {self.val_every_n_steps}")
        for key in ("stall_timeout_s", "slow_phase_timeout_s"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                self._fail(key, f"must be > 0 seconds or null, got {getattr(self, key)}")
        if self.mlflow_tracking_uri is not None and has_userinfo(self.mlflow_tracking_uri):
            # The config goes into tracker params, checkpoint metadata and registry manifests: never a secret.
            self._fail(
                "mlflow_tracking_uri",
                f"{redact(self.mlflow_tracking_uri)} holds a user name or password; credentials are never taken "
                "from the config (they would be copied into checkpoints, manifests and logs): set "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment",
            )
        if len(set(self.trackers)) != len(self.trackers):
            self._fail("trackers", f"names a tracker twice: {self.trackers}")
        if self.sample_every_n_steps is not None and self.sample_every_n_steps < 1:
            self._fail("sample_every_n_steps", f"must be >= 1 or null, got {self.sample_every_n_steps}")
        for key in ("sample_rows", "sample_columns", "sample_steps"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        if self.sample_guidance_scale < 0:
            self._fail("sample_guidance_scale", f"must be >= 0 (1: no guidance), got {self.sample_guidance_scale}")


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
    """Attempts per S3 request, with exponential backoff, before a throttled or dropped request fails; 1 = no
    retries."""

    def __post_init__(self):
        if self.endpoint_url is not None:
            if has_userinfo(self.endpoint_url):  # the message must not repeat the secret
                self._fail("endpoint_url", f"{redact(self.endpoint_url)} holds a user name or password; " + _NO_SECRETS)
            if not re.fullmatch(r"https?://[^/\s]+/?", self.endpoint_url):
                self._fail("endpoint_url", f"must be http(s)://host[:port], got {self.endpoint_url!r}")
        if self.max_attempts < 1:
            self._fail("max_attempts", f"must be >= 1 (1 = no retries), got {self.max_attempts}")


_NO_SECRETS = (
    "credentials are never taken from the config (they would be copied into checkpoints, manifests and logs): "
    "use the AWS credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)"
)


@dataclass
class RetrainConfig(Section):
    section: ClassVar[str] = "retrain"

    data_root: str | None = None
    """Directory of date partitions (date=YYYY-MM-DD/ holding parquet files) that entrypoints/retrain.py takes new data
    from."""
    models_root: str | None = None
    """Where retraining keeps model versions (versions/vNNNN/) and the production pointer (production.json)."""
    tolerance: float = 0.0
    """Promote a retrained model if its validation loss <= the production model's x (1 + tolerance)."""
    date: str | None = None
    """Schedule date (YYYY-MM-DD) a retrain run is for: it takes partitions up to it, once; null = in an Anyscale job,
    the UTC date of the job's first attempt (its retries keep it, even after midnight), else today (UTC)."""
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
            self._fail(
                "models_root" if self.models_root is None else "data_root", "is required with the other retrain key"
            )


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)

    def __post_init__(self):
        for key, uri in self.storage_uris():
            if has_userinfo(uri):
                raise ConfigError(f"{key}: {redact(uri)} holds a user name or password; {_NO_SECRETS}")
        if not self.data.train and self.retrain.data_root is None:
            raise ConfigError("data.train: is required: give a parquet file, directory, glob or list of them")
        if self.retrain.data_root is not None and not self.data.val:
            raise ConfigError(
                "data.val: retraining needs a fixed held-out set to compare the new and production models on"
            )
        if self.train.precision == "16-mixed" and self.scaling.use_gpu is False:
            raise ConfigError(
                "train.precision: 16-mixed needs GPUs (CPUs have no fp16 autocast); use bf16-mixed or 32-true"
            )
        if self.run.checkpoint_score_attribute == "val_loss":
            if not self.data.val:
                raise ConfigError("run.checkpoint_score_attribute: val_loss needs data.val")
            every = self.run.val_every_n_steps
            if every is not None and self.run.checkpoint_every_n_steps % every:
                raise ConfigError(
                    f"run.checkpoint_score_attribute: val_loss needs a validation loss with every checkpoint, but "
                    f"run.val_every_n_steps={every} does not divide "
                    f"run.checkpoint_every_n_steps={self.run.checkpoint_every_n_steps}"
                )
        for world_size in range(self.scaling.min_workers, self.scaling.max_workers + 1):
            self.batch_layout(world_size)

    def batch_layout(self, world_size: int) -> tuple[int, int]:
        """(micro-batch size, gradient accumulation steps) that make train.global_batch_size at ``world_size``."""
        batch, micro = self.train.global_batch_size, self.train.micro_batch_size
        allowed = range(self.scaling.min_workers, self.scaling.max_workers + 1)
        if batch % world_size:
            raise ConfigError(
                f"train.global_batch_size: {batch} does not divide evenly over {world_size} worker(s), which "
                f"scaling.num_workers={self.scaling.num_workers} allows; pick a multiple of every allowed world size"
            )
        if micro is None:
            micro = math.gcd(*(batch // n for n in allowed if batch % n == 0))
        per_worker = batch // world_size
        if per_worker % micro:
            raise ConfigError(
                f"train.micro_batch_size: {micro} does not divide the {per_worker} samples each of {world_size} "
                f"worker(s) takes per step (train.global_batch_size={batch}); use a divisor of it, or null"
            )
        return micro, per_worker // micro

    def storage_uris(self) -> list[tuple[str, str]]:
        """(key, path) for every path or URI the config names: data, models and storage."""
        named: list[tuple[str, str | None]] = [(f"data.train[{i}]", p) for i, p in enumerate(self.data.train)]
        named += [(f"data.val[{i}]", p) for i, p in enumerate(self.data.val)]
        if self.data.unconditional_caption != "zeros":
            named.append(("data.unconditional_caption", self.data.unconditional_caption))
        named += [("model.pretrained", self.model.pretrained), ("run.storage_path", self.run.storage_path)]
        named += [("retrain.data_root", self.retrain.data_root), ("retrain.models_root", self.retrain.models_root)]
        return [(key, path) for key, path in named if path is not None]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Build and validate a Config from nested plain data (YAML, or ``to_dict`` output)."""
        raw = dict(raw)
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = SECTIONS[f.name]
            value = raw.pop(f.name, None) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{f.name}: must be a mapping of keys, got {value!r}")
            sections[f.name] = build_section(section_cls, value)
        if raw:
            key = next(iter(raw))
            raise ConfigError(f"{key}: unknown section" + suggest(key, [f.name for f in dataclasses.fields(cls)]))
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type[Section]] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "scaling": ScalingConfig,
    "run": RunConfig,
    "failure": FailureConfig,
    "storage": StorageConfig,
    "retrain": RetrainConfig,
}
