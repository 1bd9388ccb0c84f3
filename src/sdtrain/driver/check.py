"""The check job users run first: their config's training for a few minutes on their own cluster, on one GPU and then
on all the job's GPUs, each a real Ray Train run through the same driver as the real one, and a table of what each
measured beside what sdtrain predicts (docs/performance.md). What a CPU cannot prove (kernel speed, NCCL, memory
fragmentation: ../shared/GPU.md) is measured here.

    python entrypoints/check.py --config configs/small.yaml            # on the cluster (check_job.yaml)

Each phase is its own short run under ``<run.storage_path>/checks/``, trained as configured (compiled if
train.compile is on: what the real run will do), with a checkpoint halfway (its stall is measured) and no export,
trackers or evaluation (Ray Train would wait for the final checkpoint's evaluation: up to twice eval.timeout_s). The
one-GPU phase trains the per-GPU batch of the full run (train.global_batch_size / the most workers), so its images/s
per GPU against the full run's, each net of the time it waited for data, is the share of a step the full run loses to
communication (and to stragglers); at the run's micro-batch, except under FSDP on fewer GPUs than the run's fewest,
where a phase fits its own (its row says so). ``--compare-compile`` adds a one-GPU phase with train.compile the other
way. Before any phase: a config without data.train refused, config.storage applied and checked (plan_check); each
phase starts from the run's dataset index, else the first phase's (seed_phase_index). The table is printed and
recorded as JSON beside the phases (``<run.storage_path>/checks/<run>-check-<time>.json``). Exit 1 if any phase
failed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sdtrain.config.loader import load_config
from sdtrain.config.running import EVAL_METRICS
from sdtrain.config.schema import Config
from sdtrain.driver.check_report import CheckReport, Phase, communication_share, record_report
from sdtrain.logs import log
from sdtrain.storage.uris import absolute

Shapes = tuple[tuple[int, int, int], tuple[int, int], tuple[Any, ...]]
"""What the memory model needs of a run's data (:func:`train_shapes`)."""


def check(
    config_file: str | None, overrides: Sequence[str], steps: int = 40, compare_compile: bool = False
) -> CheckReport:
    """Run the check of a config: ``steps`` optimizer steps on one worker, then on its most workers, each as
    configured; record the report beside the phases.

    Args:
        config_file: the run's YAML config, as ``train.py --config`` takes it.
        overrides: its ``key.sub=value`` overrides.
        steps: optimizer steps a phase trains (its first report window, which holds compilation, is not measured).
        compare_compile: then one more worker-phase with train.compile the other way.
    """
    config, micro = plan_check(config_file, overrides)
    most = config.scaling.max_workers
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    runs: list[tuple[int, bool | None]] = [(workers, None) for workers in sorted({1, most})]
    if compare_compile:
        runs.append((1, not config.train.compile))
    phases: list[Phase] = []
    first: Config | None = None
    for workers, compile_unet in runs:
        pinned = _pinned(config, workers, micro)
        phased = phase_config(config_file, overrides, workers, steps, stamp, compile_unet, pinned)
        seed_phase_index(config, phased, first)
        phases.append(_run_phase(phased, workers, compile_unet, micro))
        first = first or phased
    one, full = phases[0], phases[len({1, most}) - 1]
    share = communication_share(one, full) if most > 1 else None
    hours = cost = None
    if full.steps_per_s:
        hours = config.train.max_steps / full.steps_per_s / 3600
        if config.run.gpu_hour_cost is not None:
            cost = hours * most * config.run.gpu_hour_cost
    report = CheckReport(config, phases, share, hours, cost)
    return record_report(report, stamp)


