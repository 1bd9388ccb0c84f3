"""Retraining's promotion rules, without training: the gate, and finishing an interrupted promotion."""

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_config, write_latents
from diffusers import DDPMScheduler, UNet2DConditionModel
from support.registry_writers import RegistryWriters

from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.driver.retrain import JOB_ID_VAR, retrain, schedule_date_for
from sdtrain.driver.retrain_gate import HELDOUT_KEY, best_served, decide, heldout_fingerprint
from sdtrain.driver.retrain_partitions import find_partitions, new_partitions
from sdtrain.errors import ConfigError
from sdtrain.model.presets import PRESETS

REPO = Path(__file__).resolve().parent.parent


def test_the_gate_holds_against_production_and_the_best_model_ever_promoted():
    assert decide(1.0, None, None, None, 0.05) == (
        True,
        "first version (val_loss 1.00000); there is no production model to compare with",
    )
    assert decide(float("nan"), 1.0, "v0001", ("v0001", 1.0), 0.05)[0] is False
    # Within 5% of production, which is itself the best: promoted.
    assert decide(1.04, 1.0, "v0003", ("v0003", 1.0), 0.05)[0] is True
    # Production drifted to 1.04 from the best 1.0 (v0001): 1.09 is within 5% of 1.04, not of 1.0.
    promote, reason = decide(1.09, 1.04, "v0003", ("v0001", 1.0), 0.05)
    assert promote is False
    assert (
        reason
        == "val_loss 1.09000 <= v0003's 1.04000 and > v0001's 1.00000 x (1 + 0.05) (v0001 is the best that served)"
    )


def test_production_measured_non_finite_is_no_bar_and_the_reason_says_so():
    """Every comparison with NaN fails: a NaN production score re-measured on the day's data rejected every candidate,
    with a reason that named no cause. The value the best model served with still holds."""
    promote, reason = decide(1.04, float("nan"), "v0003", ("v0003", 1.0), 0.05)
    assert promote is True
    assert reason == (
        "val_loss 1.04000 <= v0003's 1.00000 x (1 + 0.05) (v0003 is the best that served); "
        "v0003's val_loss measured nan on this data: not a bar"
    )
    assert decide(1.2, float("nan"), "v0003", ("v0003", 1.0), 0.05)[0] is False  # the best's bar holds
    assert decide(1.2, float("inf"), "v0003", None, 0.05) == (
        True,
        "val_loss 1.20000; v0003's val_loss measured inf on this data: not a bar, and no other model to compare with",
    )


def test_an_interrupted_promotion_is_finished_only_if_production_is_still_its_parent(tmp_path):
    root = tmp_path / "daily"
    (root / "date=2026-11-01").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    config = tiny_config(
        f"retrain.data_root={root}",
        f"retrain.models_root={tmp_path}/models",
        f"data.val={tmp_path}/val",
        tmp_path=tmp_path,
    )
    registry = ModelRegistry(str(tmp_path / "models"))
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()

    def version(day, parent, promoted=True):
        manifest = {"schedule_date": day, "parent": parent, "promoted": promoted, "reason": "test"}
        return registry.write_version(unet, scheduler, {**manifest, "metrics": {"val_loss": 1.0}})

    torch.manual_seed(0)
    registry.set_production(version("2026-11-01", None))
    # D's run wrote v0002 to replace v0001, and died before moving the pointer...
    version("2026-11-02", "v0001")
    # ...then D+1 compared v0003 with v0001 and promoted it.
    registry.set_production(version("2026-11-03", "v0001"))

    # A retry of D must not put v0002 (never compared with v0003) in production.
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.version, registry.production()) == ("superseded", "v0002", "v0003")
    assert "production is now v0003, which it was never compared with" in outcome.message

    # Had nothing been promoted since, the retry finishes the promotion.
    registry.set_production("v0001")
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, registry.production()) == ("completed-promotion", "v0002")
    assert not (tmp_path / "runs").exists()  # neither retry trained
    assert not (tmp_path / "models" / "retrain.lock").exists()  # each run released the lock


