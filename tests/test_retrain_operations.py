"""Retraining as operators meet it, without training or Ray: a rollback while a run holds the lock, a first version
gated against model.pretrained, and a corrupt partition left out instead of stopping every later run."""

import datetime
from types import SimpleNamespace

import pytest
import torch
from conftest import write_latents
from diffusers import DDPMScheduler, UNet2DConditionModel
from test_retrain_rules import _rules_config

from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.registry import ModelRegistry, PointerMoved
from sdtrain.data import inspection
from sdtrain.data.footer import read_footer
from sdtrain.driver import retrain as retrain_module
from sdtrain.driver.cli import exit_code
from sdtrain.driver.data_check import indexed_dataset
from sdtrain.driver.retrain import retrain, rollback
from sdtrain.driver.retrain_gate import decide
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import unet_config

_config = _rules_config  # date=2026-11-01 made, with no _SUCCESS: no partition until _partition completes it


def _partition(tmp_path, day, corrupt=False):
    folder = tmp_path / "daily" / f"date={day}"
    if corrupt:  # a truncated upload: parquet's leading magic, no footer
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "part-00000.parquet").write_bytes(b"PAR1 truncated upload")
    else:
        write_latents(folder / "part-00000.parquet", rows=8)
    (folder / "_SUCCESS").touch()
    return str(folder)


def _version(registry, day, parent, loss, seen):
    manifest = {"schedule_date": day, "parent": parent, "promoted": True, "reason": "test", "partitions_seen": seen}
    torch.manual_seed(0)
    version = registry.write_version(
        UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), manifest | {"metrics": {"val_loss": loss}}
    )
    registry.set_production(version, expected=parent, kind="promote")
    return version


class _Stubs:
    """Training, the checkpoint's load and the gate's Ray task stood in for: what a run does around them is real."""

    def __init__(self, monkeypatch, tmp_path, new_loss, current_loss, during_training=None):
        self.trained, self.scored = [], []
        self.during_training = during_training
        self.scores = {"val_loss": new_loss}, {"val_loss": current_loss}
        self.tmp_path = tmp_path
        for name in ("train", "load_trained", "scores_in_task", "heldout_fingerprint", "read_state"):
            monkeypatch.setattr(retrain_module, name, getattr(self, name))

    def train(self, run_config):
        self.trained.append(run_config)
        if self.during_training is not None:
            self.during_training()
        run_dir = str(self.tmp_path / "runs" / run_config.run.name)
        return SimpleNamespace(run_dir=run_dir, checkpoint_path=f"{run_dir}/ckpt", final_step=2, final_loss=0.5)

    def load_trained(self, checkpoint):
        torch.manual_seed(1)
        unet = UNet2DConditionModel(**PRESETS["tiny"])
        return LoadedModel(
            unet, DDPMScheduler(), None, checkpoint, "raw", 2, (4, 16, 16), (77, 32), None, None, None
        ), None

    def scores_in_task(self, config, new, current):
        self.scored.append(current)
        return self.scores[0], self.scores[1] if current is not None else {}

    def heldout_fingerprint(self, config, unet):
        return {"files": 1, "rows": 8, "digest": "0"}

    def read_state(self, run_dir):
        return {"ids": {}}


def test_a_rollback_goes_through_while_a_retrain_run_holds_the_lock(tmp_path):
    """The daily run holds the lock through ~1 h of training: an emergency rollback must not be refused (exit 75)."""
    config = _config(tmp_path)
    registry = ModelRegistry(str(tmp_path / "models"))
    _version(registry, "2026-11-01", None, 0.3, ["2026-11-01"])
    _version(registry, "2026-11-02", "v0001", 0.2, ["2026-11-01", "2026-11-02"])
    with registry.lock({"run": "sd-small-retrain-2026-11-03", "date": "2026-11-03", "job": "prodjob_daily"}) as held:
        assert rollback(config, reason="NSFW leak") == ("v0002", "v0001")
        held.ensure_held()  # the run's lock is neither taken nor removed
    assert registry.production() == "v0001"
    last = registry.pointer_log()[-1]
    assert (last["from"], last["to"], last["kind"], last["reason"]) == ("v0002", "v0001", "rollback", "NSFW leak")


