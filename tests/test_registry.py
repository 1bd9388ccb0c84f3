"""The model registry on a local directory and on a real S3-protocol server."""

import dataclasses
import datetime
import functools
import hashlib
import json
import operator
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.loading import load_model
from sdtrain.artifacts.registry import (
    LOCK_FILE,
    LOCK_LEASE_S,
    ModelRegistry,
    PointerMoved,
    RegistryBusy,
    RegistryConflict,
)
from sdtrain.config.schema import ModelConfig
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import RAW_UNET_SUBFOLDER, build_unet, noise_scheduler_config, unet_config


def _exercise(root: str) -> None:
    registry = ModelRegistry(root)
    assert registry.versions() == [] and registry.production() is None
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**PRESETS["tiny"])
    scheduler = DDPMScheduler(clip_sample=False, num_train_timesteps=700)
    first = registry.write_version(unet, scheduler, {"schedule_date": "2026-11-01", "promoted": True})
    second = registry.write_version(unet, scheduler, {"schedule_date": "2026-11-02", "promoted": False})
    assert (first, second) == ("v0001", "v0002") and registry.versions() == ["v0001", "v0002"]
    assert registry.production() is None  # writing a version never moves the pointer
    registry.set_production(first)
    assert registry.production() == "v0001" and registry.manifest("v0002")["promoted"] is False
    with pytest.raises(ValueError, match="v0009 is not a complete version"):
        registry.set_production("v0009")
    production = load_model(registry.location(registry.production()))
    loaded, loaded_scheduler = production.unet, production.noise_scheduler
    for (name, a), b in zip(unet.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert loaded_scheduler.config.num_train_timesteps == 700
    # A version is a valid model.pretrained: weights and schedule for a warm start, from any node.
    model = ModelConfig(preset="tiny", pretrained=registry.location("v0001"))
    assert torch.equal(build_unet(model).conv_in.weight, unet.conv_in.weight)
    assert noise_scheduler_config(model)["num_train_timesteps"] == 700


def test_registry_on_local_disk(tmp_path):
    _exercise(str(tmp_path / "models"))
    pointer = json.loads((tmp_path / "models" / "production.json").read_text())
    assert pointer["version"] == "v0001" and (pointer["move"]["from"], pointer["move"]["to"]) == (None, "v0001")
    (tmp_path / "models" / "versions" / "v0003" / "unet").mkdir(parents=True)  # a write cut short: no manifest
    registry = ModelRegistry(str(tmp_path / "models"))
    assert registry.versions() == ["v0001", "v0002"]
    assert (
        registry.write_version(
            UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), {"schedule_date": "x", "promoted": False}
        )
        == "v0004"
    )
    assert not list((tmp_path / "models").rglob("*.tmp"))  # manifests and the pointer were moved into place whole

    # What a crash or a hand edit can leave is refused, naming the file, never joined into a path. (A manifest is
    # read once, as written, and kept in catalog.json: a hand edit of one read before is not seen.)
    (tmp_path / "models" / "versions" / "v0005").mkdir()
    (tmp_path / "models" / "versions" / "v0005" / "manifest.json").write_text('{"version": "v0005", "promo')
    with pytest.raises(DataError, match=r"v0005/manifest.json is not valid JSON"):
        ModelRegistry(str(tmp_path / "models")).manifest("v0005")
    # A swap marker left by a writer killed mid-swap: named, instead of "another writer moved it" for ever after.
    pointer = tmp_path / "models" / "production.json"
    _, tag = registry._production()
    marker = pointer.parent / f"production.json.swap-{hashlib.sha256(tag.encode()).hexdigest()[:16]}"
    marker.touch()
    # A fresh marker is a writer mid-swap: this one lost, and says so.
    with pytest.raises(PointerMoved, match=r"production.json still names v0001, but another writer is changing it"):
        registry.set_production("v0001", expected="v0001")
    os.utime(marker, (0, 0))
    with pytest.raises(RegistryConflict, match=r"production.json.swap-[0-9a-f]{16} was left \d+ s ago by a writer"):
        registry.set_production("v0001", expected="v0001")
    marker.unlink()
    registry.set_production("v0001", expected="v0001")
    (tmp_path / "models" / "production.json").write_text('{"version": "../../elsewhere"}')
    with pytest.raises(DataError, match=r'production.json must hold \{"version": "vNNNN"\}'):
        registry.production()


