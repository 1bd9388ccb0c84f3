"""The driver, in three steps (:func:`train`):

1. :func:`check_run`: storage, trackers, the data against the model and the run's own state, before Ray starts;
2. :func:`build_trainer`: join or start Ray and build the TorchTrainer (elastic scaling, failure policy,
   checkpoints in run.storage_path, each rank's planned data stream);
3. :func:`fit`, then :func:`finish`: metrics.csv, the loss curve, the diffusers export and the run's totals.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.artifacts.export import export_checkpoint, export_source
from sdtrain.artifacts.pipelines import check_export_sources
from sdtrain.artifacts.run_outputs import LossLabels, read_history, write_run_outputs
from sdtrain.artifacts.run_totals import RunTotals, run_totals
from sdtrain.config.schema import Config, ScalingConfig
from sdtrain.controller.data_hook import PlannedStreams, committed_run
from sdtrain.data.bucket_order import BucketPlan
from sdtrain.data.index_format import run_index_uri, write_index
from sdtrain.data.inspection import DatasetSpec
from sdtrain.data.metadata import latent_classifier
from sdtrain.data.position import DataPosition, plan_changes
from sdtrain.data.read_order import ReadPlan
from sdtrain.data.streams import WindowReader, file_order_dataset
from sdtrain.driver.data_check import check_data, read_plan, unconditional_caption_of
from sdtrain.driver.memory_fit import caption_encoders, cluster_gpu, fit_micro_batch
from sdtrain.driver.paths import with_absolute_paths
from sdtrain.driver.placement_group_guard import torch_trainer_class
from sdtrain.driver.preflight import preflight
from sdtrain.driver.ray_configs import ray_run_config, validation_config
from sdtrain.driver.ray_data_startup import warm_up_ray_data
from sdtrain.driver.resume_model import check_resume_model
from sdtrain.driver.staging_cleanup import remove_run_staging
from sdtrain.driver.trackers import check_trackers, log_export, log_final, tracker_env
from sdtrain.errors import TrainingFailed, find_sdtrain_error
from sdtrain.evaluation.checks import check_evaluation
from sdtrain.logs import log
from sdtrain.model.conditioning import pooled_width
from sdtrain.model.unet import resolve_prediction_type, unet_config
from sdtrain.sampling.prompts import GridPrompts, grid_prompts
from sdtrain.storage.filesystems import ray_storage, set_aside, uri_for
from sdtrain.storage.run_layout import EXPORT_DIR
from sdtrain.storage.s3 import resolved_s3_settings
from sdtrain.train.build import checkpoint_meta, driver_precision
from sdtrain.train.sample_grids import check_grid_captions
from sdtrain.train.worker import train_loop_per_worker


@dataclass
class RunSummary:
    run_dir: str
    checkpoint_path: str
    final_step: int
    final_loss: float
    outputs: list[str]
    totals: RunTotals
    """Images trained, GPU-hours (worker-hours on CPU), MFU and cost, from the final checkpoint's rows."""


def train(config: Config) -> RunSummary:
    """Train the run ``config`` names (or resume it), in three steps; return where its outputs are."""
    launched_at = time.time()  # the origin of the metric time_to_first_step_s

    # 1. Check everything that can be wrong with the input, before Ray starts.
    run = check_run(config)
    if run.finished:
        # A retry after training ended, a driver that died after fit(), a lowered train.max_steps: nothing to
        # train, so no Ray and no workers; finish the outputs the run may lack.
        log.info(
            f"{run.run_dir} is already at step {run.resume_step} (train.max_steps="
            f"{config.train.max_steps}): nothing to train; finishing its outputs from its final checkpoint"
        )
        assert run.committed is not None
        return finish(run.config, run.committed)

    # 2. Build the trainer: join or start Ray, the datasets, the TorchTrainer.
    trainer = build_trainer(run, launched_at)

    # 3. Fit, then write the run's outputs.
    return finish(run.config, fit(trainer, run))


@dataclass
class CheckedRun:
    """A run whose input passed every check: what building its trainer needs."""

    config: Config
    """The config, local paths made absolute (Ray workers do not share the driver's working directory)."""
    run_dir: str
    train: DatasetSpec
    val: DatasetSpec | None
    plan: ReadPlan
    stored_scale: float | None
    """The latent scaling factor the files record (parquet metadata), if any."""
    committed: ray.train.Result | None
    """Ray Train's record of the run's latest committed checkpoint, read once; None for a fresh run."""
    resume_step: int = 0
    eval_vae: str | None = None
    """With eval: the VAE that decodes latents for the evaluations (eval.vae, else the one data.val records); None
    when no metric needs images (class agreement reads latents without a VAE)."""
    latent_classifier: str | None = None
    """The module data.train's files name as the reader of their latents (sdtrain.sampling.latent_classifier)."""
    grid_prompts: GridPrompts | None = None
    """sample_grid.prompts, encoded once here: the workers draw them at every sample grid."""

    @property
    def finished(self) -> bool:
        return self.committed is not None and self.resume_step >= self.config.train.max_steps


