"""The locks: every package sdtrain installs, at one exact version, and the GPU image's and runtime env's installs
generated from them. pyproject.toml stays the one place a direct dependency is pinned by hand.

    python -m tools.lock            resolve pyproject.toml's pins with pip (its registries), write both locks,
                                    then the Containerfile and runtime_env/gpu.yaml from them
    python -m tools.lock --render   only write the Containerfile and runtime_env/gpu.yaml from the locks

- requirements/dev.lock: the whole resolved set of pyproject.toml's dependencies and its extras (what `make setup`
  installs, so what CI tests);
- requirements/gpu.lock: the part of it a GPU node needs (the dependencies, the trackers and preprocess extras: no
  test tools), at the same versions.

Both are resolved once, by pip, for the Python and platform of the images (CPython 3.11, Linux x86_64). torch is
pinned by its version: which build an install takes is its index's choice (the CPU build from this machine's
wheel store, the CUDA build from PyTorch's index for the image), and the CUDA build pins its own CUDA libraries
(nvidia-*, triton) exactly. tests/test_installs.py checks that the locks hold pyproject.toml's pins and are closed
(every requirement of every locked package is locked), that the installed environment is the lock, and that the
GPU files are what this renders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
DEV_LOCK = REPO / "requirements" / "dev.lock"
GPU_LOCK = REPO / "requirements" / "gpu.lock"
CONTAINERFILE = REPO / "Containerfile"
GPU_RUNTIME_ENV = REPO / "runtime_env" / "gpu.yaml"

RUNTIME_EXTRAS = ("trackers", "preprocess")
"""The extras a GPU node installs besides the dependencies (run.trackers; preprocessing, exports, evaluation)."""
DEV_EXTRAS = ("test", *RUNTIME_EXTRAS)
PYTHON = "py311"
CUDA = "cu128"
TORCH_INDEX = f"https://download.pytorch.org/whl/{CUDA}"
"""PyTorch's index of the CUDA build that matches the image's CUDA."""

Packages = Mapping[str, tuple[str, str, list[str]]]
"""Canonical name -> (name as published, version, Requires-Dist lines): a resolution, or an installed environment."""


def roots(extras: Iterable[str]) -> list[str]:
    """pyproject.toml's dependencies and those of ``extras``, as written there (``name[extras]==version``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    return list(project["dependencies"]) + [r for extra in extras for r in optional[extra]]


def closure(requirements: Iterable[str], packages: Packages, environment: Mapping[str, str]) -> dict[str, str]:
    """Canonical name -> version of every package ``requirements`` reach through ``packages``' requirements, their
    markers evaluated in ``environment`` with the extras asked for. A requirement that ``packages`` do not hold, or
    hold at a version it does not allow, is an error naming both: the set is not closed."""
    reached: dict[str, str] = {}
    done: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**environment, "extra": extra}):
            continue
        key = canonicalize_name(requirement.name)
        if key not in packages:
            raise LookupError(f"{requirement} (required) is not in the set")
        name, version, requires = packages[key]
        if not requirement.specifier.contains(version, prereleases=True):
            raise LookupError(f"{requirement} (required) does not allow {name} {version}")
        reached[key] = version
        for wanted in [""] + sorted(requirement.extras):
            if (key, wanted) not in done:
                done.add((key, wanted))
                todo += [(Requirement(line), wanted) for line in requires]
    return reached


def resolve() -> tuple[Packages, dict[str, str]]:
    """pip's resolution of every pin of pyproject.toml (a dry run that installs nothing), and the environment it
    resolved for."""
    with tempfile.TemporaryDirectory(prefix="sdtrain-lock-") as directory:
        report = os.path.join(directory, "report.json")
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        subprocess.run([*command, "--report", report, *roots(DEV_EXTRAS)], check=True)
        with open(report) as f:
            resolution = json.load(f)
    packages: dict[str, tuple[str, str, list[str]]] = {
        canonicalize_name(item["metadata"]["name"]): (
            item["metadata"]["name"],
            item["metadata"]["version"],
            item["metadata"].get("requires_dist", []),
        )
        for item in resolution["install"]
    }
    return packages, resolution["environment"]


def lock_text(packages: Packages, names: Iterable[str], what: str) -> str:
    header = (
        f"# {what}\n"
        "# Generated by `python -m tools.lock` from pyproject.toml's pins: do not edit by hand.\n"
        "# Resolved for CPython 3.11 on Linux x86_64. torch's build comes from its index (tools/lock.py).\n"
    )
    lines = [f"{packages[key][0]}=={Version(packages[key][1]).public}" for key in sorted(names)]
    return header + "".join(line + "\n" for line in lines)


