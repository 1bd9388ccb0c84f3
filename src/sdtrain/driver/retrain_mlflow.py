"""Retraining's promotions where MLflow users look: the MLflow model tracking.mlflow_register_as.

A retrain run's training registers its export as a version of that model, like any training run
(:func:`sdtrain.driver.trackers.log_export`), before the gate has judged it. The registry version's manifest records
the training run's MLflow run id (``mlflow_run_id``), so a registry version's MLflow version is the one registered
from that run. After each retrain run and rollback, :func:`publish` tags the MLflow version of the version judged and
of production with the gate's numbers, and points the model's ``production`` alias at production's, reading the
pointer again after (a rollback takes no lock, and may move it meanwhile). Each call sets
all of it again from the registry, which stays the source of truth: MLflow's failures are warnings, and the next run
(a re-run of the same date too) catches up.
"""

from __future__ import annotations

import posixpath
from typing import Any

import pyarrow.fs as pafs

from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.config.schema import Config
from sdtrain.driver.trackers import attach_export_to_mlflow, mlflow_client
from sdtrain.logs import log
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import EXPORT_DIR

ALIAS = "production"
PUBLISH_ROUNDS = 5
"""Times :func:`publish` sets the alias again when production moved meanwhile, before it leaves it to the next run."""


def publish(config: Config, registry: ModelRegistry, judged: str | None) -> None:
    """Show the registry in MLflow (with tracking.trackers' mlflow and tracking.mlflow_register_as; else nothing):
    the MLflow versions of ``judged`` (the version a run judged; None: none) and of production tagged with their
    gate's numbers, and the model's ``production`` alias on production's (removed when production has none)."""
    name = config.tracking.mlflow_register_as
    if not name or "mlflow" not in config.tracking.trackers:
        return
    production = registry.production()
    try:
        client = mlflow_client(config)
        found = {v: _tagged(client, config, registry, v) for v in dict.fromkeys((judged, production)) if v}
        for _ in range(PUBLISH_ROUNDS):
            _point_alias(client, name, production, found[production] if production else None)
            # A rollback takes no lock and may move the pointer while this sets the alias: set last from a stale
            # read, the alias would name the version rolled back from. Whoever sets it last reads the pointer after.
            now = registry.production()
            if now == production:
                return
            production = now
            if production and production not in found:
                found[production] = _tagged(client, config, registry, production)
        log.warning(
            f"MLflow: production kept moving while model {name}'s {ALIAS} alias was set; the next retrain run or "
            "rollback sets it again"
        )
    except Exception as error:  # the promotion or rollback is done: MLflow's trouble must not undo it
        log.warning(
            f"MLflow: could not show the registry's production ({production or 'none'}) on model {name} ({error}); "
            "the registry is the source of truth, and the next retrain run (a re-run of this date too) tries again"
        )


def gate_tags(registry: ModelRegistry, version: str, manifest: dict[str, Any]) -> dict[str, str]:
    """The tags of a registry version's MLflow version: which version of which registry, and its gate's numbers (the
    metric, the new model's value and production's, the tolerance, the decision and why)."""
    metric = manifest.get("gate_metric", "val_loss")
    metrics = manifest.get("metrics", {})
    return {
        "sdtrain.registry_version": version,
        "sdtrain.models_root": registry.root_uri,
        "sdtrain.schedule_date": manifest["schedule_date"],
        "sdtrain.gate.decision": "promoted" if manifest["promoted"] else "rejected",
        "sdtrain.gate.metric": metric,
        "sdtrain.gate.value": _text(metrics.get(metric)),
        "sdtrain.gate.production_value": _text(metrics.get(f"production_{metric}")),
        # A first version's baseline: the model.pretrained it was fine-tuned from (sdtrain.driver.retrain_gate).
        "sdtrain.gate.production_version": manifest["parent"] or manifest.get("baseline") or "none",
        "sdtrain.gate.tolerance": _text(manifest.get("config", {}).get("retrain", {}).get("tolerance")),
        "sdtrain.gate.reason": manifest["reason"],
    }


def _tagged(client, config: Config, registry: ModelRegistry, version: str) -> str | None:
    """The MLflow version of registry ``version``, tagged (None, with a warning, if it has none)."""
    manifest = registry.manifest(version)
    mlflow_version = _mlflow_version(client, config, manifest)
    if mlflow_version is None:
        log.warning(
            f"MLflow: registry version {version} has no version of model {config.tracking.mlflow_register_as}: its "
            "training run had no MLflow run or no export (tracking.trackers without mlflow, export.enabled false, or "
            "a version older than this record)"
        )
        return None
    for key, value in gate_tags(registry, version, manifest).items():
        client.set_model_version_tag(config.tracking.mlflow_register_as, mlflow_version, key, value)
    return mlflow_version


def _mlflow_version(client, config: Config, manifest: dict[str, Any]) -> str | None:
    """The version of the MLflow model registered from the training run of the registry version of ``manifest`` (the
    latest, should it have several); registered now from the run's export if MLflow was down at the run's end."""
    run_id, run_dir = manifest.get("mlflow_run_id"), manifest.get("run_dir")
    if run_id is None:
        return None
    name = config.tracking.mlflow_register_as
    found = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if found:
        return max(found, key=lambda v: int(v.version)).version
    export = posixpath.join(run_dir, EXPORT_DIR) if run_dir else None
    if export is None or not _is_dir(export):
        return None
    return attach_export_to_mlflow(config, client, run_id, export)


def _point_alias(client, name: str, production: str | None, mlflow_version: str | None) -> None:
    if mlflow_version is not None:
        client.set_registered_model_alias(name, ALIAS, mlflow_version)
        log.info(f"MLflow: model {name}'s {ALIAS} alias names version {mlflow_version} (registry version {production})")
        return
    registered = client.search_registered_models(f"name='{name}'")
    if registered and ALIAS in registered[0].aliases:
        # Left in place it would name a version production no longer names.
        client.delete_registered_model_alias(name, ALIAS)
        log.warning(f"MLflow: removed model {name}'s {ALIAS} alias: production ({production}) has no MLflow version")


def _is_dir(uri: str) -> bool:
    fs, path = filesystem_for(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def _text(value: Any) -> str:
    """A tag's value: MLflow's tags are strings; a value the manifest lacks or holds as null (diverged) is none."""
    return "none" if value is None else str(value)
