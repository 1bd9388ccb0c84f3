"""How many storage requests a daily retrain run and a rollback make against a registry with years of versions: they
must not grow with the number of versions and pointer moves behind them (each was one or more sequential requests,
under the run's lock, before a rollback's pointer moved). Counted through the real local filesystem the registry and
the partitions are read with; training, loading and scoring are stood in for (no Ray)."""

import datetime
import json
import shutil
from collections import Counter
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import torch
from conftest import tiny_config, write_latents
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts import conditional_writes
from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.driver import retrain as retrain_module
from sdtrain.driver import retrain_partitions
from sdtrain.model.presets import PRESETS
from sdtrain.storage.filesystems import filesystem_for

START = datetime.date(2024, 1, 1)


class CountingFileSystem(pafs.LocalFileSystem):
    """The local filesystem, counting what would be requests to object storage: a listing, a file's info, a read."""

    requests: Counter = Counter()

    def get_file_info(self, paths_or_selector):
        kind = "LIST" if isinstance(paths_or_selector, pafs.FileSelector) else "HEAD"
        self.requests[kind] += 1 if kind == "LIST" or isinstance(paths_or_selector, str) else len(paths_or_selector)
        return super().get_file_info(paths_or_selector)

    def open_input_stream(self, path, *args, **kwargs):
        self.requests["GET"] += 1
        return super().open_input_stream(path, *args, **kwargs)

    def open_input_file(self, path):
        self.requests["GET"] += 1
        return super().open_input_file(path)


def _counting(uri: str):
    fs, path = filesystem_for(uri)
    return (CountingFileSystem(), path) if isinstance(fs, pafs.LocalFileSystem) else (fs, path)


def _day(n: int) -> str:
    return (START + datetime.timedelta(n)).isoformat()


def _history(tmp_path, n: int) -> None:
    """``n`` days of data, each trained into a version that was promoted, written as a registry holds them."""
    models, daily = tmp_path / "models", tmp_path / "daily"
    (models / "production_log").mkdir(parents=True)
    for i in range(n):
        (daily / f"date={_day(i)}").mkdir(parents=True)
        (daily / f"date={_day(i)}" / "_SUCCESS").touch()
        version, parent = f"v{i + 1:04d}", (f"v{i:04d}" if i else None)
        (models / "versions" / version).mkdir(parents=True)
        manifest = {
            "version": version,
            "schedule_date": _day(i),
            "parent": parent,
            "promoted": True,
            "reason": "better",
            "partitions_seen": [_day(d) for d in range(i + 1)],
            "metrics": {"val_loss": 1.0 - i * 1e-4},
            "config": {"data": {"val": None}, "train": {"seed": 0}},
        }
        (models / "versions" / version / "manifest.json").write_text(json.dumps(manifest))
        move = {"from": parent, "to": version, "kind": "promote", "reason": "better", "by": {}, "at": "then"}
        (models / "production_log" / f"{i + 1:08d}.json").write_text(json.dumps({"seq": i + 1, **move}))
    (models / "production.json").write_text(json.dumps({"version": f"v{n:04d}", "move": move}))
    (tmp_path / "val").mkdir()


def _stand_ins(monkeypatch, tmp_path) -> None:
    """Training, loading and scoring stood in for: what is counted is the registry's and the partitions' reads."""

    def train(config):
        run_dir = str(tmp_path / "runs" / config.run.name)
        return SimpleNamespace(run_dir=run_dir, checkpoint_path=run_dir + "/ckpt", final_step=2, final_loss=0.5)

    def load_trained(checkpoint):
        torch.manual_seed(1)
        unet = UNet2DConditionModel(**PRESETS["tiny"])
        loaded = LoadedModel(unet, DDPMScheduler(), None, checkpoint, "raw", 2, (4, 16, 16), (77, 32), None, None, None)
        return loaded, None

    stand_ins = {
        "train": train,
        "load_trained": load_trained,
        "scores_in_task": lambda config, new, current: ({"val_loss": 0.5}, {"val_loss": 0.6}),
        "heldout_fingerprint": lambda config, unet: {"files": 1, "rows": 8, "digest": "0"},
        "read_state": lambda run_dir: {"ids": {}},
        "unet_config": lambda model: {},
        "usable_partitions": lambda config, unet, partitions, new, run_dir: (new, {}),
    }
    for name, stand_in in stand_ins.items():
        monkeypatch.setattr(retrain_module, name, stand_in)
    monkeypatch.setattr(conditional_writes, "filesystem_for", _counting)
    monkeypatch.setattr(retrain_partitions, "filesystem_for", _counting)