def test_a_promotion_that_loses_the_pointer_to_another_writer_is_superseded_not_overwritten(tmp_path, monkeypatch):
    root = tmp_path / "daily"
    (root / "date=2026-11-01").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    models = str(tmp_path / "models")
    config = tiny_config(f"retrain.data_root={root}", f"retrain.models_root={models}", f"data.val={tmp_path}/val")
    registry, other = ModelRegistry(models), ModelRegistry(models)
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()
    torch.manual_seed(0)
    for day, parent in (("2026-11-01", None), ("2026-11-02", "v0001"), ("2026-11-03", "v0001")):
        manifest = {"schedule_date": day, "parent": parent, "promoted": True, "reason": "test"}
        registry.write_version(unet, scheduler, {**manifest, "metrics": {"val_loss": 1.0}})
    registry.set_production("v0001")
    swap = ModelRegistry.set_production

    def someone_else_first(self, version, **expected):
        # A writer that ignores the lock (a hand edit, another tool) promotes v0003 between the
        # retry's read of the pointer and its swap.
        swap(other, "v0003", expected="v0001")
        swap(self, version, **expected)

    monkeypatch.setattr(ModelRegistry, "set_production", someone_else_first)
    outcome = retrain(config, datetime.date(2026, 11, 2))  # would finish v0002's promotion over v0001
    assert (outcome.status, outcome.version, outcome.production) == ("superseded", "v0002", "v0003")
    assert "production.json names v0003, not v0001 as when the promotion was decided" in outcome.message
    assert registry.production() == "v0003" and not (tmp_path / "models" / "retrain.lock").exists()


@pytest.mark.slow  # entrypoints/retrain.py in a subprocess
@pytest.mark.timeout(180)
def test_a_run_that_finds_the_lock_held_stops_before_ray_and_a_retry_keeps_its_jobs_date(tmp_path):
    root, models = tmp_path / "daily", tmp_path / "models"
    (root / "date=2026-11-02").mkdir(parents=True)
    (root / "date=2026-11-02" / "_SUCCESS").touch()
    (tmp_path / "val").mkdir()
    registry = ModelRegistry(str(models))
    registry.pin_date("prodjob_day2", datetime.date(2026, 11, 2))  # the job's first attempt, before midnight
    # Its retry starts after midnight, while the previous day's run still holds the lock.
    with registry.lock({"run": "retrain-2026-11-01", "date": "2026-11-01", "job": "prodjob_day1"}) as held:
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "entrypoints" / "retrain.py"),
                f"retrain.data_root={root}",
                f"retrain.models_root={models}",
                f"data.val={tmp_path}/val",
                f"run.storage_path={tmp_path}/runs",
                "scaling.use_gpu=false",
                "model.preset=tiny",
            ],
            cwd=tmp_path,
            env={**os.environ, JOB_ID_VAR: "prodjob_day2", "RAY_ADDRESS": "local", "PYTHONPATH": str(REPO / "src")},
            capture_output=True,
            text=True,
            timeout=170,
        )
        assert json.loads((models / "retrain.lock").read_text())["token"] == held.token  # not taken, not removed
        # A rollback does not wait for it (an emergency must not wait out an hour of training): here it finds
        # nothing to roll back, past the lock.
        rollback = subprocess.run(
            [sys.executable, str(REPO / "entrypoints" / "retrain.py"), "--rollback", f"retrain.models_root={models}"],
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
            capture_output=True,
            text=True,
            timeout=170,
        )
    # Busy, try later (EX_TEMPFAIL): neither bad input nor a failed run, and Ray never started.
    assert result.returncode == 75, result.stderr[-3000:]
    assert rollback.returncode == 2 and "production names no version: nothing to roll back" in rollback.stderr, (
        rollback.stderr
    )
    assert "schedule date 2026-11-02 (pinned by the first attempt of job prodjob_day2 at" in result.stdout
    assert result.stderr.startswith(
        f"error: {models}/retrain.lock is held by run retrain-2026-11-01, date 2026-11-01, job prodjob_day1"
    ), result.stderr[-3000:]
    assert "another retrain run is going on, so this one did nothing" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    assert not (models / "retrain.lock").exists()  # the holder released it