@pytest.mark.slow  # a moto server
@pytest.mark.timeout(120)
def test_registry_on_s3(s3_bucket):
    import boto3

    _exercise(f"{s3_bucket}/models")
    # What landed in the bucket: the pointer object, and complete versions (manifest included).
    s3 = boto3.client("s3")
    pointer = s3.get_object(Bucket="sdtrain-test", Key="models/production.json")["Body"].read()
    assert json.loads(pointer)["version"] == "v0001" and json.loads(pointer)["move"]["kind"] == "set"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sdtrain-test", Prefix="models/")["Contents"]}
    for version in ("v0001", "v0002"):
        assert {f"models/versions/{version}/manifest.json", f"models/versions/{version}/unet/config.json"} <= keys
    assert not [k for k in keys if k.endswith(".tmp")]  # the staged pointer was moved, not left behind


# --- one writer at a time: the lock, exclusive versions, the pointer's compare-and-swap ---------


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])  # s3: a moto server
def models_root(request, tmp_path):
    """A registry root on local disk, and one on a real S3-protocol server (moto, its own process)."""
    if request.param == "local":
        return str(tmp_path / "models")
    return f"{request.getfixturevalue('s3_bucket')}/models"


def _lock_text(registry: ModelRegistry) -> str | None:
    return registry._read_tagged(registry._path(LOCK_FILE))[0]


@pytest.mark.timeout(120)
def test_the_lock_is_exclusive_says_who_holds_it_and_is_released(models_root):
    registry = ModelRegistry(models_root)
    owner = {"run": "retrain-2026-11-01", "date": "2026-11-01", "job": "prodjob_day1"}
    with registry.lock(owner) as held:
        holder = json.loads(_lock_text(registry))
        assert {k: holder[k] for k in owner} == owner and holder["pid"] == os.getpid() and holder["host"]
        taken, expires = (datetime.datetime.fromisoformat(holder[k]) for k in ("taken_at", "expires_at"))
        assert (expires - taken).total_seconds() == LOCK_LEASE_S

        # The next run (another process would say the same) is refused, told which file, whose, until when.
        with pytest.raises(RegistryBusy) as refused:
            ModelRegistry(models_root).lock({"run": "retrain-2026-11-02", "date": "2026-11-02"}).acquire()
        message = str(refused.value)
        assert message.startswith(f"{held.uri} is held by run retrain-2026-11-01, date 2026-11-01, job prodjob_day1")
        assert held.uri.endswith("models/retrain.lock") and f"pid {os.getpid()}" in message
        assert f"until {expires.isoformat(timespec='seconds')}" in message
        assert json.loads(_lock_text(registry))["token"] == holder["token"]  # the refused run changed nothing

        held.renew()  # the renewal thread's step: same holder, a later expiry
        renewed = json.loads(_lock_text(registry))
        assert renewed["token"] == holder["token"] and renewed["expires_at"] > holder["expires_at"]
        held.ensure_held()
    assert _lock_text(registry) is None  # released on the way out...
    with pytest.raises(RuntimeError, match="failed run"):
        with registry.lock({"run": "again"}):  # ...free for the next run, and released when a run fails too
            raise RuntimeError("failed run")
    assert _lock_text(registry) is None


