"""Scheduled production retraining: new date partitions -> warm-started run -> compare -> maybe promote.

Idempotent per schedule date: a date that already has a version is not trained again, and a
run that died between writing its version and moving the production pointer is finished (the
pointer moved) by the next run for that date, without training; a version production named and
was moved off since (a rollback: ``rollback``, recorded in the registry's pointer log) is not.
One run at a time: a run holds the registry's lock from before it reads the registry until it is
done, and moves the pointer only if it still names the version it compared against.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from sdtrain import __version__
from sdtrain.artifacts.loading import LoadedModel, load_model
from sdtrain.artifacts.provenance import code_version
from sdtrain.artifacts.registry import ModelRegistry, PointerMoved, RegistryLock
from sdtrain.config.running import HIGHER_IS_BETTER
from sdtrain.config.schema import Config
from sdtrain.data.listing import list_dataset
from sdtrain.data.local_read import iter_local_batches
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.driver.preflight import preflight
from sdtrain.driver.run import dataset_spec, train
from sdtrain.errors import ConfigError, DataError
from sdtrain.evaluation.results import measured_with
from sdtrain.logs import log
from sdtrain.model.token_captions import CaptionEncoder
from sdtrain.model.validation import validation_loss
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import absolute, uri_prefix

_PARTITION = re.compile(r"date=(\d{4}-\d{2}-\d{2})")
# The ID of the Anyscale job (the same for every attempt of it), which Anyscale sets for jobs.
JOB_ID_VAR = "ANYSCALE_PRODJOB_ID"
EVAL_BATCH_SIZE = 32


@dataclass
class RetrainOutcome:
    status: str  # promoted | rejected | already-done | completed-promotion | superseded | rolled-back | no-new-data
    version: str | None
    production: str | None
    message: str


def retrain(config: Config, schedule_date: datetime.date | None = None) -> RetrainOutcome:
    """Retrain for ``schedule_date`` (None: see schedule_date_for) under the registry's lock."""
    data_root, models_root = config.retrain.data_root, config.retrain.models_root
    if data_root is None or models_root is None:
        raise ConfigError("retrain.data_root and retrain.models_root are required for retraining")
    preflight(config)  # retrain.data_root, retrain.models_root and the rest, before anything is read
    registry = ModelRegistry(models_root)
    if schedule_date is None:
        schedule_date, source = schedule_date_for(config, registry)
        log.info(f"schedule date {schedule_date} ({source})")
    day = schedule_date.isoformat()
    owner = {"run": f"{config.run.name}-{day}", "date": day, "job": os.environ.get(JOB_ID_VAR)}
    # Taken before Ray starts: a second run fails here, in seconds, without spending a restart.
    with registry.lock(owner) as lock:
        return _retrain_locked(config, registry, schedule_date, lock)


def rollback(config: Config, to: str | None = None, reason: str = "") -> tuple[str, str]:
    """Move production back (to ``to``, default the latest other version it named and was not rolled back from)
    under the registry's lock, recorded in the pointer log; returns (from, to). A later retrain run for the date of
    the version rolled back from reports it ``rolled-back`` instead of promoting it again, and the best-ever gate
    no longer counts it."""
    if config.retrain.models_root is None:
        raise ConfigError("retrain.models_root is required for a rollback")
    registry = ModelRegistry(config.retrain.models_root)
    owner = {"run": "rollback", "job": os.environ.get(JOB_ID_VAR)}
    with registry.lock(owner) as lock:
        lock.ensure_held()
        return registry.rollback(to, reason=reason, by=owner)


def schedule_date_for(config: Config, registry: ModelRegistry) -> tuple[datetime.date, str]:
    """The date a run is for, and where it came from: retrain.date if set; else, in an Anyscale
    job, the UTC date of the job's first attempt (recorded in the registry, so a retry after
    midnight retrains the same date); else today (UTC)."""
    if config.retrain.date:
        return datetime.date.fromisoformat(config.retrain.date), "retrain.date"
    today = datetime.datetime.now(datetime.timezone.utc).date()
    job = os.environ.get(JOB_ID_VAR)
    if job:
        date, pinned_at = registry.pin_date(job, today)
        return date, f"pinned by the first attempt of job {job} at {pinned_at}"
    return today, f"today (UTC): retrain.date is not set and {JOB_ID_VAR} is not either, so nothing pins it"


