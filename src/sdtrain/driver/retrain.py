"""Scheduled production retraining: new date partitions -> warm-started run -> compare -> maybe promote.

Idempotent per schedule date: a date that already has a version is not trained again, and a
run that died between writing its version and moving the production pointer is finished (the
pointer moved) by the next run for that date, without training; a version production named and
was moved off since (a rollback: ``rollback``, recorded in the registry's pointer log) is not.
One run at a time: a run holds the registry's lock from before it reads the registry until it is
done, and moves the pointer only if it still names the version it compared against. A rollback takes no lock: it
must not wait an hour for a run's training, and that compare and swap is what keeps it standing (the run reports
``superseded``, and says a rollback happened during it).

What a run trains on is found by :mod:`sdtrain.driver.retrain_partitions`; how the new model is scored against
production and whether it is promoted, by :mod:`sdtrain.driver.retrain_gate`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
from dataclasses import dataclass

from sdtrain import __version__
from sdtrain.artifacts.loading import LoadedModel, load_trained
from sdtrain.artifacts.provenance import code_version
from sdtrain.artifacts.registry import ModelRegistry, PointerMoved, RegistryLock
from sdtrain.config.schema import Config, ModelConfig, RunConfig
from sdtrain.driver.preflight import preflight
from sdtrain.driver.retrain_gate import (
    HELDOUT_KEY,
    best_served,
    gate_baseline,
    gate_decision,
    heldout_fingerprint,
    scores_in_task,
)
from sdtrain.driver.retrain_mlflow import publish
from sdtrain.driver.retrain_partitions import described_left_out, find_partitions, new_partitions, usable_partitions
from sdtrain.driver.run import RunSummary, train
from sdtrain.errors import ConfigError
from sdtrain.logs import log
from sdtrain.model.unet import unet_config
from sdtrain.train.trackers import read_state

# The ID of the Anyscale job (the same for every attempt of it), which Anyscale sets for jobs.
JOB_ID_VAR = "ANYSCALE_PRODJOB_ID"


@dataclass
class RetrainOutcome:
    # promoted | rejected | already-done | completed-promotion | superseded | rolled-back | no-new-data | no-usable-data
    status: str
    version: str | None
    production: str | None
    message: str
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    """{date: why} of the new partitions left out of the run (:func:`usable_partitions`)."""


def retrain(config: Config, schedule_date: datetime.date | None = None) -> RetrainOutcome:
    """Retrain for ``schedule_date`` (None: see schedule_date_for) under the registry's lock."""
    data_root, models_root = config.retrain.data_root, config.retrain.models_root
    if data_root is None or models_root is None:
        raise ConfigError("retrain.data_root and retrain.models_root are required for retraining")
    # Before anything is read. Not model.pretrained: only a first version starts from it, and training checks it.
    preflight(dataclasses.replace(config, model=dataclasses.replace(config.model, pretrained=None)))
    registry = ModelRegistry(models_root)
    if schedule_date is None:
        schedule_date, source = schedule_date_for(config, registry)
        log.info(f"schedule date {schedule_date} ({source})")
    day = schedule_date.isoformat()
    owner = {"run": f"{config.run.name}-{day}", "date": day, "job": os.environ.get(JOB_ID_VAR)}
    # Taken before Ray starts: a second run fails here, in seconds, without spending a restart.
    with registry.lock(owner) as lock:
        registry.settle_log(by=lock.owner)  # a move the log lacks (a writer died between swap and log entry)
        moves_before = len(registry.pointer_log())  # those logged after it were made during this run
        outcome = _with_rollbacks_since(registry, moves_before, _retrain_locked(config, registry, schedule_date, lock))
        publish(config, registry, outcome.version)  # re-reads production until it holds still: a rollback may run
        return outcome