@pytest.mark.slow  # a subprocess holds the lock and is killed
@pytest.mark.timeout(120)
def test_a_killed_holders_lock_blocks_until_its_lease_ends_then_one_run_takes_it_over(models_root, capsys):
    # A real holder that dies with SIGKILL: nothing releases its lock.
    script = (
        "import os, signal\n"
        "from sdtrain.artifacts.registry import ModelRegistry\n"
        f"ModelRegistry({models_root!r}).lock({{'run': 'killed-run', 'job': 'prodjob_1'}}, lease_s=60).acquire()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=100).returncode == -signal.SIGKILL
    registry = ModelRegistry(models_root)
    stale = json.loads(_lock_text(registry))
    assert stale["run"] == "killed-run"
    with pytest.raises(RegistryBusy, match="is held by run killed-run"):  # within its lease: it might be alive
        registry.lock({"run": "too-early", "job": "prodjob_2"}).acquire()

    # Past the lease (the next day's run, 61 s later on its clock), it is taken over, and said so.
    later = datetime.datetime.fromisoformat(stale["expires_at"]) + datetime.timedelta(seconds=1)
    with registry.lock({"run": "next-day", "job": "prodjob_2"}, clock=lambda: later):
        holder = json.loads(_lock_text(registry))
        assert holder["run"] == "next-day" and holder["token"] != stale["token"]
        said = capsys.readouterr().out
        assert "its holder (run killed-run, job prodjob_1" in said and "let its lease expire at" in said
    assert _lock_text(registry) is None

    # A retry of the same Anyscale job starts only after its attempt ended: it need not wait for the lease.
    attempt = registry.lock({"run": "attempt-1", "job": "prodjob_3"})
    assert registry._create(attempt.path, attempt._text(datetime.datetime.now(datetime.timezone.utc))) is not None
    with registry.lock({"run": "attempt-2", "job": "prodjob_3"}):
        assert json.loads(_lock_text(registry))["run"] == "attempt-2"
        said = capsys.readouterr().out
        assert "(run attempt-1, job prodjob_3, host" in said and "an earlier attempt of this job" in said
    assert _lock_text(registry) is None


@pytest.mark.timeout(120)
def test_of_two_writers_that_read_the_same_state_exactly_one_wins(models_root):
    """The conditional writes every registry change goes through, interleaved as two contenders
    interleave: both read, then both write. (moto checks a condition and then writes without a
    lock of its own, so a race of real threads on it would test moto; threads race on disk below.)"""
    registry = ModelRegistry(models_root)
    path = registry._path("contended.json")
    assert registry._create(path, "first") is not None
    assert registry._create(path, "second") is None  # exclusive create: never overwrites
    text, tag = registry._read_tagged(path)
    assert text == "first"
    assert registry._replace(path, "taker A", tag) is not None
    assert registry._replace(path, "taker B", tag) is None  # B compared with what A replaced
    assert registry._read_tagged(path)[0] == "taker A"
    assert not registry._delete(path, tag)  # a holder releasing a lock that is no longer its own
    assert registry._delete(path, registry._read_tagged(path)[1]) and registry._read_tagged(path) == (None, None)


def _race_for_the_lock(root: str, contenders: int, clock=None) -> tuple[list, list[str]]:
    """``contenders`` threads, each its own registry client, released at once to take the lock."""
    start = threading.Barrier(contenders)
    winners, refused = [], []

    def contend(i):
        lock = ModelRegistry(root).lock({"run": f"contender-{i}"}, clock=clock)
        start.wait()
        try:
            lock.acquire()
            winners.append(lock)
        except RegistryBusy as e:
            refused.append(str(e))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return winners, refused


@pytest.mark.timeout(120)
def test_racing_runs_one_takes_the_lock_fresh_or_stale(tmp_path):
    root = str(tmp_path / "models")
    registry = ModelRegistry(root)
    for round_ in range(6):
        clock = None
        if round_ % 2:  # a lock left by a run that died just after taking it, expired for every contender
            dead = registry.lock({"run": "dead"}, lease_s=60)
            now = datetime.datetime.now(datetime.timezone.utc)
            assert registry._create(dead.path, dead._text(now)) is not None
            clock = functools.partial(operator.add, now, datetime.timedelta(seconds=61))
        winners, refused = _race_for_the_lock(root, 6, clock)
        assert len(winners) == 1 and len(refused) == 5, (winners, refused)
        assert json.loads(_lock_text(registry))["token"] == winners[0].token
        winners[0].release()
        assert _lock_text(registry) is None
        assert not list((tmp_path / "models").glob("*.swap-*")) and not list((tmp_path / "models").glob(".*.tmp"))


@pytest.mark.timeout(120)
def test_two_writers_numbering_from_the_same_listing_never_share_a_version(models_root):
    torch.manual_seed(0)
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()
    mine, theirs = ModelRegistry(models_root), ModelRegistry(models_root)
    name = mine.next_version()  # both listed the same versions/...
    assert theirs.write_version(unet, scheduler, {"writer": "theirs"}) == name == "v0001"
    with pytest.raises(RegistryConflict, match=r"models/versions/v0001 already exists: another writer numbered"):
        mine._write_version_as(name, unet, scheduler, {"writer": "mine"})  # ...the second to claim it is refused
    assert mine.manifest("v0001")["writer"] == "theirs" and mine.versions() == ["v0001"]
    assert mine.write_version(unet, scheduler, {"writer": "mine"}) == "v0002"  # numbered afresh, it gets its own


@pytest.mark.timeout(120)
def test_the_pointer_moves_only_from_the_version_it_was_compared_with(models_root):
    torch.manual_seed(0)
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()
    registry, other = ModelRegistry(models_root), ModelRegistry(models_root)
    v1, v2, v3 = (registry.write_version(unet, scheduler, {"n": n}) for n in range(3))
    registry.set_production(v1, expected=None)
    with pytest.raises(PointerMoved, match=r"production.json names v0001, not nothing"):
        other.set_production(v2, expected=None)  # decided when there was no production: stale
    other.set_production(v3, expected=v1)  # another writer promotes v0003 over v0001...
    with pytest.raises(PointerMoved, match=r"production.json names v0003, not v0001 as when the promotion") as lost:
        registry.set_production(v2, expected=v1)  # ...so v0002, compared with v0001 only, is not promoted
    assert lost.value.current == "v0003" and registry.production() == "v0003"
    registry.set_production(v1)  # by hand (a rollback): no expectation, still one conditional write
    assert registry.production() == "v0001"


def _promoted(registry: ModelRegistry, count: int) -> list[str]:
    """``count`` complete versions (a manifest, no weights: the pointer and its log read only that), each promoted
    over what production names."""
    names = []
    for n in range(1, count + 1):
        name, parent = registry.next_version(), registry.production()
        manifest = {"version": name, "parent": parent, "promoted": True, "reason": f"day {n}"}
        assert registry._create(registry._path("versions", name, "manifest.json"), json.dumps(manifest))
        registry.set_production(name, expected=parent, kind="promote")
        names.append(name)
    return names


@pytest.mark.timeout(120)
def test_a_rollback_abandons_every_version_that_served_since_its_target(models_root):
    registry = ModelRegistry(models_root)
    v1, v2, v3, v4, v5 = _promoted(registry, 5)
    # v0003 brought in a bad partition: v0003..v0005 all trained on it, whatever the latest one's metric.
    assert registry.rollback(v2, reason="bad partition since v0003") == (v5, v2)
    assert registry.served() == [v1, v2]  # no bar left that only the abandoned versions set
    v6 = _promoted(registry, 1)[0]  # ...the next day's run, warm-started from v0002 and promoted over it
    registry.set_production(v4, expected=v6, kind="promote")  # abandoned, then serving again: a bar again
    assert registry.served() == [v1, v2, v4, v6]
    assert registry.rollback(v6, reason="v0004 again") == (v4, v6)  # abandoned again
    assert registry.served() == [v1, v2, v6]
    # A plain rollback goes to the latest version that no rollback abandoned: back, never forward to v0004.
    assert registry.rollback(reason="v0006 too") == (v6, v2)
    assert registry.served() == [v1, v2]
    assert registry.rollback(reason="all of it") == (v2, v1)  # v0001's last time ends before everything since
    assert registry.served() == [v1]
    with pytest.raises(ConfigError, match="nothing to roll back to"):
        registry.rollback()
    kinds = [(e["from"], e["to"], e["kind"]) for e in registry.pointer_log()[5:]]
    assert kinds == [
        (v5, v2, "rollback"),
        (v2, v6, "promote"),
        (v6, v4, "promote"),
        (v4, v6, "rollback"),
        (v6, v2, "rollback"),
        (v2, v1, "rollback"),
    ]


@pytest.mark.timeout(120)
def test_a_rollback_killed_between_the_swap_and_its_log_entry_is_logged_as_that_rollback(tmp_path):
    root = str(tmp_path / "models")
    registry = ModelRegistry(root)
    v1, v2, v3, v4 = _promoted(registry, 4)
    script = (
        "from sdtrain.artifacts.registry import ModelRegistry\n"
        f"ModelRegistry({root!r}).rollback({v2!r}, reason='blurry since v0003', by={{'run': 'rollback'}})\n"
    )
    env = {**os.environ, "SDTRAIN_CHAOS_KILL_AFTER_WRITES": "1"}  # its first write is the pointer's swap
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=100).returncode == -signal.SIGKILL
    assert registry.production() == v2 and registry.pointer_log()[-1]["to"] == v4  # swapped, not logged
    entry = registry.settle_log(by={"run": "next-day"})
    assert entry is not None and entry["seq"] == 5
    assert (entry["from"], entry["to"], entry["kind"], entry["reason"]) == (v4, v2, "rollback", "blurry since v0003")
    assert entry["by"]["run"] == "rollback" and entry["by"]["pid"] != os.getpid()  # the killed writer's, not ours
    assert registry.settle_log() is None and registry.pointer_log()[-1] == entry
    # A rollback takes no lock: had it lived on after a run settled its move, its own entry would not log it twice.
    assert registry._append_log(registry._pointer()[2]) == entry and len(registry.pointer_log()) == 5
    assert registry.served() == [v1, v2]
    assert registry.rollback(reason="v0002 too") == (v2, v1)  # back, not forward to the version rolled back from


