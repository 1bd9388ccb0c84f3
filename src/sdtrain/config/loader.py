"""A config from a YAML file plus ``key.sub=value`` overrides."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML config (if given), apply ``key.sub=value`` overrides, and validate."""
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
            raise ConfigError(f"config file {path} must be a mapping of sections (data:, model:, ...)")
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like key.sub=value, e.g. train.lr=3e-4")
        try:
            value = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError):
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return Config.from_dict(raw)
