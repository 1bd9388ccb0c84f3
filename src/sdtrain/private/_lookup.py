"""How each adapter of this folder looks up a private name: imported when first asked for, and a missing one named
with the version it was written against."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import PackageNotFoundError, requires, version
from typing import Any


class PrivateApiMissing(ImportError):
    """A library's private name that sdtrain relies on is gone or moved: the installed version is not the pinned
    one. Not an SdtrainError: no setting of the user's fixes it, only the pin (pyproject.toml) or this adapter."""


def private(module: str, name: str, distribution: str, purpose: str) -> Any:
    """``module.name``, or a PrivateApiMissing saying what it served and which version has it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise PrivateApiMissing(
            f"sdtrain uses {module}.{name} ({purpose}), which {distribution} {_installed(distribution)} lacks "
            f"({type(error).__name__}: {error}); sdtrain pins {pinned(distribution)}, which has it. Install that "
            f"version, or update sdtrain.private.{distribution} for this one"
        ) from error


def pinned(distribution: str) -> str:
    """The requirement sdtrain's metadata pins ``distribution`` to ("torch==2.13.0"), from its one source
    (pyproject.toml, as installed)."""
    try:
        for requirement in requires("sdtrain") or ():
            if re.match(rf"{re.escape(distribution)}(\[[^\]]*\])?==", requirement):
                return requirement.split(";")[0].strip()
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        pass
    return f"the {distribution} version pyproject.toml names"


def _installed(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(not installed)"