def rollback(config: Config, to: str | None = None, reason: str = "") -> tuple[str, str]:
    """Move production back (to ``to``, default the latest other version it named that no rollback abandoned),
    recorded in the pointer log; returns (from, to). A later run for the rolled-back version's date reports it
    ``rolled-back`` rather than promote it again; the best-ever gate no longer counts the versions it abandoned.

    Takes no lock: an emergency rollback must not wait for a retrain run's training. The pointer's compare and swap
    orders them: a run compared with the version rolled back from reports ``superseded``, and of two rollbacks from
    one version the second fails (PointerMoved) rather than going back a second step."""
    if config.retrain.models_root is None:
        raise ConfigError("retrain.models_root is required for a rollback")
    registry = ModelRegistry(config.retrain.models_root)
    owner = {"run": "rollback", "job": os.environ.get(JOB_ID_VAR)}
    try:
        moved = registry.rollback(to, reason=reason, by=owner)
    except PointerMoved as e:
        raise PointerMoved(
            f"rollback not made: {e}. Another rollback, or a retrain run's promotion, moved production while this "
            f"rollback was deciding; production names {e.current or 'nothing'} now: check that, then run again if it "
            "still needs rolling back",
            e.current,
        ) from None
    publish(config, registry, None)
    return moved


def schedule_date_for(config: Config, registry: ModelRegistry) -> tuple[datetime.date, str]:
    """The date a run is for, and where it came from: retrain.date if set; else, in an Anyscale job, the UTC date of
    the job's first attempt (recorded in the registry, so a retry after midnight retrains the same date); else today."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    if config.retrain.date:
        date = datetime.date.fromisoformat(config.retrain.date)
        if date > today and config.retrain.complete_marker is None:
            # Without a marker, partitions up to the date count as complete: today's (UTC) may still be filling,
            # and a run takes each partition once, so the rows written after it would never be trained.
            raise ConfigError(
                f"retrain.date: {date} is after today ({today}, UTC), and with retrain.complete_marker null the "
                f"partitions up to it count as complete, today's still filling among them. Set a date up to {today}, "
                "or a complete_marker that the partitions' writer adds last"
            )
        return date, "retrain.date"
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
    production = registry.production()
    done = _finish_date(registry, lock, day, production)
    if done is not None:
        return done

    seen = registry.manifest(production)["partitions_seen"] if production else []
    partitions = find_partitions(data_root, schedule_date, config.retrain.complete_marker, seen)
    new, empty = new_partitions(partitions, seen)
    passed_over = f"passed over {len(empty)} complete partition(s) without rows: {', '.join(empty)}"
    if empty:
        # A day without data: marked complete, holding no parquet file or none with rows. Passed over and recorded as
        # seen with the next version, rather than failing every later run on "matches no parquet files" or "hold no
        # rows".
        log.info(f"{passed_over}")
    left_out: dict[str, str] = {}
    if new:
        model = _run_model(config, registry, production)
        run_dir = _run_settings(config, day, production, new).directory  # the run that trains on all of them
        checked = dataclasses.replace(config, model=model)
        new, left_out = usable_partitions(checked, unet_config(model), partitions, new, run_dir)
    if not new:
        return _nothing_to_train(day, production, passed_over if empty else None, left_out)
    log.info(f"retraining on {len(new)} new partition(s): {', '.join(new)}; production is {production or 'none yet'}")

    run_config = _run_config(config, registry, day, production, [partitions[d] for d in new], new)
    summary = train(run_config)
    lock.ensure_held()
    trained, raw_unet = load_trained(summary.checkpoint_path)  # the EMA weights and, with an EMA, the trained ones
    manifest = {
        "parent": production,
        "schedule_date": day,
        "partitions": new,
        # Left out: not seen, so that a later run checks them again and takes them once their files are fixed.
        "partitions_seen": sorted(seen + new + empty),
        **({"partitions_left_out": left_out} if left_out else {}),
        **_judged(run_config, registry, trained, summary, production),
    }
    outcome = record_and_promote(registry, lock, trained, manifest, raw_unet)
    note = f"; {described_left_out(left_out)}" if left_out else ""
    return dataclasses.replace(outcome, message=outcome.message + note, left_out=left_out)


def _nothing_to_train(
    day: str, production: str | None, passed_over: str | None, left_out: dict[str, str]
) -> RetrainOutcome:
    """A run's outcome without a new partition to train. Every one left out is no error (exit 0): Anyscale would retry
    (schedule.yaml's max_retries) on fresh clusters what fails the same way; the next day trains its own partition."""
    if left_out:
        return RetrainOutcome(
            "no-usable-data",
            None,
            production,
            f"{day}: every new partition since {production or 'the start'} was left out, nothing to train: "
            f"{described_left_out(left_out)}" + (f" ({passed_over})" if passed_over else ""),
            left_out,
        )
    return RetrainOutcome(
        "no-new-data",
        None,
        production,
        f"{day}: no partitions with data since {production or 'the start'}; nothing to train"
        + (f" ({passed_over})" if passed_over else ""),
    )


def _with_rollbacks_since(registry: ModelRegistry, moves_before: int, outcome: RetrainOutcome) -> RetrainOutcome:
    """``outcome``, saying so where production was rolled back while the run went on (a rollback takes no lock): its
    message would otherwise name the production it compared with, or promoted, as serving."""
    rollbacks = [e for e in registry.pointer_log()[moves_before:] if e["kind"] == "rollback"]
    if not rollbacks:
        return outcome
    production = registry.production()
    during = "; ".join(
        f"{e['from']} -> {e['to']} (pointer log entry {e['seq']}, {e['reason']!r}, by {e['by'].get('run')} on "
        f"{e['by'].get('host')} at {e['at']})"
        for e in rollbacks
    )
    note = f"production was rolled back during this run: {during}; production names {production or 'nothing'} now"
    log.warning(note)
    return dataclasses.replace(outcome, production=production, message=f"{outcome.message}; {note}")


def _finish_date(
    registry: ModelRegistry, lock: RegistryLock, day: str, production: str | None
) -> RetrainOutcome | None:
    """The outcome for a date that already has a version (None: it has none yet): reported, or its promotion, written
    before an interruption, finished if production is still the parent it was compared with."""
    for version in reversed(registry.versions()):
        manifest = registry.manifest(version)
        if manifest["schedule_date"] != day:
            continue
        if not manifest["promoted"] or production == version:
            return RetrainOutcome(
                "already-done",
                version,
                production,
                f"{day}: already retrained as {version} ({manifest['reason']}); nothing to do",
            )
        log = registry.pointer_log()
        named = [e for e in log if e["to"] == version]
        if named:
            # It served, and production was moved off it since: a re-run must not undo that. Only a promotion that
            # never happened is still pending. Moved off by a later promotion, it is simply done.
            off = next((e for e in log if e["seq"] > named[-1]["seq"] and e["from"] == version), {})
            by = f" by the promotion of {off['to']}" if off.get("kind") == "promote" else ""
            return RetrainOutcome(
                "already-done" if by else "rolled-back",
                version,
                production,
                f"{day}: {version} was promoted (pointer log entry {named[-1]['seq']}) and production was moved off "
                f"it since{by}, now {production}; not promoted again",
            )
        # Pending, and only if production is still its parent: the version was compared with its parent alone.
        if production != manifest["parent"]:
            return RetrainOutcome(
                "superseded",
                version,
                production,
                f"{day}: {version} was written to replace {manifest['parent'] or 'nothing'}, but production is now "
                f"{production}, which it was never compared with; not promoted (train a later date to compare again)",
            )
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
    return None


def _run_config(
    config: Config, registry: ModelRegistry, day: str, production: str | None, files: list[str], new: list[str]
) -> Config:
    """The training run's config: the new partitions' ``files``, warm-started from production if there is one."""
    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, train=files),
        model=_run_model(config, registry, production, announce=True),
        run=_run_settings(config, day, production, new),
    )