def _requests(n: int, tmp_path, monkeypatch) -> tuple[int, int]:
    """(requests of a daily run, requests of a rollback) against ``n`` promoted versions: the run after the first
    one since an upgrade (which may read everything once), and then a rollback."""
    _history(tmp_path, n)
    _stand_ins(monkeypatch, tmp_path)
    config = tiny_config(
        f"retrain.data_root={tmp_path / 'daily'}",
        f"retrain.models_root={tmp_path / 'models'}",
        f"data.val={tmp_path / 'val'}",
        tmp_path=tmp_path,
    )
    counted = []
    for day in (n, n + 1):
        partition = tmp_path / "daily" / f"date={_day(day)}"
        write_latents(partition / "part-00000.parquet", rows=8)
        (partition / "_SUCCESS").touch()
        CountingFileSystem.requests.clear()
        outcome = retrain_module.retrain(config, datetime.date.fromisoformat(_day(day)))
        assert (outcome.status, outcome.version) == ("promoted", f"v{day + 1:04d}")
        counted.append(sum(CountingFileSystem.requests.values()))
    CountingFileSystem.requests.clear()
    assert retrain_module.rollback(config, reason="blurry") == (f"v{n + 2:04d}", f"v{n + 1:04d}")
    rollback = sum(CountingFileSystem.requests.values())
    assert ModelRegistry(str(tmp_path / "models")).production() == f"v{n + 1:04d}"
    return counted[1], rollback


@pytest.mark.timeout(300)
def test_a_daily_run_and_a_rollback_make_about_as_many_requests_after_years_as_after_days(tmp_path, monkeypatch):
    run_10, rollback_10 = _requests(10, tmp_path / "10", monkeypatch)
    run_100, rollback_100 = _requests(100, tmp_path / "100", monkeypatch)
    # Reading every version's manifest, and the whole pointer log several times, made it ~11 per version and more.
    assert run_100 < 2 * run_10, (run_10, run_100)
    assert rollback_100 < 2 * rollback_10, (rollback_10, rollback_100)


def test_the_catalog_never_gives_a_version_removed_by_hand_for_the_one_given_its_number(tmp_path):
    root, catalog = str(tmp_path / "models"), tmp_path / "models" / "catalog.json"
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()
    registry = ModelRegistry(root)
    for day in ("2026-11-01", "2026-11-02"):
        registry.write_version(unet, scheduler, {"schedule_date": day, "promoted": False})
    assert list(json.loads(catalog.read_text())["manifests"]) == ["v0001", "v0002"]
    shutil.rmtree(tmp_path / "models" / "versions" / "v0002")  # removed by hand: the next version is v0002 again
    again = ModelRegistry(root)
    assert again.versions() == ["v0001"]
    cataloged_at_claim = []
    claim = again._claim_dir

    def claim_noting_the_catalog(directory):
        cataloged_at_claim.append(list(json.loads(catalog.read_text())["manifests"]))
        claim(directory)

    again._claim_dir = claim_noting_the_catalog
    assert again.write_version(unet, scheduler, {"schedule_date": "2026-11-03", "promoted": False}) == "v0002"
    # Dropped from the catalog before the number was claimed: a writer killed before rewriting it leaves no stale copy.
    assert cataloged_at_claim == [["v0001"]]
    assert ModelRegistry(root).manifest("v0002")["schedule_date"] == "2026-11-03"
