"""The sections that say what is learned, from what and how: data, model, train.

Each field's docstring is its reference (``train.py --help``, docs/configuration.md); values are checked in
``__post_init__``, on the driver, before Ray starts. Import them from :mod:`sdtrain.config.schema`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from sdtrain.config.coercion import Section, suggest

PRESETS = ("tiny", "small", "sd2-base", "tiny-sdxl", "sdxl-base")


@dataclass(frozen=True)
class Columns:
    """The two columns a dataset's rows are read from: the latents (data.latent_column) and the captions
    (data.caption_column), embeddings or token ids."""

    latent: str
    caption: str
    further_ids: tuple[str, ...] = ()
    """Token-id captions of several tokenizers (SDXL's): the columns of the ids after the first's, read with it and
    joined onto its ids in order. Set from the files (sdtrain.data.metadata.TokenIds), not by the config."""

    @property
    def captions(self) -> tuple[str, ...]:
        """The caption columns: data.caption_column, and the further tokenizers' ids."""
        return (self.caption, *self.further_ids)

    def names(self) -> list[str]:
        return [self.latent, *self.captions]


@dataclass
class DataConfig(Section):
    section: ClassVar[str] = "data"

    train: list[str] = field(default_factory=list)
    """Training parquet files: a file, a directory (all *.parquet below it), a glob, or a list of these; local or
    s3://bucket/prefix (retraining picks its own from retrain.data_root)."""
    val: list[str] = field(default_factory=list)
    """Validation parquet files, in the same forms as data.train; empty means no validation."""
    latent_column: str = "image_latents_256"
    """Column holding the image latents, C*H*W values a row (flat list, fixed-size list or Ray tensor)."""
    caption_column: str = "caption_latents"
    """Column holding the caption embeddings, L*D values a row, D = the UNet's cross_attention_dim; or the captions'
    token ids (L integers a row, e.g. preprocessing's caption_ids), which each worker encodes in the step with the
    text encoder the files name (docs/data.md, Captions as token ids)."""
    pooled_caption_column: str = "caption_pooled"
    """For an SDXL-shaped UNet trained on caption embeddings: the column holding each caption's pooled text
    embedding (P values a row, P = the UNet's pooled width; preprocessing with an SDXL model writes it). Data of
    token ids needs none: the text encoders compute it in the step."""
    prefetch_batches: int = 2
    """Batches each worker fetches ahead of the one being trained on."""
    reads_per_worker: int = 2
    """Windows each worker's training stream reads at once, in Ray Data tasks on the worker's node that take no CPU of
    their own: they share the CPUs the worker reserves (scaling.cpus_per_worker), so any group Ray Train can place,
    after any resize, can read."""
    val_memory_gb: float = 2.0
    """Each worker holds data.val in its CPU memory after the first validation read it, if it takes at most this many
    GB (decoded): later validations read no file. A larger set is read again at every validation; 0 always reads it."""
    shuffle_chunk_rows: int = 64
    """Each epoch reads the training files as a seeded shuffle of chunks of this many consecutive rows of a file."""
    shuffle_window_rows: int = 512
    """Each worker reads its chunks in windows of this many rows (one Ray Data block) and shuffles rows within a
    window. Not bucketed data's: its rows keep their order within a chunk (docs/data.md, Aspect-ratio buckets)."""
    bucket_steps: Literal["auto"] | int = "auto"
    """Bucketed data: optimizer steps of one bucket in a row (a turn), over which each rank reads whole chunks, where
    one step a turn has ranks whose share of a step (train.global_batch_size / workers) is under a chunk read the
    same row groups (docs/data.md, Aspect-ratio buckets); the model then sees that many steps of one aspect ratio in a
    row. auto = data.shuffle_chunk_rows / that share at scaling's most workers where that is over 1 (the fewest steps
    whose lanes make whole chunks), else 1; a resumed run keeps its checkpoint's. A number must divide
    data.shuffle_chunk_rows."""
    on_resume_change: Literal["fail", "new_epoch"] = "fail"
    """When data.train, train.seed or the shuffle sizes changed since the checkpoint a run resumes from (its data
    position would read rows twice or never): fail says what changed, before Ray starts; new_epoch resumes the
    weights and starts the next epoch on the data as it is now."""
    on_read_error: Literal["fail", "skip"] = "fail"
    """A training file that cannot be read mid-run: fail stops the run at once naming the file (no retries); skip
    leaves its rows out of the loss and counts them (metric skipped_samples)."""
    latent_scaling_factor: float | None = None
    """Multiply the stored latents by this, once, as training reads them: set it (0.18215 for SD's VAE) when the files
    hold raw VAE latents; null = they are already scaled (the Anyscale notebook's files). Refused if a
    file's parquet metadata says its latents are already scaled (key sdtrain.latent_scaling_factor)."""
    unconditional_caption: str = "auto"
    """The caption embedding of the empty prompt, which caption dropout substitutes and classifier-free guidance
    samples against: zeros, or a .npy file (L x D, the text encoder's output for "") readable by every node; for
    data of token ids also the empty prompt's L ids (preprocessing's unconditional_caption_ids.npy), which each
    worker encodes. auto: the file preprocessing wrote beside data.train's first file (unconditional_caption.npy, or
    unconditional_caption_ids.npy for token ids), which diffusers' pipelines encode for "" too; zeros where there is
    none, and for an SDXL-shaped UNet (which drops captions to zeros). A resumed run keeps its checkpoint's."""

    @property
    def columns(self) -> Columns:
        return Columns(self.latent_column, self.caption_column)

    def __post_init__(self):
        for key in ("shuffle_chunk_rows", "shuffle_window_rows"):
            if getattr(self, key) < 1:
                self._fail(key, f"must be >= 1, got {getattr(self, key)}")
        steps = self.bucket_steps
        if isinstance(steps, int) and (steps < 1 or self.shuffle_chunk_rows % steps):  # else auto: the loader checks
            self._fail(
                "bucket_steps",
                f"must be auto or a divisor of data.shuffle_chunk_rows={self.shuffle_chunk_rows} (each step takes an "
                f"equal part of a chunk), got {steps}",
            )
        if self.prefetch_batches < 0:
            self._fail("prefetch_batches", f"must be >= 0, got {self.prefetch_batches}")
        self._within("val_memory_gb", 0, 1e6, "GB")  # a worker holds int(GB * 1e9) bytes: no overflow
        if self.reads_per_worker < 1:
            self._fail("reads_per_worker", f"must be >= 1, got {self.reads_per_worker}")
        for key in ("latent_column", "caption_column", "pooled_caption_column"):
            if not getattr(self, key):
                self._fail(key, "must be a column name, got an empty string")
        if self.latent_scaling_factor is not None and not self.latent_scaling_factor > 0:
            self._fail("latent_scaling_factor", f"must be > 0 or null, got {self.latent_scaling_factor}")
        if self.unconditional_caption not in ("zeros", "auto") and not self.unconditional_caption.endswith(".npy"):
            self._fail(
                "unconditional_caption",
                f"must be auto, zeros or the path of a .npy file, got {self.unconditional_caption!r}",
            )


@dataclass
class ModelConfig(Section):
    section: ClassVar[str] = "model"

    preset: Literal["tiny", "small", "sd2-base", "tiny-sdxl", "sdxl-base"] = "small"
    """UNet architecture: tiny (tests, laptops), small (the Anyscale notebook's UNet), sd2-base (Stable Diffusion 2
    base), sdxl-base (SDXL base 1.0: two text encoders' captions, pooled text and size conditioning), tiny-sdxl
    (SDXL's layout at test size)."""
    unet: dict[str, Any] = field(default_factory=dict)
    """UNet2DConditionModel keyword arguments that override the preset, e.g. model.unet.cross_attention_dim=768."""
    pretrained: str | None = None
    """Local directory, s3:// URI or hub id of a diffusers model (unet/ and scheduler/ subfolders, or a bare UNet) to
    start from."""
    prediction_type: Literal["epsilon", "v_prediction"] | None = None
    """What the UNet predicts: epsilon (the noise) or v_prediction (velocity, from the scheduler's get_velocity).
    null = model.pretrained's scheduler's (a v-prediction model keeps training as one), else epsilon. Written into the
    noise scheduler config, so validation, the exported scheduler and sampling all follow it. A value other than
    model.pretrained's changes the model's objective: allowed, with a warning naming both. A zero-terminal-SNR
    schedule (train.zero_terminal_snr, or model.pretrained's) needs v_prediction."""

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
    micro_batch_size: Literal["auto"] | int | None = None
    """Samples per worker per forward/backward pass; gradients accumulate until global_batch_size. null = the largest
    size that divides the per-worker batch at every allowed world size. auto = on GPU workers, the largest of those
    sizes whose step the memory model (sdtrain.model.memory) predicts fits 90% of the cluster's GPU with 1 GiB for the
    runtime; on CPU workers, or where the cluster's GPU model is not known yet, as null. On GPU workers a size (or
    null's) predicted not to fit the GPU is refused before any worker starts, and one over 90% of it (too little left
    for the caching allocator's fragmentation) or over its smaller memory variant trains with a line saying so."""
    lr: float = 1e-4
    """AdamW peak learning rate, reached after train.warmup_steps and then held."""
    warmup_steps: int = 10_000
    """Steps of linear learning-rate warmup from 0; at most train.max_steps (more never reaches train.lr: the driver
    warns)."""
    weight_decay: float = 1e-2
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["auto", "bf16-mixed", "16-mixed", "32-true"] = "auto"
    """Lightning precision; auto = bf16-mixed on GPU (16-mixed where bf16 is unsupported), 32-true on CPU. 16-mixed
    (fp16 with a GradScaler, whose overflow steps are skipped without counting toward train.max_nonfinite_steps) needs
    GPUs and ddp."""
    seed: int = 0
    """Seed for weight init, and with rank and step for each step's noise and timesteps; also the validation noise."""
    max_nonfinite_steps: int = 20
    """Stop the run after this many consecutive steps skipped for a NaN/inf gradient (checked at each log step)."""
    snr_gamma: float | None = None
    """Min-SNR-gamma loss weighting (arXiv 2303.09556): each sample's MSE is weighted by min(SNR, gamma)/SNR (epsilon)
    or min(SNR, gamma)/(SNR+1) (v_prediction); 5.0 is the paper's value; null = unweighted."""
    zero_terminal_snr: bool = False
    """Rescale the noise schedule's betas so its last timestep is pure noise (SNR 0; Lin et al. 2023, "Common
    Diffusion Noise Schedules and Sample Steps are Flawed"): the model learns to generate from noise alone, as
    sampling starts, instead of from the sliver of signal the stock schedule leaves. Needs
    model.prediction_type: v_prediction (an epsilon prediction at SNR 0 says nothing of the image); sampling then
    uses trailing timesteps and guidance rescale (generate.py --guidance-rescale, default 0.7), and the exported
    scheduler carries both."""
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
    used for validation, export and generation; null = no EMA. The decay ramps up to it as diffusers' EMAModel's
    does: min(ema_decay, (1 + n) / (10 + n)), n steps after the EMA starts (train.ema_start_step); except a warm
    start that continues a registry version's EMA (retraining) with ema_start_step 0, which averages at ema_decay
    from step 1."""
    ema_start_step: int = 0
    """Through step ema_start_step + 1 the EMA copies the weights; after it, it averages them with a decay that ramps
    up to train.ema_decay (diffusers' EMAModel with update_after_step = ema_start_step)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Distributed strategy: ddp (Ray's RayDDPStrategy: every worker holds the whole model) or fsdp (FSDP2, torch's
    fully_shard: weights, gradients, optimizer state and EMA sharded over the workers, for UNets too large for ddp;
    checkpoints are the same full files as ddp's, resumable at any world size)."""
    compile: bool = False
    """torch.compile the UNet (the first steps are slow while it compiles)."""
    channels_last: bool = False
    """Store the UNet's weights and activations channels-last. Only with train.compile: in eager mode on CUDA half the
    GroupNorms copy their input back to NCHW and the next convolutions copy it back (counted on fake CUDA, docs/gpu.md),
    so a GPU run with it on and compile off logs a warning."""
    gradient_checkpointing: bool = False
    """Recompute the UNet's activations in the backward pass instead of storing them: less memory, about 30% slower."""
    attention: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel: sdpa (torch's scaled_dot_product_attention: flash or memory-efficient kernels on GPUs) or
    eager (plain matmul and softmax)."""
    ddp_bucket_mb: int = 25
    """DDP's gradient bucket size in MiB (bucket_cap_mb; torch's default 25): each bucket is all-reduced as soon as the
    backward pass has filled it, overlapping communication with the rest of the backward pass. Larger buckets mean
    fewer, larger all-reduces (fewer latency-bound calls on slow links) but less overlap; ddp only."""
    gradient_compression: Literal["none", "bf16"] = "none"
    """Gradients sent as bfloat16, half the bytes of float32, for multi-node jobs whose network, not compute, bounds
    the step: ddp all-reduces each bucket as bf16 (torch's bf16_compress_hook), fsdp reduce-scatters in bf16
    (MixedPrecisionPolicy.reduce_dtype). The sum over ranks loses precision (8-bit mantissa); none = float32."""
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype FSDP2 all-gathers and computes the UNet's parameters in (MixedPrecisionPolicy.param_dtype; the
    sharded weights, the optimizer and the EMA stay float32): auto = bfloat16 when train.precision resolves to
    bf16-mixed, else float32. bfloat16 halves the all-gather bytes; fsdp only."""

    def unreached_lr(self) -> str | None:
        """What a warmup longer than the run costs, or None. The driver warns of it before Ray starts (not refused:
        tests, demos and the check's phases shorten max_steps where the learning rate does not matter)."""
        if self.warmup_steps <= self.max_steps:
            return None
        return (
            f"train.warmup_steps: {self.warmup_steps} is more than train.max_steps={self.max_steps}: the learning "
            f"rate warms up linearly to train.lr={self.lr:g} over train.warmup_steps, so the run ends at about "
            f"{self.lr * self.max_steps / self.warmup_steps:.3g}, never reaching train.lr; set train.warmup_steps "
            "to at most train.max_steps (a few percent of it is usual), or raise train.max_steps"
        )

    def __post_init__(self):
        for key in ("max_steps", "global_batch_size", "max_nonfinite_steps"):
            if getattr(self, key) <= 0:
                self._fail(key, f"must be > 0, got {getattr(self, key)}")
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size <= 0:
            self._fail("micro_batch_size", f"must be > 0, auto or null, got {self.micro_batch_size}")
        if not self.lr > 0:
            self._fail("lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.seed < 2**32:  # numpy takes no negative seed; Lightning's seed_everything none >= 2**32
            self._fail("seed", f"must be in [0, 2**32) (an unsigned 32-bit seed, as Lightning takes), got {self.seed}")
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
        # DDP's reducer takes the bytes as a C++ int64; 1 TiB holds any model's gradients in one bucket.
        self._within("ddp_bucket_mb", 1, 2**20, "MiB")
        if self.strategy != "fsdp" and self.fsdp_param_dtype != "auto":
            self._fail(
                "fsdp_param_dtype",
                f"applies only to train.strategy=fsdp (strategy is {self.strategy}); leave it auto",
            )
        if self.strategy == "fsdp" and self.precision == "16-mixed":
            self._fail(
                "precision",
                "16-mixed cannot run with train.strategy=fsdp (a GradScaler would skip a step on one rank's "
                "overflowed shard only); use bf16-mixed, or ddp",
            )
