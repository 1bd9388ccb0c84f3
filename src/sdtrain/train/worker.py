"""The function every Ray Train worker runs: build the module, stream this rank's planned data, fit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow.fs as pafs
import ray
import ray.data
import ray.train
import ray.train.torch
import torch
from ray.train.lightning import RayDDPStrategy, prepare_trainer

from sdtrain.config.schema import BatchLayout, Config
from sdtrain.data.horizons import Horizons
from sdtrain.data.object_store import fetched
from sdtrain.data.position import DataPosition
from sdtrain.data.read_order import DataState, ReadPlan
from sdtrain.data.streams import WindowReader, rank_dataset
from sdtrain.model.conditioning import pooled_width
from sdtrain.model.recipe import load_unconditional_caption
from sdtrain.private import ray as ray_private
from sdtrain.sampling.captions import Captions
from sdtrain.storage.run_layout import CHECKPOINT_FILE, HISTORY_FILE
from sdtrain.storage.s3 import apply_s3_settings
from sdtrain.train.build import build_training, run_device_settings
from sdtrain.train.cadence import ReportCadence
from sdtrain.train.checkpointing import (
    CheckpointWriter,
    DropRestoreCopy,
    node_scratch,
    restored_directory,
    worker_scratch,
)
from sdtrain.train.device_settings import training_autocast
from sdtrain.train.evaluations import CheckpointEvaluations
from sdtrain.train.preemption import PreemptionCheck
from sdtrain.train.reporting import StepReporter, log
from sdtrain.train.run_view import RunView
from sdtrain.train.sample_grids import SampleGrids, grid_captions
from sdtrain.train.strategy import CompiledGraphs
from sdtrain.train.trackers import apply_tracker_env
from sdtrain.train.train_stream import TrainStream
from sdtrain.train.validation import HeldValBatches, Validation
from sdtrain.train.watchdog import StallWatch, StallWatchdog


@dataclass
class StartPoint:
    """Where this worker group starts: step 0 of a fresh run, or the checkpoint Ray Train restored."""

    step: int = 0
    data: DataState = field(default_factory=DataState)
    """The data position after ``step``."""
    history: list[dict[str, float]] = field(default_factory=list)
    """The metric rows reported up to ``step``."""
    ckpt_path: str | None = None
    """The restored checkpoint file, for Lightning to resume from; None for a fresh run."""

    @classmethod
    def from_directory(cls, directory: str, plan: ReadPlan, on_change: str) -> StartPoint:
        """The restored checkpoint in ``directory``, its data position checked against ``plan``."""
        with open(os.path.join(directory, HISTORY_FILE)) as f:
            history = json.load(f)
        position = DataPosition.read(pafs.LocalFileSystem(), directory)
        step, data = position.resume(plan, on_change, "the restored checkpoint")
        return cls(step, data, history, os.path.join(directory, CHECKPOINT_FILE))


@dataclass(frozen=True)
class WorkerRun:
    """What a worker needs besides the module and its data stream to fit."""

    config: Config
    plan: ReadPlan
    layout: BatchLayout
    start: StartPoint
    launched_at: float
    """Wall-clock time the driver started the run (for time to first step)."""
    scratch: str
    """This rank's local directory for staged checkpoints (:func:`worker_scratch`)."""
    restore_copy: str | None = None
    """The downloaded copy of the restored checkpoint, dropped once Lightning has restored from it."""
    watchdog: StallWatchdog | None = None
    """Ends the worker when it makes no step for run.stall_timeout_s (None: never)."""
    pin_memory: bool = False
    """Pin host batches (sdtrain.train.device_settings): on GPUs, their copies to the device are then non_blocking."""
    grid_prompts: Captions | None = None
    """sample_grid.prompts as the driver encoded them: the sample grids' rows."""


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    _configure_logging()
    apply_s3_settings(loop_config["s3"])  # model.pretrained, data.unconditional_caption on s3://
    apply_tracker_env(loop_config.get("tracker_env", {}))
    config = Config.from_dict(loop_config["config"])
    use_gpu: bool = loop_config["use_gpu"]
    world_size = ray.train.get_context().get_world_size()
    rank = ray.train.get_context().get_world_rank()
    # From the worker's start: a hang while building the model, restoring or joining the other ranks counts too.
    watchdog = None
    if config.run.stall_timeout_s is not None:
        watchdog = StallWatchdog(config.run.stall_timeout_s, rank, config.run.slow_phase_timeout_s)
    layout = config.batch_layout(world_size)
    settings = run_device_settings(config.train, use_gpu)  # build_training applies them
    if rank == 0:
        for advice in settings.advice:
            log.warning(advice)
    train_batches = TrainStream(
        ray.train.get_dataset_shard("train"),
        layout.micro_batch,
        config.data.prefetch_batches,
        ray.train.torch.get_device(),
        watchdog,
        pin_memory=settings.pin_memory,
    )
    train_batches.start()  # before the model is built: see TrainStream

    meta = loop_config["checkpoint_meta"]
    module, trainer_kwargs = build_training(
        config,
        meta,
        use_gpu=use_gpu,
        world_size=world_size,
        accumulation=layout.accumulation,
        on_ray=True,
        unconditional_caption=load_unconditional_caption(
            config.data.unconditional_caption, meta.caption_shape, token_ids=meta.text_encoder is not None
        ),
        record_samples=config.checkpoint.record_rows,
    )

    context = ray.train.get_context()
    scratch = worker_scratch(config, config.run.directory, context.get_local_rank(), context.get_local_world_size())
    with _restored(config) as (directory, is_copy):
        plan: ReadPlan = fetched(loop_config["reader"]).plan
        start = (
            StartPoint()
            if directory is None
            else StartPoint.from_directory(directory, plan, config.data.on_resume_change)
        )
        copy = directory if is_copy else None
        launched, prompts = loop_config["launched_at"], loop_config.get("grid_prompts")
        run = WorkerRun(config, plan, layout, start, launched, scratch, copy, watchdog, settings.pin_memory, prompts)
        _follow_horizons(train_batches, loop_config["reader"], run)
        _fit(run, module, trainer_kwargs, train_batches)