def test_of_two_rollbacks_from_one_version_the_second_fails_clearly(tmp_path, monkeypatch):
    config = _config(tmp_path)
    registry, other = ModelRegistry(str(tmp_path / "models")), ModelRegistry(str(tmp_path / "models"))
    for day, parent, loss in (("2026-11-01", None, 0.3), ("2026-11-02", "v0001", 0.2), ("2026-11-03", "v0002", 0.1)):
        _version(registry, day, parent, loss, [day])
    swap = ModelRegistry.set_production

    def the_other_first(self, version, **kwargs):
        swap(other, "v0002", expected="v0003", kind="rollback", reason="the other operator")
        swap(self, version, **kwargs)

    monkeypatch.setattr(ModelRegistry, "set_production", the_other_first)
    with pytest.raises(PointerMoved, match=r"^rollback not made: .*names v0002, not v0003.*production names v0002 now"):
        rollback(config, reason="blurry")
    assert registry.production() == "v0002"  # one step back, not two
    assert exit_code(PointerMoved("", None)) == 2  # refused as input to look at, not retried as busy


def test_a_run_during_which_production_was_rolled_back_says_so_and_does_not_undo_it(tmp_path, monkeypatch):
    config = _config(tmp_path)
    registry = ModelRegistry(str(tmp_path / "models"))
    _version(registry, "2026-11-01", None, 0.3, ["2026-11-01"])
    _version(registry, "2026-11-02", "v0001", 0.2, ["2026-11-01", "2026-11-02"])
    _partition(tmp_path, "2026-11-03")
    stubs = _Stubs(monkeypatch, tmp_path, 0.1, 0.2, lambda: rollback(config, reason="NSFW leak"))
    outcome = retrain(config, datetime.date(2026, 11, 3))
    assert (outcome.status, outcome.version, outcome.production) == ("superseded", "v0003", "v0001")
    assert "production was rolled back during this run: v0002 -> v0001 (pointer log entry 3, 'NSFW leak'" in (
        outcome.message
    )
    assert registry.production() == "v0001" and stubs.scored == [registry.location("v0002")]


def test_a_first_version_is_gated_against_model_pretrained(tmp_path, monkeypatch):
    """The first version used to be promoted with nothing compared, though it was fine-tuned from model.pretrained."""
    pretrained = tmp_path / "export"
    UNet2DConditionModel(**PRESETS["tiny"]).save_pretrained(pretrained / "unet")
    DDPMScheduler().save_pretrained(pretrained / "scheduler")
    _partition(tmp_path, "2026-11-01")
    registry = ModelRegistry(str(tmp_path / "models"))

    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.3)  # worse than the model it started from
    outcome = retrain(_config(tmp_path, f"model.pretrained={pretrained}"), datetime.date(2026, 11, 1))
    assert stubs.scored == [str(pretrained)]
    assert (outcome.status, outcome.version, registry.production()) == ("rejected", "v0001", None)
    manifest = registry.manifest("v0001")
    assert manifest["reason"] == (
        f"first version, compared with model.pretrained={pretrained} (no production model yet): "
        "val_loss 0.50000 > model.pretrained's 0.30000 x (1 + 0)"
    )
    assert manifest["baseline"] == str(pretrained) and manifest["metrics"]["production_val_loss"] == 0.3
    assert "kept no version in production, v0001 not promoted: first version, compared with model.pretrained" in (
        outcome.message
    )


def test_a_first_version_without_any_baseline_is_promoted_saying_so(tmp_path, monkeypatch):
    _partition(tmp_path, "2026-11-01")
    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.3)
    outcome = retrain(_config(tmp_path), datetime.date(2026, 11, 1))
    assert stubs.scored == [None] and (outcome.status, outcome.production) == ("promoted", "v0001")
    assert outcome.message.endswith(
        "first version (val_loss 0.50000); there is no production model to compare with; no baseline: no production "
        "model, and no model.pretrained the gate can load"
    )