def _run_settings(config: Config, day: str, production: str | None, new: list[str]) -> RunConfig:
    """The run.* keys of the run that trains on the partitions ``new``."""
    return dataclasses.replace(config.run, name=retrain_run_name(config.run.name, day, production, new))


def _run_model(config: Config, registry: ModelRegistry, production: str | None, announce: bool = False) -> ModelConfig:
    """The run's model.* keys: warm-started from production if there is one, else model.pretrained (``announce``:
    log where the first version starts from)."""
    model = config.model
    # Warm start: the production weights, a fresh optimizer and the configured short warmup. A version of a run that
    # kept an EMA serves its EMA and keeps its trained weights beside it: the run trains on from those, its EMA from
    # the served ones (sdtrain.model.unet.build_unet), rather than both from the EMA, which would keep of each day's
    # training only the share its EMA took in (1 - ema_decay^steps).
    if production:
        return dataclasses.replace(model, pretrained=registry.location(production), unet={})
    if not announce:
        return model
    if model.pretrained is None:
        log.warning(
            f"no production model and model.pretrained is unset: this first version trains model.preset="
            f"{model.preset} from random weights, for train.max_steps={config.train.max_steps} steps at retraining's "
            f"settings (lr {config.train.lr:g}, warmup {config.train.warmup_steps} steps), and the gate promotes it "
            "with nothing to compare it to. Set model.pretrained to a trained model (schedule.yaml: job.yaml's export)"
        )
    else:
        log.info(f"no production model yet: the first version starts from model.pretrained={model.pretrained}")
    return model


