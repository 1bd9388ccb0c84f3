"""job.yaml, schedule.yaml, check_job.yaml and preprocess_job.yaml, validated offline by the Anyscale SDK's own
config models (the Containerfile they build their image from: test_installs.py)."""

import posixpath
import shlex

import pytest
from anyscale.job.models import JobConfig
from anyscale.schedule.models import ScheduleConfig
from conftest import REPO

from sdtrain.artifacts.provenance import COMMIT_ENV
from sdtrain.config.loader import load_config
from sdtrain.errors import ConfigError
from sdtrain.model.hardware import NODE_TYPES
from sdtrain.storage.run_layout import EXPORT_DIR, UNCONDITIONAL_FILE


def _job(name):
    if name in ("job.yaml", "sdxl_job.yaml", "check_job.yaml"):
        return JobConfig.from_yaml(str(REPO / name))
    return ScheduleConfig.from_yaml(str(REPO / name)).job_config


@pytest.mark.parametrize(
    "name, entrypoint",
    [
        ("job.yaml", "entrypoints/train.py"),
        ("sdxl_job.yaml", "entrypoints/train.py"),
        ("schedule.yaml", "entrypoints/retrain.py"),
        ("check_job.yaml", "entrypoints/check.py"),
    ],
)
def test_job_files_are_valid_and_consistent_with_their_config(name, entrypoint):
    job = _job(name)
    argv = shlex.split(job.entrypoint)
    assert argv[:2] == ["python", entrypoint] and (REPO / argv[1]).is_file()
    config_path = argv[argv.index("--config") + 1]
    assert (REPO / config_path).is_file()
    overrides = argv[argv.index("--config") + 2 :]
    # Storage outlives the cluster, so a retry finds the run (and resumes it: the run name is fixed).
    assert "run.storage_path=$ANYSCALE_ARTIFACT_STORAGE/sdtrain/runs" in overrides
    config = load_config(REPO / config_path, overrides)
    assert "$" not in config.run.name

    # The image is built from the Containerfile (test_installs.py): it has the dependencies, so a node
    # starting mid-run (a spot replacement) installs nothing before it trains.
    assert job.containerfile == "Containerfile" and job.image_uri is None
    assert job.requirements is None
    # A check is not retried: a phase that failed is what it found.
    assert job.max_retries >= (0 if name == "check_job.yaml" else 1) and job.timeout_s > 0
    assert job.working_dir == "."
    assert job.py_modules == ["src/sdtrain"]  # the train and Ray Data workers import sdtrain
    # Local state, caches included (mypy's is large): not uploaded with the working directory.
    assert {".git", ".venv", "runs", ".sdtrain-data", ".pytest_cache", ".mypy_cache", ".ruff_cache"} <= set(
        job.excludes
    )
    (gpu_group,) = job.compute_config.worker_nodes
    assert config.scaling.use_gpu is True
    # The driver and Ray Data on a head node without a GPU (the driver decides the precision from the workers' GPU
    # model: sdtrain.train.build.driver_precision).
    assert job.compute_config.head_node.instance_type.startswith("m5.")
    assert job.compute_config.head_node.instance_type not in NODE_TYPES
    if name != "schedule.yaml":  # the cost is printed by the check and in the run's totals
        assert config.run.gpu_hour_cost is not None and config.run.gpu_hour_cost > 0
    gpus = NODE_TYPES[gpu_group.instance_type].gpus  # a worker per GPU
    assert (gpu_group.min_nodes * gpus, gpu_group.max_nodes * gpus) == (
        config.scaling.min_workers,
        config.scaling.max_workers,
    )


def test_a_job_names_its_code_at_submission():
    """The uploaded working dir has no .git: the submit command passes the commit provenance reads."""
    submit = (REPO / "job.yaml").read_text().splitlines()[0]
    assert submit == f"# anyscale job submit -f job.yaml --env {COMMIT_ENV}=$(git rev-parse HEAD)"


def test_schedule_is_daily_and_stores_models_with_the_artifacts():
    schedule = ScheduleConfig.from_yaml(str(REPO / "schedule.yaml"))
    assert schedule.cron_expression.split()[2:] == ["*", "*", "*"]  # every day
    assert "retrain.models_root=$ANYSCALE_ARTIFACT_STORAGE/sdtrain/models" in schedule.job_config.entrypoint