def test_the_schedule_date_comes_from_the_config_else_the_jobs_first_attempt_else_today(tmp_path, monkeypatch):
    registry = ModelRegistry(str(tmp_path / "models"))
    roots = [f"retrain.data_root={tmp_path}/daily", f"retrain.models_root={tmp_path}/models", f"data.val={tmp_path}"]
    monkeypatch.setenv(JOB_ID_VAR, "prodjob_x")
    config = tiny_config(*roots, "retrain.date=2026-11-05")
    assert schedule_date_for(config, registry) == (datetime.date(2026, 11, 5), "retrain.date")
    registry.pin_date("prodjob_x", datetime.date(2026, 11, 3))
    date, source = schedule_date_for(tiny_config(*roots), registry)
    assert date == datetime.date(2026, 11, 3) and source.startswith("pinned by the first attempt of job prodjob_x at")
    monkeypatch.delenv(JOB_ID_VAR)
    today = datetime.datetime.now(datetime.timezone.utc).date()
    date, source = schedule_date_for(tiny_config(*roots), registry)
    assert date in (today, today + datetime.timedelta(days=1))  # the test may straddle midnight
    assert source == "today (UTC): retrain.date is not set and ANYSCALE_PRODJOB_ID is not either, so nothing pins it"
    # A date after today without a completion marker would take today's partition while it still fills, once.
    later = (today + datetime.timedelta(days=2)).isoformat()
    with pytest.raises(ConfigError, match=rf"^retrain\.date: {later} is after today \(.*retrain\.complete_marker null"):
        schedule_date_for(tiny_config(*roots, f"retrain.date={later}", "retrain.complete_marker=null"), registry)
    marked = tiny_config(*roots, f"retrain.date={later}")  # a partition counts once its writer marks it complete
    assert schedule_date_for(marked, registry) == (datetime.date.fromisoformat(later), "retrain.date")


def test_a_complete_partition_whose_parquet_files_hold_no_rows_is_passed_over(tmp_path):
    """Spark writes a schema-only part-00000.parquet (and _SUCCESS) for a day without rows: that partition used to
    count as new, and training refused "the 1 parquet file(s) hold no rows" at every retry."""
    root = tmp_path / "daily"
    write_latents(root / "date=2026-11-01" / "part-00000.parquet", rows=8)
    empty = pq.read_table(root / "date=2026-11-01" / "part-00000.parquet").slice(0, 0)
    (root / "date=2026-11-02").mkdir()
    pq.write_table(empty, root / "date=2026-11-02" / "part-00000.parquet")
    (root / "date=2026-11-03").mkdir()  # a day without any file
    for day in ("01", "02", "03"):
        (root / f"date=2026-11-{day}" / "_SUCCESS").touch()
    found = find_partitions(str(root), datetime.date(2026, 11, 3))
    assert new_partitions(found, []) == (["2026-11-01"], ["2026-11-02", "2026-11-03"])

    # Production has seen the first day: the run for the next one trains nothing, and says why.
    config = _rules_config(tmp_path)
    registry = ModelRegistry(str(tmp_path / "models"))
    manifest = {"schedule_date": "2026-11-01", "parent": None, "promoted": True, "reason": "test"}
    manifest |= {"metrics": {"val_loss": 0.3}, "partitions_seen": ["2026-11-01"]}
    torch.manual_seed(0)
    first = registry.write_version(UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), manifest)
    registry.set_production(first, expected=None, kind="promote")
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.production) == ("no-new-data", "v0001"), outcome
    assert "passed over 1 complete partition(s) without rows: 2026-11-02" in outcome.message
    assert not (tmp_path / "runs").exists()


class _Trained(Exception):
    """Raised by a stand-in for training, once it has the run's config."""