def check_run(config: Config) -> CheckedRun:
    """Storage, trackers, the data against the model, and the run's own state: every check before Ray starts.

    Writes only the run's dataset index (when it changed) and, with run.start_fresh, moves the old run aside first.
    """
    config = with_absolute_paths(config)
    preflight(config)  # object storage: endpoint, credentials, buckets, permissions (sdtrain.driver.preflight)
    if unreached := config.train.unreached_lr():  # here, not in preflight: a retrain runs that twice
        log.warning(unreached)
    config = resolve_prediction_type(config)  # unset: model.pretrained's; the workers get it concrete
    check_trackers(config)
    run_dir = config.run.directory
    if config.run.start_fresh:
        # Before the data check: the old run's dataset index describes the data it trained on, not this data. Only
        # moved, so a fresh start whose check then fails has lost nothing.
        replaced = set_aside(run_dir)
        if replaced:
            log.info(f"run.start_fresh: moved the previous run to {replaced}")
    train_data, val_data, stored_scale = check_data(config, run_dir)
    train_spec = train_data.spec
    config = unconditional_caption_of(config, train_spec)  # auto: the data's own empty prompt, else zeros
    plan = read_plan(train_spec, config)
    for key, data in (("data.train", train_data), ("data.val", val_data)):
        if data is not None and data.stale:
            write_index(run_index_uri(run_dir, key), data.index)
    val_spec = val_data.spec if val_data is not None else None
    run = CheckedRun(config, run_dir, train_spec, val_spec, plan, stored_scale, committed_run(*ray_storage(run_dir)))
    run.latent_classifier = latent_classifier(train_data.schema_metadata)
    if config.export.enabled:  # the export's VAE and text encoder, before the run trains for it
        latents = (train_data.schema_metadata, train_data.schema_file, train_spec.latent_shape[0])
        check_export_sources(config.export.base_model, *latents, unet_config(config.model), run.latent_classifier)
    unet = unet_config(config.model)
    captions = train_spec.embedding_shape(unet["cross_attention_dim"])
    run.grid_prompts = grid_prompts(config, train_data.schema_metadata, train_spec.token_ids, captions)
    check_grid_captions(config, captions[-1], pooled=pooled_width(unet) is not None)
    if config.eval.enabled:
        assert val_data is not None  # the config requires data.val with eval
        run.eval_vae = check_evaluation(config, val_data.schema_metadata, val_data.index.checked.schema.names)
    if run.committed is not None:
        _check_resume_position(run)
        if not run.finished and run.committed.checkpoint is not None:  # a finished run loads no weights to train on
            ema = config.train.ema_decay is not None
            check_resume_model(run.committed.checkpoint, _run_meta(run, config, captions), ema)
    return run


def _check_resume_position(run: CheckedRun) -> None:
    """The committed checkpoint's data position must refer to this data, a finished run's too: a retry that found
    other data (a partition completed since) must not pass the old run off as its own."""
    assert run.committed is not None and run.committed.checkpoint is not None  # committed_run: only such runs
    config = run.config
    checkpoint = run.committed.checkpoint
    position = DataPosition.read(checkpoint.filesystem, checkpoint.path)
    where = uri_for(checkpoint.filesystem, checkpoint.path)
    if isinstance(run.plan, BucketPlan):
        kept = run.plan.resumed_as(position.plan, keep_turns=config.data.bucket_steps == "auto")
        # Only where the rest of the position still holds: a new epoch (or the refusal) is read as a new run reads.
        if kept is not run.plan and not plan_changes(position.plan or {}, kept.fingerprint()):
            _log_kept_plan(kept, run.plan, where)
            run.plan = kept
    run.resume_step, state = position.resume(run.plan, config.data.on_resume_change, where)
    if not run.finished and config.data.on_resume_change == "new_epoch" and state != position.state:
        log.info(
            f"data.on_resume_change=new_epoch: the data changed since {where}; resuming its weights "
            f"at step {run.resume_step} and starting epoch {state.epoch} on the data as it is now"
        )