def plan_check(config_file: str | None, overrides: Sequence[str]) -> tuple[Config, int]:
    """The configured run and the micro-batch it trains (:func:`run_micro_batch`), after what every phase's driver
    checks first and may be checked at once: a config without data.train (retraining's) refused, the placeholders
    refused and config.storage applied and checked (preflight), before anything lists data.train or starts Ray (an
    S3 endpoint set in storage.endpoint_url is where auto's listing must go, and what a local Ray cluster inherits)."""
    from sdtrain.driver.data_check import require_train_data
    from sdtrain.driver.preflight import preflight

    config = load_config(config_file, overrides)
    require_train_data(config)  # first: a retraining config is the wrong job, whatever else it names
    preflight(config)  # the placeholders, then storage.endpoint_url applied and object storage checked
    if unreached := config.train.unreached_lr():  # the run's: its phases train fewer steps, warmup capped at them
        log.warning(unreached)
    return config, run_micro_batch(config)


def phase_config(
    config_file: str | None,
    overrides: Sequence[str],
    workers: int,
    steps: int = 40,
    stamp: str = "T",
    compile_unet: bool | None = None,
    micro_batch: int | str | None = None,
) -> Config:
    """The config of the check's phase on ``workers`` workers: ``steps`` steps of the configured run's per-GPU work,
    as its own run under ``<run.storage_path>/checks/``, without export or trackers; compiled as configured, or as
    ``compile_unet`` says; at ``micro_batch`` (:func:`_pinned`: the run's, or auto), where given. Reports every
    quarter; the window it measures (measured_step) holds no compilation (the first), no checkpoint's save (a
    checkpoint at its end is saved after it is timed) and no validation or sample grid (at the last step only)."""
    config = load_config(config_file, overrides)
    most = config.scaling.max_workers
    # The one-GPU phase trains one GPU's share of the full run's batch: the same work per GPU and step.
    batch = config.train.global_batch_size * workers // most
    variant = "" if compile_unet is None else ("-compiled" if compile_unet else "-eager")
    phase_overrides = [
        *overrides,
        f"run.name={config.run.name}-check-{stamp}-{workers}w{variant}",
        f"run.storage_path={config.run.storage_path.rstrip('/')}/checks",
        "run.start_fresh=false",  # a new run, but for the dataset index seed_phase_index put there
        f"run.log_every_n_steps={max(1, steps // 4)}",
        f"run.val_every_n_steps={steps}",
        f"sample_grid.every_n_steps={steps}",
        f"train.max_steps={steps}",
        # Measured for speed, not learning: a warmup longer than the phase would be warned of (TrainConfig).
        f"train.warmup_steps={min(config.train.warmup_steps, steps)}",
        f"train.global_batch_size={batch}",
        *([] if micro_batch is None else [f"train.micro_batch_size={micro_batch}"]),
        f"scaling.num_workers={workers}",
        f"checkpoint.every_n_steps={measured_step(steps)}",
        "checkpoint.num_to_keep=null",
        # Every checkpoint is kept, so no score ranks them; and val_loss as one would hold the phase's checkpoint
        # interval to run.val_every_n_steps, refusing a run config that trains.
        "checkpoint.score_attribute=null",
        "export.enabled=false",
        "tracking.trackers=[]",
        "tracking.mlflow_register_as=null",  # registers nothing without a tracker: refused (Config)
        *([] if compile_unet is None else [f"train.compile={str(compile_unet).lower()}"]),
        *_without_evaluation(config),
    ]
    return load_config(config_file, phase_overrides)