def test_the_preprocessing_job_is_valid_and_consistent_with_its_config():
    from sdtrain.preprocess.config import PreprocessConfig

    job = JobConfig.from_yaml(str(REPO / "preprocess_job.yaml"))
    argv = shlex.split(job.entrypoint)
    assert argv[:2] == ["python", "entrypoints/preprocess.py"] and (REPO / argv[1]).is_file()
    config_path = argv[argv.index("--config") + 1]
    config = load_config(REPO / config_path, argv[argv.index("--config") + 2 :], PreprocessConfig)
    # Output on storage that outlives the cluster: a retry finds the shards already written and skips them.
    assert config.output.path.startswith("$ANYSCALE_ARTIFACT_STORAGE/")
    gpu_group = next(g for g in job.compute_config.worker_nodes if g.name == "gpu-workers")
    assert gpu_group.min_nodes == config.encode.concurrency  # one encoder actor per GPU node
    assert job.containerfile == "Containerfile" and job.working_dir == "." and job.py_modules == ["src/sdtrain"]
    assert {".git", ".venv", "runs", ".sdtrain-data", ".pytest_cache", ".mypy_cache", ".ruff_cache"} <= set(
        job.excludes
    )
    # The image (test_installs.py) has the preprocess extra: a node installs nothing at start.
    assert job.requirements is None
    assert job.max_retries >= 1
    assert (REPO / "preprocess_job.yaml").read_text().splitlines()[0] == (
        f"# anyscale job submit -f preprocess_job.yaml --env {COMMIT_ENV}=$(git rev-parse HEAD)"
    )


def _entrypoint_config(job, storage="s3://artifacts/org/cld_1/"):
    """The job's config as its shell hands it over: $ANYSCALE_ARTIFACT_STORAGE expanded (here with the trailing '/'
    a storage URI may have)."""
    argv = shlex.split(job.entrypoint.replace("$ANYSCALE_ARTIFACT_STORAGE", storage))
    return load_config(REPO / argv[argv.index("--config") + 1], argv[argv.index("--config") + 2 :])


def _overrides(job) -> dict[str, str]:
    argv = shlex.split(job.entrypoint)
    return dict(arg.split("=", 1) for arg in argv[argv.index("--config") + 2 :])


def test_the_training_jobs_train_on_what_the_preprocessing_job_writes_and_none_on_a_placeholder():
    """job.yaml and check_job.yaml named no data.train, so they trained on configs/small.yaml's s3://YOUR-BUCKET
    placeholder while preprocess_job.yaml wrote latents nothing read. Now data.train is its output.path, with the
    columns and row groups it writes; sdxl_job.yaml, which has no preprocessing job, keeps the placeholder, which a
    run refuses before anything starts, naming the key."""
    from sdtrain.preprocess.config import PreprocessConfig

    preprocess = JobConfig.from_yaml(str(REPO / "preprocess_job.yaml"))
    argv = shlex.split(preprocess.entrypoint)
    written = load_config(REPO / argv[argv.index("--config") + 1], argv[argv.index("--config") + 2 :], PreprocessConfig)
    for name in ("job.yaml", "check_job.yaml"):
        job = _job(name)
        assert _overrides(job)["data.train"] == written.output.path
        config = _entrypoint_config(job)
        assert config.data.train == ["s3://artifacts/org/cld_1/sdtrain/latents-256"]
        assert (config.data.latent_column, config.data.caption_column) == (
            written.output.latent_column,
            written.output.caption_column,
        )
        assert config.data.shuffle_chunk_rows == written.output.row_group_rows
        assert config.run.storage_path == "s3://artifacts/org/cld_1/sdtrain/runs"  # no '//'
        # Guidance's unconditional prediction is trained on the empty prompt as the text encoder the data was made
        # with encodes it (what the exported pipeline guides against), not on zeros.
        assert config.train.caption_dropout_prob > 0 and written.output.captions in ("embeddings", "both")
        assert config.data.unconditional_caption == posixpath.join(config.data.train[0], UNCONDITIONAL_FILE)
    for name in ("job.yaml", "check_job.yaml", "schedule.yaml"):
        _entrypoint_config(_job(name)).refuse_placeholders()
    with pytest.raises(ConfigError, match=r"^data\.train\[0\]: s3://YOUR-BUCKET/\S+ names the shipped configs'"):
        _entrypoint_config(_job("sdxl_job.yaml")).refuse_placeholders()