def test_a_first_version_starts_from_model_pretrained_and_warns_without_it_and_later_ones_from_production(
    tmp_path, monkeypatch, caplog
):
    """schedule.yaml's first run used to train model.preset from random weights (840 steps at fine-tuning settings) and
    promote it with nothing to compare: it now starts from model.pretrained (job.yaml's export) and warns where that is
    unset. Once production exists it replaces model.pretrained, which is then neither used nor checked up front."""
    from sdtrain.driver import retrain as retrain_module

    root = tmp_path / "daily"
    for day in ("01", "02"):
        write_latents(root / f"date=2026-11-{day}" / "part-00000.parquet", rows=8)
        (root / f"date=2026-11-{day}" / "_SUCCESS").touch()
    trained, checked = [], []

    def train(run_config):
        trained.append(run_config)
        raise _Trained

    def preflight(config):
        checked.append(config.model.pretrained)

    monkeypatch.setattr(retrain_module, "train", train)
    monkeypatch.setattr(retrain_module, "preflight", preflight)
    caplog.set_level("INFO", logger="sdtrain")
    # job.yaml's export: a first version's new partitions are checked against its UNet before training.
    exported = str(tmp_path / "runs" / "sd-small-256" / "export")
    UNet2DConditionModel(**PRESETS["tiny"]).save_config(f"{exported}/unet")
    for pretrained in (None, exported):
        caplog.clear()
        config = _rules_config(tmp_path, *([f"model.pretrained={pretrained}"] if pretrained else []))
        with pytest.raises(_Trained):
            retrain(config, datetime.date(2026, 11, 1))
        assert trained[-1].model.pretrained == pretrained
        warned = [r.getMessage() for r in caplog.records if r.name == "sdtrain" and r.levelname == "WARNING"]
        if pretrained is None:
            assert warned == [
                "no production model and model.pretrained is unset: this first version trains model.preset=tiny "
                "from random weights, for train.max_steps=550000 steps at retraining's settings (lr 0.0001, warmup "
                "10000 steps), and the gate promotes it with nothing to compare it to. Set model.pretrained to a "
                "trained model (schedule.yaml: job.yaml's export)"
            ]
        else:
            assert warned == []
    assert checked == [None, None]  # the retraining's own preflight; the training run's checks what it uses

    registry = ModelRegistry(str(tmp_path / "models"))
    manifest = {"schedule_date": "2026-11-01", "parent": None, "promoted": True, "reason": "test"}
    manifest |= {"metrics": {"val_loss": 0.3}, "partitions_seen": ["2026-11-01"]}
    first = registry.write_version(UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), manifest)
    registry.set_production(first, expected=None, kind="promote")
    caplog.clear()
    shutil.rmtree(exported)
    with pytest.raises(_Trained):
        retrain(_rules_config(tmp_path, f"model.pretrained={exported}"), datetime.date(2026, 11, 2))
    assert trained[-1].model.pretrained == registry.location(first)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert checked[-1] is None  # job.yaml's export, gone or not, does not stop a run that starts from production


def _rules_config(tmp_path, *overrides):
    root = tmp_path / "daily"
    (root / "date=2026-11-01").mkdir(parents=True, exist_ok=True)
    (tmp_path / "val").mkdir(exist_ok=True)
    return tiny_config(
        f"retrain.data_root={root}",
        f"retrain.models_root={tmp_path}/models",
        f"data.val={tmp_path}/val",
        *overrides,
        tmp_path=tmp_path,
    )


def _version(registry, day, parent, loss, promoted=True, val=None, seed=0, heldout=None):
    manifest = {
        "schedule_date": day,
        "parent": parent,
        "promoted": promoted,
        "reason": "test",
        "metrics": {"val_loss": loss},
        "config": {"data": {"val": val}, "train": {"seed": seed}},
        **({HELDOUT_KEY: heldout} if heldout is not None else {}),
    }
    torch.manual_seed(0)
    return registry.write_version(UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), manifest)


def test_a_rerun_of_a_date_whose_version_a_later_promotion_replaced_is_already_done(tmp_path):
    """Reported rolled-back before, which no rollback was."""
    config = _rules_config(tmp_path)
    registry = ModelRegistry(str(tmp_path / "models"))
    registry.set_production(_version(registry, "2026-11-01", None, 0.3), expected=None, kind="promote")
    registry.set_production(_version(registry, "2026-11-02", "v0001", 0.2), expected="v0001", kind="promote")
    outcome = retrain(config, datetime.date(2026, 11, 1))
    assert (outcome.status, outcome.version, registry.production()) == ("already-done", "v0001", "v0002")
    assert "moved off it since by the promotion of v0002, now v0002; not promoted again" in outcome.message
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # entrypoints/retrain.py --rollback in two subprocesses
def test_a_rerun_of_a_date_does_not_undo_a_rollback_made_with_the_logged_command(tmp_path):
    config = _rules_config(tmp_path)
    models = tmp_path / "models"
    registry = ModelRegistry(str(models))
    val = config.data.val
    registry.set_production(_version(registry, "2026-11-01", None, 0.3, val=val), expected=None, kind="promote")
    registry.set_production(_version(registry, "2026-11-02", "v0001", 0.2, val=val), expected="v0001", kind="promote")
    # v0002 misbehaves in serving: rolled back with the documented command, which records why.
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "entrypoints" / "retrain.py"),
            "--rollback",
            "--reason",
            "blurry samples",
            f"retrain.models_root={models}",
            f"retrain.data_root={tmp_path}/daily",
            f"data.val={val}",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "production now names v0001, not v0002" in result.stdout
    assert registry.production() == "v0001" and not (models / "retrain.lock").exists()
    last = registry.pointer_log()[-1]
    assert (last["from"], last["to"], last["kind"], last["reason"]) == ("v0002", "v0001", "rollback", "blurry samples")

    # The re-run of 2026-11-02 finds v0002 promoted, production at its parent: it served and was rolled back.
    outcome = retrain(config, datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.version, registry.production()) == ("rolled-back", "v0002", "v0001")
    assert "was promoted (pointer log entry 2) and production was moved off it since" in outcome.message
    assert not (tmp_path / "runs").exists()
    # Nothing before v0001 to go back to: refused, exit 2, one line.
    refused = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "retrain.py"), "--rollback", f"retrain.models_root={models}"],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert (
        refused.returncode == 2 and refused.stderr.startswith("error: ") and "nothing to roll back to" in refused.stderr
    )
    assert registry.production() == "v0001"


