"""Reproducible installs: pyproject.toml holds the direct pins, requirements/dev.lock and requirements/gpu.lock the
whole resolved set (tools/lock.py). The locks hold pyproject's pins and nothing floats; this environment is the lock
(make setup installed it); the Containerfile and runtime_env/gpu.yaml are what the lock renders, with one torch
build; the Makefile installs the lock; every version the README and docs name is the locked one."""

import re
import shlex
import sysconfig
from importlib import metadata

import pytest
import yaml
from conftest import REPO
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.lock import (
    CUDA,
    DEV_EXTRAS,
    DEV_LOCK,
    GPU_LOCK,
    PYTHON,
    RUNTIME_EXTRAS,
    TORCH_INDEX,
    closure,
    read_lock,
    render_containerfile,
    render_gpu_runtime_env,
    roots,
)

RELOCK = "run `python -m tools.lock` (then `make setup`)"


def _installed() -> dict[str, tuple[str, str, list[str]]]:
    """This environment's distributions, as tools.lock.closure reads a resolution: those installed in its
    site-packages only. sys.path may hold more by the time this runs: setuptools (imported by torch's compile in
    earlier tests) appends its _vendor folder, whose older packaging, zipp and platformdirs would shadow ours."""
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {}
    for dist in metadata.distributions(path=site):
        name = dist.metadata["Name"]
        installed[canonicalize_name(name)] = (name, dist.version, dist.requires or [])
    return installed


@pytest.mark.parametrize("lock, extras", [(DEV_LOCK, DEV_EXTRAS), (GPU_LOCK, RUNTIME_EXTRAS)])
def test_a_lock_holds_pyprojects_pins_and_everything_they_need_as_installed_here(lock, extras):
    """Every pin of pyproject.toml (for the GPU lock: but the test extra) at its version; and the lock is exactly
    the set those pins reach through this environment's packages, each at the version installed (make setup
    installs the lock: a transitive package that floated, or a lock not regenerated after a pin changed, fails)."""
    pins = read_lock(lock)
    for root in roots(extras):
        requirement = Requirement(root)
        name, version = pins.get(canonicalize_name(requirement.name), (requirement.name, None))
        assert version is not None and requirement.specifier.contains(version), f"{root} not in {lock.name}: {RELOCK}"
    installed = _installed()
    reached = closure(roots(extras), installed, default_environment())
    locked = {key: version for key, (_, version) in pins.items()}
    public = {key: version.split("+")[0] for key, version in reached.items()}  # torch 2.13.0+cpu: the lock's 2.13.0
    assert public == locked, f"{lock.name} is not what this environment installs: {RELOCK}"


def test_the_gpu_lock_is_the_dev_locks_versions():
    """What CI tests (dev.lock) is what a GPU node runs (gpu.lock), but the test tools."""
    dev, gpu = read_lock(DEV_LOCK), read_lock(GPU_LOCK)
    assert {key: dev[key] for key in gpu} == gpu
    assert {"pytest", "moto", "ruff", "mypy", "anyscale"} <= set(dev) - set(gpu)


def test_the_gpu_image_and_runtime_env_are_rendered_from_the_lock_with_one_torch_build():
    lock = read_lock(GPU_LOCK)
    regenerate = "run `python -m tools.lock --render`"
    assert (REPO / "Containerfile").read_text() == render_containerfile(lock), regenerate
    assert (REPO / "runtime_env" / "gpu.yaml").read_text() == render_gpu_runtime_env(lock), regenerate

    torch = f"torch=={lock['torch'][1]}+{CUDA}"  # the CUDA build of the locked version, for the image's CUDA
    instructions = _containerfile()
    (base,) = [arguments for op, arguments in instructions if op == "FROM"]
    assert base == f"anyscale/ray:{lock['ray'][1]}-{PYTHON}-{CUDA}"  # Anyscale's image of the locked Ray
    first, then = [shlex.split(arguments) for op, arguments in instructions if op == "RUN"]
    assert first == ["pip", "install", "--no-cache-dir", "--index-url", TORCH_INDEX, torch]
    # then every other locked package (torch by its version, which keeps that build), none unpinned
    assert then[:3] == ["pip", "install", "--no-cache-dir"]
    assert sorted(then[3:]) == sorted(f"{name}=={version}" for key, (name, version) in lock.items() if key != "ray")
    # Anyscale builds the image from the file's text alone: there is no build context to copy from.
    assert not any(op in ("COPY", "ADD") for op, _ in instructions)

    env = yaml.safe_load((REPO / "runtime_env" / "gpu.yaml").read_text())
    packages = env["pip"]["packages"]
    assert packages[:2] == [f"--extra-index-url {TORCH_INDEX}", torch]  # the image's build, from the same index
    assert sorted(packages[2:]) == sorted(
        f"{name}=={version}" for key, (name, version) in lock.items() if key not in ("ray", "torch")
    )
    assert env["py_modules"] == ["src/sdtrain"]


def _containerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = (REPO / "Containerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines if line and not line.startswith("#")]


def test_make_setup_installs_the_lock_torch_first():
    """The CPU build of the locked torch first (an unpinned or later torch is a multi-GB CUDA build), then every
    package of dev.lock and this package with the extras the images have; reinstalled when the lock changes."""
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\$\(STAMP\): pyproject\.toml requirements/dev\.lock$", makefile, re.M)
    installs = re.findall(r"^\t\$\(PY\) -m pip install (.*)$", makefile, re.M)
    assert installs[0].endswith("$$(grep '^torch==' requirements/dev.lock)")
    (extras,) = re.findall(r"-r requirements/dev\.lock -e '\.\[([^\]]+)\]'$", installs[1])
    assert set(extras.split(",")) == set(DEV_EXTRAS)
    assert set(RUNTIME_EXTRAS) <= set(DEV_EXTRAS)  # CI tests what the image and the GPU runtime env install


def test_the_readme_and_docs_name_the_locked_versions():
    lock = read_lock(DEV_LOCK)
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for name, version in re.findall(r"\b([A-Za-z][\w.-]*)==(\d[\w.]*)", text):
            assert lock[canonicalize_name(name)][1] == version, f"{page.name} names {name}=={version}"
        for version in re.findall(r"\bray:(\d+\.\d+\.\d+)", text):
            assert version == lock["ray"][1], f"{page.name} names the image of Ray {version}"