def _log_kept_plan(kept: BucketPlan, new: BucketPlan, where: str) -> None:
    if kept.order != new.order:
        log.info(
            f"data.train: resuming in read order {kept.order}, the one {where} was written in; a new run reads "
            f"{new.order}, whose chunks are whole row groups of the files preprocessing writes (docs/data.md)"
        )
    if kept.bucket_steps != new.bucket_steps:
        log.info(
            f"data.bucket_steps=auto: resuming in turns of {kept.bucket_steps} step(s) of one bucket, the ones {where} "
            f"was written in; a new run on these workers would take {new.bucket_steps}. To take them now, from the "
            f"next epoch: data.bucket_steps={new.bucket_steps} data.on_resume_change=new_epoch (the rest of this "
            "epoch's rows are not read)"
        )


def build_trainer(run: CheckedRun, launched_at: float) -> TorchTrainer:
    """Join the cluster (or start a local one) and build the TorchTrainer: the workers' loop and its inputs, the
    elastic scaling, the failure policy, checkpoints in run.storage_path and each rank's planned data stream."""
    config = run.config
    if not ray.is_initialized():
        # Joins the cluster named by RAY_ADDRESS (as under `ray job submit`), else starts a local one.
        # No num_cpus here: inside a submitted job, ray.init() must take no resources arguments.
        ray.init()
    _quiet_ray_data()
    use_gpu = _resolve_use_gpu(config.scaling)
    captions = run.train.embedding_shape(unet_config(config.model)["cross_attention_dim"])
    # train.micro_batch_size against the GPUs' memory: auto resolved, a size predicted not to fit refused.
    gpu = cluster_gpu(ray.cluster_resources()) if use_gpu else None
    # The workers' precision from the cluster's GPU model (this machine may have none); 16-mixed where
    # scaling.use_gpu=auto found no GPU fails here.
    precision = driver_precision(config.train, use_gpu, gpu)
    # The largest bucket's steps are the ones that must fit.
    encoders = caption_encoders(run.train)  # token-id captions: each rank also holds the frozen text encoders
    config, decided = fit_micro_batch(config, gpu, run.train.largest_latent_shape, captions, precision, encoders)
    if decided is not None:
        log.info(f"{decided}")
    # PlannedStreams replaces "train" by each rank's planned stream; Ray Train needs the name.
    # TorchTrainer's own value type: its dict is invariant.
    datasets: dict[str, ray.data.Dataset | Callable[[], ray.data.Dataset]] = {
        "train": file_order_dataset(run.train, config.data, "data.train")
    }
    if run.val is not None:
        datasets["val"] = file_order_dataset(run.val, config.data, "data.val")
    # Put once a run: the controller and each rank fetch it once a process (sdtrain.data.object_store).
    reader = ray.put(WindowReader(run.train, config.data, run.plan))
    return torch_trainer_class()(  # Ray's, with a cleaner that never tears down a live run
        train_loop_per_worker,
        train_loop_config={
            "config": config.to_dict(),
            "use_gpu": use_gpu,
            "checkpoint_meta": _run_meta(run, config, captions),
            "reader": reader,
            "s3": resolved_s3_settings(),
            "launched_at": launched_at,
            "tracker_env": tracker_env(),
            "grid_prompts": run.grid_prompts.captions() if run.grid_prompts is not None else None,
        },
        scaling_config=ray.train.ScalingConfig(  # type: ignore[call-arg]  # v2 ScalingConfig: see RunConfig below
            num_workers=_ray_num_workers(config.scaling),
            use_gpu=use_gpu,
            resources_per_worker={"CPU": _cpus_per_worker(config.scaling, use_gpu)},
            elastic_resize_monitor_interval_s=config.scaling.resize_check_s,
        ),
        run_config=ray_run_config(config),
        datasets=datasets,
        dataset_config=PlannedStreams(reader, run.run_dir, config),
        # With eval, Ray Train evaluates the checkpoints rank 0 asks for, once committed, in a task of their own.
        validation_config=validation_config(config, run.run_dir, run.eval_vae) if config.eval.enabled else None,
    )


def _run_meta(run: CheckedRun, config: Config, captions: tuple[int, int]) -> CheckpointMeta:
    """What every checkpoint of the run stores besides the weights (sdtrain.train.build.checkpoint_meta), with the
    prompts of its sample grids: generate.py's default for the run."""
    text_encoder = run.train.token_ids.text_encoder if run.train.token_ids is not None else None
    meta = checkpoint_meta(
        config,
        run.train.latent_shape,
        captions,
        run.stored_scale,
        text_encoder,
        run.latent_classifier,
        run.train.bucket_shapes,
        run.train.vae_downsampling,
    )
    if run.grid_prompts is None:
        return meta
    return dataclasses.replace(
        meta, grid_prompts=run.grid_prompts.prompts, grid_text_encoder=run.grid_prompts.text_encoder
    )