def test_the_best_ever_bar_holds_without_a_production_value():
    promote, reason = decide(1.2, None, None, ("v0001", 1.0), 0.05)
    assert (promote, reason) == (
        False,
        "val_loss 1.20000 > v0001's 1.00000 x (1 + 0.05) (v0001 is the best that served)",
    )
    assert decide(1.0, None, None, None, 0.05)[0] is True


def test_a_corrupt_partition_is_left_out_and_the_newer_days_train(tmp_path, monkeypatch, caplog):
    """One unreadable file used to keep its partition new every day and fail training's data check at each run (and
    each of its retries, on a fresh cluster), so no later day trained."""
    bad = _partition(tmp_path, "2026-11-01", corrupt=True)
    good = _partition(tmp_path, "2026-11-02")
    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.3)
    caplog.set_level("WARNING", logger="sdtrain")
    outcome = retrain(_config(tmp_path), datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.version) == ("promoted", "v0001")
    assert [c.data.train for c in stubs.trained] == [[good]]
    assert list(outcome.left_out) == ["2026-11-01"]
    why = outcome.left_out["2026-11-01"]
    assert why.startswith(f"retrain.data_root: cannot read {bad}/part-00000.parquet as parquet"), why
    assert "left out 1 partition(s) whose files training cannot read: 2026-11-01: retrain.data_root: cannot" in (
        outcome.message
    )
    manifest = ModelRegistry(str(tmp_path / "models")).manifest("v0001")
    assert manifest["partitions"] == ["2026-11-02"] and manifest["partitions_left_out"] == outcome.left_out
    assert manifest["partitions_seen"] == ["2026-11-02"]  # checked again by the next run, taken once fixed
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(w.startswith(f"retrain.data_root: left partition 2026-11-01 ({bad}) out of this run: ") for w in warned)


def test_the_new_partitions_footers_are_read_once_by_a_run_and_its_training(tmp_path, monkeypatch):
    """The partitions' check used to read every footer, and training's own check read each again: at a day of 1e4
    files on object storage, twice the requests before anything trained. The check writes the training run's
    dataset index, which its own check then reads instead."""
    days = ["2026-11-01", "2026-11-02"]
    files = [_partition(tmp_path, day) for day in days]
    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.3)
    read = []
    monkeypatch.setattr(
        inspection, "read_footer", lambda file, *a, **k: read.append(file) or read_footer(file, *a, **k)
    )
    outcome = retrain(_config(tmp_path), datetime.date(2026, 11, 2))
    assert (outcome.status, outcome.left_out) == ("promoted", {})
    # Each footer once by the checks (new_partitions also reads one a partition, to tell a day without rows).
    assert sorted(read) == [f"{f}/part-00000.parquet" for f in files]
    (run_config,) = stubs.trained
    assert run_config.data.train == files
    # What training's check (sdtrain.driver.run.check_run) finds at its start: every file from the run's index.
    read.clear()
    indexed = indexed_dataset(run_config, "data.train", files, unet_config(run_config.model), run_config.run.directory)
    assert (indexed.stats.from_index, indexed.stats.footers_read, indexed.stale, read) == (2, 0, False, [])
    assert indexed.spec.num_rows == 16


@pytest.mark.usefixtures("without_ray")  # the session's cluster stopped: the run must start none
def test_a_run_whose_every_new_partition_is_corrupt_ends_without_training_or_an_error(tmp_path, monkeypatch):
    import ray

    _partition(tmp_path, "2026-11-01", corrupt=True)
    stubs = _Stubs(monkeypatch, tmp_path, 0.5, 0.3)
    outcome = retrain(_config(tmp_path), datetime.date(2026, 11, 1))
    assert (outcome.status, outcome.version, outcome.production) == ("no-usable-data", None, None)
    assert outcome.message.startswith(
        "2026-11-01: every new partition since the start was left out, nothing to train: left out 1 partition(s)"
    )
    assert stubs.trained == [] and not ray.is_initialized()
    assert ModelRegistry(str(tmp_path / "models")).versions() == []