def test_the_schedule_starts_from_job_yamls_export_and_holds_its_data_with_the_artifacts():
    """Its first run used to train configs/retrain.yaml's preset from random weights (840 steps at fine-tuning
    settings) and promote it with nothing to compare: it now starts from what job.yaml's run exports, at the path
    the driver writes it to (<run.storage_path>/<run.name>/export)."""
    schedule, job = _job("schedule.yaml"), _job("job.yaml")
    trained = _entrypoint_config(job)
    config = _entrypoint_config(schedule)
    assert config.model.pretrained == posixpath.join(trained.run.storage_path, trained.run.name, EXPORT_DIR)
    assert trained.export.enabled
    assert config.model.preset == trained.model.preset and config.model.prediction_type == trained.model.prediction_type
    assert (config.data.latent_column, config.data.caption_column) == (
        trained.data.latent_column,
        trained.data.caption_column,
    )
    overrides = _overrides(schedule)
    for key in ("retrain.data_root", "data.val"):
        assert overrides[key].startswith("$ANYSCALE_ARTIFACT_STORAGE/sdtrain/")
    # The held-out set, the daily partitions and pretraining's data: none inside another (a directory is read whole).
    assert (
        config.train.caption_dropout_prob > 0
        and config.data.unconditional_caption == trained.data.unconditional_caption
    )
    places = [config.retrain.data_root, *config.data.val, *trained.data.train]
    assert all(not a.startswith(b.rstrip("/") + "/") for a in places for b in places if a != b), places


def test_the_check_job_checks_what_job_yaml_runs():
    """The same config on the same nodes: what the check measured is what the real run will do."""
    check, job = _job("check_job.yaml"), _job("job.yaml")
    assert check.compute_config == job.compute_config
    config = shlex.split(job.entrypoint)[2:]
    assert shlex.split(check.entrypoint)[2:] == config


NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/nccl_trace_rank_",
}


@pytest.mark.parametrize(
    "name", ["job.yaml", "check_job.yaml", "sdxl_job.yaml", "schedule.yaml", "runtime_env/gpu.yaml"]
)
def test_every_gpu_job_keeps_nccls_flight_record_of_a_hang_and_names_no_interface(name):
    """A collective that times out aborts (Ray Train restarts the group) after writing each rank's last collectives
    to /tmp (docs/multi-node.md#a-hang). No interface name: it differs by image and instance type, and a wrong one
    stops every run on that node type."""
    import yaml

    if name.startswith("runtime_env/"):
        env = yaml.safe_load((REPO / name).read_text())["env_vars"]
    else:
        env = _job(name).env_vars
    assert {key: env.get(key) for key in NCCL_ENV} == NCCL_ENV
    assert not {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG"} & set(env)


@pytest.mark.parametrize("name", ["job.yaml", "schedule.yaml"])
def test_the_shipped_micro_batch_fits_the_nodes_gpu_at_every_world_size(name):
    """The memory model's peak of a rank at each world size of the job (DDP: the same at every size), with its 1 GiB
    for the CUDA runtime, within the share of the GPU that train.micro_batch_size=auto would fill: of the memory the
    GPU reports (an A10G's 22.5 GiB), not the size it is sold as."""
    from sdtrain.driver.memory_fit import AUTO_FILL, fit_micro_batch, predict_run_memory

    job = _job(name)
    argv = shlex.split(job.entrypoint)
    overrides = [arg for arg in argv[argv.index("--config") + 2 :] if "$" not in arg]
    config = load_config(REPO / argv[argv.index("--config") + 1], ["data.train=/unused", *overrides])
    node = NODE_TYPES[job.compute_config.worker_nodes[0].instance_type]
    side = int(config.data.latent_column.rsplit("_", 1)[-1]) // 8
    shapes = ((4, side, side), (77, 1024))
    assert fit_micro_batch(config, node.gpu.accelerator_type, *shapes, "bf16-mixed") == (config, None)
    for world in range(config.scaling.min_workers, config.scaling.max_workers + 1):
        memory = predict_run_memory(config, *shapes, world, "bf16-mixed")
        assert memory.with_runtime_margin <= AUTO_FILL * node.gpu_device_bytes, (name, world, memory)


EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def test_the_sdxl_job_sends_nccl_over_efa_as_docs_multi_node_says_for_p5():
    """64 H100s whose FSDP all-gathers and reduce-scatters cross the nodes: over EFA, not TCP. FI_PROVIDER=efa makes
    a missing device fail the start; p5 has RDMA reads. The g5 jobs (TCP) set neither."""
    job = _job("sdxl_job.yaml")
    assert job.compute_config.worker_nodes[0].instance_type.startswith("p5.")
    assert {key: job.env_vars.get(key) for key in EFA_ENV} == EFA_ENV
    doc = (REPO / "docs" / "multi-node.md").read_text()
    assert "`FI_PROVIDER: efa`" in doc and '`FI_EFA_USE_DEVICE_RDMA: "1"`' in doc and "aws-ofi-nccl" in doc
    for name in ("job.yaml", "check_job.yaml", "schedule.yaml"):
        assert not set(EFA_ENV) & set(_job(name).env_vars)