def _judged(
    run_config: Config, registry: ModelRegistry, trained: LoadedModel, summary: RunSummary, production: str | None
) -> dict:
    """The new version's manifest past its parent, date and partitions: both models scored by the gate, the decision
    and why, what was trained and with which code."""
    current, label = gate_baseline(run_config, registry, production)  # loaded by the gate's Ray task, not here
    new_scores, production_scores = scores_in_task(run_config, summary.checkpoint_path, current)
    metric = run_config.retrain.metric
    heldout = heldout_fingerprint(run_config, trained.unet.config)
    best, not_compared = best_served(registry, run_config, metric, heldout)
    promote, reason = gate_decision(run_config, new_scores, production_scores, label, best)  # none scored: {}
    if current is None:
        reason += "; no baseline: no production model, and no model.pretrained the gate can load"
    elif production is None:
        reason = f"first version, compared with model.pretrained={current} (no production model yet): {reason}"
    if not_compared:
        reason += "; not compared: " + "; ".join(not_compared)
    return {
        **({"baseline": current} if current and production is None else {}),
        "steps": summary.final_step,
        "checkpoint": summary.checkpoint_path,
        "run_dir": summary.run_dir,
        # Its MLflow model version (sdtrain.driver.retrain_mlflow) is the one registered from this run.
        "mlflow_run_id": read_state(summary.run_dir)["ids"].get("mlflow"),
        "metrics": {
            **{key: _finite_or_none(value) for key, value in new_scores.items()},
            **{f"production_{key}": _finite_or_none(production_scores.get(key)) for key in new_scores},
            "train_loss": _finite_or_none(summary.final_loss),
        },
        "gate_metric": metric,
        HELDOUT_KEY: heldout,
        "promoted": promote,
        "reason": reason,
        "config": run_config.to_dict(),
        "code_version": {"sdtrain": __version__, "git": code_version()},
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def record_and_promote(
    registry: ModelRegistry, lock: RegistryLock, trained: LoadedModel, manifest: dict, raw_unet=None
) -> RetrainOutcome:
    """A run's writes once its model is trained and judged: the version (``trained``, with ``raw_unet``, its run's
    trained weights where ``trained`` holds the EMA's; then its manifest), then, if ``manifest["promoted"]``, the
    pointer's move from ``manifest["parent"]`` and its log entry. A run killed between any two of them is finished or
    left safely by the next run for the date (bench/retrain_chaos.py)."""
    day, production, reason = manifest["schedule_date"], manifest["parent"], manifest["reason"]
    # The evaluation may have outlasted the lease: checked again before each write.
    version = registry.write_version(
        trained.unet, trained.noise_scheduler, manifest, lock=lock, trained=trained, raw_unet=raw_unet
    )
    if manifest["promoted"]:
        lock.ensure_held()
        try:
            registry.set_production(version, expected=production, kind="promote", reason=reason, by=lock.owner)
        except PointerMoved as e:
            return _superseded(day, version, e)
        return RetrainOutcome("promoted", version, version, f"{day}: promoted {version}: {reason}")
    return RetrainOutcome(
        "rejected",
        version,
        production,
        f"{day}: kept {production or 'no version'} in production, {version} not promoted: {reason}",
    )


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


def _finite_or_none(value: float | None) -> float | None:
    """Manifests are strict JSON: a diverged loss is recorded as null (the reason says why)."""
    return value if value is not None and math.isfinite(value) else None