def test_a_writer_killed_between_the_swap_and_the_log_entry_is_logged_by_the_next_run(tmp_path):
    registry = ModelRegistry(str(tmp_path / "models"))
    registry.set_production(_version(registry, "2026-11-01", None, 0.3), expected=None, kind="promote")
    v2 = _version(registry, "2026-11-02", "v0001", 0.2)
    _, tag = registry._production()
    assert registry._replace(registry._path("production.json"), json.dumps({"version": v2}), tag)  # swapped, no log
    entry = registry.settle_log()
    assert entry is not None and (entry["from"], entry["to"], entry["kind"]) == ("v0001", "v0002", "promote")
    assert registry.settle_log() is None and registry.served() == ["v0001", "v0002"]


def test_the_best_ever_bar_is_what_production_named_measured_on_the_same_val_set_and_seed(tmp_path):
    config = _rules_config(tmp_path)
    registry = ModelRegistry(str(tmp_path / "models"))
    val = config.data.val
    registry.set_production(_version(registry, "2026-11-01", None, 0.30, val=val), expected=None, kind="promote")
    registry.set_production(_version(registry, "2026-11-02", "v0001", 0.10, val=val), expected="v0001")
    registry.rollback(reason="v0002 regressed in serving")  # v0002 (0.10) served, then rolled back
    _version(registry, "2026-11-03", "v0001", 0.05, val=val)  # decided for promotion, never named (interrupted)
    registry.set_production(_version(registry, "2026-11-04", "v0001", 0.01, val="/other/val"), expected="v0001")
    registry.set_production(_version(registry, "2026-11-05", "v0004", 0.02, val=val, seed=7), expected="v0004")
    registry.set_production(_version(registry, "2026-11-06", "v0005", 0.30, val=val), expected="v0005")
    assert registry.served() == ["v0001", "v0004", "v0005", "v0006"]

    best, not_compared = best_served(registry, config)
    assert best in (("v0001", 0.30), ("v0006", 0.30))
    assert not_compared == [
        f"v0004's 0.01000 was measured with data.val='/other/val', this run's is {val!r}",
        "v0005's 0.02000 was measured with train.seed=7, this run's is 0",
    ]
    # A model at 0.20 against production at 0.30: promoted (the rolled-back v0002's 0.10 is no bar).
    assert decide(0.20, 0.30, "v0006", best, 0.05)[0] is True


def test_a_value_measured_on_data_val_before_its_files_changed_in_place_is_no_bar(tmp_path):
    """data.val's prefix refreshed or extended in place keeps its config value: the best-ever bar compared today's
    val_loss with one measured on other rows."""
    config = _rules_config(tmp_path)
    file = tmp_path / "val" / "part-0.parquet"
    write_latents(file, rows=6)
    unet = UNet2DConditionModel(**PRESETS["tiny"]).config
    then = heldout_fingerprint(config, unet)
    assert then == heldout_fingerprint(config, unet) and (then["files"], then["rows"]) == (1, 6)
    registry = ModelRegistry(str(tmp_path / "models"))
    val = config.data.val
    for day, parent, loss, heldout in (("2026-11-01", None, 0.1, None), ("2026-11-02", "v0001", 0.2, then)):
        version = _version(registry, day, parent, loss, val=val, heldout=heldout)
        registry.set_production(version, expected=parent, kind="promote")
    assert best_served(registry, config, "val_loss", then) == (("v0001", 0.1), [])

    write_latents(file, rows=6, seed=1)  # rewritten in place: the same name and row count, other rows
    now = heldout_fingerprint(config, unet)
    assert now["digest"] != then["digest"] and (now["files"], now["rows"]) == (1, 6)
    best, not_compared = best_served(registry, config, "val_loss", now)
    # v0001 recorded no fingerprint (written before versions did): compared, as a config key it predates.
    assert best == ("v0001", 0.1)
    assert not_compared == [
        f"v0002's 0.20000 was measured with data.val's files as they were then (1 files, 6 rows, digest "
        f"{then['digest']}), now 1 files, 6 rows, digest {now['digest']}"
    ]
    write_latents(tmp_path / "val" / "part-1.parquet", rows=3)  # extended
    assert heldout_fingerprint(config, unet)["rows"] == 9