def read_lock(path: Path) -> dict[str, tuple[str, str]]:
    """Canonical name -> (name, version) of a lock file."""
    pins: dict[str, tuple[str, str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = (name, version)
    return pins


def _image_installs(lock: Mapping[str, tuple[str, str]]) -> tuple[str, list[str]]:
    """The CUDA build of torch, and every locked package a GPU node installs but Ray (the image has it), torch by
    its version."""
    torch = f"torch=={lock['torch'][1]}+{CUDA}"
    return torch, [f"{name}=={version}" for key, (name, version) in sorted(lock.items()) if key != "ray"]


def ray_version(lock: Mapping[str, tuple[str, str]]) -> str:
    return lock["ray"][1]


def render_containerfile(lock: Mapping[str, tuple[str, str]]) -> str:
    torch, installs = _image_installs(lock)
    image = f"anyscale/ray:{ray_version(lock)}-{PYTHON}-{CUDA}"
    continued = " \\\n".join(f"    {line}" for line in installs)
    return f"""\
# Generated by `python -m tools.lock` from requirements/gpu.lock: do not edit by hand.
# The image of job.yaml and schedule.yaml (their `containerfile:`). Anyscale builds it from this text
# alone: no build context (nothing can be COPY'd from the checkout), no build arguments, and a build is
# reused for as long as the text is unchanged. So the image carries every locked package a GPU node
# needs, at its locked version (tests/test_installs.py checks it), and the code comes with the job's
# working_dir and py_modules: a spot replacement node rejoins without running pip. The job names its
# code at submission instead: --env SDTRAIN_GIT_COMMIT=$(git rev-parse HEAD) (see job.yaml).
FROM {image}

# torch first, its CUDA {CUDA[2:4]}.{CUDA[4:]} build from PyTorch's index (runtime_env/gpu.yaml takes the same
# build), which pins its CUDA libraries (nvidia-*, triton) itself. PyPI's build may target another CUDA.
RUN pip install --no-cache-dir --index-url {TORCH_INDEX} {torch}

# Then requirements/gpu.lock but Ray, which the image has (its tag names the locked version): pyproject.toml's
# dependencies with its trackers and preprocess extras, and everything they need, each at its locked version;
# torch again, which keeps the build above.
RUN pip install --no-cache-dir \\
{continued}
"""


def render_gpu_runtime_env(lock: Mapping[str, tuple[str, str]]) -> str:
    torch, installs = _image_installs(lock)
    tag = f"{ray_version(lock)}-{PYTHON}-{CUDA}"
    others = [line for line in installs if not line.startswith("torch==")]
    packages = "".join(f"    - {line}\n" for line in [f"--extra-index-url {TORCH_INDEX}", torch, *others])
    return f"""\
# Generated by `python -m tools.lock` from requirements/gpu.lock: do not edit by hand.
# For a GPU cluster on the rayproject/ray:{tag} (or anyscale/ray:{tag}) image, which has Ray but no
# torch: every other package of requirements/gpu.lock at its locked version (pyproject.toml's dependencies, its
# trackers and preprocess extras, and everything they need), torch's CUDA build from PyTorch's index as the
# Containerfile takes it, and the sdtrain package shipped to every node.
# ray job submit --working-dir . --runtime-env runtime_env/gpu.yaml -- python entrypoints/preprocess.py ...
pip:
  packages:
{packages}py_modules:
  - src/sdtrain
env_vars:
  # Loss of a node mid-collective must fail fast so Ray Train can restart the group.
  TORCH_NCCL_ASYNC_ERROR_HANDLING: "1"
  # A collective that times out dumps its flight record first (docs/multi-node.md#a-hang)
  TORCH_NCCL_DUMP_ON_TIMEOUT: "1"
  TORCH_NCCL_TRACE_BUFFER_SIZE: "2000"
  TORCH_NCCL_DEBUG_INFO_TEMP_FILE: /tmp/nccl_trace_rank_
  HF_HUB_DISABLE_TELEMETRY: "1"
excludes:
  - .git
  - .venv
  - runs
  - .sdtrain-data
  - "**/__pycache__"
  - .pytest_cache
  - .mypy_cache                  # make lint writes it; large
  - .ruff_cache
"""


def write_gpu_files() -> None:
    lock = read_lock(GPU_LOCK)
    CONTAINERFILE.write_text(render_containerfile(lock))
    GPU_RUNTIME_ENV.write_text(render_gpu_runtime_env(lock))


def write_locks() -> None:
    packages, environment = resolve()
    dev = closure(roots(DEV_EXTRAS), packages, environment)
    gpu = closure(roots(RUNTIME_EXTRAS), packages, environment)
    DEV_LOCK.parent.mkdir(exist_ok=True)
    DEV_LOCK.write_text(
        lock_text(packages, dev, "Every package `make setup` installs (pyproject.toml and its extras).")
    )
    GPU_LOCK.write_text(
        lock_text(packages, gpu, "What a GPU node installs: pyproject.toml's dependencies, trackers and preprocess.")
    )


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--render"]):
        sys.exit(__doc__)
    if not sys.argv[1:]:
        write_locks()
    write_gpu_files()