def _retrain_locked(
    config: Config, registry: ModelRegistry, schedule_date: datetime.date, lock: RegistryLock
) -> RetrainOutcome:
    """One run, while this run holds ``lock``: checked again before each write to the registry."""
    data_root = config.retrain.data_root
    assert data_root is not None  # retrain() refuses a config without it
    day = schedule_date.isoformat()
    lock.ensure_held()
    registry.settle_log(by=lock.owner)  # a move the log lacks (a writer died between swap and log entry)
    production = registry.production()

    for version in reversed(registry.versions()):
        manifest = registry.manifest(version)
        if manifest["schedule_date"] != day:
            continue
        if manifest["promoted"] and production != version:
            named = [e for e in registry.pointer_log() if e["to"] == version]
            if named:
                # It served, and production was moved off it since (a rollback, a later promotion undone): a re-run
                # must not undo that. Only a promotion that never happened is still pending.
                last = named[-1]
                return RetrainOutcome(
                    "rolled-back",
                    version,
                    production,
                    f"{day}: {version} was promoted (pointer log entry {last['seq']}) and production was moved off it "
                    f"since, now {production}; not promoted again",
                )
            # Pending, and only if production is still its parent: the version was compared with its parent alone.
            if production == manifest["parent"]:
                lock.ensure_held()
                try:
                    registry.set_production(
                        version, expected=production, kind="promote", reason=manifest["reason"], by=lock.owner
                    )
                except PointerMoved as e:
                    return _superseded(day, version, e)
                return RetrainOutcome(
                    "completed-promotion",
                    version,
                    version,
                    f"{day}: finished promoting {version}, written before an interruption",
                )
            return RetrainOutcome(
                "superseded",
                version,
                production,
                f"{day}: {version} was written to replace {manifest['parent'] or 'nothing'}, but production is now "
                f"{production}, which it was never compared with; not promoted (train a later date to compare again)",
            )
        return RetrainOutcome(
            "already-done",
            version,
            production,
            f"{day}: already retrained as {version} ({manifest['reason']}); nothing to do",
        )

    partitions = find_partitions(data_root, schedule_date, config.retrain.complete_marker)
    seen = registry.manifest(production)["partitions_seen"] if production else []
    new, empty = new_partitions(partitions, seen)
    passed_over = f"passed over {len(empty)} complete partition(s) without rows: {', '.join(empty)}"
    if empty:
        # A day without data: marked complete, holding no parquet file or none with rows. Passed over and recorded as
        # seen with the next version, rather than failing every later run on "matches no parquet files" or "hold no
        # rows".
        log.info(f"{passed_over}")
    if not new:
        return RetrainOutcome(
            "no-new-data",
            None,
            production,
            f"{day}: no partitions with data since {production or 'the start'}; nothing to train"
            + (f" ({passed_over})" if empty else ""),
        )
    log.info(f"retraining on {len(new)} new partition(s): {', '.join(new)}; production is {production or 'none yet'}")

    model = config.model
    if production:  # warm start: the production weights, a fresh optimizer and the configured short warmup
        model = dataclasses.replace(model, pretrained=registry.location(production), unet={})
    run_config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, train=[partitions[d] for d in new]),
        model=model,
        run=dataclasses.replace(config.run, name=retrain_run_name(config.run.name, day, production, new)),
    )
    summary = train(run_config)
    lock.ensure_held()

    trained = load_model(summary.checkpoint_path)
    current = load_model(registry.location(production)) if production else None
    new_scores, production_scores = gate_scores(run_config, trained, current)
    metric = config.retrain.metric
    best, not_compared = _best_served(registry, run_config, metric)
    promote, reason = _decide(
        new_scores[metric],
        production_scores.get(metric) if production else None,
        production,
        best,
        config.retrain.tolerance,
        metric,
    )
    if not_compared:
        reason += "; not compared: " + "; ".join(not_compared)
    manifest = {
        "parent": production,
        "schedule_date": day,
        "partitions": new,
        "partitions_seen": sorted(seen + new + empty),
        "steps": summary.final_step,
        "checkpoint": summary.checkpoint_path,
        "metrics": {
            **{key: _finite_or_none(value) for key, value in new_scores.items()},
            **{f"production_{key}": _finite_or_none(production_scores.get(key)) for key in new_scores},
            "train_loss": _finite_or_none(summary.final_loss),
        },
        "gate_metric": metric,
        "promoted": promote,
        "reason": reason,
        "config": run_config.to_dict(),
        "code_version": {"sdtrain": __version__, "git": code_version()},
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    return record_and_promote(registry, lock, trained.unet, trained.noise_scheduler, manifest)


def record_and_promote(registry: ModelRegistry, lock: RegistryLock, unet, scheduler, manifest: dict) -> RetrainOutcome:
    """A run's writes once its model is trained and judged: the version (weights, then its manifest), then, if
    ``manifest["promoted"]``, the pointer's move from ``manifest["parent"]`` and its log entry. A run killed between
    any two of them is finished or left safely by the next run for the date (bench/retrain_chaos.py)."""
    day, production, reason = manifest["schedule_date"], manifest["parent"], manifest["reason"]
    # The evaluation may have outlasted the lease: checked again before each write.
    version = registry.write_version(unet, scheduler, manifest, lock=lock)
    if manifest["promoted"]:
        lock.ensure_held()
        try:
            registry.set_production(version, expected=production, kind="promote", reason=reason, by=lock.owner)
        except PointerMoved as e:
            return _superseded(day, version, e)
        return RetrainOutcome("promoted", version, version, f"{day}: promoted {version}: {reason}")
    return RetrainOutcome(
        "rejected", version, production, f"{day}: kept {production} in production, {version} not promoted: {reason}"
    )


def new_partitions(partitions: dict[str, str], seen: list[str]) -> tuple[list[str], list[str]]:
    """(dates to train on, dates to pass over as empty) among ``partitions`` not in ``seen``: empty is no parquet
    file, or parquet files that hold no rows (Spark writes a schema-only part file for a day without rows)."""
    new: list[str] = []
    empty: list[str] = []
    for date in partitions:
        if date in seen:
            continue
        try:
            listing = list_dataset([partitions[date]], "retrain.data_root")
        except DataError:  # complete, and no parquet file in it
            empty.append(date)
            continue
        (new if _holds_rows(listing.paths, listing.sizes) else empty).append(date)
    return new, empty


def _holds_rows(files: list[str], sizes: Sequence[int]) -> bool:
    """Whether any of ``files`` holds a row, by their footers, largest file first: a partition with data answers with
    one footer, however many files it has (training's start reads them all anyway); only a day without rows, whose
    files are schema-only and small, has each read. A footer that cannot be read counts as rows: training's data
    check then names the file."""
    for i in sorted(range(len(files)), key=lambda i: -sizes[i]):
        fs, path = filesystem_for(files[i])
        try:
            if pq.read_metadata(path, filesystem=fs).num_rows > 0:
                return True
        except (OSError, pa.ArrowException):
            return True
    return False


def retrain_run_name(name: str, day: str, parent: str | None, partitions: list[str]) -> str:
    """The run's name: the schedule date and what it trains (its parent and partitions), so that a retry with the
    same inputs resumes its run, and one whose inputs changed (a partition completed meanwhile) trains anew
    rather than taking the finished run of other inputs for its own."""
    identity = hashlib.sha256(json.dumps([parent, sorted(partitions)]).encode()).hexdigest()[:8]
    return f"{name}-{day}-{identity}"


def _superseded(day: str, version: str, moved: PointerMoved) -> RetrainOutcome:
    return RetrainOutcome(
        "superseded", version, moved.current, f"{day}: {version} not promoted: {moved}; compare again with a later date"
    )


def find_partitions(data_root: str, up_to: datetime.date, complete_marker: str | None = "_SUCCESS") -> dict[str, str]:
    """{date: path} of the complete ``date=YYYY-MM-DD`` partitions under ``data_root`` up to ``up_to``,
    in date order. With ``complete_marker``, a partition is complete once it holds that file (its
    writer's last act); without, only dates before ``up_to`` count (``up_to``'s may still be filling)."""
    fs, root = filesystem_for(absolute(data_root))
    found = {}
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        match = _PARTITION.fullmatch(info.base_name)
        if info.type != pafs.FileType.Directory or not match:
            continue
        date = match.group(1)
        if complete_marker is None:
            complete = date < up_to.isoformat()
        else:
            complete = date <= up_to.isoformat() and _is_file(fs, posixpath.join(info.path, complete_marker))
        if complete:
            found[date] = uri_prefix(data_root) + info.path
    if not found:
        which = f"holding {complete_marker}" if complete_marker else "before it"
        raise DataError(
            f"retrain.data_root: {data_root} holds no complete date=YYYY-MM-DD partitions up to {up_to} ({which})"
        )
    return dict(sorted(found.items()))


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def gate_scores(config: Config, new: LoadedModel, production: LoadedModel | None) -> tuple[dict, dict]:
    """The gate's measures of the new model and of production (empty without one): the held-out val_loss, and with
    eval each of its metrics, both models sampled from the same data.val captions and seeds by one Evaluator (its
    reference statistics computed once)."""
    models = [new] if production is None else [new, production]
    scores: list[dict[str, float]] = [{"val_loss": heldout_loss(config, m.unet, m.noise_scheduler)} for m in models]
    if config.eval.enabled:
        from sdtrain.evaluation.checkpoint_eval import Evaluator

        evaluator = Evaluator(config, None, _eval_vae(config))
        for model, score in zip(models, scores, strict=True):
            measured = evaluator.evaluate(model)
            score.update({key: measured[key] for key in config.eval.metrics})
    return scores[0], scores[1] if production is not None else {}


def _eval_vae(config: Config) -> str | None:
    """The VAE evaluations decode with (sdtrain.evaluation.checks: eval.vae, else the one data.val records; None when
    no metric needs images)."""
    import pyarrow.parquet as pq

    from sdtrain.evaluation.checks import check_evaluation

    first = resolve_parquet_files(list(config.data.val), "data.val")[0]
    fs, path = filesystem_for(first)
    with fs.open_input_file(path) as f:
        schema = pq.read_schema(f)
    return check_evaluation(config, schema.metadata or {}, schema.names)


_UNRECORDED = object()


def _best_served(
    registry: ModelRegistry, config: Config, metric: str = "val_loss"
) -> tuple[tuple[str, float] | None, list[str]]:
    """(the version with the best ``metric`` among those production named and was not rolled back from, with that
    value; the versions left out because theirs was measured on another data.val or seed (or, for an eval metric,
    with other eval models or samples), and why).

    The pointer log, not the manifests' ``promoted`` flag, says what served: a version decided for promotion may
    have been superseded, interrupted or rolled back, and must not be the bar."""
    scored, not_compared = [], []
    measured_on = measured_with(config, metric)
    for version in registry.served():
        manifest = registry.manifest(version)
        value = manifest["metrics"].get(metric)
        if value is None:
            continue
        recorded = manifest.get("config", {})
        # A setting the version's config does not record predates the key: no difference can be shown.
        theirs = {key: recorded.get(key.split(".")[0], {}).get(key.split(".")[1], _UNRECORDED) for key in measured_on}
        differ = [
            f"{k}={theirs[k]!r}, this run's is {v!r}"
            for k, v in measured_on.items()
            if theirs[k] is not _UNRECORDED and theirs[k] != v
        ]
        if differ:
            not_compared.append(f"{version}'s {value:.5f} was measured with " + " and ".join(differ))
            continue
        scored.append((-value if metric in HIGHER_IS_BETTER else value, version))
    if not scored:
        return None, not_compared
    key, version = min(scored)
    return (version, -key if metric in HIGHER_IS_BETTER else key), not_compared


@functools.lru_cache(maxsize=1)
def _gate_encoder(source: str, device: str) -> CaptionEncoder:
    """The data's text encoder for token-id captions, loaded once for both models a gate scores."""
    return CaptionEncoder.load(source, use_gpu=False).to(device)


def heldout_loss(config: Config, unet, scheduler) -> float:
    """Validation loss on data.val at fixed timesteps and noise: comparable between any two models."""
    spec = dataset_spec(config, "data.val", config.data.val, unet.config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = iter_local_batches(spec, config.data, EVAL_BATCH_SIZE)
    latent_scale = config.data.latent_scaling_factor or 1.0
    embed = None
    if spec.token_ids is not None:  # both models see the same float32 embeddings of the ids
        encoder = _gate_encoder(spec.token_ids.text_encoder, device)
        embed = lambda ids: encoder(ids).float()  # noqa: E731
    return validation_loss(
        unet.to(device), scheduler, batches, seed=config.train.seed, latent_scale=latent_scale, embed=embed
    )


def _decide(
    new_loss: float,
    production_loss: float | None,
    production: str | None,
    best: tuple[str, float] | None,
    tolerance: float,
    metric: str = "val_loss",
) -> tuple[bool, str]:
    """Promote within ``tolerance`` of production and of the best model production ever named: a gate on
    production alone would let each promotion drift up to (1 + tolerance) worse than the last. ``metric``: what the
    values are (clip_score and class_agreement are higher the better, the others lower)."""
    if not math.isfinite(new_loss):
        return False, f"the new model's {metric} is {new_loss}: training diverged"
    if production_loss is None:
        return True, f"first version ({metric} {new_loss:.5f}); there is no production model to compare with"
    gates = [(production, production_loss)]
    if best is not None and best[0] != production:
        gates.append(best)
    higher = metric in HIGHER_IS_BETTER
    verdicts = []
    for name, loss in gates:
        if higher:
            limit = loss * (1 - tolerance)
            ok = new_loss >= limit
            verdicts.append((ok, f"{'>=' if ok else '<'} {name}'s {loss:.5f}"))
        else:
            limit = loss * (1 + tolerance)
            ok = new_loss <= limit
            verdicts.append((ok, f"{'<=' if ok else '>'} {name}'s {loss:.5f}"))
    sign = "-" if higher else "+"
    reason = f"{metric} {new_loss:.5f} " + " and ".join(v for _, v in verdicts) + f" x (1 {sign} {tolerance:g})"
    if len(gates) > 1:
        reason += f" ({gates[1][0]} is the best that served)"
    return all(ok for ok, _ in verdicts), reason


def _finite_or_none(value: float | None) -> float | None:
    """Manifests are strict JSON: a diverged loss is recorded as null (the reason says why)."""
    return value if value is not None and math.isfinite(value) else None