def test_a_pointer_without_its_move_is_settled_from_the_manifests(tmp_path):
    """production.json written before pointers recorded their move, or edited by hand."""
    registry = ModelRegistry(str(tmp_path / "models"))
    v1, v2, v3 = _promoted(registry, 3)
    pointer = registry._path("production.json")
    _, tag = registry._production()
    assert registry._replace(pointer, json.dumps({"version": v2}), tag)  # an older writer's pointer
    assert registry.production() == v2
    entry = registry.settle_log(by={"run": "next-day"})
    assert (entry["from"], entry["to"], entry["kind"]) == (v3, v2, "unlogged") and entry["by"]["run"] == "next-day"
    # A hand edit that changed the version and left the move beside it: that move is not about this version.
    text, tag = registry._read_tagged(pointer)
    assert registry._replace(pointer, json.dumps({**json.loads(text), "version": v3}), tag)
    entry = registry.settle_log()
    assert (entry["from"], entry["to"], entry["kind"]) == (v2, v3, "promote")  # v0003 was promoted over v0002


def test_a_job_pins_its_schedule_date_on_its_first_attempt(tmp_path):
    registry = ModelRegistry(str(tmp_path / "models"))
    day1, day2 = datetime.date(2026, 11, 1), datetime.date(2026, 11, 2)
    assert registry.pin_date("prodjob_abc123", day1)[0] == day1
    assert registry.pin_date("prodjob_abc123", day2)[0] == day1  # its retry, after midnight: the same date
    assert registry.pin_date("prodjob_next", day2)[0] == day2  # the next day's job
    assert json.loads((tmp_path / "models" / "jobs" / "prodjob_abc123.json").read_text())["date"] == "2026-11-01"
    with pytest.raises(ConfigError, match=r"job id '\.\./x' \(ANYSCALE_PRODJOB_ID\) may hold only"):
        registry.pin_date("../x", day1)


