"""Every entrypoint's config: a YAML file plus ``key.sub=value`` overrides, one grammar for all."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from sdtrain.config.coercion import ConfigTree, Tree
from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError
from sdtrain.storage.uris import collapse_slashes


@typing.overload
def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config: ...
@typing.overload
def load_config(path: str | Path | None, overrides: typing.Sequence[str], tree: type[Tree]) -> Tree: ...
def load_config(
    path: str | Path | None = None, overrides: typing.Sequence[str] = (), tree: type[ConfigTree] = Config
) -> ConfigTree:
    """Load a YAML config (if given), apply ``key.sub=value`` overrides, and validate.

    Args:
        path: the YAML file: a mapping of sections.
        overrides: ``key.sub=value`` strings (values are YAML), applied in order; ``model.unet.x=1`` nests.
        tree: the config to build: training's :class:`~sdtrain.config.schema.Config` or preprocessing's.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except (yaml.YAMLError, ValueError) as e:  # ValueError: a date-shaped value that is no date
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            sections = ", ".join(f"{name}:" for name in list(tree.SECTIONS)[:2])
            raise ConfigError(f"config file {path} must be a mapping of sections ({sections} ...)")
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key or "." not in key:
            raise ConfigError(f"override {override!r} must look like key.sub=value, e.g. {_example(tree)}")
        try:
            value = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError):
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:  # absent, or a section the file leaves empty (only comments under it)
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree.from_dict(_collapsed(raw))


def _collapsed(value: Any) -> Any:
    """``value`` with every s3:// URI in it, however deep, without repeated slashes in its key: the shell expands
    ``$ANYSCALE_ARTIFACT_STORAGE/sdtrain/runs`` in a job's entrypoint, and a variable that ends in '/' leaves
    ``//``, which pyarrow refuses (``Empty path component``) on the driver and on every worker."""
    if isinstance(value, str):
        return collapse_slashes(value)
    if isinstance(value, dict):
        return {key: _collapsed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_collapsed(item) for item in value]
    return value


def _example(tree: type[ConfigTree]) -> str:
    section, cls = next(iter(tree.SECTIONS.items()))
    return f"{section}.{dataclasses.fields(cls)[0].name}=..."
