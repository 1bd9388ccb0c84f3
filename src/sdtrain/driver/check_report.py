"""The check job's report (:mod:`sdtrain.driver.check`): what each phase measured, the table printed and its JSON
record beside the phases."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from sdtrain.config.schema import Config
from sdtrain.train.reporting import format_duration


@dataclass(frozen=True)
class Phase:
    """One run of the check and what it measured (None: not measured, or the run failed).

    Args:
        name: what the phase runs ("1 GPU", "4 GPUs").
        workers: its world size.
        options: the GPU options it trained with.
        compiled: it trained with train.compile.
        error: why it failed; None if it trained.
        images_per_s_per_gpu: the last report window's images/s of one worker (after the first window, which holds
            compilation).
        mfu: model FLOPs utilization in that window (GPU workers only).
        data_wait: the share of that window the slowest rank waited for data.
        checkpoint_stall_s: seconds the training loop waited on the checkpoint.
        peak_memory_gb: the largest rank's peak allocated GPU memory (GPU workers only).
        peak_reserved_gb: the largest rank's peak memory reserved by torch's caching allocator (allocated and
            cached, fragmentation included: what the GPU must hold).
        memory_capacity_gb: the GPU's memory as torch sees it (less than the datasheet's).
        predicted_memory_gb: the memory model's peak for a rank of this phase, with its allowance for the CUDA
            runtime (sdtrain.model.memory; an eager step's: compiled ones usually hold less).
        steps_per_s: optimizer steps per second in that window.
        graphs_compiled: graphs compiled in that window (compiled phases; None: eager). Above 0, its figures hold
            their compilation: a bucket first drawn in it.
        micro_batch: the micro-batch it trained, as its driver resolved it (None: the phase failed first).
        run_micro_batch: the configured run's micro-batch where the phase's differs (None: the same): a phase under
            FSDP on fewer GPUs than the run fits its own (sdtrain.driver.check._pinned).
    """

    name: str
    workers: int
    options: str
    compiled: bool = False
    error: str | None = None
    images_per_s_per_gpu: float | None = None
    mfu: float | None = None
    data_wait: float | None = None
    checkpoint_stall_s: float | None = None
    peak_memory_gb: float | None = None
    peak_reserved_gb: float | None = None
    memory_capacity_gb: float | None = None
    predicted_memory_gb: float | None = None
    steps_per_s: float | None = None
    graphs_compiled: int | None = None
    micro_batch: int | None = None
    run_micro_batch: int | None = None

    @property
    def training_images_per_s_per_gpu(self) -> float | None:
        """Images/s per GPU while not waiting for data."""
        if self.images_per_s_per_gpu is None or self.data_wait is None or self.data_wait >= 1:
            return None
        return self.images_per_s_per_gpu / (1 - self.data_wait)


@dataclass(frozen=True)
class CheckReport:
    """The check's phases and the projection of the configured run from the full one.

    Args:
        config: the configured run.
        phases: one GPU, then all of them, then (``--compare-compile``) one GPU with train.compile the other way.
        communication_share: 1 - the full run's images/s per GPU over the one-GPU phase's, each net of its data wait
            (None if either failed).
        projected_hours: train.max_steps at the full run's step rate.
        projected_cost: those hours on every worker at run.gpu_hour_cost (None without a price).
        record: where the report was recorded as JSON (None: not recorded).
    """

    config: Config
    phases: list[Phase]
    communication_share: float | None
    projected_hours: float | None
    projected_cost: float | None
    record: str | None = None

    @property
    def failed(self) -> bool:
        return any(phase.error is not None for phase in self.phases)

    def table(self) -> list[str]:
        """The report, as lines to print."""
        lines = [
            f"{'phase':17} {'options':44} {'result':8} {'img/s/GPU':>9} {'MFU':>6} {'data wait':>9} "
            f"{'ckpt stall':>10} {'peak GB alloc/reserved (predicted) of GPU':>43}",
        ]
        for phase in self.phases:
            memory = (
                f"{_figure(phase.peak_memory_gb, '.2f')}/{_figure(phase.peak_reserved_gb, '.2f')} "
                f"({_figure(phase.predicted_memory_gb, '.2f')}) of {_figure(phase.memory_capacity_gb, '.1f')}"
            )
            lines.append(
                f"{phase.name:17} {phase.options:44} {'failed' if phase.error else 'trained':8} "
                f"{_figure(phase.images_per_s_per_gpu, '.1f'):>9} {_figure(phase.mfu, '.1%'):>6} "
                f"{_figure(phase.data_wait, '.1%'):>9} {_figure(phase.checkpoint_stall_s, '.1f', ' s'):>10} "
                f"{memory:>43}"
            )
        lines += [f"{phase.name} failed: {phase.error}" for phase in self.phases if phase.error]
        lines += [
            f"{phase.name}: compiled {phase.graphs_compiled} graph(s) in its measured window (a bucket first drawn "
            "there), so its figures include compilation and understate the run's; a longer --steps draws more buckets "
            "in the first window, which is not measured"
            for phase in self.phases
            if phase.graphs_compiled
        ]
        lines += [
            f"{phase.name}: micro-batch {phase.micro_batch or 'auto'}, not the run's {phase.run_micro_batch}: under "
            f"FSDP, {phase.workers} GPU(s) each hold more of the model's state than the run's "
            f"{self.config.scaling.min_workers}, so the phase fits its own (train.micro_batch_size=auto); its "
            "figures are at that micro-batch"
            for phase in self.phases
            if phase.run_micro_batch is not None
        ]
        if self.config.eval.enabled:
            lines.append(
                f"evaluation: off in the check's phases (the run evaluates {', '.join(self.config.eval.metrics)}), "
                "whose ends would wait for their final checkpoint's evaluation"
            )
        lines.append(
            f"communication: {_figure(self.communication_share, '.1%')} of the full run's step "
            "(images/s per GPU against one GPU's, net of data wait)"
        )
        lines += self._compile_line() + self._projection()
        if self.record is not None:
            lines.append(f"recorded: {self.record}")
        return lines

    def _compile_line(self) -> list[str]:
        """The one-GPU phase's rate beside the --compare-compile phase's: the one-GPU phase trained the other way
        (the third phase, or the second where the run's most workers is 1)."""
        if not self.phases:
            return []
        one = self.phases[0]
        other = next((p for p in self.phases[1:] if p.workers == 1 and p.compiled != one.compiled), None)
        if other is None or not (one.images_per_s_per_gpu and other.images_per_s_per_gpu):
            return []
        compiled, eager = (one, other) if one.compiled else (other, one)
        assert compiled.images_per_s_per_gpu and eager.images_per_s_per_gpu  # both measured (above)
        return [
            f"compile: {compiled.images_per_s_per_gpu:.1f} images/s per GPU compiled, {eager.images_per_s_per_gpu:.1f} "
            f"eager ({compiled.images_per_s_per_gpu / eager.images_per_s_per_gpu - 1:+.0%}) on one GPU"
        ]

    def _projection(self) -> list[str]:
        if self.projected_hours is None:
            return []
        steps, workers = self.config.train.max_steps, self.config.scaling.max_workers
        line = f"projected: {steps} steps in {format_duration(self.projected_hours * 3600)} on {workers} workers"
        if self.projected_cost is None:
            return [line + " (no cost: set run.gpu_hour_cost, a worker's price an hour, as check_job.yaml does)"]
        return [line + f", {self.projected_cost:,.0f} at run.gpu_hour_cost={self.config.run.gpu_hour_cost:g}"]

    def to_json(self) -> dict:
        """What :meth:`table` shows, as data (the JSON record)."""
        return {
            "run": self.config.run.name,
            "max_workers": self.config.scaling.max_workers,
            "phases": [dataclasses.asdict(phase) for phase in self.phases],
            "communication_share": self.communication_share,
            "projected_hours": self.projected_hours,
            "projected_cost": self.projected_cost,
            "gpu_hour_cost": self.config.run.gpu_hour_cost,
            "table": dataclasses.replace(self, record=None).table(),
        }


def _figure(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}{unit}"


def communication_share(one: Phase, full: Phase) -> float | None:
    """The share of the full run's step lost beside one GPU's, from their images/s per GPU each net of its data wait
    (so that a difference in reading is not counted as communication); None if either was not measured."""
    alone, together = one.training_images_per_s_per_gpu, full.training_images_per_s_per_gpu
    if not alone or together is None:
        return None
    return max(0.0, 1 - together / alone)


def record_report(report: CheckReport, stamp: str) -> CheckReport:
    """``report`` recorded as ``<run.storage_path>/checks/<run.name>-check-<stamp>.json`` (local or object storage)."""
    from sdtrain.storage.filesystems import write_bytes

    config = report.config
    uri = f"{config.run.storage_path.rstrip('/')}/checks/{config.run.name}-check-{stamp}.json"
    recorded = dataclasses.replace(report, record=uri)
    write_bytes(uri, (json.dumps(recorded.to_json(), indent=2) + "\n").encode())
    return recorded
