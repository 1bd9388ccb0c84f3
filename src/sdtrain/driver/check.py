"""The check job users run first: their config's training for a few minutes on their own cluster, on one GPU and then
on all the job's GPUs, each a real Ray Train run through the same driver as the real one, and a table of what each
measured beside what sdtrain predicts (docs/performance.md). What a CPU cannot prove (kernel speed, NCCL, memory
fragmentation: ../shared/GPU.md) is measured here.

    python entrypoints/check.py --config configs/small.yaml            # on the cluster (check_job.yaml)

Each phase is its own short run under ``<run.storage_path>/checks/``, compiled (train.compile: the fast path) unless
``--eager``, with a checkpoint halfway (its stall is measured) and no export, trackers or evaluation (Ray Train would
wait for the final checkpoint's evaluation: up to twice eval.timeout_s). The one-GPU phase trains
the per-GPU batch of the full run (train.global_batch_size / the most workers), so its images/s per GPU against the
full run's is the share of a step the full run loses to communication. Exit 1 if any phase failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sdtrain.config.loader import load_config
from sdtrain.config.running import EVAL_METRICS
from sdtrain.config.schema import Config
from sdtrain.train.reporting import format_duration


@dataclass(frozen=True)
class Phase:
    """One run of the check and what it measured (None: not measured, or the run failed).

    Args:
        name: what the phase runs ("1 GPU", "4 GPUs").
        workers: its world size.
        options: the GPU options it trained with.
        error: why it failed; None if it trained.
        images_per_s_per_gpu: the last report window's images/s of one worker (after the first window, which holds
            compilation).
        mfu: model FLOPs utilization in that window (GPU workers only).
        data_wait: the share of that window the slowest rank waited for data.
        checkpoint_stall_s: seconds the training loop waited on the checkpoint.
        peak_memory_gb: the largest rank's peak allocated GPU memory (GPU workers only).
        predicted_memory_gb: the memory model's peak for a rank of this phase (sdtrain.model.memory).
        steps_per_s: optimizer steps per second in that window.
    """

    name: str
    workers: int
    options: str
    error: str | None = None
    images_per_s_per_gpu: float | None = None
    mfu: float | None = None
    data_wait: float | None = None
    checkpoint_stall_s: float | None = None
    peak_memory_gb: float | None = None
    predicted_memory_gb: float | None = None
    steps_per_s: float | None = None


@dataclass(frozen=True)
class CheckReport:
    """The check's phases and the projection of the configured run from the last of them.

    Args:
        config: the configured run.
        phases: the phases, one GPU first.
        communication_share: 1 - the full run's images/s per GPU over the one-GPU phase's (None if either failed).
        projected_hours: train.max_steps at the full run's step rate.
        projected_cost: those hours on every worker at run.gpu_hour_cost (None without a price).
    """

    config: Config
    phases: list[Phase]
    communication_share: float | None
    projected_hours: float | None
    projected_cost: float | None

    @property
    def failed(self) -> bool:
        return any(phase.error is not None for phase in self.phases)

    def table(self) -> list[str]:
        """The report, as lines to print."""
        lines = [
            f"{'phase':10} {'options':34} {'result':8} {'img/s/GPU':>9} {'MFU':>6} {'data wait':>9} "
            f"{'ckpt stall':>10} {'peak GB (predicted)':>19}",
        ]
        for phase in self.phases:
            lines.append(
                f"{phase.name:10} {phase.options:34} {'failed' if phase.error else 'trained':8} "
                f"{_figure(phase.images_per_s_per_gpu, '.1f'):>9} {_figure(phase.mfu, '.1%'):>6} "
                f"{_figure(phase.data_wait, '.1%'):>9} {_figure(phase.checkpoint_stall_s, '.1f', ' s'):>10} "
                f"{_figure(phase.peak_memory_gb, '.2f'):>10} ({_figure(phase.predicted_memory_gb, '.2f')})"
            )
        lines += [f"{phase.name} failed: {phase.error}" for phase in self.phases if phase.error]
        if self.config.eval.enabled:
            lines.append(
                f"evaluation: off in the check's phases (the run evaluates {', '.join(self.config.eval.metrics)}), "
                "whose ends would wait for their final checkpoint's evaluation"
            )
        lines.append(f"communication: {_figure(self.communication_share, '.1%')} of the full run's step")
        if self.projected_hours is not None:
            steps = self.config.train.max_steps
            cost = f", {self.projected_cost:,.0f} at run.gpu_hour_cost" if self.projected_cost is not None else ""
            lines.append(
                f"projected: {steps} steps in {format_duration(self.projected_hours * 3600)} on "
                f"{self.config.scaling.max_workers} workers{cost}"
            )
        return lines


def _figure(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}{unit}"


def check(config_file: str | None, overrides: Sequence[str], steps: int = 40, compile_unet: bool = True) -> CheckReport:
    """Run the check of a config: ``steps`` optimizer steps on one worker, then on its most workers.

    Args:
        config_file: the run's YAML config, as ``train.py --config`` takes it.
        overrides: its ``key.sub=value`` overrides.
        steps: optimizer steps a phase trains (its first report window, which holds compilation, is not measured).
        compile_unet: train with train.compile=true (the fast path), else as configured.
    """
    config = load_config(config_file, overrides)
    most = config.scaling.max_workers
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    phases = []
    for workers in sorted({1, most}):
        phase = phase_config(config_file, overrides, workers, steps, compile_unet, stamp)
        phases.append(_run_phase(phase, workers))
    one, full = phases[0], phases[-1]
    share = None
    if len(phases) > 1 and one.images_per_s_per_gpu and full.images_per_s_per_gpu:
        share = max(0.0, 1 - full.images_per_s_per_gpu / one.images_per_s_per_gpu)
    hours = cost = None
    if full.steps_per_s:
        hours = config.train.max_steps / full.steps_per_s / 3600
        if config.run.gpu_hour_cost is not None:
            cost = hours * most * config.run.gpu_hour_cost
    return CheckReport(config, phases, share, hours, cost)


def phase_config(
    config_file: str | None,
    overrides: Sequence[str],
    workers: int,
    steps: int = 40,
    compile_unet: bool = True,
    stamp: str = "T",
) -> Config:
    """The config of the check's phase on ``workers`` workers: ``steps`` steps of the configured run's per-GPU work,
    as its own run under ``<run.storage_path>/checks/``, checkpointed halfway, without export or trackers."""
    config = load_config(config_file, overrides)
    most = config.scaling.max_workers
    # The one-GPU phase trains one GPU's share of the full run's batch: the same work per GPU and step.
    batch = config.train.global_batch_size * workers // most
    phase_overrides = [
        *overrides,
        f"run.name={config.run.name}-check-{stamp}-{workers}w",
        f"run.storage_path={config.run.storage_path.rstrip('/')}/checks",
        f"run.log_every_n_steps={max(1, steps // 4)}",
        f"train.max_steps={steps}",
        f"train.global_batch_size={batch}",
        f"scaling.num_workers={workers}",
        f"checkpoint.every_n_steps={max(1, steps // 2)}",
        "checkpoint.num_to_keep=null",
        "export.enabled=false",
        "tracking.trackers=[]",
        *(["train.compile=true"] if compile_unet else []),
        *_without_evaluation(config),
    ]
    return load_config(config_file, phase_overrides)


def _without_evaluation(config: Config) -> list[str]:
    """Overrides that turn eval off: Ray Train waits for the final checkpoint's evaluation before a run ends, which
    would add up to twice eval.timeout_s to a phase of a few minutes; the keys that rank by an eval metric go back to
    their defaults."""
    if not config.eval.enabled:
        return []
    off = [f"eval.{key}=null" for key in sorted(set(EVAL_METRICS.values()) - {"class_agreement"})]
    off.append("eval.class_agreement=false")
    if config.checkpoint.score_attribute in EVAL_METRICS:
        off.append("checkpoint.score_attribute=null")
    if config.retrain.metric in EVAL_METRICS:
        off.append("retrain.metric=val_loss")
    return off


def _run_phase(config: Config, workers: int) -> Phase:
    import ray.train

    from sdtrain.artifacts.run_outputs import read_history
    from sdtrain.driver.run import train  # Ray and torch: only once the config is known good

    train_options = config.train
    options = ", ".join(
        [
            train_options.strategy,
            train_options.precision,
            *(["compile"] if train_options.compile else []),
            *(["channels_last"] if train_options.channels_last else []),
            *(["checkpointing"] if train_options.gradient_checkpointing else []),
            f"micro-batch {config.batch_layout(workers).micro_batch}",
        ]
    )
    label = "1 GPU" if workers == 1 else f"{workers} GPUs"
    try:
        summary = train(config)
    except Exception as error:  # a phase's failure is the check's finding, not its end
        return Phase(label, workers, options, error=f"{type(error).__name__}: {error}".splitlines()[0])
    rows = read_history(ray.train.Checkpoint(summary.checkpoint_path))
    last = rows[-1]
    on_gpu = "peak_memory_gb" in last  # reported by GPU workers only
    return Phase(
        label,
        workers,
        options,
        images_per_s_per_gpu=last["samples_per_s"] / workers,
        mfu=last.get("mfu"),
        data_wait=last["data_wait_fraction"],
        checkpoint_stall_s=max(row["checkpoint_stall_s"] for row in rows),
        peak_memory_gb=last.get("peak_memory_gb"),
        predicted_memory_gb=_predicted_memory(config, workers, on_gpu) / 1e9,
        steps_per_s=last["steps_per_s"],
    )


def _predicted_memory(config: Config, workers: int, on_gpu: bool) -> int:
    """The memory model's peak for one of ``workers`` ranks of ``config``, on the shapes of its data."""
    from sdtrain.driver.data_check import dataset_spec
    from sdtrain.driver.memory_fit import predict_run_memory
    from sdtrain.model.unet import unet_config

    unet = unet_config(config.model)
    spec = dataset_spec(config, "data.train", config.data.train, unet)
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16-mixed" if on_gpu else "32-true"
    caption_shape = spec.embedding_shape(unet["cross_attention_dim"])
    return predict_run_memory(config, spec.latent_shape, caption_shape, workers, precision).total_peak