def measured_step(steps: int) -> int:
    """The step whose report window a phase of ``steps`` steps is measured by: the second window's end."""
    return 2 * max(1, steps // 4)


def run_micro_batch(config: Config, shapes: Shapes | None = None) -> int:
    """The micro-batch the configured run trains, resolved as its driver resolves it: null's, the largest that every
    allowed world size divides; auto's, the largest of those the memory model fits to the cluster's GPUs (at its
    data's ``shapes``: :func:`train_shapes`, read here if not given). Each phase pins it: on a phase's one world
    size, null and auto would take the whole per-GPU batch at once."""
    micro = config.train.micro_batch_size
    if micro != "auto" or config.scaling.use_gpu is False:
        return int(micro) if isinstance(micro, int) else config.common_micro_batch()
    import ray

    from sdtrain.driver.memory_fit import cluster_gpu

    if not ray.is_initialized():
        ray.init()  # as train() would: the job's cluster, RAY_ADDRESS, else a local one
    resources = ray.cluster_resources()
    use_gpu = config.scaling.use_gpu is True or resources.get("GPU", 0) > 0
    gpu = cluster_gpu(resources) if use_gpu else None
    return fitted_micro_batch(config, gpu, use_gpu, shapes or train_shapes(config))


def fitted_micro_batch(config: Config, gpu: str | None, use_gpu: bool, shapes: Shapes) -> int:
    """The micro-batch ``config`` trains on ``gpu`` (the cluster's model; None: CPU workers or unknown) as its driver
    fits it (sdtrain.driver.memory_fit.fit_micro_batch, at its fewest workers), for data of ``shapes``."""
    from sdtrain.driver.memory_fit import fit_micro_batch
    from sdtrain.train.build import driver_precision

    latents, captions, encoders = shapes
    precision = driver_precision(config.train, use_gpu, gpu)
    fitted, _ = fit_micro_batch(config, gpu, latents, captions, precision, encoders)
    return fitted.batch_layout(config.scaling.min_workers).micro_batch


def _pinned(config: Config, workers: int, micro: int) -> int | str:
    """The micro-batch a phase on ``workers`` pins: the run's, but under FSDP on GPUs on fewer workers than the run's
    fewest, auto (the phase fits its own, and the table says it differs): FSDP shards the model's state over the
    ranks, so the run's size (sdxl-base: 32 a rank over 64, 34 GiB) need not fit one GPU holding all of it (81 GiB),
    whether the run's was fitted (auto) or set."""
    sharded = config.train.strategy == "fsdp" and config.scaling.use_gpu is not False
    return "auto" if sharded and workers < config.scaling.min_workers else micro


def seed_phase_index(config: Config, phase: Config, first: Config | None) -> None:
    """``phase``'s dataset indexes (data.train's, data.val's) copied from the configured run's, else from the
    ``first`` phase's, where there is one: each phase is a new run, whose driver would otherwise read every file's
    footer again (minutes at 1e5 files on object storage); files changed since are read as a restart reads them."""
    from sdtrain.data.index_format import run_index_uri
    from sdtrain.storage.filesystems import read_bytes, write_bytes

    sources = [absolute(source.run.directory) for source in (config, first) if source is not None]
    for key in ("data.train", "data.val"):
        for source in sources:
            index = read_bytes(run_index_uri(source, key))
            if index is not None:
                write_bytes(run_index_uri(absolute(phase.run.directory), key), index)
                break


def train_shapes(config: Config) -> Shapes:
    """data.train's largest latent shape (a bucketed run's largest bucket: the steps that must fit, as the driver
    fits them), its captions' shape as the UNet takes them, and the text encoders each rank holds."""
    from sdtrain.driver.data_check import dataset_spec
    from sdtrain.driver.memory_fit import caption_encoders
    from sdtrain.model.unet import unet_config

    unet = unet_config(config.model)
    spec = dataset_spec(config, "data.train", config.data.train, unet)
    return spec.largest_latent_shape, spec.embedding_shape(unet["cross_attention_dim"]), caption_encoders(spec)


def _without_evaluation(config: Config) -> list[str]:
    """Overrides that turn eval off: Ray Train waits for the final checkpoint's evaluation before a run ends, which
    would add up to twice eval.timeout_s to a phase of a few minutes; retrain.metric, if an eval metric, goes back to
    its default."""
    if not config.eval.enabled:
        return []
    off = [f"eval.{key}=null" for key in sorted(set(EVAL_METRICS.values()) - {"class_agreement"})]
    off.append("eval.class_agreement=false")
    if config.retrain.metric in EVAL_METRICS:
        off.append("retrain.metric=val_loss")
    return off


def _run_phase(config: Config, workers: int, compile_unet: bool | None, run_micro: int) -> Phase:
    """The phase ``config`` trained on ``workers`` and what it measured; ``run_micro``: the run's micro-batch, which
    the phase records and names beside its own where they differ (:func:`_pinned`)."""
    import ray.train

    from sdtrain.artifacts.run_outputs import read_history
    from sdtrain.driver.run import train  # Ray and torch: only once the config is known good

    label = ("1 GPU" if workers == 1 else f"{workers} GPUs") + ("" if compile_unet is None else ", compile flipped")
    compiled = config.train.compile
    try:
        summary = train(config)
        shapes = train_shapes(config)  # from the dataset index the phase just wrote
        micro = run_micro_batch(config, shapes)  # as the phase's driver resolved it (auto: fitted to the GPU)
    except Exception as error:  # a phase's failure is the check's finding, not its end
        error_line = f"{type(error).__name__}: {error}".splitlines()[0]
        runs = None if config.train.micro_batch_size == run_micro else run_micro  # pinned: the run's
        options = phase_options(config, workers, None, runs)
        return Phase(label, workers, options, compiled, error=error_line, run_micro_batch=runs)
    runs = None if micro == run_micro else run_micro
    rows = read_history(ray.train.Checkpoint(summary.checkpoint_path))
    last = rows[-1]
    measured = next(row for row in rows if row["step"] == measured_step(config.train.max_steps))
    on_gpu = "peak_memory_gb" in last  # reported by GPU workers only
    return Phase(
        label,
        workers,
        phase_options(config, workers, micro, runs),
        compiled,
        images_per_s_per_gpu=measured["samples_per_s"] / workers,
        mfu=measured.get("mfu"),
        data_wait=measured["data_wait_fraction"],
        checkpoint_stall_s=max(row["checkpoint_stall_s"] for row in rows),
        peak_memory_gb=last.get("peak_memory_gb"),
        peak_reserved_gb=last.get("peak_reserved_gb"),
        memory_capacity_gb=last.get("memory_capacity_gb"),
        predicted_memory_gb=predicted_memory(config, workers, on_gpu, micro, shapes) / 1e9,
        steps_per_s=measured["steps_per_s"],
        graphs_compiled=int(measured["graphs_compiled"]) if "graphs_compiled" in measured else None,
        micro_batch=micro,
        run_micro_batch=runs,
    )


def phase_options(config: Config, workers: int, micro: int | None, run_micro: int | None) -> str:
    """The GPU options of the phase ``config`` on ``workers``: its micro-batch ``micro`` (None: not resolved, the
    phase failed first), with the run's, ``run_micro``, beside it where it differs (None: the same; FSDP on fewer
    GPUs: _pinned)."""
    train_options = config.train
    if micro is None:
        auto = train_options.micro_batch_size == "auto"
        said = "auto" if auto else str(config.batch_layout(workers).micro_batch)
    else:
        said = str(micro)
    return ", ".join(
        [
            train_options.strategy,
            train_options.precision,
            "compiled" if train_options.compile else "eager",
            *(["channels_last"] if train_options.channels_last else []),
            *(["checkpointing"] if train_options.gradient_checkpointing else []),
            f"micro-batch {said}" + ("" if run_micro is None else f" (the run's: {run_micro})"),
        ]
    )


def predicted_memory(config: Config, workers: int, on_gpu: bool, micro: int, shapes: Shapes) -> int:
    """The memory model's peak for one of ``workers`` ranks of ``config`` at micro-batch ``micro`` (what its driver
    resolved: :func:`run_micro_batch`), for data of ``shapes`` (:func:`train_shapes`), with the model's allowance for
    the CUDA runtime (what a GPU must hold: beside the reserved peak)."""
    from sdtrain.driver.memory_fit import predict_run_memory

    latents, captions, encoders = shapes
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16-mixed" if on_gpu else "32-true"
    memory = predict_run_memory(config, latents, captions, workers, precision, micro, encoders, on_gpu=on_gpu)
    return memory.with_runtime_margin