def fit(trainer: TorchTrainer, run: CheckedRun) -> ray.train.Result:
    """Run the trainer to train.max_steps; a failure it cannot restart from is a TrainingFailed naming why. Once the
    trainer has ended, trained or failed, the run's checkpoint staging is removed from every node."""
    warm_up = warm_up_ray_data()  # in the background, while Ray Train starts (sdtrain.driver.ray_data_startup)
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        remove_run_staging(run.config, run.run_dir)  # not on an interrupt: its workers may still be uploading
        raise TrainingFailed(failure_message(e, run.run_dir)) from None
    finally:
        if warm_up is not None:
            warm_up.join(timeout=60)  # seconds into a run it is long done; nothing of ours outlives train()
    remove_run_staging(run.config, run.run_dir)
    return result


def failure_message(error: Exception, run_dir: str) -> str:
    filesystem, path = ray_storage(run_dir)
    try:
        latest = ray.train.Result.from_path(path, storage_filesystem=filesystem).checkpoint
    except Exception:  # no checkpoint manager state yet: the run failed before its first checkpoint
        latest = None
    where = (
        f"the latest checkpoint is {uri_for(latest.filesystem, latest.path)}" if latest else "no checkpoint was written"
    )
    rerun = "re-running the same command resumes from it" if latest else "re-running starts from scratch"
    ours = find_sdtrain_error(error)
    cause: Any = ours if ours is not None else error
    return f"training failed: {cause}\n{where}; after fixing the cause, {rerun} (run directory: {run_dir})"


def finish(config: Config, result: ray.train.Result) -> RunSummary:
    """metrics.csv, loss_curve.png, the export (unless it is already that of the final checkpoint) and the totals."""
    checkpoint = result.checkpoint
    # A committed run at train.max_steps, or a fit() that returned: its final step reported a checkpoint.
    assert checkpoint is not None
    history = read_history(checkpoint)
    log_final(config, uri_for(checkpoint.filesystem, result.path), history)  # late evaluations, MLflow caught up
    labels = LossLabels(config.model.prediction_type or "epsilon", config.train.snr_gamma)  # check_run resolved it
    outputs = write_run_outputs(history, checkpoint.filesystem, result.path, labels)
    if config.export.enabled:
        export_path = posixpath.join(result.path, EXPORT_DIR)
        source = uri_for(checkpoint.filesystem, checkpoint.path)
        if export_source(uri_for(checkpoint.filesystem, export_path)) != source:
            export_checkpoint(source, uri_for(checkpoint.filesystem, export_path))
            try:
                fs = checkpoint.filesystem
                log_export(config, uri_for(fs, result.path), uri_for(fs, export_path))
            except Exception as error:  # the run and its export are done: a tracker's failure must not undo that
                log.warning(f"could not attach the export to the trackers: {error}")
        outputs.append(export_path)
    return RunSummary(
        run_dir=uri_for(checkpoint.filesystem, result.path),
        checkpoint_path=uri_for(checkpoint.filesystem, checkpoint.path),
        final_step=int(history[-1]["step"]),
        final_loss=history[-1]["loss"],
        outputs=[uri_for(checkpoint.filesystem, path) for path in outputs],
        totals=run_totals(history, config.train.global_batch_size, config.run.gpu_hour_cost),
    )


def _resolve_use_gpu(scaling: ScalingConfig) -> bool:
    if scaling.use_gpu != "auto":
        return scaling.use_gpu
    return ray.cluster_resources().get("GPU", 0) > 0


def _ray_num_workers(scaling: ScalingConfig):
    return tuple(scaling.num_workers) if isinstance(scaling.num_workers, list) else scaling.num_workers


def _cpus_per_worker(scaling: ScalingConfig, use_gpu: bool) -> float:
    """CPUs each train worker reserves, for its training loop and its data reads (which reserve none of their
    own: sdtrain.data.streams.read_placement). auto: 1 with GPUs; on CPUs, min(1, the cluster's CPUs / the
    most workers), 1 on a cluster that has no CPU yet (an autoscaling one)."""
    if scaling.cpus_per_worker != "auto":
        return scaling.cpus_per_worker
    if use_gpu:
        return 1.0
    share = math.floor(min(1.0, ray.cluster_resources().get("CPU", 0) / scaling.max_workers) * 100) / 100
    return share if share > 0 else 1.0


def _quiet_ray_data() -> None:
    """Progress bars from Ray Data drown the training log in a terminal and in job logs."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
