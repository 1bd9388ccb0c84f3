"""The config's local paths made absolute, on the driver before Ray starts: Ray Train's workers do not run in the
driver's working directory."""

from __future__ import annotations

import dataclasses

from sdtrain.artifacts.pipelines import local_base_model
from sdtrain.config.schema import Config
from sdtrain.storage.uris import absolute


def with_absolute_paths(config: Config) -> Config:
    """Ray workers do not share the driver's working directory: make local paths absolute."""
    data = dataclasses.replace(
        config.data, train=[absolute(p) for p in config.data.train], val=[absolute(p) for p in config.data.val]
    )
    run = dataclasses.replace(config.run, storage_path=absolute(config.run.storage_path))
    export = dataclasses.replace(config.export, base_model=local_base_model(config.export.base_model))
    return dataclasses.replace(config, data=data, run=run, export=export)
