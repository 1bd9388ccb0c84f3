"""job.yaml and schedule.yaml, validated offline by the Anyscale SDK's own config models."""

import shlex

import pytest
import tomllib
from anyscale.job.models import JobConfig
from anyscale.schedule.models import ScheduleConfig
from conftest import REPO

from sdtrain.config.schema import load_config


def _job(name):
    if name == "job.yaml":
        return JobConfig.from_yaml(str(REPO / name))
    return ScheduleConfig.from_yaml(str(REPO / name)).job_config


def _pins():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {d.split("==")[0]: d for d in dependencies}


@pytest.mark.parametrize(
    "name, entrypoint", [("job.yaml", "entrypoints/train.py"), ("schedule.yaml", "entrypoints/retrain.py")]
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

    assert job.image_uri.startswith("anyscale/ray:2.60.0-") and "-cu" in job.image_uri  # Ray 2.60, GPU
    assert job.max_retries >= 1 and job.timeout_s > 0
    assert job.working_dir == "."
    assert job.py_modules == ["src/sdtrain"]  # the train and Ray Data workers import sdtrain
    assert {".git", ".venv", "runs", ".sdtrain-data"} <= set(job.excludes)
    (gpu_group,) = job.compute_config.worker_nodes
    assert config.scaling.use_gpu is True
    assert (gpu_group.min_nodes, gpu_group.max_nodes) == (config.scaling.min_workers, config.scaling.max_workers)
    # Dependencies in one place: the job's requirements are pyproject.toml's pins, torch included;
    # Ray comes with the image.
    _assert_pyproject_pins(job.requirements, job.image_uri)


def _assert_pyproject_pins(requirements, image_uri):
    pins = _pins()
    ray = pins.pop("ray[default,train,data]")
    assert sorted(requirements) == sorted(pins.values())
    assert image_uri.split(":")[1].startswith(ray.split("==")[1] + "-")  # the image's Ray is the pinned one


def test_the_gpu_runtime_env_installs_pyprojects_pins():
    import yaml

    env = yaml.safe_load((REPO / "runtime_env" / "gpu.yaml").read_text())
    _assert_pyproject_pins(env["pip"], "rayproject/ray:2.60.0-py311-gpu")
    assert env["py_modules"] == ["src/sdtrain"]


def test_schedule_is_daily_and_stores_models_with_the_artifacts():
    schedule = ScheduleConfig.from_yaml(str(REPO / "schedule.yaml"))
    assert schedule.cron_expression.split()[2:] == ["*", "*", "*"]  # every day
    assert "retrain.models_root=$ANYSCALE_ARTIFACT_STORAGE/sdtrain/models" in schedule.job_config.entrypoint