def test_a_run_whose_lease_lapsed_during_a_long_evaluation_writes_no_version(tmp_path):
    registry = ModelRegistry(str(tmp_path / "models"))
    unet, scheduler = UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler()
    now = [datetime.datetime.now(datetime.timezone.utc)]
    with registry.lock({"run": "slow-evaluation"}, lease_s=60, clock=lambda: now[0]) as lock:
        registry.write_version(unet, scheduler, {"n": 1}, lock=lock)  # held: written
        now[0] += datetime.timedelta(seconds=61)  # an evaluation longer than the lease, no renewal through
        with pytest.raises(RegistryConflict, match=r"lease on .*retrain.lock expired at .* nothing more is written"):
            registry.write_version(unet, scheduler, {"n": 2}, lock=lock)
    assert registry.versions() == ["v0001"] and not (tmp_path / "models" / "versions" / "v0002").exists()


def _trained_with_an_ema(tmp_path, config) -> str:
    """A checkpoint of the tiny UNet trained 3 steps with an EMA (decay 0.5), whose EMA and weights differ."""
    import lightning.pytorch as pl

    from sdtrain.artifacts.checkpoint_format import CheckpointMeta
    from sdtrain.train.module import DiffusionModule

    meta = CheckpointMeta(
        "test", unet_config(config.model), noise_scheduler_config(config.model), (4, 16, 16), (77, 32)
    )
    torch.manual_seed(0)
    module = DiffusionModule(build_unet(config.model), meta.noise_scheduler_config, config.train, meta)
    batch = {"latents": torch.randn(2, 4, 16, 16), "captions": torch.randn(2, 77, 32)}
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch] * 3, batch_size=None))
    checkpoint = tmp_path / "run" / "checkpoint_000000003" / "checkpoint.ckpt"
    trainer.save_checkpoint(checkpoint, weights_only=False)
    return str(checkpoint.parent)


