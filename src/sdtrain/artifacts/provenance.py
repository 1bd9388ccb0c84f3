"""Which code a model was trained with."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: Set where the code runs without its .git: a job's uploaded working dir, an image.
COMMIT_ENV = "SDTRAIN_GIT_COMMIT"


def code_version() -> str | None:
    """The git commit of the running sdtrain: ``$SDTRAIN_GIT_COMMIT``, else HEAD of the git checkout
    the package is imported from; None when neither names it."""
    commit = os.environ.get(COMMIT_ENV, "").strip()
    if commit:
        return commit
    here = Path(__file__).resolve()
    # Tracked, not only inside a work tree: a copy installed into a .venv within some checkout is
    # inside it too, but that checkout's HEAD need not be the installed code.
    if _git(here.parent, "ls-files", "--error-unmatch", here.name) is None:
        return None
    return _git(here.parent, "rev-parse", "HEAD")


def _git(directory: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on the machine, or it hung
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None