def _follow_horizons(stream: TrainStream, shared: ray.ObjectRef, run: WorkerRun) -> None:
    """The stream goes on past the data hook's first horizon with datasets this rank makes (sdtrain.data.horizons),
    on its own node. ``shared``: the run's reader in Ray's object store."""
    reader: WindowReader = fetched(shared)
    layout, start, rank = run.layout, run.start, ray.train.get_context().get_world_rank()
    steps, rows_per_step = run.config.train.max_steps - start.step, layout.rows_per_step
    horizons = Horizons.of(reader.plan, reader.horizon_reads, start.data, layout.world_size, rows_per_step, steps)
    node = ray.get_runtime_context().get_node_id()

    def shard(index: int) -> ray.data.DataIterator:
        return rank_dataset(reader, horizons.stretches(reader.plan, index)[rank], node, shared).iterator()

    # The next horizon's first window is read while this one's last is trained on.
    window_steps = -(-reader.plan.window_rows // rows_per_step)
    ahead = layout.accumulation * window_steps + stream.prefetch_batches
    stream.follow_with([horizons.steps_of(i) * layout.accumulation for i in range(len(horizons))], shard, ahead)


def _restored(config: Config) -> contextlib.AbstractContextManager[tuple[str | None, bool]]:
    """The checkpoint Ray Train restores this worker group from: (its directory, whether a copy), read in place or
    downloaded once a node (Lightning reads its file when fit starts); (None, False) for a fresh run."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return contextlib.nullcontext((None, False))
    local_rank = ray.train.get_context().get_local_rank()
    return restored_directory(checkpoint, node_scratch(config, config.run.directory), local_rank)


def _fit(
    run: WorkerRun, module: pl.LightningModule, trainer_kwargs: dict[str, Any], train_batches: TrainStream
) -> None:
    config, plan, layout, start = run.config, run.plan, run.layout, run.start
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        log.info(
            "world size %d: %d samples per worker per step = micro-batch %d x %d accumulation; data epoch %d; "
            "%d torch thread(s) per worker",
            layout.world_size,
            layout.rows_per_step,
            layout.micro_batch,
            layout.accumulation,
            start.data.epoch,
            torch.get_num_threads(),
        )
    # The first step's stretches hold the first window: the same cut at any step (sdtrain.data.horizons).
    first_step = min(1, config.train.max_steps - start.step)
    stretches = plan.rank_stretches(start.data, layout.world_size, layout.rows_per_step, first_step)
    train_batches.expected_first = plan.sample_indices(plan.window(stretches[rank][0], 0))[: layout.micro_batch]

    trainer = pl.Trainer(callbacks=_callbacks(run, module, rank, train_batches), **trainer_kwargs)
    if isinstance(trainer.strategy, RayDDPStrategy):
        # Ray's check that the strategy and cluster environment are its own; it knows no FSDP2
        # strategy (sdtrain.train.strategy.RayModelParallelStrategy), which needs nothing more from it.
        trainer = prepare_trainer(trainer)
    try:
        trainer.fit(module, train_dataloaders=train_batches, ckpt_path=start.ckpt_path, weights_only=True)
    finally:
        if run.watchdog is not None:  # watched through the run's end (StallWatch.on_train_end), no further
            run.watchdog.stop()


def _callbacks(run: WorkerRun, module: pl.LightningModule, rank: int, train_batches: TrainStream) -> list[pl.Callback]:
    """One callback a job, on one schedule: the watchdog first (its step marks precede the others' phases), then
    the preemption check (it may make this step a checkpoint step), the validation, the report."""
    config, plan, layout, start = run.config, run.plan, run.layout, run.start
    watchdog = run.watchdog
    enter = watchdog.enter if watchdog is not None else (lambda phase: None)
    cadence = ReportCadence(config)
    bucketed = bool(_buckets(module))
    validation = _validation(config, layout, cadence, enter, bucketed) if config.data.val else None
    checkpoints = CheckpointWriter(
        data_position=lambda step: plan.advance(start.data, layout.world_size, layout.rows_per_step, step - start.step),
        plan_fingerprint=plan.fingerprint(),
        upload=config.checkpoint.upload,
        staging=run.scratch,
    )
    reporter = StepReporter(
        cadence,
        config.train,
        checkpoints,
        history=start.history,
        data_wait_s=train_batches.take_wait_s,
        launched_at=run.launched_at,
        validation=validation,
        view=RunView(config, config.run.directory) if rank == 0 else None,
        enter=enter,
        grids=sample_grids(config, module, rank, run.grid_prompts),
        evaluations=CheckpointEvaluations(config, config.run.directory) if rank == 0 and config.eval.enabled else None,
    )
    callbacks: list[pl.Callback] = [] if watchdog is None else [StallWatch(watchdog)]
    callbacks.append(PreemptionCheck(cadence, lambda: reporter.slowest_steps_per_s, enter))
    if validation is not None:
        callbacks.append(validation)
    callbacks.append(reporter)
    if run.restore_copy is not None:
        callbacks.append(DropRestoreCopy(run.restore_copy, ray.train.get_context().get_local_rank()))
    if config.train.compile:
        callbacks.append(CompiledGraphs())
    return callbacks


def _buckets(module: Any) -> list | None:
    """The bucket shapes the run trains on (the DiffusionModule's checkpoint metadata), None for one shape."""
    return module.checkpoint_meta.bucket_shapes


def _validation(config: Config, layout: BatchLayout, cadence: ReportCadence, enter, bucketed: bool) -> Validation:
    """The validation loss on data.val, read through this rank's shard of it and held in memory while it fits."""
    val_shard = ray.train.get_dataset_shard("val")
    micro = layout.micro_batch

    def read() -> Iterator[dict[str, torch.Tensor]]:
        # On the CPU: validation_sums moves only the rows this rank scores to the device. Bucketed data is split here
        # into runs of one shape: Ray Data's batching would join the end of one bucket to the next.
        if not bucketed:
            yield from val_shard.iter_torch_batches(batch_size=micro, device="cpu")
            return
        for block in val_shard.iter_batches(batch_size=None, batch_format="numpy"):
            yield from one_shape_batches(block, micro)

    val_batches = HeldValBatches(read, limit_bytes=int(config.data.val_memory_gb * 1e9))
    return Validation(cadence, val_batches, config.train.seed, enter)


def one_shape_batches(block: dict[str, np.ndarray], micro: int) -> Iterator[dict[str, torch.Tensor]]:
    """A block of bucketed rows as batches of at most ``micro`` rows of one latent shape each, in the block's order.
    Ray Data joins the batches a read task yields into one block of up to 128 MiB, so a block holds the runs of
    several buckets: its latents are then an array of arrays, which no tensor can hold."""
    latents = block["latents"]
    shapes = [np.shape(row) for row in latents] if latents.dtype == object else [latents.shape[1:]] * len(latents)
    start = 0
    while start < len(shapes):
        end = start + 1
        while end < len(shapes) and end - start < micro and shapes[end] == shapes[start]:
            end += 1
        # Copies: Ray Data's arrays are read-only views of its block, and validation holds these batches.
        rows = {name: values[start:end] for name, values in block.items()}
        yield {
            name: torch.from_numpy(np.stack(list(part)) if part.dtype == object else part.copy())
            for name, part in rows.items()
        }
        start = end


def sample_grids(config: Config, module: Any, rank: int, prompts: Captions | None) -> SampleGrids | None:
    """The sample grids rank ``rank`` draws (``module``: the DiffusionModule; ``prompts``: the driver's encoding of
    sample_grid.prompts): rank 0's, and under FSDP every rank's, as each holds a shard of the weights and every
    forward pass gathers them from all; rank 0 writes. None: no grids on this rank."""
    sharded = config.train.strategy == "fsdp"
    if rank != 0 and not sharded:
        return None
    meta = module.checkpoint_meta
    encoder = module.caption_encoder
    pooled = pooled_width(meta.unet_config) is not None
    encode = encoder.encode if encoder else None
    captions = grid_captions(config, meta.caption_shape[-1], encode=encode, prompts=prompts, pooled=pooled)
    if captions is None:
        if rank == 0:
            log.info("no sample grids: none of sample_grid.prompts, sample_grid.captions and data.val is set")
        return None
    unconditional = module.unconditional_caption.detach().cpu()
    # The trainer is attached by the time a grid is drawn (in a report, during fit).
    return SampleGrids(
        config,
        meta,
        captions,
        config.run.directory,
        unconditional,
        autocast=lambda: training_autocast(module.trainer),
        writes=rank == 0,
    )


def _configure_logging() -> None:
    """Our progress lines at INFO; Lightning's start-up chatter and Ray Train's per-report lines off."""
    logging.getLogger("sdtrain").setLevel(logging.INFO)
    # Ray Train logs every report at INFO under a logger named by its file path, outside
    # "ray.train", where RunConfig's LoggingConfig does not reach.
    logging.getLogger(ray_private.report_logger_name()).setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # Lightning internals, not actionable
    # Ray Data in this worker (reading the validation set) says that progress bars are off, which the
    # driver asked for (driver._quiet_ray_data), and that the validation set does not get its own
    # per-dataset log while the training stream has one: neither is a problem (docs/observability.md).
    progress, execution = ray_private.data_logger_names()
    logging.getLogger(progress).addFilter(lambda record: not record.getMessage().startswith("Progress bars disabled"))
    logging.getLogger(execution).setLevel(logging.WARNING)
    # Every rank reads the validation set at each validation: a "Dataset ... execution finished" line a rank
    # each time, on the console only (Ray Data's log file keeps them).
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler):  # the console; the log file is a SessionFileHandler
            handler.addFilter(lambda record: "execution finished" not in record.getMessage())