def test_a_metric_is_compared_only_with_values_measured_by_the_same_model(tmp_path):
    # One definition of what a value depends on (sdtrain.evaluation.results.measured_with): an fd_inception measured
    # with another Inception file is no bar, as an fd_dinov2 of another DINOv2 is not.
    from sdtrain.evaluation.results import measured_with

    config = _rules_config(tmp_path, "eval.inception=/models/inception.pt", "eval.dinov2=/models/dinov2")
    assert measured_with(config, "fd_inception")["eval.inception"] == "/models/inception.pt"
    assert "eval.dinov2" not in measured_with(config, "fd_inception")
    assert "eval.inception" not in measured_with(config, "val_loss")
    registry = ModelRegistry(str(tmp_path / "models"))
    recorded = config.to_dict()
    for day, inception, fd in (("2026-11-01", "/models/inception.pt", 20.0), ("2026-11-02", "/other.pt", 5.0)):
        recorded["eval"] = {**recorded["eval"], "inception": inception}
        manifest = {"schedule_date": day, "parent": None, "promoted": True, "reason": "test"}
        torch.manual_seed(0)
        version = registry.write_version(
            UNet2DConditionModel(**PRESETS["tiny"]),
            DDPMScheduler(),
            manifest | {"metrics": {"fd_inception": fd}, "config": recorded},
        )
        registry.set_production(version, expected=registry.production(), kind="promote")
    best, not_compared = best_served(registry, config, "fd_inception")
    assert best == ("v0001", 20.0)
    assert not_compared == [
        "v0002's 5.00000 was measured with eval.inception='/other.pt', this run's is '/models/inception.pt'"
    ]


@pytest.mark.slow  # six subprocesses SIGKILLed, some re-run in others
@pytest.mark.timeout(600)
def test_a_retrain_killed_after_each_of_its_registry_writes_is_finished_by_the_rerun(tmp_path, monkeypatch, forkserver):
    """The chaos case without training: a run's real writes after its model is judged (version, pointer, log,
    lock) in a process SIGKILLed right after its Nth write (support.registry_writers), then the re-run;
    bench/retrain_chaos.py does the same around real training."""

    monkeypatch.setenv(JOB_ID_VAR, "prodjob_chaos")  # the re-run is the job's retry: it takes the dead run's lock
    manifest = {
        "parent": "v0001",
        "schedule_date": "2026-11-02",
        "partitions": ["2026-11-02"],
        "partitions_seen": ["2026-11-01", "2026-11-02"],
        "promoted": True,
        "reason": "val_loss 0.20000 <= v0001's 0.30000 x (1 + 0.05)",
        "metrics": {"val_loss": 0.2, "production_val_loss": 0.3},
    }
    writers = RegistryWriters(forkserver, tmp_path)
    for kill_after in range(1, 7):  # lock, version claim, weights, manifest, pointer, log entry (7: release)
        case = tmp_path / f"kill-{kill_after}"
        config = _rules_config(case)
        registry = ModelRegistry(str(case / "models"))
        registry.set_production(_version(registry, "2026-11-01", None, 0.3), expected=None, kind="promote")
        killed, output = writers.run(str(case / "models"), manifest, kill_after)
        assert killed == -9, (kill_after, output[-2000:])
        # What a reader sees meanwhile: production names a complete version, the old or the new one.
        assert registry.production() in registry.versions() and registry.production() in ("v0001", "v0002")

        if "v0002" in registry.versions():  # the version is complete: the re-run trains nothing, finishes the rest
            outcome = retrain(config, datetime.date(2026, 11, 2))
            assert outcome.status in ("completed-promotion", "already-done"), (kill_after, outcome)
        else:  # died before the manifest: the re-run trains again (here: makes the same writes again)
            exit_code, output = writers.run(str(case / "models"), manifest)
            assert exit_code == 0 and output.splitlines()[-1] == "promoted", (kill_after, output[-2000:])
        production = registry.production()
        log = registry.pointer_log()
        assert production != "v0001" and registry.manifest(production)["promoted"], kill_after
        assert [e["to"] for e in log] == ["v0001", production] and log[-1]["kind"] == "promote", (kill_after, log)
        assert registry.manifest(production)["partitions_seen"] == ["2026-11-01", "2026-11-02"]
        assert not (case / "models" / "retrain.lock").exists() and not (case / "runs").exists()