def test_a_warm_start_from_a_version_continues_its_trained_weights_and_their_ema(tmp_path):
    """A version kept only the EMA weights, and the next day's run started both its weights and its EMA from them:
    of each day's training only the share its EMA had taken in (1 - decay^steps) was kept."""
    from conftest import tiny_config

    from sdtrain.artifacts.loading import load_model, load_trained
    from sdtrain.driver.retrain import record_and_promote
    from sdtrain.train.module import DiffusionModule

    config = tiny_config("data.train=[x]", "train.ema_decay=0.5", "train.ema_start_step=0", "train.warmup_steps=0")
    checkpoint = _trained_with_an_ema(tmp_path, config)
    trained, raw = load_trained(checkpoint)
    assert raw is not None and trained.weights == "ema"
    for name, weights in (("ema", trained.unet), ("raw", raw)):  # what load_model reads of the checkpoint
        for a, b in zip(weights.parameters(), load_model(checkpoint, name).unet.parameters(), strict=True):
            assert torch.equal(a, b), name
    assert not torch.equal(trained.unet.conv_in.weight, raw.conv_in.weight)

    registry = ModelRegistry(str(tmp_path / "models"))
    manifest = {"schedule_date": "2026-11-01", "parent": None, "promoted": True, "reason": "first"}
    with registry.lock({"run": "retrain-2026-11-01"}) as lock:
        assert record_and_promote(registry, lock, trained, manifest, raw).status == "promoted"
    version = registry.location("v0001")
    served = load_model(version)  # served, evaluated and gated: the EMA weights
    assert served.weights == "ema" and torch.equal(served.unet.conv_in.weight, trained.unet.conv_in.weight)
    assert torch.equal(load_model(version, "raw").unet.conv_in.weight, raw.conv_in.weight)

    # The next day's run (model.pretrained = the version): its weights from the trained ones, its EMA from the EMA's.
    warm = dataclasses.replace(config.model, pretrained=version)
    module = DiffusionModule(build_unet(warm), noise_scheduler_config(warm), config.train, trained.meta)
    assert module.ema_unet is not None and module.ema_warm_start  # that EMA averages at the full decay: no ramp
    for ours, theirs in ((module.unet, raw), (module.ema_unet, trained.unet)):
        state = theirs.state_dict()
        assert all(torch.equal(tensor, state[name]) for name, tensor in ours.state_dict().items())
    assert {n for n in module.state_dict() if n.startswith("unet.")} == {f"unet.{n}" for n in raw.state_dict()}
    # Without an EMA in the run, it trains on from the trained weights, and holds no second UNet.
    plain = DiffusionModule(
        build_unet(warm), noise_scheduler_config(warm), dataclasses.replace(config.train, ema_decay=None), trained.meta
    )
    assert plain.ema_unet is None and torch.equal(plain.unet.conv_in.weight, raw.conv_in.weight)
    assert "_sdtrain_ema_start" not in vars(plain.unet)
    # A version of a run without an EMA (or written before versions kept both) starts both from its one set.
    (tmp_path / "models" / "versions" / "v0001" / RAW_UNET_SUBFOLDER / "config.json").unlink()
    older = DiffusionModule(build_unet(warm), noise_scheduler_config(warm), config.train, trained.meta)
    assert older.ema_unet is not None and not older.ema_warm_start  # a copy of the weights trained: it ramps
    assert torch.equal(older.unet.conv_in.weight, trained.unet.conv_in.weight)
    assert torch.equal(older.ema_unet.conv_in.weight, trained.unet.conv_in.weight)
