"""The config's local paths made absolute, on the driver before Ray starts: Ray Train's workers do not run in the
driver's working directory."""

from __future__ import annotations

import dataclasses

from sdtrain.artifacts.pipelines import local_base_model
from sdtrain.config.schema import Config
from sdtrain.driver.trackers import absolute_mlflow_uri
from sdtrain.storage.uris import absolute


def with_absolute_paths(config: Config) -> Config:
    """Every local path the config names (:meth:`Config.storage_uris`, checkpoint.staging_dir, a local MLflow store
    in tracking.mlflow_tracking_uri) made absolute: Ray Train's workers run in a directory of their own (Ray Train V2
    changes into the run's), and evaluation tasks on other nodes. URIs, hub ids, ``zeros`` and ``auto`` stay as they
    are."""
    model_source = local_base_model  # a local directory or file made absolute; a hub id (org/name) kept
    caption = config.data.unconditional_caption
    data = dataclasses.replace(
        config.data,
        train=[absolute(p) for p in config.data.train],
        val=[absolute(p) for p in config.data.val],
        unconditional_caption=caption if caption in ("zeros", "auto") else absolute(caption),
    )
    evaluation = config.eval
    evaluation = dataclasses.replace(
        evaluation,
        dinov2=model_source(evaluation.dinov2),
        inception=model_source(evaluation.inception),
        clip=model_source(evaluation.clip),
        vae=model_source(evaluation.vae),
    )
    grid = config.sample_grid
    grid = dataclasses.replace(
        grid,
        captions=absolute(grid.captions) if grid.captions is not None else None,
        prompts=absolute(grid.prompts) if isinstance(grid.prompts, str) else grid.prompts,
    )
    roots = config.retrain.data_root, config.retrain.models_root
    data_root, models_root = (absolute(root) if root is not None else None for root in roots)
    retrain = dataclasses.replace(config.retrain, data_root=data_root, models_root=models_root)
    staging = config.checkpoint.staging_dir
    checkpoint = dataclasses.replace(config.checkpoint, staging_dir=absolute(staging) if staging else staging)
    uri = config.tracking.mlflow_tracking_uri  # MLFLOW_TRACKING_URI: sdtrain.driver.trackers.tracker_env
    tracking = dataclasses.replace(config.tracking, mlflow_tracking_uri=absolute_mlflow_uri(uri) if uri else uri)
    return dataclasses.replace(
        config,
        data=data,
        checkpoint=checkpoint,
        tracking=tracking,
        model=dataclasses.replace(config.model, pretrained=model_source(config.model.pretrained)),
        run=dataclasses.replace(config.run, storage_path=absolute(config.run.storage_path)),
        export=dataclasses.replace(config.export, base_model=model_source(config.export.base_model)),
        eval=evaluation,
        sample_grid=grid,
        retrain=retrain,
    )