def _trained(tmp_path, client, config, day, registered=True) -> dict:
    """What a retrain run's training leaves for its version's manifest: the run's directory with its export and its
    MLflow run (trackers.json), the export registered as a version of the MLflow model at the run's end
    (sdtrain.driver.trackers.log_export) unless MLflow was down then."""
    from sdtrain.driver.trackers import log_export
    from sdtrain.storage.run_layout import TRACKERS_FILE
    from sdtrain.train.tracker_loggers import mlflow_experiment

    run_dir = tmp_path / "runs" / f"retrain-{day}"
    (run_dir / "export").mkdir(parents=True)
    (run_dir / "export" / "sdtrain.json").write_text("{}")
    name = mlflow_experiment(config)  # the experiment training's MLflow logger would create the run in
    experiment = client.get_experiment_by_name(name) or client.get_experiment(client.create_experiment(name))
    run_id = client.create_run(experiment.experiment_id).info.run_id
    (run_dir / TRACKERS_FILE).write_text(json.dumps({"ids": {"mlflow": run_id}, "logged_through": 12}))
    if registered:
        log_export(config, str(run_dir), str(run_dir / "export"))
    return {"run_dir": str(run_dir), "mlflow_run_id": run_id}


@pytest.mark.slow  # a real MLflow server in its own process
@pytest.mark.timeout(300)
def test_mlflow_shows_what_the_registry_promoted_and_a_rollback_and_catches_up_after_an_outage(
    tmp_path, monkeypatch, caplog, mlflow_uri, mlflow_experiment_name
):
    """The MLflow model's production alias names the MLflow version of the registry's production version, each
    version judged by the gate is tagged with its numbers, a rollback moves the alias back, and MLflow being down
    neither undoes a promotion nor leaves MLflow behind after the date's re-run. Each version is written as a run
    interrupted before the pointer's move leaves it, so the runs here train nothing."""
    import mlflow

    from sdtrain.driver.retrain import rollback

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow down: fail at once, not after minutes
    name = "retrained-unet"  # a model name no other test registers: the server is the session's (mlflow_uri)
    uri = mlflow_uri
    tracking = [
        "tracking.trackers=[mlflow]",
        f"tracking.mlflow_register_as={name}",
        f"tracking.mlflow_experiment={mlflow_experiment_name}",  # its runs in an experiment of its own
    ]
    config = _rules_config(tmp_path, *tracking, f"tracking.mlflow_tracking_uri={uri}", "retrain.tolerance=0.05")
    down = _rules_config(
        tmp_path, *tracking, "tracking.mlflow_tracking_uri=http://127.0.0.1:9", "retrain.tolerance=0.05"
    )
    client = mlflow.MlflowClient(uri)
    registry = ModelRegistry(str(tmp_path / "models"))

    def version(day, parent, promoted, value, production_value, reason, **trained):
        manifest = {
            "schedule_date": day,
            "parent": parent,
            "promoted": promoted,
            "reason": reason,
            "gate_metric": "val_loss",
            "metrics": {"val_loss": value, "production_val_loss": production_value},
            "config": config.to_dict(),
            **trained,
        }
        torch.manual_seed(0)
        return registry.write_version(UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), manifest)

    def mlflow_version(registry_version):
        found = client.search_model_versions(f"name='{name}' and tags.`sdtrain.registry_version`='{registry_version}'")
        assert len(found) == 1, (registry_version, found)
        return found[0]

    # The first version: promoted, the alias set on the MLflow version its run registered, the gate's numbers
    # tagged.
    first = "first version (val_loss 0.30000); there is no production model to compare with"
    run_one = _trained(tmp_path, client, config, "2026-11-01")
    version("2026-11-01", None, True, 0.3, None, first, **run_one)
    outcome = retrain(config, datetime.date(2026, 11, 1))
    assert (outcome.status, registry.production()) == ("completed-promotion", "v0001")
    one = mlflow_version("v0001")
    assert one.run_id == run_one["mlflow_run_id"]
    assert client.get_registered_model(name).aliases == {"production": one.version}
    assert {k: v for k, v in one.tags.items() if k.startswith("sdtrain.")} == {
        "sdtrain.registry_version": "v0001",
        "sdtrain.models_root": registry.root_uri,
        "sdtrain.schedule_date": "2026-11-01",
        "sdtrain.gate.decision": "promoted",
        "sdtrain.gate.metric": "val_loss",
        "sdtrain.gate.value": "0.3",
        "sdtrain.gate.production_value": "none",
        "sdtrain.gate.production_version": "none",
        "sdtrain.gate.tolerance": "0.05",
        "sdtrain.gate.reason": first,
    }

    # A worse model: registered by its run, tagged rejected, the alias left on production's.
    worse = "val_loss 0.50000 > v0001's 0.30000 x (1 + 0.05)"
    version("2026-11-02", "v0001", False, 0.5, 0.3, worse, **_trained(tmp_path, client, config, "2026-11-02"))
    assert retrain(config, datetime.date(2026, 11, 2)).status == "already-done"
    two = mlflow_version("v0002")
    assert two.tags["sdtrain.gate.decision"] == "rejected" and two.tags["sdtrain.gate.reason"] == worse
    assert (two.tags["sdtrain.gate.value"], two.tags["sdtrain.gate.production_value"]) == ("0.5", "0.3")
    assert client.get_registered_model(name).aliases == {"production": one.version}

    # MLflow down from the end of the third day's training on: its export was never registered, and the
    # promotion goes through anyway, with a warning.
    better = "val_loss 0.20000 <= v0001's 0.30000 x (1 + 0.05)"
    trained = _trained(tmp_path, client, config, "2026-11-03", registered=False)
    version("2026-11-03", "v0001", True, 0.2, 0.3, better, **trained)
    caplog.clear()
    outcome = retrain(down, datetime.date(2026, 11, 3))
    assert (outcome.status, registry.production()) == ("completed-promotion", "v0003")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("MLflow" in w and "the registry is the source of truth" in w for w in warned), warned
    assert client.get_registered_model(name).aliases == {"production": one.version}
    # The date's re-run, MLflow up again, registers the export of v0003's run and catches up; again, nothing more.
    for _ in range(2):
        assert retrain(config, datetime.date(2026, 11, 3)).status == "already-done"
    three = mlflow_version("v0003")
    assert three.run_id == trained["mlflow_run_id"] and three.tags["sdtrain.gate.decision"] == "promoted"
    assert client.get_registered_model(name).aliases == {"production": three.version}
    assert len(client.search_model_versions(f"name='{name}'")) == 3

    # A rollback moves the alias back with the pointer, and what serving fetches by it is v0001's run's export.
    # It takes no lock, so here it lands while a re-run of the date sets the alias from its earlier read of the
    # pointer (v0003): set after the rollback's, that stale alias would stand unless the run reads the pointer
    # again.
    from sdtrain.driver import retrain_mlflow

    point_alias, rolled = retrain_mlflow._point_alias, []

    def rollback_first(*args):
        if not rolled:  # the run's first alias: the rollback (whose own publish sets the alias) goes first
            rolled.append(None)
            rolled[0] = rollback(config, reason="blurry samples")
        point_alias(*args)

    monkeypatch.setattr(retrain_mlflow, "_point_alias", rollback_first)
    assert retrain(config, datetime.date(2026, 11, 3)).status == "already-done"
    monkeypatch.setattr(retrain_mlflow, "_point_alias", point_alias)
    assert rolled == [("v0003", "v0001")] and registry.production() == "v0001"
    assert client.get_registered_model(name).aliases == {"production": one.version}
    # models:/ URIs are resolved by the process's registry: set, over what an earlier test's MLflow logger left
    # there (set_tracking_uri wins over the environment; CI fetched from that test's server, long stopped).
    mlflow.set_tracking_uri(uri)
    try:
        fetched = mlflow.artifacts.download_artifacts(f"models:/{name}@production")
    finally:
        mlflow.set_tracking_uri(None)  # unset, and MLFLOW_TRACKING_URI with it
    assert os.listdir(fetched) == ["sdtrain.json"]

    # A production version without an MLflow version (its run logged to no MLflow): the alias is removed rather
    # than left on a version production no longer names.
    version("2026-11-04", "v0001", True, 0.25, 0.3, "val_loss 0.25000 <= v0001's 0.30000 x (1 + 0.05)")
    caplog.clear()
    assert retrain(config, datetime.date(2026, 11, 4)).status == "completed-promotion"
    assert client.get_registered_model(name).aliases == {}
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"removed model {name}'s production alias: production (v0004) has no" in w for w in warned), warned
